"""Training L6 for PPO: the held-out reward, computed by the grader, never reported by the candidate.

The L6 child decodes with grader code: this module's `decode` drives the candidate's public forward (its
logits, with the adapter its own L5 run produced) through LF's sampling settings on the recorded held-out
prompts, with noise the grader draws (`eval_noise`, the stream torch_sources/training/ppo.py's
evaluate_reward uses). The parent then trims each response by LF's rule and scores query + response with
`RewardModel`, a float64 numpy forward of the reward checkpoint (a Llama-architecture model with TRL's
value head, as every PPO task here uses) that belongs to the grader. The recorder checks that these
functions, driven by the torch source's forward, give the source's own evaluate_reward.

A vision-language prompt batch (M-RoPE) also hands `decode` its prompt positions: the prompt keeps them and each
new token sits at its text position + the row's rope delta (transformers' generate, torch_sources'
mrope.decode_positions); the images are the forward's business. Its queries start at the first attended token
(the workflow's rule: LF's fake image, masked, stays out of what the reward model scores). The deltas `decode`
derives (`rope_deltas`: largest attended position + 1 - attended count) are the ones the workflow's generation
continues: the collator's for Qwen2-VL / Qwen3-VL, and for Qwen2.5-Omni's thinker its prompt_vision's (taken against
the text positions; LF's Omni collator hands deltas against the absolute column, which decode does not use). An Omni
batch's fake audio, like its images, is the forward's business.

Numpy only: the parent runs the scoring on untrusted token ids, so ids and shapes are checked first.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from catalog.heldout import HeldoutError, REWARD_KEY

__all__ = ["REWARD_KEY", "EVAL_STREAM", "eval_noise", "warp_probs", "rope_deltas", "decode", "trim_rollouts",
           "RewardModel", "heldout_reward"]

EVAL_STREAM = 4  # np.random.default_rng([EVAL_STREAM, sample, batch]): ppo.py's _EVAL stream
_RESPONSES = re.compile(r"b(\d+)\.s(\d+)\.responses")


def eval_noise(sample: int, batch_index: int, shape) -> np.ndarray:
    return np.random.default_rng([EVAL_STREAM, sample, batch_index]).exponential(size=shape).astype(np.float32)


def warp_probs(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """HF's warpers in generate's order (temperature, top-k, top-p) then softmax, in float32 as torch runs them."""
    scores = np.asarray(logits, np.float32) / np.float32(temperature)
    if 0 < top_k < scores.shape[-1]:
        kth = -np.sort(-scores, axis=-1)[..., top_k - 1:top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    if top_p < 1.0:
        order = np.argsort(scores, axis=-1, kind="stable")
        s = np.take_along_axis(scores, order, axis=-1)
        e = np.exp(s - s[..., -1:])
        cumulative = np.cumsum(e / e.sum(axis=-1, keepdims=True), axis=-1, dtype=np.float32)
        remove = cumulative <= np.float32(1 - top_p)
        remove[..., -1] = False
        back = np.empty_like(remove)
        np.put_along_axis(back, order, remove, axis=-1)
        scores = np.where(back, -np.inf, scores)
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _draw(logits, noise, finished, gen: dict) -> np.ndarray:
    """One decode step's tokens from the step's logits f[B, V]: the exponential race, pad after a row's eos."""
    probs = warp_probs(logits, float(gen["temperature"]), int(gen["top_k"]), float(gen["top_p"]))
    return np.where(finished, int(gen["pad_token_id"]), np.argmax(probs / noise, axis=-1))


def rope_deltas(position_ids, attention_mask) -> np.ndarray:
    """i64[B]: each left-padded M-RoPE prompt row's rope delta (transformers' get_rope_index): its largest attended
    position (over the three rows) + 1 - its attended count."""
    positions, mask = np.asarray(position_ids, np.int64), np.asarray(attention_mask) != 0
    if positions.ndim != 3 or positions.shape[0] != 3 or positions.shape[1:] != mask.shape or not mask.any(-1).all():
        raise HeldoutError(f"M-RoPE positions {list(positions.shape)} for a prompt mask {list(mask.shape)}: expected "
                           f"[3, B, P] and an attended token in every row")
    return np.where(mask[None], positions, np.iinfo(np.int64).min).max(axis=(0, 2)) + 1 - mask.sum(-1)


def _positions(mask, prompt_positions, deltas) -> np.ndarray:
    """The positions of the buffer [B, P + N]: mask cumsum - 1, 1 on pads; an M-RoPE prompt's i64[3,B,P] kept,
    the new tokens at that text position + the row's delta on all three rows."""
    text = np.where(mask == 0, 1, np.cumsum(mask, axis=-1) - 1)
    if prompt_positions is None:
        return text
    B, P = prompt_positions.shape[1:]
    new = np.broadcast_to((text[:, P:] + deltas[:, None])[None], (3, B, text.shape[1] - P))
    return np.concatenate([prompt_positions, new], axis=2)


def decode(forward, input_ids, attention_mask, noise, gen: dict, position_ids=None) -> tuple[np.ndarray, np.ndarray]:
    """(sampled responses i64[B, N], the logits each token was drawn from f32[B, N, V]) from left-padded prompts
    [B, P]: forward(ids, mask, position_ids) -> logits [B, P + N, V] on a fixed buffer (causal: the logits at
    P + t - 1 see only the first P + t tokens); the exponential race argmax(p / noise[:, t]); after a row's
    eos, pad. Positions: mask cumsum - 1, 1 on pads; position_ids (an M-RoPE prompt's i[3, B, P]): the prompt's
    own, then [3, B, P + N] as `_positions` continues them."""
    ids, mask = np.asarray(input_ids, np.int64), np.asarray(attention_mask, np.int64)
    B, P = ids.shape
    N, pad = int(gen["max_new_tokens"]), int(gen["pad_token_id"])
    eos = np.asarray(gen["eos_token_ids"], np.int64)
    prompt_positions = None if position_ids is None else np.asarray(position_ids, np.int64)
    deltas = None if position_ids is None else rope_deltas(prompt_positions, mask)
    ids = np.concatenate([ids, np.full((B, N), pad, np.int64)], axis=1)
    mask = np.concatenate([mask, np.zeros((B, N), np.int64)], axis=1)
    finished, steps = np.zeros(B, bool), []
    for t in range(N):
        position_ids = _positions(mask, prompt_positions, deltas)
        steps.append(np.asarray(forward(ids, mask, position_ids), np.float32)[:, P + t - 1])
        token = _draw(steps[-1], noise[:, t], finished, gen)
        finished |= np.isin(token, eos)
        ids[:, P + t], mask[:, P + t] = token, 1
    return ids[:, P:], np.stack(steps, axis=1)


def redraw(logits, noise, gen: dict) -> np.ndarray:
    """The tokens `decode` draws from per-step logits f[B, N, V] and noise f32[B, N, V]: the parent's check that
    the child's responses are the draws of its logits (code in the child can be patched; this cannot)."""
    eos = np.asarray(gen["eos_token_ids"], np.int64)
    finished, tokens = np.zeros(logits.shape[0], bool), []
    for t in range(logits.shape[1]):
        tokens.append(_draw(logits[:, t], noise[:, t], finished, gen))
        finished |= np.isin(tokens[-1], eos)
    return np.stack(tokens, axis=1)


def trim_rollouts(query_ids, response_ids, pad_token_id: int, eos_token_id: int, attention_mask=None):
    """LF get_inputs: the query without its left pad; the response cut after its last non-pad token (+1 more
    when pad == eos, keeping the eos), one token when it is all pad. attention_mask (a VL batch's): the query
    starts at its first attended token."""
    queries, responses = [], []
    starts = None if attention_mask is None else [int(np.flatnonzero(m)[0]) for m in np.asarray(attention_mask)]
    for i, (q, r) in enumerate(zip(np.asarray(query_ids), np.asarray(response_ids))):
        start = int(np.flatnonzero(q != pad_token_id)[0]) if starts is None else starts[i]
        kept = np.flatnonzero(r != pad_token_id)
        length = 1 if not len(kept) else int(kept[-1]) + (2 if eos_token_id == pad_token_id else 1)
        queries.append(q[start:])
        responses.append(r[:length])
    return queries, responses


def _llama3_inv_freq(c: dict) -> np.ndarray:
    """HF's rope inverse frequencies: default, or llama3-scaled (modeling_rope_utils._compute_llama3_parameters)."""
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    inv = 1.0 / (c["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    scaling = c.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled)


class RewardModel:
    """The reward checkpoint in float64 numpy: Llama decoder (RMSNorm, rope, GQA eager attention, SwiGLU) and
    TRL's value head at the last token of each right-padded row."""

    def __init__(self, checkpoint_dir):
        from safetensors.numpy import load_file

        d = Path(checkpoint_dir)
        self.c = json.loads((d / "config.json").read_text())
        self.w = {k: v.astype(np.float64) for k, v in load_file(str(d / "model.safetensors")).items()}
        head = load_file(str(d / "value_head.safetensors"))
        self.v_w, self.v_b = head["v_head.summary.weight"].astype(np.float64), head["v_head.summary.bias"].astype(np.float64)
        self.inv_freq = _llama3_inv_freq(self.c)

    def _norm(self, x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.c["rms_norm_eps"]) * w

    def hidden(self, ids, mask) -> np.ndarray:
        c, w = self.c, self.w
        B, T = ids.shape
        nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
        hd = c.get("head_dim") or c["hidden_size"] // nh
        angles = np.arange(T)[:, None] * self.inv_freq[None]
        cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))

        def rope(x):  # [B, T, H, hd]
            half = x.shape[-1] // 2
            rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
            return x * cos[None, :, None] + rotated * sin[None, :, None]

        allowed = np.tril(np.ones((T, T), bool))[None] & (np.asarray(mask) > 0)[:, None, :]
        h = w["model.embed_tokens.weight"][ids]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = self._norm(h, w[p + "input_layernorm.weight"])
            q = rope((x @ w[p + "self_attn.q_proj.weight"].T).reshape(B, T, nh, hd))
            k = rope((x @ w[p + "self_attn.k_proj.weight"].T).reshape(B, T, nkv, hd))
            v = (x @ w[p + "self_attn.v_proj.weight"].T).reshape(B, T, nkv, hd)
            k, v = np.repeat(k, nh // nkv, axis=2), np.repeat(v, nh // nkv, axis=2)
            s = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
            s = np.where(allowed[:, None], s, np.finfo(np.float64).min)
            s = np.exp(s - s.max(-1, keepdims=True))
            a = np.einsum("bhts,bshd->bthd", s / s.sum(-1, keepdims=True), v).reshape(B, T, nh * hd)
            h = h + a @ w[p + "self_attn.o_proj.weight"].T
            x = self._norm(h, w[p + "post_attention_layernorm.weight"])
            gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
            h = h + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        return self._norm(h, w["model.norm.weight"])

    def scores(self, queries, responses, pad_token_id: int) -> np.ndarray:
        """f64[B]: the value head at attention_mask.sum - 1 of each right-padded query + response."""
        rows = [np.concatenate([q, r]).astype(np.int64) for q, r in zip(queries, responses)]
        T = max(len(x) for x in rows)
        ids, mask = np.full((len(rows), T), pad_token_id, np.int64), np.zeros((len(rows), T), np.int64)
        for i, x in enumerate(rows):
            ids[i, :len(x)], mask[i, :len(x)] = x, 1
        h = self.hidden(ids, mask)
        last = mask.sum(-1) - 1
        return h[np.arange(len(rows)), last] @ self.v_w[0] + self.v_b[0]


def _query_mask(recorded: dict, i: int):
    """The attention mask that starts batch i's queries: a VL batch's (it has pixels: the fake image is masked), else
    None (the first non-pad token)."""
    if f"b{i}.pixel_values" not in recorded:
        return None
    mask, prompts = np.asarray(recorded[f"b{i}.attention_mask"]), np.asarray(recorded[f"b{i}.input_ids"])
    if mask.shape != prompts.shape or not (mask != 0).any(-1).all():
        raise HeldoutError(f"b{i}.attention_mask {list(mask.shape)} for prompts {list(prompts.shape)}")
    return mask


def heldout_reward(recorded: dict, produced: dict, reward_model: RewardModel) -> tuple[dict[str, float], list]:
    """({"reward": mean score over every held-out response}, response shapes) from the recorded prompt batches
    b<i>.input_ids and the child's b<i>.s<k>.responses and .logits (each token's step logits); HeldoutError when
    they are malformed or the responses are not the race's draws from those logits under eval_noise."""
    gen = {k[len("gen."):]: recorded[k] for k in recorded if k.startswith("gen.")}
    num_batches = len([k for k in recorded if re.fullmatch(r"b\d+\.input_ids", k)])
    samples, N = int(gen["eval_samples"]), int(gen["max_new_tokens"])
    vocab = int(reward_model.c["vocab_size"])
    expected = {f"b{i}.s{k}.{f}" for i in range(num_batches) for k in range(samples) for f in ("responses", "logits")}
    if set(produced) != expected:
        missing, extra = sorted(expected - set(produced)), sorted(set(produced) - expected)
        raise HeldoutError(f"held-out responses: missing {missing[:3]}, unexpected {extra[:3]}")
    scores, shapes = [], []
    for i in range(num_batches):
        prompts = np.asarray(recorded[f"b{i}.input_ids"])
        for k in range(samples):
            r = np.asarray(produced[f"b{i}.s{k}.responses"])
            if r.dtype.kind not in "iu" or r.shape != (len(prompts), N) or r.min(initial=0) < 0 or r.max(initial=0) >= vocab:
                raise HeldoutError(f"b{i}.s{k}.responses is {r.dtype}{list(r.shape)}; expected token ids "
                                   f"[{len(prompts)}, {N}] in [0, {vocab})")
            x = np.asarray(produced[f"b{i}.s{k}.logits"])
            if x.dtype.kind != "f" or x.shape != (len(prompts), N, vocab) or not np.all(np.isfinite(x)):
                raise HeldoutError(f"b{i}.s{k}.logits is {x.dtype}{list(x.shape)}; expected finite "
                                   f"[{len(prompts)}, {N}, {vocab}]")
            if not np.array_equal(redraw(x, eval_noise(k, i, x.shape), gen), r):
                raise HeldoutError(f"b{i}.s{k}.responses are not the draws of its logits under the grader's noise")
            q, resp = trim_rollouts(prompts, r, int(gen["pad_token_id"]), int(np.ravel(gen["eos_token_ids"])[0]),
                                    _query_mask(recorded, i))
            scores.append(reward_model.scores(q, resp, int(gen["pad_token_id"])))
            shapes.append(tuple(r.shape))
    return {"reward": float(np.mean(np.concatenate(scores)))}, shapes
