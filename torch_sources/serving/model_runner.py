"""Device side of one engine step (shaped like vllm/v1/worker/gpu_model_runner.py), eager PyTorch fp32.

execute_model: SchedulerOutput -> input_batch.BatchMetadata (plain lists) -> tensors -> forward_paged over the
ragged batch -> hidden of each request's last scheduled token -> logits -> Sampler. A request still
mid-prefill is not sampled (vLLM samples and discards it; nothing it would give is used). Logprobs dicts are
built only for the requests that ask (SamplingParams.logprobs / prompt_logprobs), from the raw logits.

A multimodal family (its module's MULTIMODAL) takes images, as vLLM's GPUModelRunner does: the encoder runs each
image the scheduler lists in scheduled_encoder_inputs and keeps its output by content hash in `encoder_cache`
(dropped when the scheduler frees the hash); each step gathers the rows of every placeholder range the step's
tokens cover, a chunk boundary inside a range included, in place of those tokens' embeddings. Positions are
M-RoPE's three rows: the prompt's table computed once per request (`mrope_positions`), every later token at its
position plus the request's delta on all three rows.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from torch_sources.serving import models
from torch_sources.serving.config import EngineConfig
from torch_sources.serving.input_batch import BatchMetadata, build_batch_metadata, mrope_positions, \
    multimodal_slices, prompt_logprob_targets
from torch_sources.serving.multimodal import ImageInput, expand_image_tokens, image_hash
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
        self.multimodal = bool(getattr(self.family, "MULTIMODAL", False))
        self.encoder_cache: dict[str, torch.Tensor] = {}  # mm_hash -> the encoder's rows f32[n,D] of that image
        self.mrope_tables: dict[str, tuple[list[list[int]], int]] = {}  # request id -> (prompt's 3 x L rows, delta)
        self.num_encoder_runs = 0  # images encoded (an encoder-cache hit runs none)

    # ---- images ----------------------------------------------------------------------------------------------
    def prepare_images(self, prompt_token_ids: Sequence[int], images: Sequence) -> tuple[
            list[int], list[tuple[int, int, str]], list[ImageInput]]:
        """A prompt naming each image with one image token, and the raw images uint8[H,W,3] in order ->
        (the prompt with each image token expanded to its image's rows, placeholders (offset, length, content
        hash), the processed images): vLLM's input processing for the image modality."""
        if not self.multimodal:
            raise ValueError(f"{type(self.model_config).__name__} takes no images (a text-only family)")
        c = self.model_config
        merge = c.vision.spatial_merge_size
        inputs = []
        for image in images:
            pixel_values, grid = self.family.process_image(c, np.asarray(image))
            inputs.append(ImageInput(pixel_values, grid, grid[0] * grid[1] * grid[2] // merge ** 2))
        ids, runs = expand_image_tokens(prompt_token_ids, self.family.image_token_id(c),
                                        [x.num_tokens for x in inputs])
        placeholders = [(off, n, image_hash(np.asarray(image))) for (off, n), image in zip(runs, images)]
        return ids, placeholders, inputs

    def _encode(self, image: ImageInput) -> torch.Tensor:  # -> f32[n,D]
        self.num_encoder_runs += 1
        out = self.family.embed_multimodal(self.model, image.pixel_values, image.image_grid_thw)
        if out.shape[0] != image.num_tokens:
            raise ValueError(f"the encoder gave {out.shape[0]} rows for an image of {image.num_tokens} tokens")
        return out

    def _mrope_table(self, request_id: str, prompt_token_ids, images: Sequence[ImageInput]):
        if request_id not in self.mrope_tables:  # once per request: a chunk or a recompute slices it
            table, delta = self.family.mrope_positions(self.model_config, prompt_token_ids,
                                                       [x.image_grid_thw for x in images])
            self.mrope_tables[request_id] = (np.asarray(table).tolist(), int(delta))
        return self.mrope_tables[request_id]

    def _multimodal_inputs(self, out: SchedulerOutput, batch: BatchMetadata, requests: Mapping[str, Request]):
        """-> (positions i32[3,T], image rows f32[T,D], is_mm bool[T]) of one step, after running its encoders."""
        for mm_hash in out.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        for rid in out.finished_req_ids:
            self.mrope_tables.pop(rid, None)
        for rid, inputs in out.scheduled_encoder_inputs.items():
            req = requests[rid]
            for i in inputs:
                self.encoder_cache[req.mm_placeholders[i][2]] = self._encode(req.mm_inputs[i])
        tables = {rid: self._mrope_table(rid, requests[rid].prompt_token_ids, requests[rid].mm_inputs)
                  for rid in batch.req_ids}
        embeds, is_mm = self._image_rows(batch, requests, self.encoder_cache)
        return _i32(mrope_positions(batch, tables)), embeds, is_mm

    def _image_rows(self, batch: BatchMetadata, requests, encoded: Mapping[str, torch.Tensor]):
        T = len(batch.input_ids)
        embeds = torch.zeros(T, self.model_config.hidden_size)
        is_mm = torch.zeros(T, dtype=torch.bool)
        for s in multimodal_slices(batch, requests):
            rows = encoded.get(s.mm_hash)
            if rows is None:
                raise RuntimeError(f"request {s.request_id!r}: no encoder output for image {s.mm_hash[:12]} in this "
                                   f"step (the scheduler ran no encoder for it, or freed it too early)")
            embeds[s.token_index:s.token_index + s.end - s.start] = rows[s.start:s.end]
            is_mm[s.token_index:s.token_index + s.end - s.start] = True
        return embeds, is_mm

    # ---- engine step ---------------------------------------------------------------------------------------
    def _forward(self, batch: BatchMetadata, multimodal=None):  # -> final-normed hidden f32[T,D]
        """multimodal: (positions i32[3,T], image rows f32[T,D], is_mm bool[T]) for a multimodal family (None: a
        text-only batch, its positions on all three rows)."""
        meta = attention_metadata(batch)
        if not self.multimodal:
            hidden, self.kv_cache = self.family.forward_paged(self.model, _i32(batch.input_ids),
                                                              _i32(batch.positions), self.kv_cache, meta)
            return hidden
        if multimodal is None:
            T = len(batch.input_ids)
            multimodal = (_i32([batch.positions] * 3), torch.zeros(T, self.model_config.hidden_size),
                          torch.zeros(T, dtype=torch.bool))
        hidden, self.kv_cache = self.family.forward_paged(self.model, _i32(batch.input_ids), multimodal[0],
                                                          self.kv_cache, meta, multimodal[1], multimodal[2])
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
        hidden = self._forward(batch, self._multimodal_inputs(scheduler_output, batch, requests)
                               if self.multimodal else None)
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

    def _single_sequence_inputs(self, batch: BatchMetadata, prompt, placeholders=(), images=()):
        # a standalone sequence's M-RoPE rows and image rows (its encoders run here, outside the cache)
        if not self.multimodal:
            return None
        table, delta = self.family.mrope_positions(self.model_config, prompt, [x.image_grid_thw for x in images])
        tables = {"0": (np.asarray(table).tolist(), int(delta))}
        request = {"0": Request("0", list(prompt), mm_placeholders=tuple(placeholders))}
        encoded = {h: self._encode(x) for (_, _, h), x in zip(placeholders, images)}
        return (_i32(mrope_positions(batch, tables)), *self._image_rows(batch, request, encoded))

    @torch.no_grad()
    def prefill_logits(self, token_ids: Sequence[int], images: Sequence = ()):
        """Logits f32[T,V] at every prompt position, from one prefill through the paged path. With images
        (uint8[H,W,3], a multimodal family): token_ids name each image with one image token, and the logits
        are those of the expanded prompt (prepare_images)."""
        placeholders, inputs = (), ()
        if images:
            token_ids, placeholders, inputs = self.prepare_images(token_ids, images)
        batch = self._single_sequence_batch(token_ids, 0)
        hidden = self._forward(batch, self._single_sequence_inputs(batch, token_ids, placeholders, inputs))
        return self.family.compute_logits(self.model, hidden)

    @torch.no_grad()
    def teacher_forced_decode(self, prompt: Sequence[int], continuation: Sequence[int]):
        """Prefill `prompt`, then decode `continuation` one token per step (teacher forcing) ->
        (f32[N,V]: logits of decode step j, fed continuation[j] at position len(prompt) + j,
         cache snapshot {"layers.<i>.k" / ".v": f32[len(prompt)+N, K, H]} of every layer that owns a cache,
         tokens in logical order)."""
        batch = self._single_sequence_batch(prompt, 0)
        self._forward(batch, self._single_sequence_inputs(batch, prompt))
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
