"""Device side of one engine step: twin of torch_sources/serving/model_runner.py, as ONE jitted function.

execute_model: SchedulerOutput -> input_batch.BatchMetadata (plain lists) -> numpy -> `step`, jitted:
forward_paged over the ragged batch -> hidden of each request's last scheduled token -> logits -> Sampler.
Static shapes keep the number of compilations small: the flat token axis is padded to a bucket
(make_token_buckets: 16, 32, 64, ...; below 16, row_buckets for decode steps of few sequences), the
per-sequence axis to max_num_seqs (1 in core mode), the block table to max_blocks_per_seq; a pure decode step
is its own variant of its bucket (max_q_len 1: the CPU attention gathers each sequence's pages once, not each
padded token's); above 256 tokens or slots a step is also compiled for bounds on its longest query and its
longest sequence (query_bound, kv_page_bound), so that its attention works on the pages its sequences reach,
not on max_model_len. The KV cache is an argument and a result of `step`, donated, so XLA updates it in place
(tpu-inference's `donate_argnums` on kv_caches); the runner keeps only the returned value.
Per step the host reads back the sampled ids, plus the raw log-prob rows of only those requests that ask for
logprobs (prompt logprobs switch to a variant of the step that also returns every token's log-probs). Rows
whose token is discarded (a partial prefill chunk, a padding row) are sampled greedily and ignored.

A multimodal family (its module's MULTIMODAL) takes images, as the torch twin does: the encoder (jitted per image
grid) runs each image the scheduler lists and its rows stay in `encoder_cache` by content hash until the
scheduler frees it; each step hands `step` its M-RoPE positions i32[3,T] and the image rows f32[T,D] of the
placeholder ranges its tokens cover (zeros and False elsewhere: the same static shapes as a text-only step).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from serving_engine import models
from serving_engine.config import EngineConfig
from serving_engine.input_batch import PAD_SLOT_ID, BatchMetadata, build_batch_metadata, make_token_buckets, \
    mrope_positions, multimodal_slices, pick_bucket, prompt_logprob_targets
from serving_engine.multimodal import ImageInput, expand_image_tokens, image_hash
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


def _forward(family, model, input_ids, positions, kv_cache, attn_meta, images):
    # images: (image rows f32[T,D], is_mm bool[T]) for a multimodal family, else None
    return family.forward_paged(model, input_ids, positions, kv_cache, attn_meta, *(images or ()))


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,), static_argnames=("all_logprobs",))
def _step(family, model, kv_cache, input_ids, positions, attn_meta, logits_indices, sampling, images=None,
          all_logprobs=False):
    """-> (sampled ids i32[S], raw log-probs f32[S,V], kv_cache, log-probs f32[T_bucket,V] of every token
    when all_logprobs (prompt logprobs) else None). input_ids i32[T_bucket], positions i32[T_bucket] (M-RoPE:
    i32[3,T_bucket]), logits_indices i32[S] (S = max_num_seqs)."""
    _TRACES[0] += 1
    hidden, kv_cache = _forward(family, model, input_ids, positions, kv_cache, attn_meta, images)
    logits = family.compute_logits(model, hidden[logits_indices])  # f32[S,V]
    ids, raw_logprobs = _SAMPLER(logits, sampling)
    every = jax.nn.log_softmax(family.compute_logits(model, hidden), -1) if all_logprobs else None
    return ids, raw_logprobs, kv_cache, every


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _forward_logits(family, model, kv_cache, input_ids, positions, attn_meta, images=None):
    """-> (logits f32[T_bucket,V] at every token, kv_cache)."""
    _TRACES[0] += 1
    hidden, kv_cache = _forward(family, model, input_ids, positions, kv_cache, attn_meta, images)
    return family.compute_logits(model, hidden), kv_cache


@functools.partial(jax.jit, static_argnums=(0, 3))
def _encode(family, model, pixel_values, grid_thw):
    """One image's encoder rows f32[n,D]; its grid is static (the tower's windows and rope derive from it)."""
    _TRACES[0] += 1
    return family.embed_multimodal(model, pixel_values, grid_thw)


# Static bounds a step's attention is compiled for, on a grid that starts at 256 so that a step whose token bucket and
# block table hold at most 256 is compiled as it would be without them (every tiny-scale task's steps).
BOUND_FLOOR = 256
KV_BOUND_STEP = 128  # slots: a decode step of sequences of <= 320 tokens in a 512-slot table reads 384 slots' pages


def query_bound(longest: int, num_tokens: int) -> int | None:
    """Static bound on any sequence's new tokens: 1 in a pure decode step; above BOUND_FLOOR tokens a power of two
    (>= 64) that holds the longest, which sizes the CPU attention's query blocks; else None (the token bucket)."""
    if longest <= 1:
        return 1
    if num_tokens <= BOUND_FLOOR:
        return None
    bound = 64
    while bound < longest:
        bound *= 2
    return min(bound, num_tokens)


def kv_page_bound(longest: int, block_size: int, table_width: int) -> int:
    """Pages of the block table a step's attention reads: every live sequence's, on the grid BOUND_FLOOR,
    + KV_BOUND_STEP, ... slots (the whole table at or under BOUND_FLOOR slots, as without a bound)."""
    slots = max(BOUND_FLOOR, -(-longest // KV_BOUND_STEP) * KV_BOUND_STEP)
    return min(table_width, -(-slots // block_size))


def row_buckets(max_num_seqs: int, max_model_len: int, min_bucket: int = 16) -> list[int]:
    """Token buckets below the grid's first (make_token_buckets: 16) for decode steps of few sequences. A decode
    step streams every weight for however many rows it has, and XLA:CPU's matmuls take longer the more rows they
    have (`bench/matmul_stream.py --rows R` at small scale: 10.8 ms for one row, 20.3 for 4, 27.0 for 16).
    An engine of one sequence (core mode) decodes in one row. An engine of several takes powers of two up to the
    first that holds max_num_seqs only where its sequences may pass BOUND_FLOOR tokens: each bucket is a compiled
    variant, and at tiny scale (max_model_len 128), where compiling dominates, buckets of 1, 2, 4 and 8 rows took a
    chunked task's engine run from 0.43 to 0.85 of its time budget."""
    if max_num_seqs == 1:
        return [1]
    if max_model_len <= BOUND_FLOOR:
        return []
    buckets = [1]
    while buckets[-1] < min(max_num_seqs, min_bucket // 2):
        buckets.append(buckets[-1] * 2)
    return buckets


def attention_metadata(batch: BatchMetadata, impl: str = "auto", block_size: int | None = None) -> AttentionMetadata:
    """Host arrays (numpy) of one step; jit moves them to the device with the call. A pure decode step
    (every sequence one new token) says so statically: max_q_len 1, one query per sequence. With block_size,
    the block table is cut to the pages the step's longest sequence reaches (kv_page_bound): its width is part
    of the compiled variant, as the token bucket is."""
    live = batch.num_seqs
    q_lens = np.diff(batch.query_start_loc[: live + 1])
    table = _i32(batch.block_tables)
    if block_size is not None and live:
        table = table[:, :kv_page_bound(int(max(batch.seq_lens[:live])), block_size, table.shape[1])]
    return AttentionMetadata(slot_mapping=_i32(batch.slot_mapping), kv_lens=_i32(batch.seq_lens),
                             page_indices=np.ascontiguousarray(table), cu_q_lens=_i32(batch.query_start_loc),
                             num_seqs=_i32([live]), impl=impl,
                             max_q_len=query_bound(int(q_lens.max()), batch.padded_num_tokens) if q_lens.size else None)


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
        self.token_buckets = list(token_buckets or row_buckets(cfg.max_running, cfg.max_model_len) +
                                  make_token_buckets(cfg.max_num_batched_tokens))
        # prefill_logits / teacher_forced_decode run one whole prompt, which may exceed a chunked budget.
        self._check_buckets = row_buckets(1, cfg.max_model_len) + make_token_buckets(
            max(cfg.max_num_batched_tokens, cfg.max_model_len))
        # Of the last execute_model, for the requests that asked: the sampled token's logprobs dict, and
        # (prompt position, dict of the next prompt token) for each prompt position it computed.
        self.sampled_logprobs: dict[str, dict[int, Logprob]] = {}
        self.prompt_logprobs: dict[str, list[tuple[int, dict[int, Logprob]]]] = {}
        self.num_steps = 0  # steps run: the engine-wide noise of unseeded requests is keyed by it
        self.num_compilations = 0  # traces of the jitted functions (each trace is one XLA compilation)
        self.buckets_used: set[int] = set()  # token buckets execute_model has run
        # (token bucket, max_q_len, block-table width) it has run: each is one compiled variant of the step
        self.variants_used: set[tuple[int, int | None, int]] = set()
        self.multimodal = bool(getattr(self.family, "MULTIMODAL", False))
        self.encoder_cache: dict[str, np.ndarray] = {}  # mm_hash -> the encoder's rows f32[n,D] of that image
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

    def _encode(self, image: ImageInput) -> np.ndarray:  # -> f32[n,D]
        self.num_encoder_runs += 1
        out = np.asarray(self._traced(_encode, self.family, self.model, np.asarray(image.pixel_values, np.float32),
                                      tuple(int(x) for x in image.image_grid_thw)))
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
        """-> (positions i32[3,T], (image rows f32[T,D], is_mm bool[T])) of one step, after running its encoders."""
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
        return _i32(mrope_positions(batch, tables)), self._image_rows(batch, requests, self.encoder_cache)

    def _image_rows(self, batch: BatchMetadata, requests, encoded: Mapping[str, np.ndarray]):
        T = len(batch.input_ids)
        embeds = np.zeros((T, self.model_config.hidden_size), np.float32)
        is_mm = np.zeros(T, bool)
        for s in multimodal_slices(batch, requests):
            rows = encoded.get(s.mm_hash)
            if rows is None:
                raise RuntimeError(f"request {s.request_id!r}: no encoder output for image {s.mm_hash[:12]} in this "
                                   f"step (the scheduler ran no encoder for it, or freed it too early)")
            embeds[s.token_index:s.token_index + s.end - s.start] = rows[s.start:s.end]
            is_mm[s.token_index:s.token_index + s.end - s.start] = True
        return embeds, is_mm

    def _step_inputs(self, batch: BatchMetadata, multimodal=None):
        """-> (positions, images) for the jitted bodies: a text-only family's i32[T] and None; a multimodal
        family's i32[3,T] and its image rows (multimodal None: a text-only batch, its positions on three rows)."""
        if not self.multimodal:
            return _i32(batch.positions), None
        if multimodal is None:
            T = len(batch.input_ids)
            return _i32([batch.positions] * 3), (np.zeros((T, self.model_config.hidden_size), np.float32),
                                                 np.zeros(T, bool))
        return multimodal

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
        attn_meta = attention_metadata(batch, self.attn_impl, cfg.block_size)
        self.buckets_used.add(batch.padded_num_tokens)
        self.variants_used.add((batch.padded_num_tokens, attn_meta.max_q_len, attn_meta.page_indices.shape[1]))
        sampling = SamplingMetadata.from_requests([requests[r] for r in batch.req_ids], self.vocab_size,
                                                  num_rows=self.max_num_seqs, sample_rows=out.will_sample,
                                                  engine_seed=cfg.seed, step=step)
        targets = prompt_logprob_targets(batch, requests)
        positions, images = self._step_inputs(
            batch, self._multimodal_inputs(out, batch, requests) if self.multimodal else None)
        ids, raw_logprobs, self.kv_cache, every = self._step(
            self.model, self.kv_cache, _i32(batch.input_ids), positions,
            attn_meta, _i32(batch.logits_indices), sampling, images,
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

    def _run_single(self, token_ids: Sequence[int], start: int, placeholders=(), images=()):
        """-> logits f32[len(token_ids),V]; a multimodal family's prompt (start 0) with its M-RoPE table and the
        rows of its images (placeholders, processed images: their encoders run here, outside the cache)."""
        batch = self._single_sequence_batch(token_ids, start)
        multimodal = None
        if self.multimodal and start == 0:
            table, delta = self.family.mrope_positions(self.model_config, token_ids,
                                                       [x.image_grid_thw for x in images])
            request = {"0": Request("0", list(token_ids), mm_placeholders=tuple(placeholders))}
            encoded = {h: self._encode(x) for (_, _, h), x in zip(placeholders, images)}
            multimodal = (_i32(mrope_positions(batch, {"0": (np.asarray(table).tolist(), int(delta))})),
                          self._image_rows(batch, request, encoded))
        positions, images_in = self._step_inputs(batch, multimodal)
        meta = attention_metadata(batch, self.attn_impl, self.engine_config.block_size)
        logits, self.kv_cache = self._forward_logits(self.model, self.kv_cache, _i32(batch.input_ids), positions,
                                                     meta, images_in)
        return logits[: batch.num_tokens]

    def prefill_logits(self, token_ids: Sequence[int], images: Sequence = ()):
        """Logits f32[T,V] at every prompt position, from one prefill through the paged path. With images
        (uint8[H,W,3], a multimodal family): token_ids name each image with one image token, and the logits
        are those of the expanded prompt (prepare_images)."""
        if len(images):
            token_ids, placeholders, inputs = self.prepare_images(token_ids, images)
            return self._run_single(token_ids, 0, placeholders, inputs)
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
