"""The `small` scale (tools/checkpoints_small.py, configs/scale/): every family's ~100M-parameter config is one
transformers accepts as the tiny one is, counts 70M-170M parameters, keeps the tiny layout's tensor kinds, and
`scale=small` composes to the small checkpoint and 512-token sequences while `scale=tiny` changes nothing.

The slow test writes each small checkpoint and holds the torch source's logits to transformers' on it
(`pytest -m slow tests/models/test_small_scale.py`; 3-16 s a family on 2 cores, about 90 s for all 11).
"""
import importlib
import importlib.util
import json
import re
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from catalog import scale as scale_mod
from catalog.tasks import compose_task

ROOT = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


small = _load("checkpoints_small")
FAMILIES = small.SMALL_FAMILIES
# config.json keys transformers 5 folds into others when it builds a config (rope_scaling / rope_theta ->
# rope_parameters, torch_dtype -> dtype) or rewrites (transformers_version): the tiny configs lose the same ones.
LLAMA3_ROPE_WARNING = "original_max_position_embeddings field must be less than max_position_embeddings"


def _transformers_dict(config: dict) -> tuple[dict, list[str]]:
    """transformers' to_dict() of the config built from `config`, and what it warned (log lines and warnings)."""
    import logging

    from transformers import AutoConfig

    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            obj = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    finally:
        logger.removeHandler(handler)
    built = obj.to_dict()
    if "text_config" in built:  # a vision-language config: transformers 5 nests the release's flat text keys
        built = {**built.pop("text_config"), **built}
    return built, records + [str(w.message) for w in caught]


def _lost(config: dict, built: dict) -> set[str]:
    return {k for k, v in config.items() if built.get(k, "<absent>") != v}


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_accepts_the_small_config_as_it_does_the_tiny_one(family):
    cfg, tiny = small.small_config(family), small.tiny_config(family)
    built, logged = _transformers_dict(cfg)
    tiny_built, tiny_logged = _transformers_dict(tiny)
    # every key the family reads survives as it does at tiny scale: the small widths, windows, experts, layer types
    assert _lost(cfg, built) == _lost(tiny, tiny_built), family
    for key in small.small_overrides(family):
        if key not in _lost(tiny, tiny_built):  # rope_scaling (in rope_parameters, below); qwen2's unused window
            assert built[key] == cfg[key], key
    if cfg.get("rope_scaling"):
        assert {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"]}.items() <= built["rope_parameters"].items()
    # nothing logged that the tiny config does not log, but for llama3: Llama 3.1's original_max_position_embeddings
    # (8192) is above the 2048 positions, as asked for; transformers warns and uses it (the frequencies are static)
    new = [m for m in logged if m not in tiny_logged]
    assert new == ([m for m in new if LLAMA3_ROPE_WARNING in m] if family.startswith("llama3") else []), new


@pytest.mark.parametrize("family", FAMILIES)
def test_small_widths_vocab_and_special_ids(family):
    cfg = small.text_keys(small.small_config(family))
    assert cfg["vocab_size"] == 32000
    assert 70e6 <= small.param_count(family) <= 170e6, small.param_count(family)
    gen = small._load(small.SOURCES[family][0])
    ids = [cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")]
    ids += [getattr(gen, small.SOURCES[family][2]).get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    flat = [i for x in ids if x is not None for i in (x if isinstance(x, list) else [x])]
    assert flat and max(flat) < cfg["vocab_size"]
    heads = cfg.get("num_attention_heads", cfg.get("n_head"))
    kv = cfg.get("num_key_value_heads", cfg.get("num_kv_heads", heads))
    assert heads % kv == 0
    tiny = small.text_keys(small.tiny_config(family))
    tiny_kv = tiny.get("num_key_value_heads", tiny.get("num_kv_heads"))
    if tiny_kv is not None and tiny_kv < tiny.get("num_attention_heads", 0):
        assert kv < heads, "grouped-query attention kept"
    for key in ("sliding_window",):
        if cfg.get(key) and cfg.get("use_sliding_window", True):
            assert cfg[key] < small.SMALL_SEQ_LEN, "512-token sequences cross the window"
    if family == "gpt_oss":  # MXFP4 groups of 32 along both experts' input dims
        assert cfg["hidden_size"] % 32 == 0 and cfg["intermediate_size"] % 32 == 0
        assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (8, 2)
    if family == "gemma4":
        assert cfg["layer_types"][-1] == "full_attention" and len(cfg["layer_types"]) == cfg["num_hidden_layers"]
    if family == "llama3":  # the exact config another benchmark runs
        assert {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                    "num_key_value_heads", "head_dim", "max_position_embeddings",
                                    "tie_word_embeddings")} == {
            "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
            "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 2048, "tie_word_embeddings": False}
        assert cfg["rope_scaling"]["original_max_position_embeddings"] == 8192


def read_header(path) -> dict:
    """A safetensors file's {name: {"dtype", "shape", ...}} (no torch import: this module stays fast)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    header.pop("__metadata__", None)
    return header


def _kinds(names) -> set[str]:
    return {re.sub(r"\.\d+\.", ".N.", n) for n in names}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_config_unchanged_and_shapes_match_the_generator(family):
    """The tiny config is the committed checkpoint's, before and after building the small one; the shape-only run
    of the generator gives the committed tiny checkpoint's exact names, shapes and dtypes; the small model has
    the same kinds of tensors (no bias, norm, sink or per-layer input lost)."""
    asset = ROOT / "assets" / "checkpoints" / family
    committed = json.loads((asset / "config.json").read_text())
    assert small.tiny_config(family) == committed
    small.small_config(family), small.small_shapes(family)
    assert small.tiny_config(family) == committed
    tiny_shapes = small.small_shapes(family, committed)
    stored = {n: (tuple(e["shape"]), e["dtype"]) for f in ("model.safetensors", "value_head.safetensors")
              if (asset / f).is_file() for n, e in read_header(asset / f).items()}
    dtype = {"float32": "F32", "uint8": "U8"}
    assert {n: (s, dtype[d]) for n, (s, d) in tiny_shapes.items()} == stored
    assert _kinds(small.small_shapes(family)) == _kinds(tiny_shapes)


def test_scale_small_composes_to_the_small_checkpoint_and_512_tokens(monkeypatch, tmp_path):
    monkeypatch.setenv("T2J_CACHE_DIR", str(tmp_path))
    base = tmp_path / "checkpoints" / "small"
    ppo = compose_task("qwen2-ppo", ["scale=small"])
    assert scale_mod.scale_name(ppo) == "small" and ppo.method.train.cutoff_len == 512
    assert Path(ppo.method.reward_model) == base / "llama3-reward" and Path(ppo.checkpoint) == base / "qwen2"
    assert Path(ppo.out_dir) == tmp_path / "references" / "small"
    for task, budget in (("llama3-core", 512), ("gemma4-chunked", 24)):
        served = compose_task(task, ["scale=small"])
        e = served.mode.engine
        assert (e.max_model_len, e.num_blocks, e.max_num_batched_tokens) == (512, 384, budget)
        assert "method" not in served
    given = compose_task("llama3-sft", ["scale=small", f"checkpoint={tmp_path / 'mine'}"])
    assert Path(given.checkpoint) == tmp_path / "mine"  # checkpoint=PATH still wins


def test_scale_tiny_is_the_default_and_changes_nothing():
    from catalog.provenance import hashed_config
    for task in ("llama3-ppo", "llama3-core"):
        default, tiny = compose_task(task), compose_task(task, ["scale=tiny"])
        assert default == tiny and "scale" not in default and default.checkpoint is None
        assert scale_mod.scale_name(default) == "tiny" and "scale" not in hashed_config(default)
        if task == "llama3-ppo":
            assert default.method.train.cutoff_len == 64
            assert default.method.reward_model == "assets/checkpoints/llama3-reward"
        else:
            e = default.mode.engine
            assert (e.max_model_len, e.num_blocks, e.max_num_batched_tokens) == (128, 64, 128)


def test_ensure_writes_only_the_scales_own_missing_directories(monkeypatch, tmp_path):
    monkeypatch.setenv("T2J_CACHE_DIR", str(tmp_path))
    calls = []
    fake = type("Tools", (), {"SMALL_FAMILIES": FAMILIES,
                              "ensure_small": staticmethod(lambda f, p, log=None: calls.append((f, p)) or p)})
    monkeypatch.setattr(scale_mod, "small_tools", lambda: fake)
    base = tmp_path / "checkpoints" / "small"
    scale_mod.ensure_scale_checkpoints(compose_task("llama3-ppo", ["scale=small"]))
    assert calls == [("llama3", base / "llama3"), ("llama3-reward", base / "llama3-reward")]
    calls.clear()
    (base / "llama3").mkdir(parents=True)
    (base / "llama3" / "config.json").write_text("{}")
    scale_mod.ensure_scale_checkpoints(compose_task("llama3-sft", ["scale=small"]))
    scale_mod.ensure_scale_checkpoints(compose_task("llama3-sft"))  # tiny
    scale_mod.ensure_scale_checkpoints(compose_task("llama3-sft", ["scale=small", f"checkpoint={tmp_path / 'x'}"]))
    assert calls == []


def test_interrupted_write_leaves_no_checkpoint(monkeypatch, tmp_path):
    mod = _load("checkpoints_small")

    def half(family, out_dir, dtype="float32"):
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(mod, "make_small", half)
    with pytest.raises(KeyboardInterrupt):
        mod.ensure_small("llama3", tmp_path / "llama3", log=lambda m: None)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(mod, "make_small", lambda family, out_dir, dtype="float32": (Path(out_dir) / "config.json")
                        .write_text("{}"))
    assert mod.ensure_small("llama3", tmp_path / "llama3", log=lambda m: None) == tmp_path / "llama3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama3"]
    monkeypatch.setattr(mod, "make_small", half)
    assert mod.ensure_small("llama3", tmp_path / "llama3", log=lambda m: None) == tmp_path / "llama3"  # there: kept


def test_cli_rejects_an_unknown_family():
    tools = _load("make_checkpoints")
    with pytest.raises(SystemExit):
        tools.main(["--scale", "small", "--family", "llama2"])


# ---- slow: the written checkpoints against transformers ---------------------------------------------------------

TORCH_CLASSES = {"llama3": "llama3.LlamaForCausalLM", "llama3-reward": "llama3.LlamaForCausalLM",
                 "gemma4": "gemma4.Gemma4ForCausalLM", "bloom": "bloom.BloomForCausalLM",
                 "falcon": "falcon.FalconForCausalLM", "mistral": "mistral.MistralForCausalLM",
                 "qwen2": "qwen2.Qwen2ForCausalLM", "qwen3": "qwen3.Qwen3ForCausalLM", "phi4": "phi4.Phi3ForCausalLM",
                 "starcoder2": "starcoder2.Starcoder2ForCausalLM", "gpt_oss": "gpt_oss.GptOssForCausalLM",
                 "qwen2_vl": "qwen2_vl.Qwen2VLForConditionalGeneration",
                 "qwen3_vl": "qwen3_vl.Qwen3VLForConditionalGeneration",
                 "qwen2_omni": "qwen2_omni.Qwen2OmniThinkerForConditionalGeneration",
                 "qwen2_5_vl": "qwen2_5_vl.Qwen2_5VLForConditionalGeneration",
                 "gemma3": "gemma3.Gemma3ForConditionalGeneration",
                 "paligemma": "paligemma.PaliGemmaForConditionalGeneration",
                 "llava_next": "llava_next.LlavaNextForConditionalGeneration",
                 "internvl": "internvl.InternVLForConditionalGeneration"}
SEQ = 300  # past every sliding window (128, 256)
VL_FAMILIES = ("qwen2_vl", "qwen3_vl", "qwen2_omni", "qwen2_5_vl", "gemma3", "paligemma", "llava_next", "internvl")  # transformers loads them as image-text-to-text models (text-only logits here)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_small_checkpoint_loads_in_the_torch_source_and_transformers_alike(family, tmp_path):
    import torch
    import transformers

    from torch_sources.models.loading import tensor_index

    torch.manual_seed(0)
    started = time.perf_counter()
    ckpt = small.make_small(family, tmp_path / family)
    made = time.perf_counter() - started
    stored = {n: tuple(e["shape"]) for n, (_, e) in tensor_index(ckpt).items()}
    assert stored == {n: s for n, (s, _) in small.small_shapes(family).items() if not n.startswith("v_head.")}
    assert len({f for f, _ in tensor_index(ckpt).values()}) > 1  # sharded, with an index
    if family == "llama3-reward":
        assert (ckpt / "value_head.safetensors").is_file()

    module, cls = TORCH_CLASSES[family].split(".")
    ours = getattr(importlib.import_module(f"torch_sources.models.{module}"), cls).from_pretrained(ckpt)
    if family != "gpt_oss":  # MXFP4: the source holds the experts as stored (blocks + scales)
        value_head = 768 + 1 if family == "llama3-reward" else 0  # not part of the causal LM
        held = sum(p.numel() for p in ours.parameters()) + sum(  # gemma4's layer_scalar: a buffer, as in HF
            b.numel() for n, b in ours.named_buffers() if n.endswith("layer_scalar"))
        assert held == small.param_count(family) - value_head
    extra = {"experts_implementation": "eager", "quantization_config": transformers.Mxfp4Config(dequantize=True)} \
        if family == "gpt_oss" else {}
    auto = (transformers.Qwen2_5OmniThinkerForConditionalGeneration if family == "qwen2_omni"
            else transformers.AutoModelForImageTextToText if family in VL_FAMILIES else transformers.AutoModelForCausalLM)
    hf = auto.from_pretrained(ckpt, attn_implementation="eager", dtype=torch.float32, **extra).eval()
    ids = torch.randint(0, small.SMALL_VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours(ids)
        a = (a.logits if hasattr(a, "logits") else a).float()
        b = hf(input_ids=ids).logits.float()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    print(f"\n{family}: {small.param_count(family) / 1e6:.1f}M, written in {made:.1f} s, max |logit| {scale:.2f}, "
          f"max diff {diff:.2e}, total {time.perf_counter() - started:.1f} s")
    assert np.isfinite(scale) and diff <= 1e-4 * max(scale, 1.0), (diff, scale)
