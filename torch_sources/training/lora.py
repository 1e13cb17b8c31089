"""LoRA as PEFT applies it for LLaMA-Factory (`lora_target=all`: every nn.Linear of the decoder layers,
lm_head excluded, as LF's `find_all_linear_modules` finds them, fused projections included).

y = base(x) + scaling * B(A(dropout(x))), scaling = lora_alpha / r; A: [r, in] kaiming-uniform
(a=sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), B: [out, r] zeros, so training starts from the
base model. The base is frozen; only A and B train. Adapter tensors are named as PEFT saves
them (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, torch layout), and the
init is drawn from one numpy generator in canonical order, so the JAX twin gets the same bits.
"""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PEFT_PREFIX", "TARGET_ORDER", "FROZEN_TOWERS", "LoraConfig", "lora_linear", "lora_target_specs", "init_lora_weights",
           "LoraLinear", "inject_lora", "disable_adapter", "load_lora_state_dict", "lora_state_dict"]

PEFT_PREFIX = "base_model.model."
# Canonical order of the projections within a decoder layer (every family's names; attention, then MLP):
# the order of the numpy init draws and of the state dicts, the same in both frameworks.
TARGET_ORDER = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "o_proj", "dense",
                "gate_proj", "up_proj", "gate_up_proj", "down_proj", "c_fc", "c_proj", "dense_h_to_4h", "dense_4h_to_h")
_IN_LAYER = re.compile(r"(.+?)\.(\d+)\.(.+)")  # "<layers path>.<index>.<module path in the layer>"
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
    return F.linear(x, weight, bias) + F.linear(F.linear(x, lora_A), lora_B) * scaling


def _canonical(name: str) -> tuple[int, int]:
    """Sort key of a module name inside a decoder layer: (layer index, TARGET_ORDER position)."""
    m = _IN_LAYER.fullmatch(name)
    last = name.rsplit(".", 1)[-1]
    if m is None or last not in TARGET_ORDER:
        raise ValueError(f"{name}: not a decoder-layer projection LoRA knows (TARGET_ORDER: {TARGET_ORDER})")
    return int(m.group(2)), TARGET_ORDER.index(last)


def lora_target_specs(model: nn.Module, config: LoraConfig) -> list[tuple[str, int, int]]:
    """(PEFT module name, in, out) of every adapted projection, in canonical order.

    LF's find_all_linear_modules: every nn.Linear but the output head; "all" or the named modules."""
    specs = []
    for name, module in model.named_modules():
        if (isinstance(module, LoraLinear) or not isinstance(module, nn.Linear) or name.split(".")[0] == "lm_head"
                or name.rsplit(".", 1)[-1] in ("lora_A", "lora_B")  # an injected adapter's own matrices
                or set(name.split(".")) & set(FROZEN_TOWERS)):
            continue
        if "all" in config.target_modules or name.rsplit(".", 1)[-1] in config.target_modules:
            if name.endswith(".base_layer"):
                name = name[: -len(".base_layer")]
            specs.append((f"{PEFT_PREFIX}{name}", module.in_features, module.out_features))
    return sorted(specs, key=lambda spec: _canonical(spec[0][len(PEFT_PREFIX):]))


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
    """PEFT's lora.Linear around a frozen nn.Linear (parameter names as PEFT saves them)."""

    def __init__(self, base_layer: nn.Linear, r: int, lora_alpha: int, lora_dropout: float = 0.0):
        super().__init__()
        self.base_layer = base_layer
        self.lora_dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(base_layer.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base_layer.out_features, bias=False)
        self.scaling = lora_alpha / r
        self.disable_adapters = False  # PEFT's flag, set by disable_adapter()

    def forward(self, x):  # f32[..., in] -> f32[..., out]
        if self.disable_adapters:
            return self.base_layer(x)
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


def inject_lora(model: nn.Module, config: LoraConfig, seed: int) -> list[str]:
    """Freeze the model, wrap every target projection in a LoraLinear initialised by
    init_lora_weights(seed); returns the trainable PEFT parameter names."""
    model.requires_grad_(False)
    specs = lora_target_specs(model, config)
    for name, _, _ in specs:
        parent_name, attr = name[len(PEFT_PREFIX):].rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, LoraLinear(getattr(parent, attr), config.r, config.lora_alpha, config.lora_dropout))
    weights = init_lora_weights(specs, seed, config.r)
    load_lora_state_dict(model, weights)
    return list(weights)


@contextmanager
def disable_adapter(model: nn.Module):
    """PeftModel.disable_adapter(): inside, every LoraLinear is its base layer (DPO/PPO's reference policy)."""
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    if not layers:
        raise ValueError("the model has no LoRA adapters to disable")
    for m in layers:
        m.disable_adapters = True
    try:
        yield model
    finally:
        for m in layers:
            m.disable_adapters = False


def load_lora_state_dict(model: nn.Module, state_dict: dict) -> None:
    """Copy {peft name: array} into the model's adapters (every adapter must be named)."""
    params = _lora_params(model)
    if params.keys() != state_dict.keys():
        raise KeyError(f"adapter names differ: missing {sorted(params.keys() - state_dict.keys())}, "
                       f"unexpected {sorted(state_dict.keys() - params.keys())}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(torch.as_tensor(np.asarray(state_dict[name]), dtype=p.dtype))
            p.requires_grad_(True)


def _lora_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """{peft name: adapter parameter} in canonical order (layer, TARGET_ORDER, A then B)."""
    params = {PEFT_PREFIX + n: p for n, p in model.named_parameters() if ".lora_" in n}
    return {k: params[k] for k in sorted(params, key=lambda k: (*_canonical(k[len(PEFT_PREFIX):].rsplit(".", 2)[0]), k))}


def lora_state_dict(model: nn.Module) -> dict[str, np.ndarray]:
    """{peft name: f32 numpy copy, torch layout} in canonical order."""
    return {name: p.detach().cpu().numpy().copy() for name, p in _lora_params(model).items()}
