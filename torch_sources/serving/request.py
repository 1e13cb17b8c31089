"""Request state of the paged-attention serving engine (host side, plain Python; shaped like vllm/v1/request.py).

A request with images carries one placeholder (offset, length, content hash) per image, sorted and disjoint inside
the prompt, and optionally one opaque payload per image for the model runner's encoder (mm_inputs).

This is the original in torch_sources/serving/; serving_engine/request.py is the JAX engine's own copy.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from .config import SamplingParams

__all__ = ["RequestStatus", "Request"]


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished (vLLM orders the enum the same way).
    FINISHED_STOPPED = 3  # eos or a stop token
    FINISHED_LENGTH_CAPPED = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: RequestStatus) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(status)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_id: int | None = None
    # Multimodal placeholders (offset, length, content_hash): the hash enters the prefix-cache key of every
    # block the placeholder overlaps, so two different images behind the same pad tokens never share KV.
    mm_placeholders: tuple[tuple[int, int, str], ...] = ()
    arrival_index: int = -1  # set by Scheduler.add_request; breaks ties in FCFS order
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or is being written this step)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks so far
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling (-1 until then)
    num_preemptions: int = 0
    stop_reason: int | None = None  # the stop token id that finished the request, if any
    # One opaque payload per placeholder (e.g. an image's pixel values and grid) for the model runner's encoder;
    # the host side never looks inside. Empty when the request has no images or the runner gets them elsewhere.
    mm_inputs: tuple = ()

    def __post_init__(self):
        self.prompt_token_ids = [int(t) for t in self.prompt_token_ids]
        self.mm_placeholders = tuple((int(o), int(n), str(h)) for o, n, h in self.mm_placeholders)
        self.mm_inputs = tuple(self.mm_inputs)
        self._check_mm_placeholders()

    def _check_mm_placeholders(self) -> None:
        # The encoder scheduler walks placeholders in order and stops at the first one past the chunk, so they must
        # be sorted and disjoint; each must lie inside the prompt, where its embeddings replace the pad tokens.
        rid, num_prompt, prev_end = self.request_id, len(self.prompt_token_ids), 0
        for i, (offset, length, _) in enumerate(self.mm_placeholders):
            if length < 1:
                raise ValueError(f"request {rid!r}: placeholder {i} has length {length}, it must be >= 1")
            if offset < 0 or offset + length > num_prompt:
                raise ValueError(f"request {rid!r}: placeholder {i} covers [{offset}, {offset + length}), outside the "
                                 f"prompt of {num_prompt} tokens")
            if offset < prev_end:
                raise ValueError(f"request {rid!r}: placeholder {i} starts at {offset}, before the previous one ends "
                                 f"at {prev_end}; placeholders must be sorted by offset and must not overlap")
            prev_end = offset + length
        if self.mm_inputs and len(self.mm_inputs) != len(self.mm_placeholders):
            raise ValueError(f"request {rid!r}: {len(self.mm_inputs)} mm_inputs for {len(self.mm_placeholders)} "
                             f"placeholders; give one per placeholder, or none")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def has_encoder_inputs(self) -> bool:
        return bool(self.mm_placeholders)

    def get_num_encoder_tokens(self, input_id: int) -> int:
        # Every placeholder token is one image-embedding row: vLLM's is_embed mask is all-true for Qwen2.5-VL's
        # image pads, so the encoder output of an image is exactly as long as its placeholder.
        return self.mm_placeholders[input_id][1]

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))
