"""Device side of one engine step: twin of torch_sources/serving/model_runner.py, as ONE jitted function.

execute_model: SchedulerOutput -> input_batch.BatchMetadata (plain lists) -> numpy -> `step`, jitted:
forward_paged over the ragged batch -> hidden of each request's last scheduled token -> logits -> Sampler.
Static shapes keep the number of compilations small: the flat token axis is padded to a bucket
(make_token_buckets: 16, 32, 64, ...), the per-sequence axis to max_num_seqs (1 in core mode), the block
table to max_blocks_per_seq; a pure decode step is its own variant of its bucket (max_q_len 1: the CPU
attention gathers each sequence's pages once, not each padded token's). The KV cache is an argument and a result of `step`, donated, so XLA updates
it in place (tpu-inference's `donate_argnums` on kv_caches); the runner keeps only the returned value.
Per step the host reads back the sampled ids, plus the raw log-prob rows of only those requests that ask for
logprobs (prompt logprobs switch to a variant of the step that also returns every token's log-probs). Rows
whose token is discarded (a partial prefill chunk, a padding row) are sampled greedily and ignored.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from serving_engine import models
from serving_engine.config import EngineConfig
from serving_engine.input_batch import PAD_SLOT_ID, BatchMetadata, build_batch_metadata, make_token_buckets, \
    pick_bucket, prompt_logprob_targets
from serving_engine.paged_attention import AttentionMetadata, allocate_kv_cache, layer_kv_shapes
from serving_engine.request import Request
from serving_engine.sampler import Logprob, Sampler, SamplingMetadata, top_logprobs
from serving_engine.scheduler import SchedulerOutput

__all__ = ["ModelRunner", "attention_metadata"]


def _i32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int32)


# ---- jitted bodies (Python here runs once per trace) -------------------------------------------------------
# Module-level, the family module static: every runner of a process shares the compiled steps, as a vLLM
# worker compiles once per shape and then serves request after request (a new engine costs no compilation).
_TRACES = [0]  # traces of the two step functions in this process (each trace is one XLA compilation)
_SAMPLER = Sampler()  # stateless


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,), static_argnames=("all_logprobs",))
def _step(family, model, kv_cache, input_ids, positions, attn_meta, logits_indices, sampling, all_logprobs=False):
    """-> (sampled ids i32[S], raw log-probs f32[S,V], kv_cache, log-probs f32[T_bucket,V] of every token
    when all_logprobs (prompt logprobs) else None). input_ids/positions i32[T_bucket], logits_indices i32[S]
    (S = max_num_seqs)."""
    _TRACES[0] += 1
    hidden, kv_cache = family.forward_paged(model, input_ids, positions, kv_cache, attn_meta)
    logits = family.compute_logits(model, hidden[logits_indices])  # f32[S,V]
    ids, raw_logprobs = _SAMPLER(logits, sampling)
    every = jax.nn.log_softmax(family.compute_logits(model, hidden), -1) if all_logprobs else None
    return ids, raw_logprobs, kv_cache, every


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _forward_logits(family, model, kv_cache, input_ids, positions, attn_meta):
    """-> (logits f32[T_bucket,V] at every token, kv_cache)."""
    _TRACES[0] += 1
    hidden, kv_cache = family.forward_paged(model, input_ids, positions, kv_cache, attn_meta)
    return family.compute_logits(model, hidden), kv_cache


def attention_metadata(batch: BatchMetadata, impl: str = "auto") -> AttentionMetadata:
    """Host arrays (numpy) of one step; jit moves them to the device with the call. A pure decode step
    (every sequence one new token) says so statically: max_q_len 1, one query block per sequence."""
    q_lens = np.diff(batch.query_start_loc[: batch.num_seqs + 1])
    return AttentionMetadata(slot_mapping=_i32(batch.slot_mapping), kv_lens=_i32(batch.seq_lens),
                             page_indices=_i32(batch.block_tables), cu_q_lens=_i32(batch.query_start_loc),
                             num_seqs=_i32([batch.num_seqs]), impl=impl,
                             max_q_len=1 if q_lens.size and q_lens.max() <= 1 else None)


class ModelRunner:
    def __init__(self, model_dir, engine_config: EngineConfig, *, attn_impl: str = "auto",
                 token_buckets: Sequence[int] | None = None):
        # An entry point: fp32 parity needs true fp32 matmuls (GPUs default to TF32 otherwise).
        jax.config.update("jax_default_matmul_precision", "highest")
        cfg = self.engine_config = engine_config
        self.family = models.family(model_dir)
        self.model_config, self.model = models.load_model(model_dir)
        self.vocab_size = self.model_config.vocab_size
        self.kv_cache = allocate_kv_cache(self.model_config, engine_config)
        self.attn_impl = attn_impl
        self.max_num_seqs = cfg.max_running
        self.token_buckets = list(token_buckets or make_token_buckets(cfg.max_num_batched_tokens))
        # prefill_logits / teacher_forced_decode run one whole prompt, which may exceed a chunked budget.
        self._check_buckets = make_token_buckets(max(cfg.max_num_batched_tokens, cfg.max_model_len))
        # Of the last execute_model, for the requests that asked: the sampled token's logprobs dict, and
        # (prompt position, dict of the next prompt token) for each prompt position it computed.
        self.sampled_logprobs: dict[str, dict[int, Logprob]] = {}
        self.prompt_logprobs: dict[str, list[tuple[int, dict[int, Logprob]]]] = {}
        self.num_steps = 0  # steps run: the engine-wide noise of unseeded requests is keyed by it
        self.num_compilations = 0  # traces of the jitted functions (each trace is one XLA compilation)
        self.buckets_used: set[int] = set()  # token buckets execute_model has run
        # (token bucket, max_q_len) pairs it has run: each is one compiled variant of the step
        self.variants_used: set[tuple[int, int | None]] = set()

    def _step(self, *args, **kwargs):
        return self._traced(_step, self.family, *args, **kwargs)

    def _forward_logits(self, *args):
        return self._traced(_forward_logits, self.family, *args)

    def _traced(self, fn, *args, **kwargs):
        before = _TRACES[0]
        out = fn(*args, **kwargs)
        self.num_compilations += _TRACES[0] - before
        return out

    # ---- engine step ---------------------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request]) -> dict[str, int]:
        """Run one scheduled step -> {request_id: sampled token} for the requests whose prompt is complete
        after this step (will_sample); logprobs asked for land in self.sampled_logprobs / self.prompt_logprobs."""
        cfg, out = self.engine_config, scheduler_output
        self.sampled_logprobs, self.prompt_logprobs = {}, {}
        if out.num_seqs == 0:
            return {}
        step, self.num_steps = self.num_steps, self.num_steps + 1
        batch = build_batch_metadata(out, requests, cfg.block_size, self.max_num_seqs, cfg.max_blocks_per_seq,
                                     self.token_buckets)
        attn_meta = attention_metadata(batch, self.attn_impl)
        self.buckets_used.add(batch.padded_num_tokens)
        self.variants_used.add((batch.padded_num_tokens, attn_meta.max_q_len))
        sampling = SamplingMetadata.from_requests([requests[r] for r in batch.req_ids], self.vocab_size,
                                                  num_rows=self.max_num_seqs, sample_rows=out.will_sample,
                                                  engine_seed=cfg.seed, step=step)
        targets = prompt_logprob_targets(batch, requests)
        ids, raw_logprobs, self.kv_cache, every = self._step(
            self.model, self.kv_cache, _i32(batch.input_ids), _i32(batch.positions),
            attn_meta, _i32(batch.logits_indices), sampling,
            all_logprobs=bool(targets))
        rows = [i for i, sample in enumerate(out.will_sample) if sample]
        rids = [batch.req_ids[i] for i in rows]
        want = [k for k, r in enumerate(rids) if requests[r].sampling_params.logprobs is not None]
        # One transfer: the ids, and only the log-prob rows some request asked for.
        ids, lp_rows, prompt_rows = jax.device_get((
            ids, raw_logprobs[np.asarray([rows[k] for k in want], np.int32)] if want else None,
            every[np.asarray([t.token_index for t in targets], np.int32)] if targets else None))
        for t, row in zip(targets, prompt_rows if targets else ()):
            self.prompt_logprobs.setdefault(t.request_id, []).append(
                (t.position, top_logprobs(row, t.next_token_id, t.num_logprobs)))
        for j, k in enumerate(want):
            rid = rids[k]
            self.sampled_logprobs[rid] = top_logprobs(lp_rows[j], int(ids[rows[k]]),
                                                      requests[rid].sampling_params.logprobs)
        return {r: int(ids[i]) for r, i in zip(rids, rows)}

    # ---- standalone checks (own block table over the runner's cache; no scheduler) --------------------------
    def _single_sequence_batch(self, token_ids: Sequence[int], start: int) -> BatchMetadata:
        # Tokens start..start+len of one sequence whose pages are blocks 0, 1, 2, ... of the cache, padded to a
        # token bucket; one sequence row, a block table max_blocks_per_seq wide.
        cfg = self.engine_config
        S, n, T = cfg.block_size, start + len(token_ids), len(token_ids)
        num_pages = -(-n // S)
        if num_pages > cfg.num_blocks or num_pages > cfg.max_blocks_per_seq:
            raise ValueError(f"{n} tokens need {num_pages} blocks, the cache has {cfg.num_blocks} "
                             f"(max {cfg.max_blocks_per_seq} per sequence)")
        padded = pick_bucket(T, self._check_buckets)
        positions = list(range(start, n))
        return BatchMetadata(req_ids=["0"], input_ids=list(token_ids) + [0] * (padded - T),
                             positions=positions + [0] * (padded - T),
                             slot_mapping=positions + [PAD_SLOT_ID] * (padded - T),
                             block_tables=[list(range(num_pages)) + [0] * (cfg.max_blocks_per_seq - num_pages)],
                             seq_lens=[n], query_start_loc=[0, T], logits_indices=[T - 1], num_seqs=1,
                             num_tokens=T, padded_num_tokens=padded)

    def _run_single(self, token_ids: Sequence[int], start: int):  # -> logits f32[len(token_ids),V]
        batch = self._single_sequence_batch(token_ids, start)
        logits, self.kv_cache = self._forward_logits(self.model, self.kv_cache, _i32(batch.input_ids),
                                                     _i32(batch.positions), attention_metadata(batch, self.attn_impl))
        return logits[: batch.num_tokens]

    def prefill_logits(self, token_ids: Sequence[int]):
        """Logits f32[T,V] at every prompt position, from one prefill through the paged path."""
        return self._run_single(token_ids, 0)

    def teacher_forced_decode(self, prompt: Sequence[int], continuation: Sequence[int]):
        """Prefill `prompt`, then decode `continuation` one token per step (teacher forcing) ->
        (f32[N,V]: logits of decode step j, fed continuation[j] at position len(prompt) + j,
         cache snapshot {"layers.<i>.k" / ".v": f32[len(prompt)+N, K, H]} of every layer that owns a cache,
         tokens in logical order)."""
        self._run_single(prompt, 0)
        logits = [self._run_single([token], len(prompt) + j)[0] for j, token in enumerate(continuation)]
        return np.stack(jax.device_get(logits)), self.cache_snapshot(len(prompt) + len(continuation))

    def cache_snapshot(self, num_tokens: int, block_ids: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """K/V of the first num_tokens tokens of the sequence whose block table is block_ids (default 0, 1, ...)."""
        S = self.engine_config.block_size
        pages = np.asarray(list(block_ids) if block_ids is not None else range(-(-num_tokens // S)), np.int32)
        out = {}
        for i, shape in enumerate(layer_kv_shapes(self.model_config)):
            if shape is None:
                continue
            out[f"layers.{i}.k"] = np.asarray(self.kv_cache.k[i][pages]).reshape(-1, *shape)[:num_tokens].copy()
            out[f"layers.{i}.v"] = np.asarray(self.kv_cache.v[i][pages]).reshape(-1, *shape)[:num_tokens].copy()
        return out
