"""The generic training checks run unchanged on the staged vision-language families (gemma3, paligemma,
llava_next, internvl). recorder/probes/training.py and grader/probes/training.py read a family through one
contract (docs/FAMILIES.md, "The contract the generic checks rely on"): `layer_inputs(config, mask, positions)`,
decoder layer 0 called as `layer(hidden, inputs)`, its attention as `attn(x, inputs)`, the language model's
norm, MLP and attention core, the family's RoPE operators and the config's family-neutral names. Here each
family's torch and JAX model come from its shipped checkpoint, the probes' own contexts are given what the
family's yaml will name, and the probes' own functions run: torch against JAX, on batches with a padded row.
Gemma 3 also gets a check of every layer, sliding and full, under token_type_ids' image blocks."""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np
import pytest
import torch

jax.config.update("jax_default_matmul_precision", "highest")

from catalog.family import language_model, model_class_name  # noqa: E402
from grader.probes import training as grader_probes  # noqa: E402
from recorder.probes import training as recorder_probes  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5  # of the output's scale (at least 1)

# What each family's yaml will say (configs/family/<name>.yaml): the model, the decoder the layer checks read, and
# the feature tags that pick the checks.
GEMMA = ["norm:rms", "pos:rope", "mlp:gated"]
FAMILIES = {
    "gemma3": {"model_prefix": "Gemma3", "language_model": {"module": "models/gemma3.py", "prefix": "Gemma3"},
               "features": [*GEMMA, "attn:sliding_window"]},
    "paligemma": {"model_prefix": "PaliGemma", "language_model": {"module": "models/paligemma.py", "prefix": "Gemma"},
                  "features": GEMMA},
    "llava_next": {"model_prefix": "LlavaNext", "language_model": {"module": "models/llama3.py", "prefix": "Llama"},
                   "features": GEMMA},
    "internvl": {"model_prefix": "InternVL", "language_model": {"module": "models/qwen2.py", "prefix": "Qwen2"},
                 "features": ["norm:rms", "pos:rope", "mlp:gated", "attn:qkv_bias"]},
}
for _name, _family in FAMILIES.items():
    _family.update(name=_name, model_module=f"models/{_name}.py", layers="model.language_model.layers",
                   attention="self_attn", model_class=f"{_family['model_prefix']}ForConditionalGeneration")

# the probes every family meets, then those its tags add (catalog/checks.py)
PROBES = ["rms_norm", "mlp", "activation", "attention_core", "attention_block", "decoder_layer"]
TAGGED = {"rope": "pos:rope", "attention_window": "attn:sliding_window"}


def _module(side: str, path: str):
    return importlib.import_module(f"{side}." + path[:-3].replace("/", "."))


def recorder_ctx(family: dict):
    """recorder.probes.training.Ctx as its __init__ leaves it for this family (the method's fields are not read
    by the layer probes)."""
    ctx = object.__new__(recorder_probes.Ctx)
    ctx.cfg = SimpleNamespace(family=SimpleNamespace(**family))
    ctx.family, ctx.prefix = _module("torch_sources", family["model_module"]), family["model_prefix"]
    ctx.model_class = getattr(ctx.family, model_class_name(family))
    ctx.ckpt = ROOT / "assets/checkpoints" / family["name"]
    ctx.model = ctx.model_class.from_pretrained(ctx.ckpt)
    ctx.config = ctx.model.config
    lm_module, ctx.lm_prefix = language_model(family)
    ctx.lm = _module("torch_sources", lm_module)
    ctx.lm_config = getattr(ctx.config, "text", ctx.config)
    ctx.features = frozenset(family["features"])
    return ctx


def grader_ctx(family: dict):
    """grader.probes.training.Ctx as its __init__ leaves it for this family's task meta."""
    ctx = object.__new__(grader_probes.Ctx)
    ctx.assets = {"checkpoint": str(ROOT / "assets/checkpoints" / family["name"])}
    ctx.prefix = family["model_prefix"]
    ctx.family = _module("jax_oracles", family["model_module"])
    ctx.model_class = getattr(ctx.family, model_class_name(family))
    lm_module, ctx.lm_prefix = language_model(family)
    ctx.lm = _module("jax_oracles", lm_module)
    ctx.conversion = importlib.import_module(f"conversion.{family['name']}")
    ctx.features = frozenset(family["features"])
    ctx.layers, ctx.attention = family["layers"], family["attention"]
    ctx._params = None
    return ctx


@functools.cache
def contexts_for(name: str):
    family = FAMILIES[name]
    return family, recorder_ctx(family), grader_ctx(family)


@pytest.fixture(params=list(FAMILIES))
def contexts(request):
    return contexts_for(request.param)


def _close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got.astype(np.float64) - want).max()
    assert err <= TOL * max(1.0, np.abs(want).max()), (what, err)


def test_generic_probes_agree(contexts):
    """Each layer probe as the recorder runs it on the torch source (inputs and reference outputs) and as the
    grader runs it on the JAX twin (the inputs only): every output within 1e-5. attention_block and decoder_layer
    run on a batch with a padded row (the probes' own)."""
    family, rec, grd = contexts
    names = PROBES + [p for p, tag in TAGGED.items() if tag in family["features"]]
    for name in names:
        with torch.no_grad():
            inputs, want = recorder_probes.PROBES[name](rec)
        got = grader_probes.PROBES[name](grd, inputs)
        assert set(got) == set(want), (name, set(got) ^ set(want))
        for key in want:
            _close(got[key], want[key], f"{family['name']} {name}.{key}")


def test_layer_inputs_default_positions(contexts):
    """Without position_ids, layer_inputs gives the positions the model's forward uses (0..T-1; PaliGemma's 1..T)
    on both sides, and the JAX layer on them equals the torch layer (decoder_layer's shapes: compiled already)."""
    family, rec, grd = contexts
    mask = np.array([[1] * 7, [1] * 5 + [0] * 2], np.int32)
    hidden = recorder_probes.rng_for("layer_inputs_default").standard_normal((2, 7, rec.config.hidden_size),
                                                                           np.float32)
    first = 1 if family["name"] == "paligemma" else 0
    positions = np.broadcast_to(np.arange(first, first + 7, dtype=np.int32), (2, 7)).copy()
    with torch.no_grad():
        want = rec.layer0()(torch.tensor(hidden), rec.family.layer_inputs(rec.config, torch.tensor(mask).long()))
        given = rec.layer0()(torch.tensor(hidden), rec.inputs(mask, positions))
    torch.testing.assert_close(want, given, rtol=0, atol=0)
    layer = grd.lm_cls("DecoderLayer")(grd.lm_config)
    got = layer.apply({"params": grd.layer0_params}, hidden, grd.family.layer_inputs(grd.config, mask))
    _close(got, want.numpy(), f"{family['name']} layer 0, default positions")


def test_gemma3_every_layer_reads_its_own_type():
    """Gemma 3's layer_inputs carries both layer types' masks and RoPE tables: each layer, sliding or full, picks its
    own, past the sliding window, with the image blocks of token_type_ids and a padded row; the forward is the layers
    over layer_inputs(..., token_type_ids=)."""
    from jax_oracles.models import gemma3 as jg
    from torch_sources.models import gemma3 as tg

    _, rec, grd = contexts_for("gemma3")
    c = rec.config
    T = 2 * c.sliding_window + 3
    assert set(c.text.layer_types) == {"sliding_attention", "full_attention"}
    mask = np.array([[1] * T, [1] * (T - 4) + [0] * 4], np.int32)
    types = np.zeros((2, T), np.int32)
    types[0, 2:2 + c.sliding_window + 2] = 1  # an image block longer than the window
    types[1, 5:9] = 1
    hidden = recorder_probes.rng_for("gemma3_layers").standard_normal((2, T, c.hidden_size), np.float32)
    t_inputs = tg.layer_inputs(c, torch.tensor(mask).long(), token_type_ids=torch.tensor(types).long())
    j_inputs = jg.layer_inputs(grd.config, mask, token_type_ids=types)
    assert set(t_inputs) == set(j_inputs) == set(c.text.layer_types)
    assert not torch.equal(t_inputs["sliding_attention"].mask, t_inputs["full_attention"].mask)
    assert not torch.equal(t_inputs["sliding_attention"].cos, t_inputs["full_attention"].cos)
    layers = rec.model.model.language_model.layers
    x = torch.tensor(hidden)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            want = layer(x, t_inputs)
            layer_j = jg.Gemma3DecoderLayer(grd.lm_config, layer_idx=i)
            got = jax.jit(layer_j.apply)({"params": grd.params["model"]["language_model"][f"layers_{i}"]}, hidden,
                                         j_inputs)
            _close(got, want.numpy(), f"gemma3 layer {i} ({c.text.layer_types[i]})")
            other_type = next(t for t in t_inputs if t != c.text.layer_types[i])
            other = {t: t_inputs[other_type] for t in t_inputs}  # the other type's mask and table for every type
            assert (layer(x, other) - want).abs().max() > 1e3 * TOL
        # the forward applies the image blocks through layer_inputs
        ids = torch.tensor(np.random.default_rng(0).integers(0, 400, (2, T)))
        h = rec.model.model.embed(ids)
        for layer in layers:
            h = layer(h, t_inputs)
        _, hidden_out = rec.model(ids, torch.tensor(mask).long(), token_type_ids=torch.tensor(types).long(),
                                  return_hidden=True)
    torch.testing.assert_close(hidden_out, rec.model.model.language_model.norm(h), rtol=0, atol=0)
