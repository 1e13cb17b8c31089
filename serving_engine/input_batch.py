"""Flat attention metadata of one engine step, as plain Python lists (host side; no numpy, torch or jax).

The torch and JAX runners turn a BatchMetadata into tensors. Layout follows vLLM's FlashAttentionMetadata and
tpu-inference's ragged paged attention: all scheduled tokens of all requests concatenated into one ragged batch,
padded to a token bucket so a jitted step sees few distinct shapes.

This is the JAX engine's own copy of torch_sources/serving/input_batch.py: an oracle must stand alone, so the
mirror is intended. Keep the code identical to the original (tests/serving/test_serving_bookkeeping.py checks it).
"""
from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .request import Request
from .scheduler import SchedulerOutput

__all__ = ["PAD_SLOT_ID", "BatchMetadata", "PromptLogprobTarget", "MultimodalSlice", "pick_bucket",
           "make_token_buckets", "build_batch_metadata", "prompt_logprob_targets", "mrope_positions",
           "multimodal_slices"]

PAD_SLOT_ID = -1  # padding tokens write nowhere (a JAX runner maps it to an out-of-range index with mode="drop")


@dataclass(frozen=True)
class BatchMetadata:
    req_ids: list[str]  # the scheduled requests, row order of the per-sequence lists
    input_ids: list[int]  # i32[T]: scheduled tokens, request after request, 0 past num_tokens
    positions: list[int]  # i32[T]: absolute position of each token, 0 past num_tokens
    slot_mapping: list[int]  # i32[T]: block_id * block_size + offset, PAD_SLOT_ID past num_tokens
    block_tables: list[list[int]]  # i32[S, max_blocks_per_seq]: padded with 0 (masked by seq_lens)
    seq_lens: list[int]  # i32[S]: KV length after this step (context + new tokens), 0 for padding rows
    query_start_loc: list[int]  # i32[S+1]: cu_q_lens; padding rows repeat num_tokens (empty queries)
    logits_indices: list[int]  # i32[S]: index in T of each request's last scheduled token, 0 for padding rows
    num_seqs: int  # real rows of the per-sequence lists (S = max_num_seqs)
    num_tokens: int  # real tokens (T = padded_num_tokens)
    padded_num_tokens: int


def pick_bucket(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n."""
    ordered = sorted(buckets)
    i = bisect.bisect_left(ordered, n)
    if i == len(ordered):
        raise ValueError(f"{n} tokens exceed the largest bucket {ordered[-1] if ordered else None}")
    return ordered[i]


def make_token_buckets(max_num_tokens: int, min_bucket: int = 16, step: int = 256) -> list[int]:
    """Powers of two from min_bucket up to `step` (tpu-inference's default grid), then multiples of `step`, the last
    one >= max_num_tokens: a step pads fewer than `step` tokens, where doubling would pad up to as many again as it
    holds (1337 prompt tokens: 1536, not 2048); each bucket is one more compiled variant."""
    buckets = [min_bucket]
    while buckets[-1] < max_num_tokens:
        buckets.append(buckets[-1] * 2 if buckets[-1] < step else buckets[-1] + step)
    return buckets


def build_batch_metadata(scheduler_output: SchedulerOutput, requests: Mapping[str, Request], block_size: int,
                         max_num_seqs: int, max_blocks_per_seq: int,
                         token_buckets: Sequence[int] | None = None) -> BatchMetadata:
    """Flatten one SchedulerOutput; token lists are padded to pick_bucket(num_tokens, token_buckets) (no padding
    when token_buckets is None), per-sequence lists to max_num_seqs rows."""
    out = scheduler_output
    if out.num_seqs > max_num_seqs:
        raise ValueError(f"{out.num_seqs} scheduled requests exceed max_num_seqs={max_num_seqs}")
    input_ids, positions, slot_mapping = [], [], []
    block_tables, seq_lens, query_start_loc, logits_indices = [], [], [0], []
    for rid, num_new, start, table in zip(out.scheduled_req_ids, out.num_scheduled_tokens,
                                          out.num_computed_tokens, out.block_tables):
        end = start + num_new
        if len(table) > max_blocks_per_seq:
            raise ValueError(f"request {rid!r} holds {len(table)} blocks > max_blocks_per_seq={max_blocks_per_seq}")
        if len(table) * block_size < end:
            raise ValueError(f"request {rid!r}: {len(table)} blocks cannot hold {end} tokens")
        input_ids += requests[rid].all_token_ids[start:end]
        for pos in range(start, end):
            positions.append(pos)
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        block_tables.append(list(table) + [0] * (max_blocks_per_seq - len(table)))
        seq_lens.append(end)
        query_start_loc.append(query_start_loc[-1] + num_new)
        logits_indices.append(query_start_loc[-1] - 1)

    num_seqs, num_tokens = out.num_seqs, len(input_ids)
    padded = num_tokens if token_buckets is None else pick_bucket(num_tokens, token_buckets)
    pad_tokens, pad_seqs = padded - num_tokens, max_num_seqs - num_seqs
    return BatchMetadata(
        req_ids=list(out.scheduled_req_ids),
        input_ids=input_ids + [0] * pad_tokens,
        positions=positions + [0] * pad_tokens,
        slot_mapping=slot_mapping + [PAD_SLOT_ID] * pad_tokens,
        block_tables=block_tables + [[0] * max_blocks_per_seq for _ in range(pad_seqs)],
        seq_lens=seq_lens + [0] * pad_seqs,
        query_start_loc=query_start_loc + [num_tokens] * pad_seqs,
        logits_indices=logits_indices + [0] * pad_seqs,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        padded_num_tokens=padded,
    )


@dataclass(frozen=True)
class PromptLogprobTarget:
    request_id: str
    token_index: int  # index in the step's flat token axis whose logits predict the next prompt token
    position: int  # that token's position in the prompt
    next_token_id: int  # prompt_token_ids[position + 1]
    num_logprobs: int  # SamplingParams.prompt_logprobs


def prompt_logprob_targets(batch: BatchMetadata, requests: Mapping[str, Request]) -> list[PromptLogprobTarget]:
    """Prompt positions of this step whose next token is a prompt token, for the requests that ask for
    prompt logprobs (vLLM's prompt_logprobs: one entry per prompt token after the first, chunk by chunk)."""
    targets = []
    for row, rid in enumerate(batch.req_ids):
        req = requests[rid]
        num = req.sampling_params.prompt_logprobs
        if num is None:
            continue
        for i in range(batch.query_start_loc[row], batch.query_start_loc[row + 1]):
            pos = batch.positions[i]
            if pos + 1 < req.num_prompt_tokens:
                targets.append(PromptLogprobTarget(rid, i, pos, req.prompt_token_ids[pos + 1], num))
    return targets


def mrope_positions(batch: BatchMetadata, tables: Mapping[str, tuple[Sequence[Sequence[int]], int]]) -> list[list[int]]:
    """M-RoPE positions i32[3, T] of a step: a prompt token's column of its request's table (tables[request id] =
    (the prompt's 3 x L rows, delta)), a later token (an output, or its recompute) at position + delta on all
    three rows, as vLLM's MRotaryEmbedding.get_next_input_positions continues them; padding at 0."""
    rows = [[0] * batch.padded_num_tokens for _ in range(3)]
    for row, rid in enumerate(batch.req_ids):
        table, delta = tables[rid]
        num_prompt = len(table[0])
        for i in range(batch.query_start_loc[row], batch.query_start_loc[row + 1]):
            pos = batch.positions[i]
            for axis in range(3):
                rows[axis][i] = table[axis][pos] if pos < num_prompt else pos + delta
    return rows


@dataclass(frozen=True)
class MultimodalSlice:
    request_id: str
    token_index: int  # first index in the step's flat token axis the slice fills
    mm_hash: str  # whose encoder output
    start: int  # rows start..end of that output
    end: int


def multimodal_slices(batch: BatchMetadata, requests: Mapping[str, Request]) -> list[MultimodalSlice]:
    """Where the step's tokens cover a placeholder range: the encoder rows they take, a chunk that starts or
    ends inside a range taking only its part (vLLM's _gather_mm_embeddings)."""
    out = []
    for row, rid in enumerate(batch.req_ids):
        lo, hi = batch.query_start_loc[row], batch.query_start_loc[row + 1]  # a scheduled request has tokens
        start = batch.positions[lo]
        end = start + hi - lo
        for offset, length, mm_hash in requests[rid].mm_placeholders:
            a, b = max(start, offset), min(end, offset + length)
            if a < b:
                out.append(MultimodalSlice(rid, lo + a - start, mm_hash, a - offset, b - offset))
    return out
