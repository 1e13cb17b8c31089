"""Mistral, Qwen2, Qwen3 (the Llama-shaped families): torch source vs transformers, JAX oracle vs torch,
checkpoint assets, conversion both ways and LoRA targets, one parametrized suite."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import yaml

jax.config.update("jax_default_matmul_precision", "highest")

from conversion import safetensors_io  # noqa: E402
from jax_oracles.training import lora as jlora  # noqa: E402
from torch_sources.training import lora as tlora  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
TORCH_TOL, JAX_TOL = 1e-5, 2e-5

# The real releases' config.json keys (mistralai/Mistral-7B-Instruct-v0.2, Qwen/Qwen2.5-0.5B, Qwen/Qwen3-0.6B),
# less transformers_version.
RELEASE_KEYS = {
    "mistral": {"architectures", "attention_dropout", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size",
                "initializer_range", "intermediate_size", "max_position_embeddings", "model_type",
                "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_theta",
                "sliding_window", "tie_word_embeddings", "torch_dtype", "use_cache", "vocab_size"},
    "qwen2": {"architectures", "attention_dropout", "bos_token_id", "eos_token_id", "hidden_act", "hidden_size",
              "initializer_range", "intermediate_size", "max_position_embeddings", "max_window_layers", "model_type",
              "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_theta",
              "sliding_window", "tie_word_embeddings", "torch_dtype", "use_cache", "use_mrope", "use_sliding_window",
              "vocab_size"},
    "qwen3": {"architectures", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim",
              "hidden_act", "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings",
              "max_window_layers", "model_type", "num_attention_heads", "num_hidden_layers", "num_key_value_heads",
              "rms_norm_eps", "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings", "torch_dtype",
              "use_cache", "use_sliding_window", "vocab_size"},
}
# (batch, seq, real lengths, side): 7 tokens unpadded; 16 and 33 padded, past Mistral's window of 16.
BATCHES = [(1, 7, (7,), "right"), (2, 16, (16, 11), "right"), (3, 33, (33, 20, 5), "right"),
           (3, 33, (33, 20, 5), "left")]
BATCH_IDS = ["b1t7", "b2t16-right", "b3t33-right", "b3t33-left"]


class Family:
    """One family's modules (torch, JAX, conversion), checkpoint and loaded models, built once."""

    def __init__(self, name: str):
        self.name, self.prefix = name, FAMILIES[name]
        self.ckpt = ROOT / "assets" / "checkpoints" / name
        self.tm = importlib.import_module(f"torch_sources.models.{name}")
        self.jm = importlib.import_module(f"jax_oracles.models.{name}")
        self.conv = importlib.import_module(f"conversion.{name}")
        self.torch_model = self.tcls("ForCausalLM").from_pretrained(self.ckpt)
        self.jax_model = self.jcls("ForCausalLM")(self.conv.load_config(self.ckpt))
        self.params = self.conv.load_params(self.ckpt)
        self._hf = None

    def tcls(self, suffix):
        return getattr(self.tm, self.prefix + suffix)

    def jcls(self, suffix):
        return getattr(self.jm, self.prefix + suffix)

    @property
    def hf(self):
        if self._hf is None:
            transformers = importlib.import_module("transformers")
            self._hf = getattr(transformers, f"{self.prefix}ForCausalLM").from_pretrained(
                self.ckpt, attn_implementation="eager", dtype=torch.float32).eval()
        return self._hf


_FAMILIES: dict[str, Family] = {}


@pytest.fixture(params=list(FAMILIES))
def fam(request) -> Family:
    if request.param not in _FAMILIES:
        _FAMILIES[request.param] = Family(request.param)
    return _FAMILIES[request.param]


def batch(spec, seed=0):
    """ids, mask and HF positions (mask cumsum - 1, 1 at pads, as generate computes them)."""
    B, T, lengths, side = spec
    rng = np.random.default_rng(seed)
    real = np.arange(T)[None] < np.array(lengths)[:, None]
    mask = (real if side == "right" else real[:, ::-1]).astype(np.int32)
    ids = np.where(mask == 1, rng.integers(0, 400, size=(B, T)), 0).astype(np.int64)
    positions = np.where(mask == 1, np.cumsum(mask, -1) - 1, 1)
    return ids, mask, positions


def torch_logits(model, ids, mask, positions=None):
    with torch.no_grad():
        return model(torch.tensor(ids), torch.tensor(mask),
                     None if positions is None else torch.tensor(positions)).numpy()


_apply = jax.jit(lambda model, variables, ids, mask, pos: model.apply(variables, ids, mask, pos), static_argnums=0)


def jax_logits(fam, ids, mask, positions, lora=None):
    variables = {"params": fam.params} if lora is None else {"params": fam.params, "lora": lora}
    return np.asarray(_apply(fam.jax_model, variables, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32),
                             jnp.asarray(positions, jnp.int32)))


def max_diff(a, b, mask) -> float:  # over the real (unpadded) positions only
    return float(np.abs(np.asarray(a)[mask == 1] - np.asarray(b)[mask == 1]).max())


def load_generator(name):
    spec = importlib.util.spec_from_file_location(f"checkpoints_{name}", ROOT / "tools" / f"checkpoints_{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, f"make_{name}")


# ---- checkpoint assets -----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FAMILIES))
def test_checkpoint_regenerates_byte_identical(name, tmp_path):
    out = load_generator(name)(tmp_path / name)
    ckpt = ROOT / "assets" / "checkpoints" / name
    names = ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(p.name for p in ckpt.iterdir()) == sorted(p.name for p in out.iterdir()) == names
    for n in names:
        assert (out / n).read_bytes() == (ckpt / n).read_bytes(), n


def test_config_keys_are_the_releases(fam):
    config = json.loads((fam.ckpt / "config.json").read_text())
    assert set(config) == RELEASE_KEYS[fam.name]
    assert config["architectures"] == [f"{fam.prefix}ForCausalLM"] and config["rope_theta"] == 1e6
    state = safetensors_io.load_state_dict(fam.ckpt)
    assert ("lm_head.weight" in state) == (not config["tie_word_embeddings"])
    for name, w in state.items():  # norms drawn off identity so a dropped or misplaced weight shows
        if "norm" in name:
            assert np.abs(w - 1.0).max() > 0.05, name


def test_transformers_loads_every_tensor_and_no_other(fam):
    transformers = importlib.import_module("transformers")
    _, info = getattr(transformers, f"{fam.prefix}ForCausalLM").from_pretrained(fam.ckpt, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_special_tokens():
    cfg = {n: json.loads((ROOT / "assets" / "checkpoints" / n / "config.json").read_text()) for n in FAMILIES}
    assert (cfg["mistral"]["bos_token_id"], cfg["mistral"]["eos_token_id"]) == (401, 402)
    assert (cfg["qwen2"]["bos_token_id"], cfg["qwen2"]["eos_token_id"]) == (400, 400)
    assert (cfg["qwen3"]["bos_token_id"], cfg["qwen3"]["eos_token_id"]) == (400, 402)


# ---- config -----------------------------------------------------------------------------------

def test_config_features(fam):
    c, jc = fam.torch_model.config, fam.jax_model.config
    assert dataclass_dict(c) == dataclass_dict(jc)
    assert (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers) == (64, 4, 2, 2)
    assert c.head_dim == {"mistral": 16, "qwen2": 16, "qwen3": 32}[fam.name]  # qwen3's differs from 64 / 4
    assert c.tie_word_embeddings == (fam.name != "mistral")
    assert c.norm_eps == (1e-5 if fam.name == "mistral" else 1e-6)
    assert c.sliding_window == (16 if fam.name == "mistral" else None)  # qwen2: use_sliding_window false, as HF


def dataclass_dict(c):  # nested dataclasses (the Rope) as dicts, so the torch and JAX twins compare
    from dataclasses import asdict
    return asdict(c)


def test_reads_config_saved_by_transformers(fam, tmp_path):
    fam.hf.config.save_pretrained(tmp_path)  # transformers 5 writes `rope_parameters`, not rope_theta
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_theta" not in saved
    assert fam.tcls("Config").from_pretrained(tmp_path) == fam.torch_model.config
    assert fam.conv.load_config(tmp_path) == fam.jax_model.config


def test_rope_inv_freq_matches_transformers(fam):
    ours = fam.tm.rope_inv_freq(fam.torch_model.config)
    assert torch.equal(ours, fam.hf.model.rotary_emb.inv_freq)
    # both twins round the float64 power once (models/rope.py): the same table, bit for bit
    np.testing.assert_array_equal(np.asarray(fam.jm.rope_inv_freq(fam.jax_model.config)), ours.numpy())


def test_sliding_window_mask():
    """masking_utils: key allowed iff q - k < window (window 3: the query and the 2 keys before it)."""
    expect = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 0]], bool)
    mask = np.array([[1, 1, 1, 1, 0]])
    from jax_oracles.models import mistral as jm
    from torch_sources.models import mistral as tm
    np.testing.assert_array_equal(tm.causal_mask(torch.tensor(mask), 3)[0].numpy(), expect)
    np.testing.assert_array_equal(np.asarray(jm.causal_mask(jnp.asarray(mask), 3))[0], expect)


# ---- torch source vs transformers, JAX oracle vs torch ---------------------------------------

@pytest.mark.parametrize("spec", BATCHES, ids=BATCH_IDS)
def test_torch_matches_transformers(fam, spec):
    ids, mask, positions = batch(spec)
    pos = positions if spec[3] == "left" else None  # right padding: both default to 0..T-1
    ours = torch_logits(fam.torch_model, ids, mask, pos)
    with torch.no_grad():
        ref = fam.hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                     position_ids=None if pos is None else torch.tensor(pos)).logits.numpy()
    diff = max_diff(ours, ref, mask)
    print(f"{fam.name} {spec}: max |torch - transformers| = {diff:.3g}")
    assert diff <= TORCH_TOL


@pytest.mark.parametrize("spec", BATCHES, ids=BATCH_IDS)
def test_jax_matches_torch(fam, spec):
    ids, mask, positions = batch(spec, seed=1)
    ours = jax_logits(fam, ids, mask, positions)
    ref = torch_logits(fam.torch_model, ids, mask, positions)
    diff = max_diff(ours, ref, mask)
    print(f"{fam.name} {spec}: max |jax - torch| = {diff:.3g}")
    assert diff <= JAX_TOL


def test_window_is_crossed():
    """At 33 tokens Mistral's window of 16 changes the logits (so the checks above exercise it)."""
    fam = _FAMILIES.get("mistral") or Family("mistral")
    ids, mask, _ = batch(BATCHES[2])
    from dataclasses import replace
    full = fam.tcls("ForCausalLM")(replace(fam.torch_model.config, sliding_window=None))
    full.load_state_dict(fam.torch_model.state_dict())
    windowed, unwindowed = torch_logits(fam.torch_model, ids, mask), torch_logits(full.eval(), ids, mask)
    assert np.abs(windowed[:, :16] - unwindowed[:, :16]).max() == 0  # t - s < 16 for every pair
    assert np.abs(windowed[0, 16:] - unwindowed[0, 16:]).max() > 1e-3


# ---- conversion --------------------------------------------------------------------------------

def test_hf_layout_is_the_checkpoints(fam):
    state = safetensors_io.load_state_dict(fam.ckpt)
    assert fam.conv.hf_layout(fam.params) == {k: tuple(v.shape) for k, v in state.items()}


def test_conversion_is_checked_both_ways(fam):
    state = safetensors_io.load_state_dict(fam.ckpt)
    config = fam.conv.load_config(fam.ckpt)
    with pytest.raises(ValueError, match=r"never written \['model/layers_1/mlp/up_proj/kernel'\]"):
        fam.conv.convert_state_dict({k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"},
                                    config)
    with pytest.raises(ValueError, match="unused source tensors"):
        fam.conv.convert_state_dict({**state, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)},
                                    config)
    own = {"mistral": "model.layers.0.self_attn.q_proj.bias", "qwen2": "model.layers.0.self_attn.o_proj.bias",
           "qwen3": "model.layers.0.self_attn.q_proj.bias"}[fam.name]  # a bias the family does not have
    with pytest.raises(ValueError, match="params the model does not declare"):
        fam.conv.convert_state_dict({**state, own: np.zeros(64, np.float32)}, config)
    if fam.name == "qwen2":
        missing = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.k_proj.bias"}
        with pytest.raises(ValueError, match="never written"):
            fam.conv.convert_state_dict(missing, config)
    if fam.name == "qwen3":
        missing = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_norm.weight"}
        with pytest.raises(ValueError, match=r"never written \['model/layers_1/self_attn/k_norm/weight'\]"):
            fam.conv.convert_state_dict(missing, config)


# ---- LoRA targets --------------------------------------------------------------------------------

def test_lora_targets_are_every_decoder_linear(fam):
    config = tlora.LoraConfig()
    want = [(f"{tlora.PEFT_PREFIX}{n}", m.in_features, m.out_features) for n, m in fam.hf.named_modules()
            if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")]
    specs = tlora.lora_target_specs(fam.torch_model, config)
    assert sorted(specs) == sorted(want) and len(specs) == 7 * 2
    assert jlora.lora_target_specs(fam.params, jlora.LoraConfig()) == specs


def test_lora_adapter_torch_matches_jax(fam):
    model = fam.tcls("ForCausalLM").from_pretrained(fam.ckpt)
    tlora.inject_lora(model, tlora.LoraConfig(), seed=0)
    rng = np.random.default_rng(11)
    adapters = {k: (rng.standard_normal(v.shape) * 0.05).astype(np.float32)
                for k, v in tlora.lora_state_dict(model).items()}
    tlora.load_lora_state_dict(model, adapters)
    ids, mask, positions = batch(BATCHES[2], seed=2)
    ours = jax_logits(fam, ids, mask, positions, jlora.lora_tree_from_state_dict(tlora.lora_state_dict(model)))
    ref = torch_logits(model, ids, mask, positions)
    base = torch_logits(fam.torch_model, ids, mask, positions)
    assert max_diff(ref, base, mask) > 1e-3  # the adapter moves the logits
    diff = max_diff(ours, ref, mask)
    print(f"{fam.name}: max |jax - torch| with LoRA = {diff:.3g}")
    assert diff <= JAX_TOL


# ---- family yaml, torch-free JAX side --------------------------------------------------------

def test_family_yaml(fam):
    y = yaml.safe_load((ROOT / "configs" / "family" / f"{fam.name}.yaml").read_text())
    assert y["name"] == fam.name and y["model_prefix"] == fam.prefix and y["model_module"] == f"models/{fam.name}.py"
    assert y["checkpoint"] == f"assets/checkpoints/{fam.name}" and y["tokenizer"] == f"assets/tokenizer/{fam.name}"
    assert fam.torch_model.get_submodule(y["layers"] + ".0." + y["attention"]) is not None
    for module in (fam.tm, fam.jm):
        assert all(hasattr(module, n) for n in module.__all__)
    assert fam.tm.__all__ == fam.jm.__all__


def test_jax_side_imports_without_torch():
    code = ("import sys\n"
            "for m in ('torch', 'transformers', 'torch_sources', 'recorder'): sys.modules[m] = None\n"
            + "".join(f"import conversion.{n}, jax_oracles.models.{n}\n" for n in FAMILIES))
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
