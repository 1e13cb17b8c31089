"""Gemma 4 text model (dense; E2B/E4B/31B style), pure PyTorch, eager fp32.

Follows transformers 5.24 `models/gemma4/modeling_gemma4.py` (Gemma4ForCausalLM, and the language
model of Gemma4ForConditionalGeneration, which is what a release directory holds):
- layers are "sliding_attention" (window `sliding_window`) or "full_attention"; full
  layers may have a larger head_dim / other KV-head count (`global_head_dim`,
  `num_global_key_value_heads`, resolved into `per_layer_config` as transformers does);
- with `attention_k_eq_v` full layers have no v_proj: V is the raw K projection;
- rope per layer type: sliding "default" (theta 1e4), full "proportional" (only the
  first int(partial_rotary_factor * hd / 2) frequency pairs rotate, the rest have
  frequency 0; the exponent denominator is the full hd);
- q_norm, k_norm (weighted) and v_norm (no weight) over head_dim; attention scale 1.0;
- RMSNorm is x * (mean(x^2) + eps)^-0.5 * w with a plain weight (not 1 + w), in fp32;
- 4 norms per layer, then per-layer input embeddings (PLE, absent when
  `hidden_size_per_layer_input` is 0) and a learned `layer_scalar` that multiplies the
  whole hidden state;
- the last `num_kv_shared_layers` layers compute no K/V: each reuses the K/V of the last
  earlier non-shared layer of its own type (`Gemma4TextConfig.kv_source_layer`), and
  with `use_double_wide_mlp` their MLP is twice as wide;
- embeddings scaled by sqrt(hidden_size); tied lm_head; logits soft-capped.

Config keys this source does not implement (the MoE block, bidirectional attention, other
activations or rope types, unknown keys) are refused by `Gemma4TextConfig`, never ignored.

Serving hooks (a paged KV cache supplies K/V from outside):
`Gemma4TextModel.embed`, `.per_layer_inputs`, `.rope`; per layer `input_layernorm`,
`self_attn.project_qkv` (q, k, v with norms and rope; k = v = None on KV-shared layers),
`self_attn.project_output`, `after_attention`; `Gemma4ForCausalLM.final_logits`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from torch_sources.models import rope
from torch_sources.models.loading import load_config, load_state_dict

__all__ = [
    "Gemma4TextConfig",
    "rms_norm", "rope_inv_freq", "rope_cos_sin", "apply_rope", "causal_mask", "eager_attention",
    "Gemma4MLP", "Gemma4Attention", "Gemma4DecoderLayer", "Gemma4TextModel", "Gemma4ForCausalLM",
]  # text_state_dict is the torch loader's (the JAX side maps names in conversion/gemma4.py): not mirrored


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

    @classmethod
    def from_pretrained(cls, path) -> "Gemma4TextConfig":
        return cls.from_hf(load_config(path))

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

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma 4 RMSNorm over the last axis: x * (mean(x^2) + eps)^-0.5 * weight, in fp32.
    The weight is plain (identity 1), not Gemma 3's 1 + w; weight=None is v_norm's unscaled form."""
    x32 = x.float()
    out = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (out if weight is None else out * weight.float()).type_as(x)


def rope_inv_freq(config: Gemma4TextConfig, layer_type: str) -> torch.Tensor:
    """f32[hd/2] for the layer type's head dim. "proportional": the first
    int(partial_rotary_factor * hd / 2) pairs get theta^(-2i/hd), the rest frequency 0."""
    return rope.inv_freq(layer_rope(config, layer_type))


def layer_rope(config: Gemma4TextConfig, layer_type: str) -> rope.Rope:
    """The layer type's RoPE block, read by models/rope.py (the table is computed there)."""
    return rope.read_rope({"rope_parameters": config.rope_parameters[layer_type]}, config.type_head_dim(layer_type),
                          what=f"gemma4 rope_parameters[{layer_type!r}]")


def rope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """inv_freq f32[hd/2], position_ids i32[B,T] -> (cos, sin) f32[B,T,hd] (rotate-half layout)."""
    freqs = position_ids[..., None].float() * inv_freq.float()  # f32[B,T,hd/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x f32[B,T,N,hd]; cos/sin f32[B,T,hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def causal_mask(attention_mask: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """attention_mask i32[B,T] (1 = real token) -> bool[B,T,T]: key s visible from query t iff
    s <= t, the key is real, and (sliding) t - s < sliding_window."""
    T = attention_mask.shape[1]
    t = torch.arange(T)[:, None]
    s = torch.arange(T)[None, :]
    allowed = s <= t
    if sliding_window is not None:
        allowed = allowed & (t - s < sliding_window)
    return allowed[None] & attention_mask.bool()[:, None, :]


def eager_attention(q, k, v, mask, scale: float, softcap: float | None = None) -> torch.Tensor:
    """q f32[B,T,N,hd], k/v f32[B,S,K,hd], mask bool[B,T,S] -> f32[B,T,N,hd].
    GQA: query head n reads KV head n // (N/K) (transformers' repeat_kv)."""
    B, T, N, hd = q.shape
    K = k.shape[2]
    qg = q.view(B, T, K, N // K, hd)
    scores = torch.einsum("btkgh,bskh->bkgts", qg, k) * scale  # f32[B,K,G,T,S]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    # finfo.min rather than -inf: a fully masked (padding) row stays finite, as in transformers.
    scores = scores.masked_fill(~mask[:, None, None], torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(B, T, N, hd)


# ---- modules ---------------------------------------------------------------------------------

class _Norm(nn.Module):
    """Holds a `weight` so the state-dict key is `<name>.weight`; math is `rms_norm`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


class Gemma4MLP(nn.Module):
    def __init__(self, config: Gemma4TextConfig, layer_idx: int):
        super().__init__()
        D, inter = config.hidden_size, config.layer_intermediate_size(layer_idx)
        self.gate_proj = nn.Linear(D, inter, bias=False)
        self.up_proj = nn.Linear(D, inter, bias=False)
        self.down_proj = nn.Linear(inter, D, bias=False)

    def forward(self, x):  # f32[B,T,D]
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma4Attention(nn.Module):
    """Per-layer attention. KV-shared layers (`is_kv_shared`) own only q_proj, q_norm and
    o_proj; they attend over the K/V of layer `kv_source` (config.kv_source_layer)."""

    def __init__(self, config: Gemma4TextConfig, layer_idx: int):
        super().__init__()
        c = config
        self.layer_type = c.layer_types[layer_idx]
        self.head_dim = c.layer_head_dim(layer_idx)
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.layer_num_kv_heads(layer_idx)
        self.sliding_window = c.sliding_window if self.layer_type == "sliding_attention" else None
        self.is_kv_shared = c.is_kv_shared(layer_idx)
        self.kv_source = c.kv_source_layer(layer_idx)
        self.scaling = 1.0  # q/k norms replace the 1/sqrt(hd) scale
        self.eps = c.rms_norm_eps
        D = c.hidden_size
        self.q_proj = nn.Linear(D, self.num_heads * self.head_dim, bias=c.attention_bias)
        self.q_norm = _Norm(self.head_dim, c.rms_norm_eps)
        if not self.is_kv_shared:
            self.k_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=c.attention_bias)
            # attention_k_eq_v: full layers have no v_proj; V is the raw K projection (v_norm'ed, not roped)
            self.k_eq_v = c.attention_k_eq_v and self.layer_type == "full_attention"
            if not self.k_eq_v:
                self.v_proj = nn.Linear(D, self.num_kv_heads * self.head_dim, bias=c.attention_bias)
            self.k_norm = _Norm(self.head_dim, c.rms_norm_eps)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, D, bias=c.attention_bias)

    def project_qkv(self, hidden, cos, sin):
        """hidden f32[B,T,D] (already input_layernorm'ed), cos/sin f32[B,T,hd] of this layer
        type -> q f32[B,T,N,hd], k/v f32[B,T,K,hd] (normed; q/k roped); k = v = None on a
        KV-shared layer, which must be given the K/V of layer `kv_source`."""
        B, T, _ = hidden.shape
        q = self.q_proj(hidden).view(B, T, self.num_heads, self.head_dim)
        q = apply_rope(self.q_norm(q), cos, sin)
        if self.is_kv_shared:
            return q, None, None
        k = self.k_proj(hidden).view(B, T, self.num_kv_heads, self.head_dim)
        v = k if self.k_eq_v else self.v_proj(hidden).view(B, T, self.num_kv_heads, self.head_dim)
        k = apply_rope(self.k_norm(k), cos, sin)
        v = rms_norm(v, None, self.eps)
        return q, k, v

    def project_output(self, attn):  # f32[B,T,N,hd] -> f32[B,T,D]
        return self.o_proj(attn.flatten(-2))

    def forward(self, hidden, mask, cos, sin, shared_kv=None):
        """-> (f32[B,T,D], (k, v) used). shared_kv: the (k, v) of layer `kv_source` (KV-shared layers)."""
        q, k, v = self.project_qkv(hidden, cos, sin)
        if self.is_kv_shared:
            k, v = shared_kv
        return self.project_output(eager_attention(q, k, v, mask, self.scaling)), (k, v)


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Gemma4TextConfig, layer_idx: int):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config, layer_idx)
        self.mlp = Gemma4MLP(config, layer_idx)
        self.input_layernorm = _Norm(D, eps)
        self.post_attention_layernorm = _Norm(D, eps)
        self.pre_feedforward_layernorm = _Norm(D, eps)
        self.post_feedforward_layernorm = _Norm(D, eps)
        self.register_buffer("layer_scalar", torch.ones(1))  # a buffer in transformers too
        P = self.ple_dim = config.hidden_size_per_layer_input
        if P:  # per-layer inputs (E2B/E4B); releases with hidden_size_per_layer_input 0 have none
            self.per_layer_input_gate = nn.Linear(D, P, bias=False)
            self.per_layer_projection = nn.Linear(P, D, bias=False)
            self.post_per_layer_input_norm = _Norm(D, eps)

    def after_attention(self, residual, attn_out, per_layer_input):
        """residual f32[B,T,D] (layer input), attn_out f32[B,T,D] (after o_proj),
        per_layer_input f32[B,T,P] (None without PLE) -> layer output f32[B,T,D]."""
        h = residual + self.post_attention_layernorm(attn_out)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if self.ple_dim:
            gate = F.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar  # scales the residual stream too, not only the branch

    def forward(self, hidden, per_layer_input, mask, cos, sin, shared_kv=None):
        """hidden f32[B,T,D], per_layer_input f32[B,T,P], mask bool[B,T,T] -> (f32[B,T,D], (k, v))."""
        attn_out, kv = self.self_attn(self.input_layernorm(hidden), mask, cos, sin, shared_kv)
        return self.after_attention(hidden, attn_out, per_layer_input), kv


class Gemma4TextModel(nn.Module):
    def __init__(self, config: Gemma4TextConfig):
        super().__init__()
        c = self.config = config
        L, P = c.num_hidden_layers, c.hidden_size_per_layer_input
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        if P:
            self.embed_tokens_per_layer = nn.Embedding(c.vocab_size_per_layer_input, L * P)
            self.per_layer_model_projection = nn.Linear(c.hidden_size, L * P, bias=False)
            self.per_layer_projection_norm = _Norm(P, c.rms_norm_eps)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(c, i) for i in range(L))
        self.norm = _Norm(c.hidden_size, c.rms_norm_eps)
        for t in sorted(set(c.layer_types)):
            self.register_buffer(f"{t}_inv_freq", rope_inv_freq(c, t), persistent=False)

    def embed(self, input_ids):  # i32[B,T] -> f32[B,T,D], scaled by sqrt(hidden_size)
        return self.embed_tokens(input_ids) * torch.tensor(self.config.hidden_size ** 0.5)

    def per_layer_inputs(self, input_ids, inputs_embeds):
        """PLE: i32[B,T], f32[B,T,D] (scaled embeddings) -> f32[B,T,L,P]
        = (norm(proj(embeds) / sqrt(D)) + embed_per_layer(ids) * sqrt(P)) / sqrt(2); None without PLE."""
        c = self.config
        L, P = c.num_hidden_layers, c.hidden_size_per_layer_input
        if not P:
            return None
        token = self.embed_tokens_per_layer(input_ids) * torch.tensor(P ** 0.5)
        token = token.reshape(*input_ids.shape, L, P)
        proj = self.per_layer_model_projection(inputs_embeds) * c.hidden_size ** -0.5
        proj = self.per_layer_projection_norm(proj.reshape(*inputs_embeds.shape[:-1], L, P))
        return (proj + token) * 2.0 ** -0.5

    def rope(self, position_ids) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """i32[B,T] -> {layer_type: (cos, sin) f32[B,T,hd of that type]}."""
        return {t: rope_cos_sin(getattr(self, f"{t}_inv_freq"), position_ids) for t in set(self.config.layer_types)}

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        """i32[B,T] -> final-normed hidden f32[B,T,D] (right padding; positions default 0..T-1)."""
        c = self.config
        B, T = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones(B, T, dtype=torch.int32)
        if position_ids is None:
            position_ids = torch.arange(T)[None].expand(B, T)
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
    def __init__(self, config: Gemma4TextConfig):
        super().__init__()
        self.config = config
        self.model = Gemma4TextModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def final_logits(self, hidden):
        """hidden f32[...,D] *after* the final norm (Gemma4TextModel's output) -> f32[...,V],
        soft-capped: c * tanh(logits / c)."""
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        """input_ids i32[B,T], attention_mask i32[B,T] | None -> logits f32[B,T,V]."""
        return self.final_logits(self.model(input_ids, attention_mask, position_ids))

    @classmethod
    def from_pretrained(cls, path) -> "Gemma4ForCausalLM":
        """Build from an HF checkpoint directory (single file or sharded index), fp32, eval mode: a text-only
        `gemma4_text` one or a release's multimodal one (language model only, towers skipped)."""
        config = Gemma4TextConfig.from_pretrained(path)
        state = {k: v.to(torch.float32) for k, v in text_state_dict(config, load_state_dict(path)).items()}
        model = cls(config).eval()
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
        if set(missing) - tied or unexpected:
            raise ValueError(f"{path}: checkpoint/model mismatch: missing {sorted(set(missing) - tied)}, "
                             f"unexpected {sorted(unexpected)}")
        return model


def text_state_dict(config: Gemma4TextConfig, state: dict) -> dict:
    """The language model's tensors under the text model's names (`model.layers...`, `lm_head`).

    A release (Gemma4ForConditionalGeneration) stores them under `model.language_model.*`; its vision and
    audio towers (SKIPPED_TOWERS) are dropped here on purpose, any other unknown prefix is an error. As in
    transformers, k/v tensors of KV-shared layers and a tied lm_head are ignored."""
    out = {}
    for name, w in state.items():
        if name.startswith(SKIPPED_TOWERS):
            continue
        if name.startswith(LANGUAGE_MODEL):
            name = "model." + name[len(LANGUAGE_MODEL):]
        elif not name.startswith("model.") and name != "lm_head.weight":
            raise ValueError(f"Gemma 4 checkpoint: tensor {name!r} belongs to no known part")
        if not _ignored_key(config, name):
            out[name] = w
    return out


def _ignored_key(config: Gemma4TextConfig, key: str) -> bool:
    # Released checkpoints may still carry k/v weights on KV-shared layers; transformers ignores them.
    if key == "lm_head.weight":
        return config.tie_word_embeddings
    parts = key.split(".")
    return (len(parts) > 4 and parts[:2] == ["model", "layers"] and config.is_kv_shared(int(parts[2]))
            and parts[3] == "self_attn" and parts[4] in ("k_proj", "v_proj", "k_norm", "v_norm"))
