"""Release-form configs (issue 29): each family's config.json written with the keys real releases publish
(RoPE scaling blocks in the `rope_scaling` form the model cards give, explicit head dims, Phi-4-mini's
longrope with partial rotary), random tiny weights saved by transformers itself. transformers reads the
file, and so do the torch source and the torch-free JAX twin: logits within fp32 noise of transformers,
greedy ids identical through both paged engines where the family serves. Configs a source cannot honour
are refused, naming the key."""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

jax.config.update("jax_default_matmul_precision", "highest")

transformers = pytest.importorskip("transformers")

TORCH_TOL, JAX_TOL = 1e-5, 2e-5
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
            vocab_size=512, max_position_embeddings=256, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
            torch_dtype="bfloat16", transformers_version="4.51.0", use_cache=True, tie_word_embeddings=False)


def llama(**over):  # Llama 3.1's config.json keys
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
            "attention_dropout": 0.0, "hidden_act": "silu", "mlp_bias": False, "pretraining_tp": 1,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, **TINY, **over}


def mistral(**over):  # Mistral-7B-Instruct-v0.2's
    return {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "attention_dropout": 0.0,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None, **TINY, **over}


def qwen2(**over):  # Qwen2.5's
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
            "hidden_act": "silu", "max_window_layers": 2, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "sliding_window": 256, "use_sliding_window": False, "use_mrope": False, **TINY, **over}


def qwen3(**over):  # Qwen3-0.6B's
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
            "attention_dropout": 0.0, "head_dim": 32, "hidden_act": "silu", "max_window_layers": 2,
            "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1e6, "sliding_window": None,
            "use_sliding_window": False, **TINY, **over}


def phi3(**over):  # Phi-4(-mini)'s
    return {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "attention_bias": False,
            "attention_dropout": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 250000.0, "sliding_window": None,
            "original_max_position_embeddings": 256, "pad_token_id": 3, **TINY, **over}


def starcoder2(**over):  # starcoder2-3b's
    return {"architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2", "attention_dropout": 0.0,
            "embedding_dropout": 0.0, "residual_dropout": 0.0, "hidden_act": "gelu_pytorch_tanh", "mlp_type": "default",
            "norm_epsilon": 1e-5, "rope_theta": 999999.4420358813, "sliding_window": 16, "use_bias": True,
            **{**TINY, "tie_word_embeddings": True}, **over}


def falcon(**over):  # falcon-7b's (multi-query, parallel attention)
    tiny = {k: v for k, v in TINY.items() if k not in ("intermediate_size", "num_key_value_heads")}
    return {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "alibi": False,
            "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0, "bias": False,
            "hidden_dropout": 0.0, "layer_norm_epsilon": 1e-5, "multi_query": True, "new_decoder_architecture": False,
            "parallel_attn": True, **{**tiny, "tie_word_embeddings": True}, **over}


def gpt_oss(**over):  # gpt-oss-20b's, less quantization_config (the tiny experts are stored fp32)
    tiny = {**TINY, "intermediate_size": 32}
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
            "attention_dropout": 0.0, "experts_per_token": 2, "num_experts_per_tok": 2, "head_dim": 16,
            "hidden_act": "silu", "initial_context_length": 64, "layer_types": ["sliding_attention", "full_attention"],
            "num_local_experts": 4, "output_router_logits": False, "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.9,
            "sliding_window": 8, "swiglu_limit": 7.0, "pad_token_id": 3, "rope_theta": 150000,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 64,
                             "rope_type": "yarn", "truncate": False}, **tiny, **over}


# The long factors of a tiny Phi-4-mini: 6 rotary pairs (head_dim 16 x 0.75 / 2), short ones near 1.
SHORT, LONG = [1.0, 1.05, 1.1, 1.3, 1.6, 2.0], [1.0, 1.2, 1.8, 3.5, 7.0, 12.0]
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

# (id, family file, config.json)
CASES = [
    ("llama3.1", "llama3", llama(rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64, "rope_type": "llama3"})),
    ("llama-yarn", "llama3", llama(rope_scaling=dict(YARN))),
    ("llama-linear", "llama3", llama(rope_scaling={"type": "linear", "factor": 2.0})),
    ("llama-dynamic", "llama3", llama(rope_scaling={"type": "dynamic", "factor": 2.0})),
    ("mistral-yarn", "mistral", mistral(rope_scaling=dict(YARN))),
    ("qwen2.5-yarn", "qwen2", qwen2(rope_scaling=dict(YARN))),  # the Qwen2.5 model cards' block
    ("qwen3-yarn", "qwen3", qwen3(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 64})),
    ("phi4-mini-longrope", "phi4", phi3(partial_rotary_factor=0.75, original_max_position_embeddings=32,
                                        rope_theta=10000.0, rope_scaling={"type": "longrope", "short_factor": SHORT,
                                                                          "long_factor": LONG})),
    ("phi3-head-dim", "phi4", phi3(head_dim=32)),
    ("starcoder2-head-dim", "starcoder2", starcoder2(head_dim=32)),
    ("starcoder2-linear", "starcoder2", starcoder2(rope_scaling={"type": "linear", "factor": 2.0})),
    ("falcon-linear", "falcon", falcon(rope_scaling={"type": "linear", "factor": 2.0})),
    ("gpt-oss", "gpt_oss", gpt_oss()),
    ("gpt-oss-mscale", "gpt_oss", gpt_oss(rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                                        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5,
                                                        "original_max_position_embeddings": 64, "truncate": False})),
]
SERVING = {"llama-yarn", "llama3.1", "qwen2.5-yarn", "qwen3-yarn", "gpt-oss-mscale"}  # families the engines serve
CI_CASES = {"llama-yarn", "phi4-mini-longrope", "gpt-oss-mscale"}  # the rest in make test-full


def _param(case):
    marks = () if case[0] in CI_CASES else (pytest.mark.slow,)
    return pytest.param(case, id=case[0], marks=marks)


_BUILT: dict[str, Path] = {}


def build(case, root: Path) -> Path:
    """A checkpoint directory: the release-form config.json, random weights saved by transformers."""
    name, _, config = case
    if name in _BUILT:
        return _BUILT[name]
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(config, indent=2))
    hf_config = transformers.AutoConfig.from_pretrained(d)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    model.save_pretrained(d)
    (d / "config.json").write_text(json.dumps(config, indent=2))  # the release's form, not transformers 5's
    (d / "generation_config.json").unlink(missing_ok=True)
    _BUILT[name] = d
    return d


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("release-configs")


def _batch(T=40, seed=0):
    """Two rows, the second right-padded; 40 positions run past the tiny originals (32 for longrope)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, 512, size=(2, T)).astype(np.int64)
    mask = np.ones((2, T), np.int64)
    mask[1, 25:] = 0
    ids[mask == 0] = 0
    return ids, mask


def _hf(d):
    return transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()


def _families(fam):
    return (importlib.import_module(f"torch_sources.models.{fam}"), importlib.import_module(f"jax_oracles.models.{fam}"),
            importlib.import_module(f"conversion.{fam}"))


def _diff(a, b, mask):
    return float(np.abs(np.asarray(a)[mask == 1] - np.asarray(b)[mask == 1]).max())


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
@pytest.mark.parametrize("T", [24, 40])  # longrope: the short table (positions < 32), then the long one
def test_logits_match_transformers(case, T, root):
    d = build(case, root)
    tm, jm, conv = _families(case[1])
    ids, mask = _batch(T)
    with torch.no_grad():
        want = _hf(d)(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        model = tm.__dict__[_lm(tm)].from_pretrained(d)
        got = model(torch.tensor(ids), torch.tensor(mask)).numpy()
    assert _diff(got, want, mask) <= TORCH_TOL, f"{case[0]}: torch source vs transformers {_diff(got, want, mask):.3g}"
    config = conv.load_config(d)
    params = conv.load_params(d)
    jlogits = jm.__dict__[_lm(jm)](config).apply({"params": params}, jnp.asarray(ids, jnp.int32),
                                                 jnp.asarray(mask, jnp.int32))
    assert _diff(jlogits, got, mask) <= JAX_TOL, f"{case[0]}: JAX vs torch {_diff(jlogits, got, mask):.3g}"


def _lm(module) -> str:
    return next(n for n in module.__all__ if n.endswith("ForCausalLM"))


def test_rope_tables_of_the_cases_are_the_twins_bit_for_bit(root):
    """Every case's RoPE, read by both twins from the same config.json: the same table."""
    for name, fam, config in CASES:
        tm, jm, _ = _families(fam)
        tc, jc = _config(tm, config), _config(jm, config)
        np.testing.assert_array_equal(np.asarray(jm.rope_inv_freq(jc)), tm.rope_inv_freq(tc).numpy(), err_msg=name)
        assert jm.rope_attention_factor(jc) == tm.rope_attention_factor(tc), name


def _config(module, d):
    cls = next(getattr(module, n) for n in module.__all__ if n.endswith("Config") and n != "CONFIG_KEYS")
    return cls.from_hf(copy.deepcopy(d))


def _greedy_hf(hf, prompts, n=10):
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                          eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("case", [_param(c) for c in CASES if c[0] in SERVING])
@pytest.mark.parametrize("side", ["torch", "jax"])
def test_engines_greedy_match_transformers(case, side, root):
    d = build(case, root)
    engine_mod = importlib.import_module("torch_sources.serving.engine" if side == "torch" else "serving_engine.engine")
    config_mod = engine_mod  # its own EngineConfig and SamplingParams (another test may have re-imported config)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(4, 512, size=n).tolist() for n in (17, 9, 30)]
    want = _greedy_hf(_hf(d), prompts)
    engine = engine_mod.LLMEngine(d, config_mod.EngineConfig(block_size=4, num_blocks=64, max_num_seqs=3,
                                                             max_num_batched_tokens=64, max_model_len=64, mode="ragged"))
    outs = engine.generate(prompts, config_mod.SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [o.output_token_ids for o in outs] == want, case[0]


# ---- refused, by name ------------------------------------------------------------------------------------

REFUSED = [
    ("llama3", llama(rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}), "no rope_type or type key"),
    ("llama3", llama(rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta": 2.0}), r"\['beta'\]"),
    ("llama3", llama(rope_scaling={"rope_type": "su", "factor": 4.0}), "rope_type 'su'"),
    ("llama3", llama(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("llama3", llama(hidden_act="gelu"), "hidden_act"),
    ("llama3", llama(quantization_config={"quant_method": "awq"}), r"unknown key\(s\) \['quantization_config'\]"),
    ("qwen2", qwen2(use_sliding_window=True), "use_sliding_window"),
    ("qwen2", qwen2(use_mrope=True), "use_mrope"),
    ("qwen3", qwen3(layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    ("falcon", falcon(alibi=True), "alibi"),
    ("falcon", falcon(parallel_attn=False), "parallel_attn"),
    ("falcon", falcon(n_head=4), r"\['n_head'\]"),
    ("bloom", {"model_type": "bloom", "hidden_size": 64, "n_head": 4, "n_layer": 2, "vocab_size": 512,
               "tie_word_embeddings": False}, "tie_word_embeddings"),
    ("gpt_oss", gpt_oss(experts_per_token=4), "experts_per_token"),
    ("gpt_oss", gpt_oss(output_router_logits=True), "output_router_logits"),
    ("phi4", phi3(attention_bias=True), "attention_bias"),
    ("starcoder2", starcoder2(mlp_type="gated"), "mlp_type"),
]


@pytest.mark.parametrize("fam,config,match", REFUSED, ids=[f"{f}-{m[:24]}" for f, _, m in REFUSED])
@pytest.mark.parametrize("side", ["torch", "jax"])
def test_unsupported_release_keys_are_refused_by_name(fam, config, match, side):
    tm, jm, _ = _families(fam)
    with pytest.raises(ValueError, match=match):
        _config(tm if side == "torch" else jm, config)


@pytest.mark.parametrize("side", ["torch", "jax"])
def test_paged_engines_refuse_a_table_that_moves_with_the_length(side, root):
    case = next(c for c in CASES if c[0] == "llama-dynamic")
    d = build(case, root)
    engine_mod = importlib.import_module("torch_sources.serving.engine" if side == "torch" else "serving_engine.engine")
    config_mod = engine_mod
    with pytest.raises(ValueError, match="dynamic.*changes its table"):
        engine_mod.LLMEngine(d, config_mod.EngineConfig(block_size=4, num_blocks=16, max_model_len=32))
