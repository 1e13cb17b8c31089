"""Sampler in vLLM v1 order (vllm/v1/sample/sampler.py), batched over rows, fp32:

    raw logprobs -> penalties -> greedy argmax -> temperature -> min_p -> top_k / top_p -> exponential race

- Log-probs are the raw logits' log_softmax (vLLM's default logprobs_mode "raw_logprobs"); the runner
  turns the rows a request asked for into vLLM logprobs dicts (`top_logprobs`).
- Greedy rows (temperature < 1e-5) take the argmax after penalties, before any other transform.
- Random rows take argmax(probs / q), q ~ Exp(1). A seeded request's noise is drawn by numpy from (seed, step)
  (`exponential_noise`); an unseeded one's from the engine-wide stream (`engine_noise`: engine seed, engine
  step, batch row), as vLLM draws unseeded rows from the one global generator, so they depend on the batch.
  (`exponential_noise`), so another engine given the same seeds draws the same tokens.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["SAMPLING_EPS", "exponential_noise", "apply_penalties", "apply_temperature",
           "apply_min_p", "apply_top_k_top_p", "greedy_sample", "random_sample", "SamplingMetadata", "Sampler",
           "ENGINE_STREAM", "engine_noise", "Logprob", "top_logprobs"]

SAMPLING_EPS = 1e-5  # vLLM _SAMPLING_EPS: a temperature below it is greedy


def exponential_noise(seed: int, step: int, vocab: int) -> np.ndarray:
    """f32[vocab] of Exp(1) noise for the `step`-th output token of a request seeded `seed`."""
    return np.random.default_rng([seed, step]).standard_exponential(vocab, dtype=np.float32)


# A fixed first word keeps the engine-wide stream apart from every per-request (seed, step) stream.
ENGINE_STREAM = 0x7F4A7C15


def engine_noise(engine_seed: int, step: int, row: int, vocab: int) -> np.ndarray:
    """f32[vocab] of Exp(1) noise for batch row `row` of engine step `step`: what an unseeded request draws."""
    return np.random.default_rng([ENGINE_STREAM, engine_seed, step, row]).standard_exponential(vocab,
                                                                                               dtype=np.float32)


@dataclass(frozen=True)
class Logprob:
    """One entry of a vLLM logprobs dict: the raw log-probability and its 1-based rank in the vocabulary."""
    logprob: float
    rank: int


def top_logprobs(row: np.ndarray, token_id: int, num: int) -> dict[int, Logprob]:
    """vLLM's logprobs entry of one position from its raw log-softmax row f32[V]: the chosen token first, then
    the `num` most likely (ties: lower id first; -1 = the whole vocabulary). Rank = 1 + tokens strictly above."""
    row = np.asarray(row, np.float32)
    order = np.argsort(-row, kind="stable")[: row.shape[-1] if num == -1 else num]
    ids = [int(token_id), *order.tolist()]
    neg_sorted = np.sort(-row)  # ascending; the count of entries below -x = tokens strictly above x
    ranks = np.searchsorted(neg_sorted, -row[ids], side="left") + 1
    out: dict[int, Logprob] = {}
    for t, rank in zip(ids, ranks.tolist()):
        out.setdefault(t, Logprob(float(row[t]), int(rank)))
    return out


# ---- transforms (each f32[B,V] -> f32[B,V]; per-row parameters are f32[B] / i32[B]) -------------------------

def apply_penalties(logits, prompt_ids_mask, output_counts, repetition_penalty, presence_penalty,
                    frequency_penalty):
    """prompt_ids_mask bool[B,V] (token in the prompt), output_counts i32[B,V] (occurrences in the output).
    Repetition divides positive / multiplies negative logits of tokens seen in prompt or output; frequency
    and presence subtract per output occurrence / once if it occurred (OpenAI definitions)."""
    seen = prompt_ids_mask | (output_counts > 0)
    r = repetition_penalty[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / r, logits * r)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalty[:, None] * output_counts.to(logits.dtype)
    return logits - presence_penalty[:, None] * (output_counts > 0).to(logits.dtype)


def apply_temperature(logits, temperature):
    """Divide each row by its temperature; greedy rows (T < SAMPLING_EPS) divide by 1."""
    t = torch.where(temperature < SAMPLING_EPS, torch.ones_like(temperature), temperature)
    return logits / t[:, None]


def apply_min_p(logits, min_p):
    """Mask tokens whose probability is below min_p times the row's top probability (min_p 0 = off)."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits, k, p):
    """k i32[B] (0 = off), p f32[B] (1 = off). Top-k keeps logits >= the k-th largest (ties kept). Top-p keeps
    the smallest set of most likely tokens whose mass reaches p, the token that crosses p included: in an
    ascending sort a token goes when the mass up to and including it is <= 1 - p; the largest always stays."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # f32[B,V] ascending
    k_on = k > 0
    kth = sorted_logits.gather(-1, (V - k.clamp(1, V)).long()[:, None])  # the k-th largest
    drop = (sorted_logits < kth) & k_on[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = (cum <= 1 - p[:, None]) & (p < 1.0)[:, None]
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def greedy_sample(logits):  # f32[B,V] -> i64[B] (first index on ties)
    return logits.argmax(dim=-1)


def random_sample(probs, exponential_noise):
    """probs f32[B,V], exponential_noise f32[B,V] (Exp(1)) -> i64[B]: argmax(probs / q), an exact draw from
    the categorical (the exponential race vLLM uses to avoid a device sync)."""
    return (probs / exponential_noise).argmax(dim=-1)


# ---- batched sampler -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SamplingMetadata:
    temperature: torch.Tensor  # f32[B]
    top_k: torch.Tensor  # i32[B], 0 = off
    top_p: torch.Tensor  # f32[B]
    min_p: torch.Tensor  # f32[B]
    repetition_penalty: torch.Tensor  # f32[B]
    presence_penalty: torch.Tensor  # f32[B]
    frequency_penalty: torch.Tensor  # f32[B]
    prompt_ids_mask: torch.Tensor | None  # bool[B,V]; None when no row has a penalty
    output_counts: torch.Tensor | None  # i32[B,V]; None when no row has a penalty
    exponential_noise: torch.Tensor | None  # f32[B,V]; None when every row is greedy

    @property
    def all_greedy(self) -> bool:
        return bool((self.temperature < SAMPLING_EPS).all())

    @classmethod
    def from_requests(cls, requests: Sequence, vocab_size: int, *, engine_seed: int = 0, step: int = 0,
                      rows: Sequence[int] | None = None) -> "SamplingMetadata":
        """Rows from serving Request objects (sampling_params, prompt/output token ids). An unseeded random row
        draws engine_noise(engine_seed, step, rows[i]): rows are the requests' places in the step's batch."""
        ps = [r.sampling_params for r in requests]
        rows = list(range(len(requests))) if rows is None else list(rows)

        def col(name, dtype=torch.float32):
            return torch.tensor([getattr(p, name) for p in ps], dtype=dtype)

        has_penalty = any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in ps)
        prompt_mask = counts = None
        if has_penalty:
            prompt_mask = torch.zeros(len(ps), vocab_size, dtype=torch.bool)
            counts = torch.zeros(len(ps), vocab_size, dtype=torch.int32)
            for row, r in enumerate(requests):
                prompt_mask[row, torch.tensor(r.prompt_token_ids, dtype=torch.int64)] = True
                out = torch.tensor(r.output_token_ids, dtype=torch.int64)
                counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        noise = None
        if any(p.temperature >= SAMPLING_EPS for p in ps):
            noise = torch.from_numpy(np.stack([
                np.ones(vocab_size, np.float32) if p.temperature < SAMPLING_EPS
                else engine_noise(engine_seed, step, row, vocab_size) if p.seed is None
                else exponential_noise(p.seed, len(r.output_token_ids), vocab_size)
                for r, p, row in zip(requests, ps, rows)]))
        return cls(temperature=col("temperature"), top_k=col("top_k", torch.int32), top_p=col("top_p"),
                   min_p=col("min_p"), repetition_penalty=col("repetition_penalty"),
                   presence_penalty=col("presence_penalty"), frequency_penalty=col("frequency_penalty"),
                   prompt_ids_mask=prompt_mask, output_counts=counts, exponential_noise=noise)


class Sampler:
    def __call__(self, logits, metadata: SamplingMetadata):
        """logits f32[B,V] -> (token ids i64[B], raw log-probs f32[B,V]: log_softmax of the logits as given)."""
        m = metadata
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        if m.prompt_ids_mask is not None:
            logits = apply_penalties(logits, m.prompt_ids_mask, m.output_counts, m.repetition_penalty,
                                     m.presence_penalty, m.frequency_penalty)
        ids = greedy_sample(logits)
        if not m.all_greedy:
            logits = apply_temperature(logits, m.temperature)
            if bool((m.min_p > 0).any()):
                logits = apply_min_p(logits, m.min_p)
            if bool((m.top_k > 0).any() or (m.top_p < 1.0).any()):
                logits = apply_top_k_top_p(logits, m.top_k, m.top_p)
            sampled = random_sample(torch.softmax(logits, dim=-1), m.exponential_noise)
            ids = torch.where(m.temperature < SAMPLING_EPS, ids, sampled)
        return ids, raw_logprobs
