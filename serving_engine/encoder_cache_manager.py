"""Encoder-output cache bookkeeping of the serving engine's multimodal requests (host side, plain Python).

Shaped like vllm/v1/core/encoder_cache_manager.py: the vision encoder's output for an image (one embedding row per
placeholder token) stays cached under the image's content hash while any request still needs it, so a prefill cut
into chunks runs the encoder once, and requests showing the same image share one output. An entry no request
references is kept, and evicted (oldest first) only when a new image needs its room; the evicted hashes reach the
model runner through SchedulerOutput.free_encoder_mm_hashes. Sizes are counted in embedding rows, not bytes.

This is the JAX engine's own copy of torch_sources/serving/encoder_cache_manager.py: an oracle must stand alone, so the
mirror is intended. Keep the code identical to the original (tests/serving/test_serving_bookkeeping.py checks it).
"""
from __future__ import annotations

from collections import OrderedDict

from .request import Request

__all__ = ["EncoderCacheManager"]


class EncoderCacheManager:
    def __init__(self, cache_size: int):
        self.cache_size = cache_size
        self.num_free_slots = cache_size  # rows not held by any entry
        self.num_freeable_slots = cache_size  # free rows plus the rows of unreferenced entries (reclaimable)
        self.cached: dict[str, set[str]] = {}  # mm hash -> ids of the requests using it (empty: kept, unreferenced)
        self.freeable: OrderedDict[str, int] = OrderedDict()  # unreferenced entries -> their rows, oldest first
        self.freed: list[str] = []  # evicted since the last get_freed_mm_hashes()

    def check_and_update_cache(self, request: Request, input_id: int) -> bool:
        """Is the input's encoder output cached? If so the request takes a reference on it (an unreferenced entry
        stops being freeable)."""
        mm_hash = _mm_hash(request, input_id)
        if mm_hash not in self.cached:
            return False
        if not self.cached[mm_hash]:
            self.num_freeable_slots -= self.freeable.pop(mm_hash)
        self.cached[mm_hash].add(request.request_id)
        return True

    def can_allocate(self, request: Request, input_id: int, encoder_compute_budget: int,
                     num_embeds_to_schedule: int) -> bool:
        """Can the input run in this step, on top of num_embeds_to_schedule rows already planned for it? Evicts
        unreferenced entries, oldest first, when only their room makes it fit; refuses without evicting anything
        when even that is not enough or the compute budget is too small."""
        num_embeds = request.get_num_encoder_tokens(input_id)
        if num_embeds > encoder_compute_budget:
            return False
        num_embeds += num_embeds_to_schedule
        if num_embeds <= self.num_free_slots:
            return True
        if num_embeds > self.num_freeable_slots:
            return False
        # The runner drops an evicted output only when the scheduler output names it (free_encoder_mm_hashes).
        while num_embeds > self.num_free_slots:
            mm_hash, num_rows = self.freeable.popitem(last=False)
            del self.cached[mm_hash]
            self.freed.append(mm_hash)
            self.num_free_slots += num_rows
        return True

    def allocate(self, request: Request, input_id: int) -> None:
        """Reserve the input's rows for the encoder output computed this step (after can_allocate said yes)."""
        mm_hash = _mm_hash(request, input_id)
        num_embeds = request.get_num_encoder_tokens(input_id)
        if num_embeds > self.num_free_slots or num_embeds > self.num_freeable_slots:
            raise ValueError(
                f"request {request.request_id!r}: input {input_id} needs {num_embeds} encoder cache rows, only "
                f"{self.num_free_slots} are free ({self.num_freeable_slots} reclaimable); call can_allocate first")
        self.cached.setdefault(mm_hash, set()).add(request.request_id)
        self.num_free_slots -= num_embeds
        self.num_freeable_slots -= num_embeds

    def get_cached_input_ids(self, request: Request) -> set[int]:
        """The request's inputs whose hash has an entry (referenced or not)."""
        return {i for i in range(len(request.mm_placeholders)) if _mm_hash(request, i) in self.cached}

    def free_encoder_input(self, request: Request, input_id: int) -> None:
        """Drop the request's reference on the input's entry; an entry left unreferenced becomes freeable (kept
        until a new image needs its room)."""
        mm_hash = _mm_hash(request, input_id)
        if not self.cached.get(mm_hash):
            return
        self.cached[mm_hash].discard(request.request_id)
        if not self.cached[mm_hash]:
            num_embeds = request.get_num_encoder_tokens(input_id)
            self.freeable[mm_hash] = num_embeds
            self.num_freeable_slots += num_embeds

    def free(self, request: Request) -> None:
        """Drop every reference the request holds (it finished, was aborted or preempted)."""
        for input_id in sorted(self.get_cached_input_ids(request)):
            self.free_encoder_input(request, input_id)

    def get_freed_mm_hashes(self) -> list[str]:
        """The hashes evicted since the last call, in eviction order; the list starts over."""
        freed, self.freed = self.freed, []
        return freed


def _mm_hash(request: Request, input_id: int) -> str:
    return request.mm_placeholders[input_id][2]
