"""Rotary position embeddings, every type transformers applies to these families, read from either
config.json form: the torch-free twin of torch_sources/models/rope.py (same names, same numerics; the
tables are numpy constants, so under jit they are literals; longrope's short/long switch is traced).

`read_rope(config_dict, head_dim)` standardises what `RotaryEmbeddingConfigMixin` standardises
(transformers 5.24, modeling_rope_utils.py): `rope_scaling` (the releases' key) wins over
`rope_parameters` (what transformers 5 saves); the type is `rope_type`, else the legacy `type`, else
"default"; `rope_theta` and `partial_rotary_factor` inside the dict win over the top-level keys; llama3,
yarn and longrope take `original_max_position_embeddings` from the dict, else from the model's
`max_position_embeddings` (Phi-3's top-level key wins over both, as its config class has one). A key a
type does not read, a missing required key, or a type not listed is refused by name (transformers only
warns and drops it).

Types: default; linear (frequencies / factor); dynamic (NTK: the base grows past max_position_embeddings;
at or below it the table is the default one, and longer forwards are refused, because transformers'
table past it depends on what the module saw before); yarn (ramp between interpolation and
extrapolation, attention factor from factor / mscale / mscale_all_dim); longrope (per-pair short or long
factors, long iff the forward's largest position + 1 exceeds original_max_position_embeddings; its
attention factor); llama3 (wavelength bands); proportional (Gemma 4: the rotated pairs over head_dim,
zeros for the rest).

The base theta^(2i/d) is computed in float64 from the float32 exponent and float32 theta, then rounded
once: the float32 nearest the true power. torch's vectorised powf (which transformers runs) misses it by
an ulp at a few pairs of a release head dim (3 of 64 at d=128, theta 1e6), numpy's float32 power at 10-20%
of them; rounding once pins both twins to the same table on every machine. Every later op is float32 in
transformers' order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

__all__ = ["ROPE_TYPES", "Rope", "RopeError", "read_rope", "inv_freq", "attention_factor", "cos_sin",
           "static_inv_freq", "rope_cos_sin"]

# type -> (required keys, optional keys) beyond rope_type / type / rope_theta / partial_rotary_factor
ROPE_TYPES = {
    "default": (set(), set()),
    "linear": ({"factor"}, set()),
    "dynamic": ({"factor"}, set()),
    "yarn": ({"factor"}, {"original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                          "mscale", "mscale_all_dim", "truncate"}),
    "longrope": ({"short_factor", "long_factor"}, {"original_max_position_embeddings", "attention_factor", "factor"}),
    "llama3": ({"factor", "low_freq_factor", "high_freq_factor"}, {"original_max_position_embeddings"}),
    "proportional": (set(), {"factor"}),
}
_NEEDS_ORIGINAL = ("llama3", "yarn", "longrope")


class RopeError(ValueError):
    """A RoPE block this source will not guess at: the message names the key."""


@dataclass(frozen=True)
class Rope:
    """One resolved RoPE: the type, its parameters, and the head geometry it rotates."""
    rope_type: str
    theta: float
    head_dim: int
    dim: int                              # rotated channels: int(head_dim * partial_rotary_factor)
    max_position_embeddings: int | None = None
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None
    beta_fast: float | None = None        # yarn
    beta_slow: float | None = None
    truncate: bool = True
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # yarn, longrope: None = derived
    short_factor: tuple[float, ...] | None = None  # longrope
    long_factor: tuple[float, ...] | None = None
    partial_rotary_factor: float = 1.0

    @property
    def position_dependent(self) -> bool:
        """The table depends on the positions of the forward (longrope's switch, dynamic's growth)."""
        return self.rope_type in ("longrope", "dynamic")


def read_rope(d: dict, head_dim: int, *, default_theta: float = 10_000.0, partial_rotary: bool = False,
              aliases: dict[str, str] | None = None, top_level_original: bool = False, what: str = "config") -> Rope:
    """The RoPE of a config.json dict (either form). `partial_rotary`: the family rotates a leading
    fraction of each head (a factor other than 1 is refused otherwise); `aliases`: legacy type names
    (Phi-3: su, yarn -> longrope); `top_level_original`: the family's config class has its own
    `original_max_position_embeddings` (Phi-3), which wins."""
    block = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(block, dict):
        raise RopeError(f"{what}: rope_scaling / rope_parameters must be a dict, got {block!r}")
    p = dict(block)
    rope_type = p.pop("rope_type", None)
    legacy = p.pop("type", None)
    rope_type = rope_type or legacy or "default"
    rope_type = (aliases or {}).get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise RopeError(f"{what}: rope_type {rope_type!r} is not supported (supported: {sorted(ROPE_TYPES)})")
    theta = p.pop("rope_theta", None)
    theta = d.get("rope_theta") if theta is None else theta
    theta = default_theta if theta is None else float(theta)
    prf = p.pop("partial_rotary_factor", None)
    prf = d.get("partial_rotary_factor") if prf is None else prf
    prf = 1.0 if prf is None else float(prf)
    if prf != 1.0 and not partial_rotary and rope_type != "proportional":
        raise RopeError(f"{what}: partial_rotary_factor={prf} (this family rotates whole heads)")
    required, optional = ROPE_TYPES[rope_type]
    if rope_type == "default" and p:
        raise RopeError(f"{what}: rope keys {sorted(p)} with rope_type 'default' (no rope_type or type key given: "
                        f"transformers reads this block as the default RoPE and drops them); name the type")
    unknown = sorted(p.keys() - required - optional)
    if unknown:
        raise RopeError(f"{what}: rope key(s) {unknown} are not read by rope_type {rope_type!r}")
    missing = sorted(k for k in required if p.get(k) is None)
    if missing:
        raise RopeError(f"{what}: rope_type {rope_type!r} needs {missing}")
    max_pos = d.get("max_position_embeddings")
    original = p.get("original_max_position_embeddings")
    if rope_type in _NEEDS_ORIGINAL:
        if top_level_original and d.get("original_max_position_embeddings") is not None:
            original = d["original_max_position_embeddings"]
        original = max_pos if original is None else original
        if original is None:
            raise RopeError(f"{what}: rope_type {rope_type!r} needs original_max_position_embeddings")
        original = int(original)
    dim = int(head_dim * prf) if rope_type != "proportional" else head_dim
    factor = p.get("factor")
    if rope_type in ("yarn", "longrope") and factor is None:
        factor = max_pos / original  # transformers' implicit factor
    for key in ("short_factor", "long_factor"):
        if key in p and len(p[key]) != dim // 2:
            raise RopeError(f"{what}: {key} has {len(p[key])} entries, the rotary dim {dim} needs {dim // 2}")
    return Rope(rope_type=rope_type, theta=theta, head_dim=head_dim, dim=dim,
                max_position_embeddings=None if max_pos is None else int(max_pos),
                factor=None if factor is None else float(factor), original_max_position_embeddings=original,
                low_freq_factor=p.get("low_freq_factor"), high_freq_factor=p.get("high_freq_factor"),
                beta_fast=p.get("beta_fast"), beta_slow=p.get("beta_slow"),
                truncate=bool(p.get("truncate", True)), mscale=p.get("mscale"), mscale_all_dim=p.get("mscale_all_dim"),
                attention_factor=p.get("attention_factor"),
                short_factor=None if p.get("short_factor") is None else tuple(float(x) for x in p["short_factor"]),
                long_factor=None if p.get("long_factor") is None else tuple(float(x) for x in p["long_factor"]),
                partial_rotary_factor=prf)


# ---- tables ---------------------------------------------------------------------------------

_f32 = np.float32


def _power(theta: float, dim: int, pairs: int | None = None) -> np.ndarray:
    """f32[pairs] theta^(2i/dim): the float32 exponent and theta, the power in float64, rounded once."""
    pairs = dim // 2 if pairs is None else pairs
    exponent = (np.arange(0, 2 * pairs, 2).astype(_f32) / _f32(dim)).astype(np.float64)
    return (np.float64(_f32(theta)) ** exponent).astype(_f32)


def inv_freq(r: Rope, seq_len: int | None = None) -> np.ndarray:  # -> f32[dim/2]
    """The inverse frequencies for a forward whose largest position + 1 is `seq_len` (None: the table
    transformers builds at init). numpy float32 in transformers' op order."""
    t = r.rope_type
    if t == "proportional":  # Gemma 4: pairs over head_dim, the first rotated ones only
        rotated = int(r.partial_rotary_factor * r.head_dim // 2)
        freq = _f32(1.0) / _power(r.theta, r.head_dim, rotated)
        freq = np.concatenate([freq, np.zeros(r.head_dim // 2 - rotated, _f32)])
        return freq / _f32(r.factor) if r.factor is not None else freq
    if t == "dynamic":
        if seq_len is not None and r.max_position_embeddings is not None and seq_len > r.max_position_embeddings:
            raise RopeError(f"dynamic RoPE past max_position_embeddings={r.max_position_embeddings} (positions up to "
                            f"{seq_len - 1}): transformers' table there depends on the lengths the module saw before")
        return _f32(1.0) / _power(r.theta, r.dim)  # within max_position_embeddings the NTK base is theta itself
    if t == "yarn":
        return _yarn(r)
    if t == "longrope":
        long = seq_len is not None and seq_len > r.original_max_position_embeddings
        ext = np.asarray(r.long_factor if long else r.short_factor, dtype=_f32)
        return _f32(1.0) / (ext * _power(r.theta, r.dim))
    freq = _f32(1.0) / _power(r.theta, r.dim)
    if t == "linear":
        return freq / _f32(r.factor)
    if t == "llama3":
        return _llama3(r, freq)
    return freq


def _llama3(r: Rope, freq: np.ndarray) -> np.ndarray:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended."""
    low_freq_wavelen = r.original_max_position_embeddings / r.low_freq_factor
    high_freq_wavelen = r.original_max_position_embeddings / r.high_freq_factor
    wavelen = 2 * math.pi / freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, freq / r.factor, freq)
    smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / r.factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama).astype(_f32)


def _yarn(r: Rope) -> np.ndarray:
    """YaRN: pairs that turn fewer than beta_slow times over the original context are interpolated
    (divided by `factor`), those turning more than beta_fast times kept, a linear ramp between. The
    ramp's ends are Python doubles, floored / ceiled only if `truncate`; array ops are float32."""
    dim, orig = r.dim, r.original_max_position_embeddings
    beta_fast, beta_slow = r.beta_fast or 32, r.beta_slow or 1  # transformers: `or`, so 0 means the default

    def pair_index(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(r.theta))

    low, high = pair_index(beta_fast), pair_index(beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    pos_freqs = _power(r.theta, dim)
    extrapolation, interpolation = _f32(1.0) / pos_freqs, _f32(1.0) / (_f32(r.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=_f32) - _f32(low)) / _f32(high - low), _f32(0), _f32(1))
    keep = _f32(1) - ramp  # weight of the unscaled (extrapolated) frequency
    return interpolation * (_f32(1) - keep) + extrapolation * keep


def attention_factor(r: Rope) -> float:
    """What cos and sin are multiplied by: YaRN's (given, else from mscale / mscale_all_dim, else
    0.1 ln(factor) + 1) and longrope's (given, else sqrt(1 + ln(factor) / ln(orig))); 1.0 otherwise."""
    if r.rope_type == "yarn":
        if r.attention_factor is not None:
            return float(r.attention_factor)

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
        if r.mscale and r.mscale_all_dim:
            return float(mscale(r.factor, r.mscale) / mscale(r.factor, r.mscale_all_dim))
        return mscale(r.factor)
    if r.rope_type == "longrope":
        if r.attention_factor is not None:
            return float(r.attention_factor)
        if r.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(r.factor) / math.log(r.original_max_position_embeddings))
    return 1.0


def rope_cos_sin(freq, position_ids, factor: float = 1.0):
    """f32[rd/2], i32[B,T] -> (cos, sin) f32[B,T,rd], both times `factor` (YaRN's, longrope's; 1.0 otherwise)."""
    freqs = position_ids[..., None].astype(jnp.float32) * jnp.asarray(freq, jnp.float32)  # f32[B,T,rd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    if factor != 1.0:  # f32 multiply by the rounded factor, as torch's tensor * python float
        cos, sin = cos * jnp.float32(factor), sin * jnp.float32(factor)
    return cos, sin


def cos_sin(r: Rope, position_ids):
    """The (cos, sin) of one forward: the table its positions select, times the attention factor. Traced:
    longrope picks its long table iff the largest position + 1 exceeds original_max_position_embeddings, as
    transformers does, padding positions included (so a caller that pads wider than torch for a static shape
    passes torch's positions: layers.padded_positions); dynamic is refused at trace time for a forward longer
    than max_position_embeddings."""
    if r.rope_type == "longrope":
        longest = jnp.max(position_ids) + 1 if position_ids.size else 0
        freq = jnp.where(longest > r.original_max_position_embeddings, jnp.asarray(inv_freq(r, r.original_max_position_embeddings + 1)),
                         jnp.asarray(inv_freq(r)))
    else:
        freq = inv_freq(r, position_ids.shape[-1] if r.rope_type == "dynamic" else None)
    return rope_cos_sin(freq, position_ids, attention_factor(r))


def static_inv_freq(r: Rope, where: str) -> np.ndarray:
    """The table of an engine that caches rotated keys step after step: refused where the table would
    change with the positions (a switch mid-sequence would leave the cached keys on the old one)."""
    if r.position_dependent:
        raise RopeError(f"{where}: rope_type {r.rope_type!r} changes its table with the sequence length; the paged "
                        f"engine caches rotated keys and does not serve it")
    return inv_freq(r)
