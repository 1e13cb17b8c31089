"""GPT-OSS torch source vs transformers 5 on the tiny MXFP4 checkpoint (assets/checkpoints/gpt_oss): logits,
MXFP4 dequantization, the router (ties included), YaRN, and the paged serving path (prefill and greedy engine)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from torch_sources.models import rope as trope
from torch_sources.models.gpt_oss import (GptOssConfig, GptOssForCausalLM, layer_inputs, rope_attention_factor,
                                          rope_inv_freq, route, swiglu_clamped)
from torch_sources.models.mxfp4 import dequantize_mxfp4
from torch_sources.serving.config import EngineConfig, SamplingParams
from torch_sources.serving.engine import LLMEngine, eos_token_ids
from torch_sources.serving.model_runner import ModelRunner

transformers = pytest.importorskip("transformers")
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CKPT = str(ROOT / "assets" / "checkpoints" / "gpt_oss")
ATOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hf_model():
    # Mxfp4Config(dequantize=True): transformers' own CPU path (no accelerate, triton or kernels needed), which
    # dequantizes the experts to fp32 GptOssExperts; the eager experts loop, not the grouped_mm default.
    return transformers.AutoModelForCausalLM.from_pretrained(
        CKPT, attn_implementation="eager", dtype=torch.float32, experts_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()


@pytest.fixture(scope="module")
def model():
    return GptOssForCausalLM.from_pretrained(CKPT)


def _ids(batch: int, length: int, seed: int = 0):
    return torch.randint(0, 400, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_checkpoint_is_reproducible(tmp_path):
    spec = importlib.util.spec_from_file_location("make_checkpoints", ROOT / "tools" / "make_checkpoints.py")
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    out = tools.BUILDERS["gpt_oss"](tmp_path / "gpt_oss")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (Path(CKPT) / name).read_bytes(), name


# ---- (a) the torch source vs transformers --------------------------------------------------------------------

def test_config_reads_both_forms(hf_model):
    release = GptOssConfig.from_pretrained(CKPT)  # rope_theta + rope_scaling, as the release writes
    assert GptOssConfig.from_hf(hf_model.config.to_dict()) == release  # transformers 5's rope_parameters form
    assert release.layer_types == ("sliding_attention", "full_attention")
    assert [release.layer_sliding_window(i) for i in range(2)] == [8, None]
    assert release.num_experts_per_tok == 2 and release.swiglu_limit == 7.0


@pytest.mark.parametrize("batch,length", [(2, 40), (1, 5)])  # 40 > 5x the window of 8
def test_logits_match_transformers(hf_model, model, batch, length):
    ids = _ids(batch, length)
    with torch.no_grad():
        want, got = hf_model(ids).logits, model(ids)
    assert (got - want).abs().max().item() <= ATOL


def test_window_sinks_and_clamp_are_exercised(model):
    """The checkpoint is drawn so that each GPT-OSS feature changes the logits (a port that drops it fails)."""
    ids = _ids(1, 40)
    with torch.no_grad():
        base = model(ids)
        layer0 = model.model.layers[0]
        window, layer0.self_attn.sliding_window = layer0.self_attn.sliding_window, None
        assert (model(ids) - base).abs().max() > 1e-2
        layer0.self_attn.sliding_window = window
        sinks = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e30)
        assert (model(ids) - base).abs().max() > 1e-2
        for layer, s in zip(model.model.layers, sinks):
            layer.self_attn.sinks.copy_(s)
        # gate_up pre-activations of layer 0 on these tokens: some beyond the limit on both sides of the clamp
        x = model.model.embed_tokens(ids)
        x = x + layer0.self_attn(layer0.input_layernorm(x), layer_inputs(model.config, torch.ones_like(ids)))
        h = layer0.post_attention_layernorm(x)
        ex = layer0.mlp.experts
        gu = torch.einsum("bth,ehf->betf", h, ex.gate_up_proj) + ex.gate_up_proj_bias[None, :, None]
        assert (gu[..., 0::2] > 7).any() and (gu[..., 1::2].abs() > 7).any()
        assert torch.equal(model(ids), base)


def test_swiglu_clamped_values():
    gu = torch.tensor([[10.0, 10.0, -3.0, -10.0, 1.0, 0.5]])  # (gate, up) pairs, interleaved
    gate, up = torch.tensor([7.0, -3.0, 1.0]), torch.tensor([7.0, -7.0, 0.5])
    want = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    torch.testing.assert_close(swiglu_clamped(gu, 1.702, 7.0), want[None], rtol=0, atol=0)


# ---- (b) MXFP4 ---------------------------------------------------------------------------------------------

def test_dequantize_matches_transformers(hf_model):
    state = load_file(f"{CKPT}/model.safetensors")
    scales_seen = set()
    for i in range(2):
        for name in ("gate_up_proj", "down_proj"):
            blocks, scales = (state[f"model.layers.{i}.mlp.experts.{name}_{s}"] for s in ("blocks", "scales"))
            scales_seen |= set(scales.flatten().tolist())
            mine = dequantize_mxfp4(blocks, scales)  # f32[E, out, in]
            assert torch.equal(mine.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            assert torch.equal(mine.transpose(1, 2), getattr(hf_model.model.layers[i].mlp.experts, name).detach())
    assert len(scales_seen) >= 8  # several E8M0 exponents


def test_dequantize_nibble_order_and_scale():
    blocks = torch.tensor([[[0x21] + [0] * 15]], dtype=torch.uint8)  # low nibble 1 (0.5), high 2 (1.0)
    blocks[0, 0, 1] = 0xF8  # low 8 (-0), high 15 (-6)
    out = dequantize_mxfp4(blocks, torch.tensor([[129]], dtype=torch.uint8))  # x 2^2
    assert out.shape == (1, 32)
    assert out[0, :4].tolist() == [2.0, 4.0, -0.0, -24.0]


# ---- (c) the router ------------------------------------------------------------------------------------------

def _hf_router(num_experts: int, top_k: int):
    # Identity weight and zero bias: the router's logits are its input, exactly.
    cfg = transformers.GptOssConfig(hidden_size=num_experts, num_local_experts=num_experts, num_experts_per_tok=top_k)
    router = hf_gpt_oss.GptOssTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(num_experts))
        router.bias.zero_()
    return router


def test_route_matches_transformers_with_ties():
    logits = torch.cat([torch.randn(64, 4, generator=torch.Generator().manual_seed(1)) * 2,
                        torch.tensor([[1.0, 2.0, 2.0, 0.0], [0.0, 5.0, 0.0, 5.0]])])  # ties inside the top 2
    _, hf_w, hf_i = _hf_router(4, 2)(logits)
    w, i = route(logits, 2)
    assert torch.equal(i, hf_i) and torch.equal(w, hf_w)
    assert i.dtype == torch.int64 and w.dtype == torch.float32


def test_route_ties_across_the_kth_place_take_the_lower_index():
    # torch.topk (transformers) leaves this order unspecified (CPU, 4 experts: the highest tied indices);
    # the source's rule is jax.lax.top_k's: the lower expert index wins, equally weighted.
    logits = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 0.0, 3.0, 3.0]])
    w, i = route(logits, 2)
    assert i.tolist() == [[0, 1], [0, 1], [0, 2]]
    assert torch.equal(w, torch.full((3, 2), 0.5))
    _, hf_w, hf_i = _hf_router(4, 2)(logits)
    assert torch.equal(hf_w, w) and hf_i.tolist() != i.tolist()  # the same weights on other, tied experts


# ---- (d) YaRN ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [{}, {"truncate": True}, {"attention_factor": 1.25, "beta_fast": 16.0}])
def test_yarn_matches_transformers(extra):
    cfg = GptOssConfig.from_pretrained(CKPT)
    rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096, **extra}
    hf_cfg = transformers.GptOssConfig(head_dim=16, hidden_size=64, num_attention_heads=4, rope_parameters=rope)
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    ours = _with_rope(cfg, rope)
    assert torch.equal(rope_inv_freq(ours), want_inv)
    assert rope_attention_factor(ours) == want_factor
    if not extra:  # the release's: 0.1 ln 32 + 1; every branch of the ramp is hit at head_dim 16
        assert want_factor == pytest.approx(0.1 * math.log(32) + 1)
        base = trope.inv_freq(trope.read_rope({"rope_theta": cfg.rope_theta}, 16))
        ratio = (rope_inv_freq(ours) / base).tolist()
        assert ratio[0] == 1.0 and ratio[-1] == pytest.approx(1 / 32) and any(1 / 32 < r < 1 for r in ratio)


def _with_rope(cfg: GptOssConfig, rope: dict) -> GptOssConfig:  # the checkpoint's config.json, another rope block
    d = json.loads((Path(CKPT) / "config.json").read_text())
    d.pop("rope_scaling"), d.pop("rope_theta")
    return GptOssConfig.from_hf({**d, "rope_parameters": dict(rope)})


# ---- (e) serving: the paged path vs transformers -------------------------------------------------------------

@pytest.fixture(scope="module")
def runner():
    return ModelRunner(CKPT, EngineConfig(block_size=4, num_blocks=32, max_model_len=64, max_num_batched_tokens=64))


@pytest.mark.parametrize("length", [1, 5, 19, 44])
def test_prefill_logits_match_transformers(hf_model, runner, length):
    ids = _ids(1, length, seed=length)
    with torch.no_grad():
        want = hf_model(ids).logits[0]
    got = runner.prefill_logits(ids[0].tolist())
    assert (got - want).abs().max().item() <= ATOL


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(3, 400, (12,), generator=g).tolist()
    return [prefix + torch.randint(3, 400, (7,), generator=g).tolist(), prefix[:10],
            torch.randint(3, 400, (5,), generator=g).tolist(), [400]]


@pytest.fixture(scope="module")
def hf_greedy(hf_model):
    eos = set(eos_token_ids(CKPT))
    conts = []
    for prompt in _prompts():
        ids = torch.tensor([prompt])
        gen = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        cont = gen[0, len(prompt):].tolist()
        conts.append(cont[:next((i + 1 for i, t in enumerate(cont) if t in eos), len(cont))])
    return conts


@pytest.mark.parametrize("mode,max_num_seqs,step_tokens,prefix", [("core", 1, 64, False), ("ragged", 4, 64, False),
                                                                  ("chunked", 4, 8, True)])
def test_engine_greedy_matches_transformers(hf_greedy, mode, max_num_seqs, step_tokens, prefix):
    config = EngineConfig(block_size=4, num_blocks=32, max_num_seqs=max_num_seqs, max_num_batched_tokens=step_tokens,
                          max_model_len=64, mode=mode, enable_prefix_caching=prefix)
    engine = LLMEngine(CKPT, config)
    outs = engine.generate(_prompts(), SamplingParams(temperature=0.0, max_tokens=12))
    assert [o.output_token_ids for o in outs] == hf_greedy
    assert sum(len(c) for c in hf_greedy) > 8 + 2 * 4  # continuations run past the window of 8
