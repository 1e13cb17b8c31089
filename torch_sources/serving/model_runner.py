"""Device side of one engine step (shaped like vllm/v1/worker/gpu_model_runner.py), eager PyTorch fp32.

execute_model: SchedulerOutput -> input_batch.BatchMetadata (plain lists) -> tensors -> forward_paged over the
ragged batch -> hidden of each request's last scheduled token -> logits -> Sampler. A request still
mid-prefill is not sampled (vLLM samples and discards it; nothing it would give is used). Logprobs dicts are
built only for the requests that ask (SamplingParams.logprobs / prompt_logprobs), from the raw logits.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from torch_sources.serving import models
from torch_sources.serving.config import EngineConfig
from torch_sources.serving.input_batch import BatchMetadata, build_batch_metadata, prompt_logprob_targets
from torch_sources.serving.paged_attention import AttentionMetadata, allocate_kv_cache, layer_kv_shapes
from torch_sources.serving.request import Request
from torch_sources.serving.sampler import Logprob, Sampler, SamplingMetadata, top_logprobs
from torch_sources.serving.scheduler import SchedulerOutput

__all__ = ["ModelRunner", "attention_metadata"]


def _i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def attention_metadata(batch: BatchMetadata) -> AttentionMetadata:
    return AttentionMetadata(slot_mapping=_i32(batch.slot_mapping), kv_lens=_i32(batch.seq_lens),
                             page_indices=_i32(batch.block_tables), cu_q_lens=_i32(batch.query_start_loc),
                             num_seqs=_i32([batch.num_seqs]))


class ModelRunner:
    def __init__(self, model_dir, engine_config: EngineConfig):
        self.engine_config = engine_config
        self.family = models.family(model_dir)
        self.model_config, self.model = models.load_model(model_dir)
        self.vocab_size = self.model_config.vocab_size
        self.kv_cache = allocate_kv_cache(self.model_config, engine_config)
        self.sampler = Sampler()
        # Of the last execute_model, for the requests that asked: the sampled token's logprobs dict, and
        # (prompt position, dict of the next prompt token) for each prompt position it computed.
        self.sampled_logprobs: dict[str, dict[int, Logprob]] = {}
        self.prompt_logprobs: dict[str, list[tuple[int, dict[int, Logprob]]]] = {}
        self.num_steps = 0  # steps run: the engine-wide noise of unseeded requests is keyed by it

    # ---- engine step ---------------------------------------------------------------------------------------
    def _forward(self, batch: BatchMetadata):  # -> final-normed hidden f32[T,D]
        hidden, self.kv_cache = self.family.forward_paged(self.model, _i32(batch.input_ids),
                                                          _i32(batch.positions), self.kv_cache,
                                                          attention_metadata(batch))
        return hidden

    @torch.no_grad()
    def execute_model(self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request]) -> dict[str, int]:
        """Run one scheduled step -> {request_id: sampled token} for the requests whose prompt is complete
        after this step (will_sample); logprobs asked for land in self.sampled_logprobs / self.prompt_logprobs."""
        cfg = self.engine_config
        self.sampled_logprobs, self.prompt_logprobs = {}, {}
        if scheduler_output.num_seqs == 0:
            return {}
        step, self.num_steps = self.num_steps, self.num_steps + 1
        batch = build_batch_metadata(scheduler_output, requests, cfg.block_size, scheduler_output.num_seqs,
                                     cfg.max_blocks_per_seq)
        hidden = self._forward(batch)
        targets = prompt_logprob_targets(batch, requests)
        if targets:
            logits = self.family.compute_logits(self.model, hidden[[t.token_index for t in targets]])
            rows_lp = torch.log_softmax(logits.float(), dim=-1).numpy()
            for t, row in zip(targets, rows_lp):
                self.prompt_logprobs.setdefault(t.request_id, []).append(
                    (t.position, top_logprobs(row, t.next_token_id, t.num_logprobs)))
        rows = [i for i, s in enumerate(scheduler_output.will_sample) if s]
        if not rows:
            return {}
        rids = [batch.req_ids[i] for i in rows]
        logits = self.family.compute_logits(self.model, hidden[[batch.logits_indices[i] for i in rows]])
        ids, raw_logprobs = self.sampler(logits, SamplingMetadata.from_requests(
            [requests[r] for r in rids], self.vocab_size, engine_seed=cfg.seed, step=step, rows=rows))
        ids = ids.tolist()
        for k, rid in enumerate(rids):
            num = requests[rid].sampling_params.logprobs
            if num is not None:
                self.sampled_logprobs[rid] = top_logprobs(raw_logprobs[k].numpy(), ids[k], num)
        return dict(zip(rids, ids))

    # ---- standalone checks (own block table over the runner's cache; no scheduler) --------------------------
    def _single_sequence_batch(self, token_ids: Sequence[int], start: int) -> BatchMetadata:
        # Tokens start..start+len of one sequence whose pages are blocks 0, 1, 2, ... of the cache.
        S, n = self.engine_config.block_size, start + len(token_ids)
        num_pages = -(-n // S)
        if num_pages > self.engine_config.num_blocks:
            raise ValueError(f"{n} tokens need {num_pages} blocks, the cache has {self.engine_config.num_blocks}")
        positions = list(range(start, n))
        return BatchMetadata(req_ids=["0"], input_ids=list(token_ids), positions=positions, slot_mapping=positions,
                             block_tables=[list(range(num_pages))], seq_lens=[n],
                             query_start_loc=[0, len(token_ids)], logits_indices=[len(token_ids) - 1], num_seqs=1,
                             num_tokens=len(token_ids), padded_num_tokens=len(token_ids))

    @torch.no_grad()
    def prefill_logits(self, token_ids: Sequence[int]):
        """Logits f32[T,V] at every prompt position, from one prefill through the paged path."""
        hidden = self._forward(self._single_sequence_batch(token_ids, 0))
        return self.family.compute_logits(self.model, hidden)

    @torch.no_grad()
    def teacher_forced_decode(self, prompt: Sequence[int], continuation: Sequence[int]):
        """Prefill `prompt`, then decode `continuation` one token per step (teacher forcing) ->
        (f32[N,V]: logits of decode step j, fed continuation[j] at position len(prompt) + j,
         cache snapshot {"layers.<i>.k" / ".v": f32[len(prompt)+N, K, H]} of every layer that owns a cache,
         tokens in logical order)."""
        self._forward(self._single_sequence_batch(prompt, 0))
        logits = []
        for j, token in enumerate(continuation):
            hidden = self._forward(self._single_sequence_batch([token], len(prompt) + j))
            logits.append(self.family.compute_logits(self.model, hidden)[0])
        return torch.stack(logits), self.cache_snapshot(len(prompt) + len(continuation))

    def cache_snapshot(self, num_tokens: int, block_ids: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """K/V of the first num_tokens tokens of the sequence whose block table is block_ids (default 0, 1, ...)."""
        S = self.engine_config.block_size
        pages = torch.as_tensor(list(block_ids) if block_ids is not None else range(-(-num_tokens // S)))
        out = {}
        for i, shape in enumerate(layer_kv_shapes(self.model_config)):
            if shape is None:
                continue
            out[f"layers.{i}.k"] = self.kv_cache.k[i][pages].reshape(-1, *shape)[:num_tokens].numpy().copy()
            out[f"layers.{i}.v"] = self.kv_cache.v[i][pages].reshape(-1, *shape)[:num_tokens].numpy().copy()
        return out
