"""LoRA as PEFT applies it for LLaMA-Factory (`lora_target=all` on Llama: every projection).

y = base(x) + scaling * B(A(dropout(x))), scaling = lora_alpha / r; A: [r, in] kaiming-uniform
(a=sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in))), B: [out, r] zeros, so training starts from the
base model. The base is frozen; only A and B train. Adapter tensors are named as PEFT saves
them (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, torch layout), and the
init is drawn from one numpy generator in canonical order, so the JAX twin gets the same bits.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PEFT_PREFIX", "TARGET_ORDER", "LoraConfig", "lora_linear", "lora_target_specs", "init_lora_weights",
           "LoraLinear", "inject_lora", "disable_adapter", "load_lora_state_dict", "lora_state_dict"]

PEFT_PREFIX = "base_model.model."
# Canonical order within a decoder layer (HF registration order): attention, then MLP.
TARGET_ORDER = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
                ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))


@dataclass(frozen=True)
class LoraConfig:
    r: int = 8
    lora_alpha: int = 16  # LF: lora_alpha None -> 2 * lora_rank
    lora_dropout: float = 0.0
    target_modules: tuple[str, ...] = tuple(name for _, name in TARGET_ORDER)

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.r  # use_rslora=False


def lora_linear(x, weight, bias, lora_A, lora_B, scaling: float):
    """x [..., in], weight [out, in], bias [out] | None, lora_A [r, in], lora_B [out, r] -> [..., out]."""
    return F.linear(x, weight, bias) + F.linear(F.linear(x, lora_A), lora_B) * scaling


def lora_target_specs(model: nn.Module, config: LoraConfig) -> list[tuple[str, int, int]]:
    """(PEFT module name, in, out) of every adapted projection, in canonical order."""
    specs = []
    for i, layer in enumerate(model.model.layers):
        for group, proj in TARGET_ORDER:
            if proj in config.target_modules:
                linear = getattr(getattr(layer, group), proj)
                linear = getattr(linear, "base_layer", linear)
                specs.append((f"{PEFT_PREFIX}model.layers.{i}.{group}.{proj}", linear.in_features, linear.out_features))
    return specs


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
    params = {PEFT_PREFIX + n: p for n, p in model.named_parameters() if ".lora_" in n}
    if params.keys() != state_dict.keys():
        raise KeyError(f"adapter names differ: missing {sorted(params.keys() - state_dict.keys())}, "
                       f"unexpected {sorted(state_dict.keys() - params.keys())}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(torch.as_tensor(np.asarray(state_dict[name]), dtype=p.dtype))
            p.requires_grad_(True)


def lora_state_dict(model: nn.Module) -> dict[str, np.ndarray]:
    """{peft name: f32 numpy copy, torch layout} in canonical order."""
    return {PEFT_PREFIX + n: p.detach().cpu().numpy().copy() for n, p in model.named_parameters() if ".lora_" in n}
