"""Sampler in vLLM v1 order (vllm/v1/sample/sampler.py), batched over rows, fp32, jit-able:

    raw logprobs -> penalties -> greedy argmax -> temperature -> min_p -> top_k / top_p -> exponential race

Twin of torch_sources/serving/sampler.py: same operators, same order, same numpy noise.
- Log-probs are the raw logits' log_softmax (vLLM's default logprobs_mode "raw_logprobs"); the runner
  turns the rows a request asked for into vLLM logprobs dicts (`top_logprobs`).
- Greedy rows (temperature < 1e-5) take the argmax after penalties, before any other transform.
- Random rows take argmax(probs / q), q ~ Exp(1). A seeded request's noise is drawn by numpy from (seed, step)
  (`exponential_noise`); an unseeded one's from the engine-wide stream (`engine_noise`: engine seed, engine
  step, batch row), as vLLM draws unseeded rows from the one global generator, so they depend on the batch.
  (`exponential_noise`) and handed in, so the torch engine given the same seeds draws the same tokens.
Which optional stages run is decided on the host (static flags of SamplingMetadata), so a greedy batch
compiles to argmax alone; a skipped stage would be the identity on its neutral parameters anyway.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

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


@dataclasses.dataclass(frozen=True)
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
    r = repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / r, logits * r), logits)
    logits = logits - frequency_penalty[:, None] * output_counts.astype(logits.dtype)
    return logits - presence_penalty[:, None] * (output_counts > 0).astype(logits.dtype)


def apply_temperature(logits, temperature):
    """Divide each row by its temperature; greedy rows (T < SAMPLING_EPS) divide by 1."""
    t = jnp.where(temperature < SAMPLING_EPS, 1.0, temperature)
    return logits / t[:, None]


def apply_min_p(logits, min_p):
    """Mask tokens whose probability is below min_p times the row's top probability (min_p 0 = off)."""
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = min_p[:, None] * probs.max(axis=-1, keepdims=True)
    return jnp.where(probs < threshold, -jnp.inf, logits)


def apply_top_k_top_p(logits, k, p):
    """k i32[B] (0 = off), p f32[B] (1 = off). Top-k keeps logits >= the k-th largest (ties kept). Top-p keeps
    the smallest set of most likely tokens whose mass reaches p, the token that crosses p included: in an
    ascending sort a token goes when the mass up to and including it is <= 1 - p; the largest always stays."""
    V = logits.shape[-1]
    order = jnp.argsort(logits, axis=-1, stable=True)  # i32[B,V] ascending
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    kth = jnp.take_along_axis(sorted_logits, (V - jnp.clip(k, 1, V))[:, None], axis=-1)  # the k-th largest
    sorted_logits = jnp.where((sorted_logits < kth) & (k > 0)[:, None], -jnp.inf, sorted_logits)
    cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    drop = (cum <= 1 - p[:, None]) & (p < 1.0)[:, None]
    drop = drop.at[:, -1].set(False)
    sorted_logits = jnp.where(drop, -jnp.inf, sorted_logits)
    rows = jnp.arange(logits.shape[0])[:, None]
    return jnp.empty_like(logits).at[rows, order].set(sorted_logits)  # scatter back to vocab order


def greedy_sample(logits):  # f32[B,V] -> i32[B] (first index on ties)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def random_sample(probs, exponential_noise):
    """probs f32[B,V], exponential_noise f32[B,V] (Exp(1)) -> i32[B]: argmax(probs / q), an exact draw from
    the categorical (the exponential race vLLM uses to avoid a device sync)."""
    return jnp.argmax(probs / exponential_noise, axis=-1).astype(jnp.int32)


# ---- batched sampler -----------------------------------------------------------------------------------------

@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "prompt_ids_mask", "output_counts", "exponential_noise"],
    meta_fields=["all_greedy", "use_min_p", "use_top_k_top_p"])
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B], 0 = off
    top_p: jax.Array  # f32[B]
    min_p: jax.Array  # f32[B]
    repetition_penalty: jax.Array  # f32[B]
    presence_penalty: jax.Array  # f32[B]
    frequency_penalty: jax.Array  # f32[B]
    prompt_ids_mask: jax.Array | None  # bool[B,V]; None when no row has a penalty
    output_counts: jax.Array | None  # i32[B,V]; None when no row has a penalty
    exponential_noise: jax.Array | None  # f32[B,V]; None when every row is greedy
    # Static (host-decided) flags: which stages the jitted sampler contains.
    all_greedy: bool = True
    use_min_p: bool = False
    use_top_k_top_p: bool = False

    @classmethod
    def from_requests(cls, requests: Sequence, vocab_size: int, num_rows: int | None = None,
                      sample_rows: Sequence[bool] | None = None, *, engine_seed: int = 0,
                      step: int = 0) -> "SamplingMetadata":
        """Rows from serving Request objects (sampling_params, prompt/output token ids), as numpy. Row i is
        batch row i: an unseeded random row draws engine_noise(engine_seed, step, i).
        num_rows pads to a fixed row count (greedy, neutral rows), so the jitted step keeps its shape;
        sample_rows[i] False marks a row whose token is discarded (a partial prefill): it is made greedy so
        no noise is drawn for it."""
        n = len(requests)
        B = n if num_rows is None else num_rows
        keep = [True] * n if sample_rows is None else list(sample_rows)
        ps = [r.sampling_params for r in requests]

        def col(name, neutral, dtype=np.float32):
            return np.array([getattr(p, name) for p in ps] + [neutral] * (B - n), dtype=dtype)

        temperature = np.array([p.temperature if k else 0.0 for p, k in zip(ps, keep)] + [0.0] * (B - n),
                               np.float32)
        random_rows = temperature >= SAMPLING_EPS
        prompt_mask = counts = None
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in ps):
            prompt_mask = np.zeros((B, vocab_size), bool)
            counts = np.zeros((B, vocab_size), np.int32)
            for row, r in enumerate(requests):
                prompt_mask[row, r.prompt_token_ids] = True
                counts[row] = np.bincount(np.asarray(r.output_token_ids, np.int64), minlength=vocab_size)
        noise = None
        if random_rows.any():
            noise = np.ones((B, vocab_size), np.float32)
            for row in np.flatnonzero(random_rows):
                r = requests[row]
                seed = r.sampling_params.seed
                noise[row] = (engine_noise(engine_seed, step, int(row), vocab_size) if seed is None
                              else exponential_noise(seed, len(r.output_token_ids), vocab_size))
        top_k, top_p, min_p = col("top_k", 0, np.int32), col("top_p", 1.0), col("min_p", 0.0)
        return cls(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                   repetition_penalty=col("repetition_penalty", 1.0),
                   presence_penalty=col("presence_penalty", 0.0), frequency_penalty=col("frequency_penalty", 0.0),
                   prompt_ids_mask=prompt_mask, output_counts=counts, exponential_noise=noise,
                   all_greedy=not random_rows.any(), use_min_p=bool((min_p[random_rows] > 0).any()),
                   use_top_k_top_p=bool((top_k[random_rows] > 0).any() or (top_p[random_rows] < 1.0).any()))


class Sampler:
    def __call__(self, logits, metadata: SamplingMetadata):
        """logits f32[B,V] -> (token ids i32[B], raw log-probs f32[B,V]: log_softmax of the logits as given)."""
        m = metadata
        logits = logits.astype(jnp.float32)
        raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
        if m.prompt_ids_mask is not None:
            logits = apply_penalties(logits, m.prompt_ids_mask, m.output_counts, m.repetition_penalty,
                                     m.presence_penalty, m.frequency_penalty)
        ids = greedy_sample(logits)
        if not m.all_greedy:
            logits = apply_temperature(logits, m.temperature)
            if m.use_min_p:
                logits = apply_min_p(logits, m.min_p)
            if m.use_top_k_top_p:
                logits = apply_top_k_top_p(logits, m.top_k, m.top_p)
            sampled = random_sample(jax.nn.softmax(logits, axis=-1), m.exponential_noise)
            ids = jnp.where(m.temperature < SAMPLING_EPS, ids, sampled)
        return ids, raw_logprobs
