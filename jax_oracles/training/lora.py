"""LoRA for the Flax models, twin of torch_sources/training/lora.py.

Adapters live in their own variable collection "lora", at the same module paths as the base
params, with leaves `lora_A` f32[in,r] and `lora_B` f32[r,out] (PEFT's A/B, transposed).
`model.apply({"params": base, "lora": adapters}, ...)`; without a "lora" collection, or for a
module the collection does not name, a LoraLinear is a plain linear layer. The init is drawn
by the same numpy code as the torch side (one default_rng(seed), canonical order), so both
frameworks start from identical bits; `lora_state_dict` / `lora_tree_from_state_dict` convert
to and from PEFT names in torch layout.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

__all__ = ["PEFT_PREFIX", "TARGET_ORDER", "FROZEN_TOWERS", "LoraConfig", "lora_linear", "lora_target_specs", "init_lora_weights",
           "LoraLinear", "inject_lora", "disable_adapter", "load_lora_state_dict", "lora_state_dict", "init_lora_tree",
           "lora_tree_from_state_dict"]

PEFT_PREFIX = "base_model.model."
# Canonical order of the projections within a decoder layer (every family's names; attention, then MLP):
# the order of the numpy init draws and of the state dicts, the same in both frameworks.
TARGET_ORDER = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "o_proj", "dense",
                "gate_proj", "up_proj", "gate_up_proj", "down_proj", "c_fc", "c_proj", "dense_h_to_4h", "dense_4h_to_h")
_LAYER = re.compile(r"(.+)_(\d+)")  # a decoder layer's param key: "layers_0", "h_0"
# LF's forbidden modules of a vision-language model under its defaults (freeze_vision_tower,
# freeze_multi_modal_projector: `patch_target_modules`, COMPOSITE_MODELS' keys): the vision tower with its merger,
# Omni's audio tower, and the LLaVA-style towers and projectors never take adapters, whatever their projections are
# called (Qwen2.5-VL's tower has a gate_proj, SigLIP's, CLIP's and InternViT's q/k/v_proj).
FROZEN_TOWERS = ("visual", "audio_tower", "vision_tower", "multi_modal_projector")


@dataclass(frozen=True)
class LoraConfig:
    r: int = 8
    lora_alpha: int = 16  # LF: lora_alpha None -> 2 * lora_rank
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = ("all",)  # LF's lora_target: "all", or module names

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r  # use_rslora=False


def lora_linear(x, weight, bias, lora_A, lora_B, scaling: float):
    """x [..., in], weight [out, in], bias [out] | None, lora_A [r, in], lora_B [out, r] -> [..., out]."""
    y = x @ weight.T
    if bias is not None:
        y = y + bias
    return y + ((x @ lora_A.T) @ lora_B.T) * scaling


def _split_layer_path(path: tuple[str, ...]) -> tuple[int, int]:
    """Index of the decoder-layer key in a param path and that layer's index; the path must name a projection."""
    for k, key in enumerate(path):
        m = _LAYER.fullmatch(key)
        if m is not None:
            if path[-1] not in TARGET_ORDER:
                break
            return k, int(m.group(2))
    raise ValueError(f"{'/'.join(path)}: not a decoder-layer projection LoRA knows (TARGET_ORDER: {TARGET_ORDER})")


def _peft_module_name(path: tuple[str, ...]) -> str:
    """("model", "layers_0", "self_attn", "q_proj") -> "base_model.model.model.layers.0.self_attn.q_proj"."""
    k, index = _split_layer_path(path)
    base = _LAYER.fullmatch(path[k]).group(1)
    return PEFT_PREFIX + ".".join((*path[:k], base, str(index), *path[k + 1:]))


def _canonical(path: tuple[str, ...]) -> tuple[int, int]:
    return _split_layer_path(path)[1], TARGET_ORDER.index(path[-1])


def lora_target_specs(params: dict, config: LoraConfig) -> list[tuple[str, int, int]]:
    """(PEFT module name, in, out) of every adapted projection, in canonical order.

    LF's find_all_linear_modules: every linear kernel but the output head's; "all" or the named modules."""
    specs = []
    for path, leaf in traverse_util.flatten_dict(params).items():
        if path[-1] != "kernel" or path[0] == "lm_head" or np.ndim(leaf) != 2 or set(path) & set(FROZEN_TOWERS):
            continue
        module = path[:-1]
        if "all" in config.target_modules or module[-1] in config.target_modules:
            specs.append((module, *np.shape(leaf)))
    return [(_peft_module_name(m), fan_in, fan_out) for m, fan_in, fan_out in sorted(specs, key=lambda s: _canonical(s[0]))]


def init_lora_weights(specs: list[tuple[str, int, int]], seed: int, r: int = 8) -> dict[str, np.ndarray]:
    """{peft name: f32 array} for specs, from one np.random.default_rng(seed) drawn in spec order."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, fan_in, fan_out in specs:
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)) on an [r, in] weight
        weights[f"{name}.lora_A.weight"] = rng.uniform(-bound, bound, size=(r, fan_in)).astype(np.float32)
        weights[f"{name}.lora_B.weight"] = np.zeros((fan_out, r), dtype=np.float32)
    return weights


class LoraLinear(nn.Module):
    """y = x @ kernel (+ bias) + scaling * (x @ lora_A) @ lora_B.  kernel: f32[in,out] = HF weight.T"""
    features: int
    use_bias: bool = False
    scaling: float = 2.0  # lora_alpha / r = 16 / 8

    @nn.compact
    def __call__(self, x):  # f32[..., in] -> f32[..., out]
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32) if self.use_bias else None
        if not self.has_variable("lora", "lora_A"):
            return x @ kernel if bias is None else x @ kernel + bias
        lora_a = self.get_variable("lora", "lora_A")  # f32[in,r]
        lora_b = self.get_variable("lora", "lora_B")  # f32[r,out]
        return _adapted(x, kernel, bias, lora_a, lora_b, self.scaling)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _adapted(x, kernel, bias, lora_a, lora_b, scaling: float):
    """x @ kernel (+ bias) + scaling * (x @ lora_a) @ lora_b, in that order of operations."""
    return _adapted_fwd(x, kernel, bias, lora_a, lora_b, scaling)[0]


def _adapted_fwd(x, kernel, bias, lora_a, lora_b, scaling):
    xa = x @ lora_a
    y = x @ kernel
    if bias is not None:
        y = y + bias
    return y + scaling * (xa @ lora_b), (x, kernel, bias, lora_a, lora_b, xa)


def _adapted_bwd(scaling, res, g):
    """The products autodiff forms, on [tokens, features] matrices, each weight grad as (thin)^T @ (wide): XLA's
    own transpose of the same expression moved the wide [tokens, out] cotangent into a transposed layout (a
    strided copy per projection, about a quarter of a ~100M model's LoRA step on a CPU). Bit-identical grads."""
    x, kernel, bias, lora_a, lora_b, xa = res
    x2, xa2, g2 = x.reshape(-1, x.shape[-1]), xa.reshape(-1, xa.shape[-1]), g.reshape(-1, g.shape[-1])
    gs = g2 * scaling                 # the cotangent of (x @ lora_a) @ lora_b
    g_xa = gs @ lora_b.T              # [tokens, r]
    dx = g2 @ kernel.T + g_xa @ lora_a.T
    dbias = None if bias is None else jnp.sum(g2, axis=0)
    # kernel and bias are frozen: under jit their cotangents are dead code unless someone differentiates them
    return (dx.reshape(x.shape), x2.T @ g2, dbias, x2.T @ g_xa, xa2.T @ gs)


_adapted.defvjp(_adapted_fwd, _adapted_bwd)


def inject_lora(params: dict, config: LoraConfig, seed: int) -> tuple[dict, list[str]]:
    """Functional twin of torch's inject_lora: (the "lora" collection, its PEFT names). The base
    params need no freezing: only the "lora" collection is ever differentiated."""
    weights = init_lora_weights(lora_target_specs(params, config), seed, config.r)
    return lora_tree_from_state_dict(weights), list(weights)


def disable_adapter(variables: dict) -> dict:
    """Functional twin of PeftModel.disable_adapter(): the variables without the "lora" collection, so
    every LoraLinear is its base layer (DPO/PPO's reference policy)."""
    if "lora" not in variables:
        raise ValueError("the variables hold no LoRA adapters to disable")
    return {k: v for k, v in variables.items() if k != "lora"}


def load_lora_state_dict(lora_tree: dict, state_dict: dict) -> dict:
    """A new "lora" collection from {peft name: array}; every adapter of lora_tree must be named, same shapes."""
    current = lora_state_dict(lora_tree)
    if current.keys() != state_dict.keys():
        raise KeyError(f"adapter names differ: missing {sorted(current.keys() - state_dict.keys())}, "
                       f"unexpected {sorted(state_dict.keys() - current.keys())}")
    bad = {k: (np.shape(state_dict[k]), v.shape) for k, v in current.items() if np.shape(state_dict[k]) != v.shape}
    if bad:
        raise ValueError(f"adapter shape mismatch (got, expected): {bad}")
    return lora_tree_from_state_dict(state_dict)


def lora_state_dict(lora_tree: dict) -> dict[str, np.ndarray]:
    """{peft name: f32 numpy, torch layout} in canonical order (layer, TARGET_ORDER, A then B)."""
    flat = traverse_util.flatten_dict(lora_tree)
    return {f"{_peft_module_name(path[:-1])}.{path[-1]}.weight": np.array(flat[path]).T.copy()
            for path in sorted(flat, key=lambda p: (*_canonical(p[:-1]), p[-1]))}


def init_lora_tree(params: dict, config: LoraConfig, seed: int) -> dict:
    """The "lora" collection for params, from the same numpy draws as torch's inject_lora."""
    return inject_lora(params, config, seed)[0]


_PEFT_KEY = re.compile(rf"{re.escape(PEFT_PREFIX)}(.+?)\.(\d+)\.(.+)\.(lora_[AB])\.weight")


def lora_tree_from_state_dict(state_dict: dict) -> dict:
    """{peft name: [r,in] / [out,r] array} -> {"model": {"layers_0": {...: {"lora_A": [in,r], "lora_B": [r,out]}}}}."""
    flat = {}
    for name, w in state_dict.items():
        m = _PEFT_KEY.fullmatch(name)
        if m is None:
            raise KeyError(f"not a PEFT LoRA weight name: {name}")
        layers, index, module, leaf = m.groups()
        *root, base = layers.split(".")
        flat[(*root, f"{base}_{index}", *module.split("."), leaf)] = jnp.asarray(np.asarray(w, np.float32).T)
    return traverse_util.unflatten_dict(flat)
