"""Gemma 4 text model (dense) in Flax Linen: the torch-free twin of torch_sources/models/gemma4.py.

Same public names in the same order; the semantics are listed in the torch file's docstring
(sliding/full layers with per-type head_dim and rope, q/k/v norms, scale 1.0, plain-weight
RMSNorm, PLE (optional), `layer_scalar`, KV sharing over the last layers, double-wide MLP there,
K = V on full layers with `attention_k_eq_v`, scaled embeddings, tied and soft-capped logits).
The config reads the text-only and the release's multimodal config.json alike, and refuses
what it cannot honour.

Params are named after the HF checkpoint (conversion/gemma4.py):
`params["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"]` = HF weight transposed,
norms hold `weight`, embeddings `embedding`, each layer a `layer_scalar` f32[1].

Serving hooks, callable with `model.apply(variables, ..., method=...)`:
`Gemma4ForCausalLM.final_logits`; `Gemma4TextModel.embed`, `.per_layer_inputs`, `.rope`;
per layer (`model.model.layers[i]`) `input_layernorm`, `self_attn.project_qkv`,
`self_attn.project_output`, `after_attention`. KV-shared layers return k = v = None from
`project_qkv` and attend over the K/V of layer `config.kv_source_layer(i)`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

import flax.linen as nn
import jax
import jax.numpy as jnp

from jax_oracles.models import rope

__all__ = [
    "Gemma4TextConfig",
    "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention",
    "Gemma4MLP", "Gemma4Attention", "Gemma4DecoderLayer", "Gemma4TextModel", "Gemma4ForCausalLM",
]


@dataclass(frozen=True)
class Gemma4TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_activation: str
    max_position_embeddings: int
    rms_norm_eps: float
    pad_token_id: int | None
    eos_token_id: int | list[int] | None
    bos_token_id: int | None
    tie_word_embeddings: bool
    rope_parameters: dict       # {layer_type: {"rope_type", "rope_theta", ["partial_rotary_factor"], ["factor"]}}
    attention_bias: bool
    sliding_window: int
    layer_types: tuple[str, ...]
    final_logit_softcapping: float | None
    vocab_size_per_layer_input: int
    hidden_size_per_layer_input: int  # 0: no per-layer inputs (26B-A4B / 31B style)
    num_kv_shared_layers: int
    use_double_wide_mlp: bool
    per_layer_config: dict      # {"<layer idx>": {"head_dim": .., ["num_key_value_heads": ..]}}
    attention_k_eq_v: bool = False  # full layers: no v_proj, V = v_norm(k_proj(x)) (31B style)
    enable_moe_block: bool = False
    use_bidirectional_attention: str | None = None  # "vision" only changes image-token masks: none here

    def __post_init__(self):
        _check_supported(self)

    def __hash__(self):  # dict fields: hash the json form, so the config can be a static jit argument
        return hash(json.dumps(asdict(self), sort_keys=True))

    @classmethod
    def from_hf(cls, d: dict) -> "Gemma4TextConfig":
        """From config.json: a text-only `gemma4_text` one, or a release's multimodal `gemma4` one (the
        language model under `text_config`). Missing keys take transformers' defaults, and the layer pattern,
        rope and per-layer head shapes resolve as Gemma4TextConfig.__post_init__ does; a key that is not
        known is refused."""
        d = _text_config(d)
        unknown = sorted(d.keys() - {f.name for f in fields(cls)} - HEAD_SHAPE_KEYS - NO_MATH_KEYS)
        if unknown:
            raise ValueError(f"Gemma 4 text config: unknown key(s) {unknown}; refusing to guess what they mean")
        if d.get("attention_dropout"):  # train-mode math this source has no dropout for
            raise ValueError(f"Gemma 4 config not supported by this source: attention_dropout={d['attention_dropout']}")
        kw = {**HF_DEFAULTS, **{f.name: d[f.name] for f in fields(cls) if f.name in d}}
        L = kw["num_hidden_layers"]
        types = list(kw["layer_types"] or
                     ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(L)])
        types[-1] = "full_attention"  # transformers forces the last layer to full attention
        kw["layer_types"] = tuple(types)
        kw["rope_parameters"] = kw["rope_parameters"] or DEFAULT_ROPE
        kw["per_layer_config"] = _per_layer_config(d, kw)
        return cls(**kw)

    # ---- derived per-layer values --------------------------------------------------------
    def layer_head_dim(self, i: int) -> int:
        return self.per_layer_config.get(str(i), {}).get("head_dim", self.head_dim)

    def layer_num_kv_heads(self, i: int) -> int:
        return self.per_layer_config.get(str(i), {}).get("num_key_value_heads", self.num_key_value_heads)

    def type_head_dim(self, layer_type: str) -> int:
        return self.layer_head_dim(self.layer_types.index(layer_type))

    @property
    def first_kv_shared_layer_idx(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def is_kv_shared(self, i: int) -> bool:
        return i >= self.first_kv_shared_layer_idx

    def kv_source_layer(self, i: int) -> int:
        """Layer whose K/V layer i attends over: itself, or for a KV-shared layer the last
        non-shared layer of the same type (transformers' "store" layer)."""
        if not self.is_kv_shared(i):
            return i
        first = self.first_kv_shared_layer_idx
        return max(j for j in range(first) if self.layer_types[j] == self.layer_types[i])

    def layer_intermediate_size(self, i: int) -> int:
        return self.intermediate_size * (2 if self.use_double_wide_mlp and self.is_kv_shared(i) else 1)


# ---- config.json forms -----------------------------------------------------------------------
# transformers 5.24 Gemma4TextConfig defaults, for keys a config.json may omit.
HF_DEFAULTS = dict(
    vocab_size=262_144, hidden_size=2304, intermediate_size=9216, num_hidden_layers=30, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072,
    rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1, bos_token_id=2, tie_word_embeddings=True,
    rope_parameters=None, attention_bias=False, sliding_window=512, layer_types=None, final_logit_softcapping=None,
    vocab_size_per_layer_input=262_144, hidden_size_per_layer_input=256, num_kv_shared_layers=0,
    use_double_wide_mlp=False, attention_k_eq_v=False, enable_moe_block=False, use_bidirectional_attention=None)
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
# The full layers' shapes: the release writes the global_* keys, transformers 5.24 saves per_layer_config.
HEAD_SHAPE_KEYS = {"global_head_dim", "num_global_key_value_heads", "per_layer_config"}
PER_LAYER_KEYS = {"head_dim", "num_key_value_heads"}  # the per_layer_config overrides this source honours
ROPE_KEYS = {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}
# PreTrainedConfig bookkeeping, attention_dropout (refused unless 0) and the MoE sizes (unused unless
# enable_moe_block, which is refused).
NO_MATH_KEYS = {
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "initializer_range", "use_cache", "attention_dropout",
    "num_experts", "top_k_experts", "moe_intermediate_size"}
# Gemma4Config (model_type "gemma4", Gemma4ForConditionalGeneration): the towers' configs and their token ids
# are not the language model's; the text-only source reads text_config alone.
MULTIMODAL_KEYS = {"text_config", "vision_config", "audio_config", "boi_token_id", "eoi_token_id", "image_token_id",
                   "video_token_id", "boa_token_id", "eoa_token_index", "audio_token_id", "tie_word_embeddings"}
# Release weights outside the language model: the vision / audio towers and their embedders into the LM.
SKIPPED_TOWERS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")
LANGUAGE_MODEL = "model.language_model."


def _text_config(d: dict) -> dict:
    """The language model's keys: d itself (gemma4_text) or, for a release's gemma4 config, d["text_config"]."""
    if d.get("model_type") == "gemma4" or "text_config" in d:
        unknown = sorted(d.keys() - MULTIMODAL_KEYS - NO_MATH_KEYS)
        if unknown:
            raise ValueError(f"Gemma 4 multimodal config: unknown key(s) {unknown}; refusing to guess what they mean")
        text = d.get("text_config") or {}
        if d.get("tie_word_embeddings", True) != text.get("tie_word_embeddings", True):
            raise ValueError("Gemma 4 config: tie_word_embeddings differs between the top level and text_config")
        d = text
    if d.get("model_type", "gemma4_text") != "gemma4_text":
        raise ValueError(f"not a Gemma 4 text config: model_type {d.get('model_type')!r}")
    return d


def _per_layer_config(d: dict, kw: dict) -> dict:
    """{"<layer>": overrides} as transformers resolves it: a saved per_layer_config wins; otherwise every full
    layer gets head_dim = global_head_dim (default 512) and, only with attention_k_eq_v (transformers gates it
    so), num_key_value_heads = num_global_key_value_heads."""
    if "per_layer_config" in d:
        return {str(int(i)): dict(o) for i, o in (d["per_layer_config"] or {}).items()}  # keys may be zero-padded
    over = {"head_dim": d.get("global_head_dim", 512)}
    if kw["attention_k_eq_v"] and d.get("num_global_key_value_heads") is not None:
        over["num_key_value_heads"] = d["num_global_key_value_heads"]
    return {str(i): dict(over) for i, t in enumerate(kw["layer_types"]) if t == "full_attention"}


def _check_supported(c) -> None:
    """Refuse, naming the key, what this dense causal text source does not implement."""
    def refuse(why):
        raise ValueError(f"Gemma 4 config not supported by this source: {why}")
    if c.enable_moe_block:
        refuse("enable_moe_block (the 26B-A4B MoE block) is not implemented")
    if c.use_bidirectional_attention not in (None, "vision"):
        refuse(f"use_bidirectional_attention={c.use_bidirectional_attention!r} (only causal text attention)")
    if c.hidden_activation != "gelu_pytorch_tanh":
        refuse(f"hidden_activation={c.hidden_activation!r}")
    if len(c.layer_types) != c.num_hidden_layers or set(c.layer_types) - {"sliding_attention", "full_attention"}:
        refuse(f"layer_types={list(c.layer_types)}")
    if c.layer_types[-1] != "full_attention":
        refuse("the last layer must be full attention (transformers forces it)")
    for t in set(c.layer_types):
        p = c.rope_parameters.get(t) or {}
        if p.get("rope_type") not in ("default", "proportional") or set(p) - ROPE_KEYS:
            refuse(f"rope_parameters[{t!r}]={p}")
    for i, over in c.per_layer_config.items():
        if not 0 <= int(i) < c.num_hidden_layers or set(over) - PER_LAYER_KEYS:
            refuse(f"per_layer_config[{i!r}]={over} (honoured: {sorted(PER_LAYER_KEYS)} of layers 0..L-1)")
    for t in set(c.layer_types):
        if len({(c.layer_head_dim(i), c.layer_num_kv_heads(i)) for i, u in enumerate(c.layer_types) if u == t}) > 1:
            refuse(f"{t} layers differ in head shape")
    if any(c.num_attention_heads % c.layer_num_kv_heads(i) for i in range(c.num_hidden_layers)):
        refuse("num_attention_heads is not a multiple of every layer's KV head count")
    if not 0 <= c.num_kv_shared_layers < c.num_hidden_layers or \
            set(c.layer_types) - set(c.layer_types[:c.first_kv_shared_layer_idx]):
        refuse(f"num_kv_shared_layers={c.num_kv_shared_layers}: a layer type has no earlier layer to share K/V from")


# ---- operators -------------------------------------------------------------------------------

def rms_norm(x, weight, eps: float):
    """Gemma 4 RMSNorm over the last axis: x * (mean(x^2) + eps)^-0.5 * weight, in fp32.
    The weight is plain (identity 1), not Gemma 3's 1 + w; weight=None is v_norm's unscaled form."""
    x32 = x.astype(jnp.float32)
    out = x32 * jnp.power(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps, -0.5)  # pow, as transformers
    return (out if weight is None else out * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(config: Gemma4TextConfig, layer_type: str):
    """f32[hd/2] for the layer type's head dim. "proportional": the first
    int(partial_rotary_factor * hd / 2) pairs get theta^(-2i/hd), the rest frequency 0.
    A config constant (models/rope.py)."""
    return jnp.asarray(rope.inv_freq(layer_rope(config, layer_type)))


def layer_rope(config: Gemma4TextConfig, layer_type: str) -> rope.Rope:
    """The layer type's RoPE block, read by models/rope.py (the table is computed there)."""
    return rope.read_rope({"rope_parameters": config.rope_parameters[layer_type]}, config.type_head_dim(layer_type),
                          what=f"gemma4 rope_parameters[{layer_type!r}]")


def rope_cos_sin(inv_freq, position_ids):
    """inv_freq f32[hd/2], position_ids i32[B,T] -> (cos, sin) f32[B,T,hd] (rotate-half layout)."""
    freqs = position_ids[..., None].astype(jnp.float32) * inv_freq.astype(jnp.float32)  # f32[B,T,hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x f32[B,T,N,hd]; cos/sin f32[B,T,hd]."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def causal_mask(attention_mask, sliding_window: int | None = None):
    """attention_mask i32[B,T] (1 = real token) -> bool[B,T,T]: key s visible from query t iff
    s <= t, the key is real, and (sliding) t - s < sliding_window."""
    T = attention_mask.shape[1]
    t = jnp.arange(T)[:, None]
    s = jnp.arange(T)[None, :]
    allowed = s <= t
    if sliding_window is not None:
        allowed = allowed & (t - s < sliding_window)
    return allowed[None] & attention_mask.astype(jnp.bool_)[:, None, :]


def eager_attention(q, k, v, mask, scale: float):
    """q f32[B,T,N,hd], k/v f32[B,S,K,hd], mask bool[B,T,S] -> f32[B,T,N,hd].
    GQA: query head n reads KV head n // (N/K) (transformers' repeat_kv)."""
    B, T, N, hd = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, hd)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k) * scale
    # finfo.min rather than -inf: a fully masked (padding) row stays finite, as in transformers.
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    return out.reshape(B, T, N, hd)


# ---- modules ---------------------------------------------------------------------------------

class _Norm(nn.Module):
    """Holds a `weight` param named like the checkpoint; math is `rms_norm`."""
    eps: float

    @nn.compact
    def __call__(self, x):
        weight = self.param("weight", nn.initializers.ones_init(), (x.shape[-1],), jnp.float32)
        return rms_norm(x, weight, self.eps)


def _gelu_tanh(x):  # transformers "gelu_pytorch_tanh"
    return jax.nn.gelu(x, approximate=True)


class Gemma4MLP(nn.Module):
    config: Gemma4TextConfig
    layer_idx: int

    @nn.compact
    def __call__(self, x):  # f32[B,T,D]
        c = self.config
        inter = c.layer_intermediate_size(self.layer_idx)
        gate = nn.Dense(inter, use_bias=False, name="gate_proj")(x)
        up = nn.Dense(inter, use_bias=False, name="up_proj")(x)
        return nn.Dense(c.hidden_size, use_bias=False, name="down_proj")(_gelu_tanh(gate) * up)


class Gemma4Attention(nn.Module):
    """Per-layer attention. KV-shared layers (`is_kv_shared`) own only q_proj, q_norm and
    o_proj; they attend over the K/V of layer `kv_source` (config.kv_source_layer)."""
    config: Gemma4TextConfig
    layer_idx: int

    @property
    def head_dim(self) -> int:
        return self.config.layer_head_dim(self.layer_idx)

    @property
    def is_kv_shared(self) -> bool:
        return self.config.is_kv_shared(self.layer_idx)

    @property
    def kv_source(self) -> int:
        return self.config.kv_source_layer(self.layer_idx)

    @property
    def sliding_window(self) -> int | None:
        c = self.config
        return c.sliding_window if c.layer_types[self.layer_idx] == "sliding_attention" else None

    @property
    def k_eq_v(self) -> bool:
        c = self.config
        return c.attention_k_eq_v and c.layer_types[self.layer_idx] == "full_attention"

    scaling = 1.0  # q/k norms replace the 1/sqrt(hd) scale

    def setup(self):
        c, hd = self.config, self.head_dim
        dense = lambda n: nn.Dense(n, use_bias=c.attention_bias)  # noqa: E731
        self.q_proj = dense(c.num_attention_heads * hd)
        self.q_norm = _Norm(c.rms_norm_eps)
        if not self.is_kv_shared:
            self.k_proj = dense(c.layer_num_kv_heads(self.layer_idx) * hd)
            if not self.k_eq_v:  # attention_k_eq_v: full layers have no v_proj (V = raw K projection)
                self.v_proj = dense(c.layer_num_kv_heads(self.layer_idx) * hd)
            self.k_norm = _Norm(c.rms_norm_eps)
        self.o_proj = dense(c.hidden_size)

    def project_qkv(self, hidden, cos, sin):
        """hidden f32[B,T,D] (already input_layernorm'ed), cos/sin f32[B,T,hd] of this layer
        type -> q f32[B,T,N,hd], k/v f32[B,T,K,hd] (normed; q/k roped); k = v = None on a
        KV-shared layer, which must be given the K/V of layer `kv_source`."""
        c, hd = self.config, self.head_dim
        B, T, _ = hidden.shape
        q = self.q_proj(hidden).reshape(B, T, c.num_attention_heads, hd)
        q = apply_rope(self.q_norm(q), cos, sin)
        if self.is_kv_shared:
            return q, None, None
        K = c.layer_num_kv_heads(self.layer_idx)
        k = self.k_proj(hidden).reshape(B, T, K, hd)
        v = k if self.k_eq_v else self.v_proj(hidden).reshape(B, T, K, hd)
        k = apply_rope(self.k_norm(k), cos, sin)
        v = rms_norm(v, None, c.rms_norm_eps)
        return q, k, v

    def project_output(self, attn):  # f32[B,T,N,hd] -> f32[B,T,D]
        return self.o_proj(attn.reshape(*attn.shape[:-2], -1))

    def __call__(self, hidden, mask, cos, sin, shared_kv=None):
        """-> (f32[B,T,D], (k, v) used). shared_kv: the (k, v) of layer `kv_source` (KV-shared layers)."""
        q, k, v = self.project_qkv(hidden, cos, sin)
        if self.is_kv_shared:
            k, v = shared_kv
        return self.project_output(eager_attention(q, k, v, mask, self.scaling)), (k, v)


class Gemma4DecoderLayer(nn.Module):
    config: Gemma4TextConfig
    layer_idx: int

    def setup(self):
        c = self.config
        eps = c.rms_norm_eps
        self.self_attn = Gemma4Attention(c, self.layer_idx)
        self.mlp = Gemma4MLP(c, self.layer_idx)
        self.input_layernorm = _Norm(eps)
        self.post_attention_layernorm = _Norm(eps)
        self.pre_feedforward_layernorm = _Norm(eps)
        self.post_feedforward_layernorm = _Norm(eps)
        self.layer_scalar = self.param("layer_scalar", nn.initializers.ones_init(), (1,), jnp.float32)
        if c.hidden_size_per_layer_input:  # per-layer inputs (E2B/E4B); none when it is 0
            self.per_layer_input_gate = nn.Dense(c.hidden_size_per_layer_input, use_bias=False)
            self.per_layer_projection = nn.Dense(c.hidden_size, use_bias=False)
            self.post_per_layer_input_norm = _Norm(eps)

    def after_attention(self, residual, attn_out, per_layer_input):
        """residual f32[B,T,D] (layer input), attn_out f32[B,T,D] (after o_proj),
        per_layer_input f32[B,T,P] (None without PLE) -> layer output f32[B,T,D]."""
        h = residual + self.post_attention_layernorm(attn_out)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if self.config.hidden_size_per_layer_input:
            gate = _gelu_tanh(self.per_layer_input_gate(h)) * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar  # scales the residual stream too, not only the branch

    def __call__(self, hidden, per_layer_input, mask, cos, sin, shared_kv=None):
        """hidden f32[B,T,D], per_layer_input f32[B,T,P], mask bool[B,T,T] -> (f32[B,T,D], (k, v))."""
        attn_out, kv = self.self_attn(self.input_layernorm(hidden), mask, cos, sin, shared_kv)
        return self.after_attention(hidden, attn_out, per_layer_input), kv


class Gemma4TextModel(nn.Module):
    config: Gemma4TextConfig

    def setup(self):
        c = self.config
        L, P = c.num_hidden_layers, c.hidden_size_per_layer_input
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size)
        if P:
            self.embed_tokens_per_layer = nn.Embed(c.vocab_size_per_layer_input, L * P)
            self.per_layer_model_projection = nn.Dense(L * P, use_bias=False)
            self.per_layer_projection_norm = _Norm(c.rms_norm_eps)
        self.layers = [Gemma4DecoderLayer(c, i) for i in range(L)]
        self.norm = _Norm(c.rms_norm_eps)

    def embed(self, input_ids):  # i32[B,T] -> f32[B,T,D], scaled by sqrt(hidden_size)
        return self.embed_tokens(input_ids) * jnp.float32(self.config.hidden_size ** 0.5)

    def per_layer_inputs(self, input_ids, inputs_embeds):
        """PLE: i32[B,T], f32[B,T,D] (scaled embeddings) -> f32[B,T,L,P]
        = (norm(proj(embeds) / sqrt(D)) + embed_per_layer(ids) * sqrt(P)) / sqrt(2); None without PLE."""
        c = self.config
        L, P = c.num_hidden_layers, c.hidden_size_per_layer_input
        if not P:
            return None
        token = self.embed_tokens_per_layer(input_ids) * jnp.float32(P ** 0.5)
        token = token.reshape(*input_ids.shape, L, P)
        proj = self.per_layer_model_projection(inputs_embeds) * jnp.float32(c.hidden_size ** -0.5)
        proj = self.per_layer_projection_norm(proj.reshape(*inputs_embeds.shape[:-1], L, P))
        return (proj + token) * jnp.float32(2.0 ** -0.5)

    def rope(self, position_ids) -> dict:
        """i32[B,T] -> {layer_type: (cos, sin) f32[B,T,hd of that type]}."""
        return {t: rope_cos_sin(rope_inv_freq(self.config, t), position_ids) for t in set(self.config.layer_types)}

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        """i32[B,T] -> final-normed hidden f32[B,T,D] (right padding; positions default 0..T-1)."""
        c = self.config
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((B, T), jnp.int32)
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T))
        masks = {"full_attention": causal_mask(attention_mask),
                 "sliding_attention": causal_mask(attention_mask, c.sliding_window)}
        rope = self.rope(position_ids)
        h = self.embed(input_ids)
        ple = self.per_layer_inputs(input_ids, h)  # f32[B,T,L,P]
        kv_of_layer = {}
        for i, layer in enumerate(self.layers):
            t = c.layer_types[i]
            h, kv_of_layer[i] = layer(h, None if ple is None else ple[:, :, i], masks[t], *rope[t],
                                      shared_kv=kv_of_layer.get(c.kv_source_layer(i)))
        return self.norm(h)


class Gemma4ForCausalLM(nn.Module):
    """logits = model.apply({"params": params}, input_ids, attention_mask)."""
    config: Gemma4TextConfig

    def setup(self):
        self.model = Gemma4TextModel(self.config)
        if not self.config.tie_word_embeddings:
            self.lm_head = nn.Dense(self.config.vocab_size, use_bias=False)

    def final_logits(self, hidden):
        """hidden f32[...,D] *after* the final norm (Gemma4TextModel's output) -> f32[...,V],
        soft-capped: c * tanh(logits / c)."""
        c = self.config
        logits = self.model.embed_tokens.attend(hidden) if c.tie_word_embeddings else self.lm_head(hidden)
        cap = c.final_logit_softcapping
        return logits if cap is None else cap * jnp.tanh(logits / cap)

    def __call__(self, input_ids, attention_mask=None, position_ids=None):
        """input_ids i32[B,T], attention_mask i32[B,T] | None -> logits f32[B,T,V]."""
        return self.final_logits(self.model(input_ids, attention_mask, position_ids))
