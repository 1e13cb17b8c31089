"""The scheduler's per-step trace as fixed-shape arrays, the same on both sides of the L5 check.

Scheduler.trace (EngineConfig.record_trace) holds one StepTrace per engine step: the scheduled
request ids and token counts, the preempted ids, each scheduled request's block table, and the
block ids freed and evicted in that step (and, with images, the images encoded and evicted from the encoder
cache). Each becomes an int64 array padded with -1 (0 for token
counts), plus the preemption and eviction totals, so the grader compares them element by element (agreement) and a schedule that takes a
different number of steps mismatches in shape. Numpy only: the recorder and the sandboxed child
both import it.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

__all__ = ["pressure_config", "trace_arrays", "image_trace_arrays", "reference_pressure"]


def pressure_config(engine_config, num_blocks: int, long_prefill_token_threshold: int = 0):
    """The mode's engine (either side's EngineConfig dataclass) with a KV pool small enough to preempt and
    evict, prefix caching on (vLLM v1's default), and the per-step trace kept; chunked mode may also cap
    one request's chunk (long_prefill_token_threshold, 0 = no cap)."""
    return replace(engine_config, num_blocks=int(num_blocks), enable_prefix_caching=True, record_trace=True,
                   long_prefill_token_threshold=int(long_prefill_token_threshold))


def _rows(rows, width: int, fill: int = -1) -> np.ndarray:
    out = np.full((len(rows), width), fill, np.int64)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"trace row {i} holds {len(row)} entries, more than {width}")
        out[i, :len(row)] = [int(x) for x in row]
    return out


def trace_arrays(trace, max_num_seqs: int, max_blocks_per_seq: int, num_blocks: int) -> dict[str, np.ndarray]:
    steps = list(trace)
    tables = np.full((len(steps), max_num_seqs, max_blocks_per_seq), -1, np.int64)
    for i, step in enumerate(steps):
        tables[i, :len(step.block_tables)] = _rows(step.block_tables, max_blocks_per_seq)
    return {
        "num_preemptions": np.array(sum(len(s.preempted_req_ids) for s in steps), np.int64),
        "num_evictions": np.array(sum(len(s.evicted_block_ids) for s in steps), np.int64),
        "scheduled_req_ids": _rows([s.scheduled_req_ids for s in steps], max_num_seqs),
        "num_scheduled_tokens": _rows([s.num_scheduled_tokens for s in steps], max_num_seqs, 0),
        "preempted_req_ids": _rows([s.preempted_req_ids for s in steps], max_num_seqs),
        "block_tables": tables,
        "freed_block_ids": _rows([s.freed_block_ids for s in steps], num_blocks),
        "evicted_block_ids": _rows([s.evicted_block_ids for s in steps], num_blocks),
    }


def image_trace_arrays(trace, max_num_seqs: int, max_blocks_per_seq: int, num_blocks: int,
                       image_index: dict[str, int], max_images_per_step: int = 8) -> dict[str, np.ndarray]:
    """trace_arrays plus what images add per step: the images encoded, (request id, image of the request), and
    the images evicted from the encoder cache, each by its index in the workload's image list (`image_index`:
    content hash -> index), so each side's own hash function never shows in the arrays."""
    steps = list(trace)
    runs = np.full((len(steps), max_images_per_step, 2), -1, np.int64)
    for i, step in enumerate(steps):
        if len(step.scheduled_encoder_inputs) > max_images_per_step:
            raise ValueError(f"step {i} encodes {len(step.scheduled_encoder_inputs)} images, more than "
                             f"{max_images_per_step}")
        for j, (rid, k) in enumerate(step.scheduled_encoder_inputs):
            runs[i, j] = (int(rid), int(k))
    freed = _rows([[image_index[h] for h in step.freed_mm_hashes] for step in steps], max(len(image_index), 1))
    return {**trace_arrays(steps, max_num_seqs, max_blocks_per_seq, num_blocks), "encoder_runs": runs,
            "freed_images": freed,
            "num_encoder_runs": np.array(sum(len(s.scheduled_encoder_inputs) for s in steps), np.int64)}


def reference_pressure(ref) -> dict[str, int] | None:
    """{num_preemptions, num_evictions} of a reference's pressure run (None for a task without one): the
    report shows them, so a reader sees that the graded schedule really preempted and evicted."""
    check = getattr(ref, "checks", {}).get("L5/schedule_trace")
    if check is None:
        return None
    return {k: int(check.outputs[k]) for k in ("num_preemptions", "num_evictions")}
