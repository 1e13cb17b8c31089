"""The serving engine loop (shaped like vllm/v1/engine/core.py): step = schedule -> execute_model ->
update_from_output. Twin of torch_sources/serving/engine.py; requests are token ids in, token ids out.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from conversion.safetensors_io import load_config
from serving_engine.config import EngineConfig, SamplingParams
from serving_engine.model_runner import ModelRunner
from serving_engine.request import Request, RequestStatus
from serving_engine.sampler import Logprob
from serving_engine.scheduler import Scheduler

__all__ = ["RequestOutput", "LLMEngine", "eos_token_ids"]


@dataclass
class RequestOutput:
    """One request's state as vLLM's RequestOutput/CompletionOutput give it (token ids, no text)."""
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # SamplingParams.logprobs set: per output token {token id: Logprob}, the sampled token first; else None.
    logprobs: list[dict[int, Logprob]] | None = None
    # SamplingParams.prompt_logprobs set: per prompt token, None for the first, then {token id: Logprob}.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" (eos or a stop token), "length" (max_tokens, max_model_len)
    stop_reason: int | None = None  # the stop token id that finished it (None for eos and for length)


def eos_token_ids(model_dir, override_generation_config: Mapping | None = None) -> tuple[int, ...]:
    """EOS ids: the override's eos_token_id if it names one, else generation_config.json's, else config.json's."""
    eos = (override_generation_config or {}).get("eos_token_id")
    gen = Path(model_dir) / "generation_config.json"
    if eos is None and gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = load_config(model_dir).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


class LLMEngine:
    def __init__(self, model_dir, engine_config: EngineConfig = EngineConfig(),
                 override_generation_config: Mapping | None = None, **runner_kwargs):
        """override_generation_config: keys that replace the checkpoint's generation config (vLLM's
        --override-generation-config); only eos_token_id is read. runner_kwargs go to ModelRunner."""
        self.config = engine_config
        self.runner = ModelRunner(model_dir, engine_config, **runner_kwargs)
        self.scheduler = Scheduler(engine_config)
        self.eos_token_ids = eos_token_ids(model_dir, override_generation_config)
        self._outputs: dict[str, RequestOutput] = {}  # unfinished requests
        self._requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_preemptions = 0

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None, images: Sequence = ()) -> None:
        """images: raw uint8[H,W,3] arrays, in order, each named in the prompt by one image token (a multimodal
        family); the request's prompt is the expanded one (ModelRunner.prepare_images)."""
        params = sampling_params or SamplingParams()
        placeholders, mm_inputs = (), ()
        if len(images) or self.runner.multimodal:  # also refuses an image token without its image
            prompt_token_ids, placeholders, mm_inputs = self.runner.prepare_images(prompt_token_ids, images)
        # Request holds one EOS id; a checkpoint's further EOS ids (Llama 3: <|eot_id|>) stop it as stop tokens
        # (vLLM's SamplingParams.update_from_generation_config).
        eos, extra = (self.eos_token_ids[0], self.eos_token_ids[1:]) if self.eos_token_ids else (None, ())
        extra = tuple(e for e in extra if e != eos and e not in params.stop_token_ids)
        if extra and not params.ignore_eos:
            params = replace(params, stop_token_ids=params.stop_token_ids + extra)
        request = Request(str(request_id), list(prompt_token_ids), params, eos_token_id=eos,
                          mm_placeholders=tuple(placeholders), mm_inputs=tuple(mm_inputs))
        self.scheduler.add_request(request)
        self._requests[request.request_id] = request
        n = len(request.prompt_token_ids)
        self._outputs[request.request_id] = RequestOutput(
            request.request_id, list(request.prompt_token_ids), [],
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] * n if params.prompt_logprobs is not None else None)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Finish these requests as aborted (vLLM's abort_request): their blocks go back to the pool at once and
        no further output comes for them. Unknown or finished ids are ignored."""
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            self.scheduler.abort_request(str(rid))
            self._outputs.pop(str(rid), None)
            self._requests.pop(str(rid), None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One schedule -> forward -> sample -> update round -> a snapshot of every request that got a token."""
        scheduler_output = self.scheduler.schedule()
        sampled = self.runner.execute_model(scheduler_output, self.scheduler.requests)
        for rid, entries in self.runner.prompt_logprobs.items():
            prompt_logprobs = self._outputs[rid].prompt_logprobs
            for position, entry in entries:  # a recompute after preemption repeats positions: keep the first
                if prompt_logprobs[position + 1] is None:
                    prompt_logprobs[position + 1] = entry
        finished = {r.request_id: r for r in self.scheduler.update_from_output(scheduler_output, sampled)}
        self.num_steps += 1
        self.num_preemptions += len(scheduler_output.preempted_req_ids)
        results = []
        for rid in scheduler_output.scheduled_req_ids:
            out, request = self._outputs.get(rid), self._requests.get(rid)
            if out is None or len(request.output_token_ids) == len(out.output_token_ids):
                continue  # mid-prefill, or aborted: no new token
            out.output_token_ids.append(request.output_token_ids[-1])
            if out.logprobs is not None:
                out.logprobs.append(self.runner.sampled_logprobs[rid])
            if rid in finished:
                out.finished = True
                out.finish_reason = RequestStatus.finish_reason(request.status)
                out.stop_reason = request.stop_reason
            results.append(replace(out, output_token_ids=list(out.output_token_ids),
                                   logprobs=None if out.logprobs is None else list(out.logprobs),
                                   prompt_logprobs=None if out.prompt_logprobs is None else list(out.prompt_logprobs)))
            if out.finished:
                del self._outputs[rid], self._requests[rid]
        return results

    def generate(self, prompts: Sequence[Sequence[int] | Mapping],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts (token ids, or vLLM's tokens prompt {"prompt_token_ids": ..., "multi_modal_data":
        {"image": [uint8[H,W,3], ...]}}; request ids "0", "1", ... in order) to completion -> outputs in prompt
        order."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        ids = [str(i) for i in range(len(prompts))]
        for rid, prompt, params in zip(ids, prompts, sampling_params):
            if isinstance(prompt, Mapping):
                self.add_request(rid, prompt["prompt_token_ids"], params,
                                 images=(prompt.get("multi_modal_data") or {}).get("image", ()))
            else:
                self.add_request(rid, prompt, params)
        done: dict[str, RequestOutput] = {}
        while self.scheduler.has_unfinished_requests():
            done.update((o.request_id, o) for o in self.step() if o.finished)
        return [done[rid] for rid in ids]

    def stats(self) -> dict[str, int]:
        kv = self.scheduler.kv_cache_manager
        return dict(num_steps=self.num_steps, num_prefix_hit_blocks=kv.num_prefix_hit_blocks,
                    num_preemptions=self.num_preemptions, num_free_blocks=kv.num_free_blocks,
                    num_blocks=self.config.num_blocks, num_encoder_runs=self.runner.num_encoder_runs,
                    num_compilations=self.runner.num_compilations)
