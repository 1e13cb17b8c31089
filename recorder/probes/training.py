"""Record every check of the training class (levels L0-L6) from the pure-PyTorch sources.

Each probe draws its inputs from numpy (seeded by the check name, so the inputs never depend on
torch's RNG), runs the torch source on them in fp32 and returns a CheckRecord. The JAX twin of
this file is grader/probes/training.py, which gets only the inputs.
"""
from __future__ import annotations

import ast
import gc
import hashlib
import importlib
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from catalog.checks import checks_for
from catalog.h5schema import CheckRecord
from catalog.heldout import eval_loss
from catalog.layout import layout_arrays
from catalog.provenance import ROOT, checkpoint_dir
from catalog.family import language_model, mirrored_modules, model_class_name
from catalog.workloads import (FIXED_STEPS_OPTIONS, collate_outputs, data_fields, fixed_step_runs, layer_positions,
                               tied_checkpoint)
from recorder.probes import run_probes
from torch_sources.models.loading import tensor_index

# modules whose public names a candidate must mirror (relative to torch_sources/ and jax_oracles/); the
# method's workflow (training/<method>.py) is added per task
TRAINING_MODULES = ("training/template.py", "training/processor.py", "training/collator.py",
                    "training/lora.py", "training/optimizer.py", "training/loss.py", "training/sft.py")


_FRESH_SEED: list[int | None] = [None]  # set by the recorder per recording (fresh=SEED), else None


def set_fresh_seed(seed: int | None) -> None:
    """Draw every probe's inputs from `seed` as well as the check's name (the grader's fresh pass records the same
    checks on inputs no frozen reference holds); None: the frozen draws."""
    _FRESH_SEED[0] = None if seed is None else int(seed)


def rng_for(name: str) -> np.random.Generator:
    if _FRESH_SEED[0] is not None:
        name = f"fresh-{_FRESH_SEED[0]}/{name}"
    return np.random.default_rng(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))


def public_names(path: Path) -> list[str]:
    """`__all__` of a source file, read statically."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise ValueError(f"{path} declares no __all__")


def _module(path: str):
    return importlib.import_module("torch_sources." + path[:-3].replace("/", "."))


class Ctx:
    """What the probes share: the config, the torch family module, the loaded model, the method's
    workflow and args, and (lazily, once) the end-to-end run of the task's seed. `lm`, `lm_prefix` and
    `lm_config`: the decoder the layer checks read (a vision-language family's text family and text config; a
    text family's own)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.family = _module(cfg.family.model_module)
        self.prefix = cfg.family.model_prefix
        self.model_class = getattr(self.family, model_class_name(cfg.family))
        self.ckpt = checkpoint_dir(cfg)  # checkpoint=PATH, else the family's
        self.model = self.model_class.from_pretrained(self.ckpt)
        self.config = self.model.config
        lm_module, self.lm_prefix = language_model(cfg.family)
        self.lm = _module(lm_module)
        self.lm_config = getattr(self.config, "text", self.config)
        self.method = cfg.method.name  # configs/method/<name>.yaml registers its workflow, args, entry and probes
        missing = [k for k in ("workflow", "args", "entry") if not cfg.method.get(k)]
        if missing:
            raise ValueError(f"configs/method/{self.method}.yaml names no {', '.join(missing)}")
        self.sft = importlib.import_module("torch_sources.training.sft")
        self.lora = importlib.import_module("torch_sources.training.lora")
        self.workflow = importlib.import_module(f"torch_sources.{cfg.method.workflow}")
        self.entry = cfg.method.entry
        self.args = getattr(self.workflow, cfg.method.args)(**dict(cfg.method.train), template=cfg.family.template)
        self.features = frozenset(cfg.family.features)
        self.result, self.band, self.l6_attrs, self.wall = None, None, {}, None

    def layer0(self, model=None):
        """Decoder layer 0 of the model (the family yaml's `layers` path)."""
        return (model or self.model).get_submodule(f"{self.cfg.family.layers}.0")

    def inputs(self, attention_mask, position_ids=None):
        """The family's LayerInputs (mask and position encoding) for int arrays."""
        return self.family.layer_inputs(self.config, t(attention_mask).long(),
                                        None if position_ids is None else t(position_ids).long())

    def cls(self, suffix):
        return getattr(self.family, f"{self.prefix}{suffix}")

    def lm_cls(self, suffix):
        return getattr(self.lm, f"{self.lm_prefix}{suffix}")

    @property
    def rope_index(self):
        """The model's rope_index (M-RoPE families: LF's collator asks the model for positions), else None; from an
        empty instance on the meta device, so that no probe holds a second model for it."""
        if not hasattr(self.model_class, "rope_index"):
            return None
        with torch.device("meta"):
            return self.model_class(self.config).rope_index

    def collator(self, **options):
        """The training collator of the task (sft.make_collator: its tokenizer's pad id; a vision-language
        template's loads the rows' images from the data dir and takes the model's rope index)."""
        return self.sft.make_collator(self.args, ROOT / self.cfg.family.tokenizer, data_dir=ROOT / self.cfg.data.dir,
                                      rope_index=self.rope_index, **options)

    def train(self, seed: int):
        """The method's own entry point from the raw dataset, with the given seed (PPO: and its reward model)."""
        paths = [self.ckpt, ROOT / self.cfg.family.tokenizer, ROOT / self.cfg.data.dir]
        if "reward_model" in self.cfg.method:
            paths.append(ROOT / self.cfg.method.reward_model)
        return getattr(self.workflow, self.entry)(*paths, replace(self.args, seed=seed))

    def run(self):
        """The end-to-end run of the task's seed (once; every L5/L6 probe reads it)."""
        if self.result is None:
            self.result = self.train(self.args.seed)
            self.wall = self.result.wall_clock_s
        return self.result


def t(x):
    return torch.from_numpy(np.asarray(x))


def n(x):
    return x.detach().cpu().numpy()


# ---- L0 spec -----------------------------------------------------------------------------------

def probe_layout(ctx):
    mods = [*mirrored_modules(ctx.cfg.family), *dict.fromkeys((*TRAINING_MODULES, f"training/{ctx.method}.py"))]
    names = [f"{m}:{name}" for m in mods for name in public_names(ROOT / "torch_sources" / m)]
    return {"names": np.array(names)}, {"missing": np.array(0)}


def checkpoint_layout(ckpt) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of every checkpoint tensor: a converted tree must come from each exactly once."""
    return {name: tuple(e["shape"]) for name, (_, e) in tensor_index(ckpt).items()}  # the headers: no tensor read


def probe_param_tree(ctx):
    return {}, layout_arrays(checkpoint_layout(ctx.ckpt))


def probe_lora_trainable(ctx):
    lora = importlib.import_module("torch_sources.training.lora")
    with torch.device("meta"):  # names and shapes only: a release-sized model is not loaded twice
        model = ctx.model_class(ctx.config)
    lora.inject_lora(model, ctx.sft.lora_config(ctx.args), seed=0)
    sd = lora.lora_state_dict(model)
    trainable = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    assert len(trainable) == len(sd), "every trainable parameter is a LoRA matrix"
    names = sorted(sd)
    return {}, {"names": np.array(names), "shapes": np.array([sd[k].shape for k in names], np.int64)}


# ---- L1 operators ------------------------------------------------------------------------------

def probe_rms_norm(ctx):
    r = rng_for("rms_norm")
    x = r.standard_normal((2, 5, ctx.config.hidden_size), np.float32) * 3
    w = (1 + 0.1 * r.standard_normal(ctx.config.hidden_size)).astype(np.float32)
    return {"x": x, "weight": w}, {"y": n(ctx.lm.rms_norm(t(x), t(w), ctx.config.norm_eps))}


def probe_layer_norm(ctx):
    r = rng_for("layer_norm")
    x = (r.standard_normal((2, 5, ctx.config.hidden_size), np.float32) * 3 + 1.5).astype(np.float32)
    w = (1 + 0.1 * r.standard_normal(ctx.config.hidden_size)).astype(np.float32)
    b = (0.1 * r.standard_normal(ctx.config.hidden_size)).astype(np.float32)
    return {"x": x, "weight": w, "bias": b}, {"y": n(ctx.family.layer_norm(t(x), t(w), t(b), ctx.config.norm_eps))}


def unscaled_config_json(ckpt) -> str:
    """The checkpoint's config.json as transformers>=5 writes an unscaled one (rope_parameters with the
    default rope, a single eos id): the config parsing and inverse frequencies the checkpoint never takes."""
    d = json.loads((Path(ckpt) / "config.json").read_text())
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
    d.pop("rope_scaling", None)
    d["eos_token_id"] = int(np.ravel(d["eos_token_id"])[0])
    return json.dumps(d)


def probe_rope(ctx):
    """The family's inverse frequencies (its rotary dim: partial rotary rotates fewer channels), cos/sin and
    the rotation of whole heads; for llama3-scaled rope also the unscaled config form it never takes."""
    r = rng_for("rope")
    hd = ctx.config.head_dim
    pos = np.stack([np.arange(9), np.arange(9) + 57]).astype(np.int32)  # past original_max too
    x = r.standard_normal((2, 9, ctx.config.num_attention_heads, hd), np.float32)
    inv = ctx.family.rope_inv_freq(ctx.config)
    cos, sin = ctx.family.rope_cos_sin(inv, t(pos))
    inputs = {"position_ids": pos, "x": x}
    outputs = {"inv_freq": n(inv), "cos": n(cos), "sin": n(sin), "x_rot": n(ctx.family.apply_rope(t(x), cos, sin))}
    if "rope:llama3" in ctx.features:
        config = unscaled_config_json(ctx.ckpt)
        inputs["unscaled_config"] = np.array(config)
        outputs["inv_freq_unscaled"] = n(ctx.family.rope_inv_freq(ctx.cls("Config").from_hf(json.loads(config))))
    return inputs, outputs


ALIBI_HEAD_COUNTS = (4, 6, 12, 20)  # powers of two and not: the extra slopes come from 2p's base


def probe_alibi(ctx):
    """ALiBi slopes for several head counts, and the bias of a left- and a right-padded mask."""
    am = np.array([[1] * 7, [1] * 4 + [0] * 3, [0] * 2 + [1] * 5], np.int32)
    slopes = ctx.family.alibi_slopes(ctx.config.num_attention_heads)
    outputs = {f"slopes_{h}": n(ctx.family.alibi_slopes(h)) for h in ALIBI_HEAD_COUNTS}
    outputs["bias"] = n(ctx.family.alibi_bias(slopes, t(am).long()))
    return {"attention_mask": am, "head_counts": np.array(ALIBI_HEAD_COUNTS, np.int64)}, outputs


def probe_mlp(ctx):
    x = rng_for("mlp").standard_normal((2, 5, ctx.config.hidden_size), np.float32)
    return {"x": x}, {"y": n(ctx.layer0().mlp(t(x)))}


ACTIVATION_GRID = {"core": np.linspace(-3, 4, 57, dtype=np.float32), "tail": np.linspace(-8, -3, 41, dtype=np.float32)}


def probe_activation(ctx):
    """The MLP's activation on a grid: the core, and the negative tail where the GELU variants part."""
    act = ctx.layer0().mlp.act
    return ({f"x_{k}": x for k, x in ACTIVATION_GRID.items()},
            {f"y_{k}": n(act(t(x))) for k, x in ACTIVATION_GRID.items()})


def _attention_case(ctx, name, T=9):
    r = rng_for(name)
    am = np.array([[1] * T, [1] * (T - 3) + [0] * 3], np.int32)
    return r, am, layer_positions(ctx.features, np.broadcast_to(np.arange(T, dtype=np.int32), (2, T)).copy())


def probe_attention_block(ctx):
    """Layer 0's whole attention module (its projections, fused or not, biases, q/k norms, position
    encoding and core) on random hidden states with a padded row."""
    r, am, pos = _attention_case(ctx, "attention_block")
    x = r.standard_normal((2, 9, ctx.config.hidden_size), np.float32)
    attn = getattr(ctx.layer0(), ctx.cfg.family.attention)
    return {"x": x, "attention_mask": am, "position_ids": pos}, {"out": n(attn(t(x), ctx.inputs(am, pos)))}


def probe_qkv_split(ctx):
    """A fused projection's output split into q, k, v heads the family's way (interleaved, grouped, blocks)."""
    c = ctx.config
    width = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    fused = rng_for("qkv_split").standard_normal((2, 5, width), np.float32)
    q, k, v = ctx.family.split_qkv(c, t(fused))
    return {"fused": fused}, {"q": n(q), "k": n(k), "v": n(v)}


def probe_attention_window(ctx):
    """The sliding-window mask on a sequence twice the window, padded, and eager attention under it."""
    c = ctx.config
    T = 2 * c.sliding_window + 3
    r = rng_for("attention_window")
    am = np.array([[1] * T, [1] * (T - 4) + [0] * 4], np.int32)
    q = r.standard_normal((2, T, c.num_attention_heads, c.head_dim), np.float32)
    k = r.standard_normal((2, T, c.num_key_value_heads, c.head_dim), np.float32)
    v = r.standard_normal((2, T, c.num_key_value_heads, c.head_dim), np.float32)
    mask = ctx.family.causal_mask(t(am), c.sliding_window)
    out = ctx.family.eager_attention(t(q), t(k), t(v), mask, c.head_dim ** -0.5)
    return {"q": q, "k": k, "v": v, "attention_mask": am, "sliding_window": np.int64(c.sliding_window)}, {
        "mask": n(mask).astype(np.int8), "out": n(out)}


def probe_attention_core(ctx):
    r, c = rng_for("attention_core"), ctx.lm_config
    q = r.standard_normal((2, 6, c.num_attention_heads, c.head_dim), np.float32)
    k = r.standard_normal((2, 6, c.num_key_value_heads, c.head_dim), np.float32)
    v = r.standard_normal((2, 6, c.num_key_value_heads, c.head_dim), np.float32)
    am = np.array([[1] * 6, [1] * 4 + [0] * 2], np.int32)
    out = ctx.lm.eager_attention(t(q), t(k), t(v), ctx.lm.causal_mask(t(am)), c.head_dim ** -0.5)
    return {"q": q, "k": k, "v": v, "attention_mask": am}, {"out": n(out)}


def probe_lora_linear(ctx):
    lora = importlib.import_module("torch_sources.training.lora")
    r = rng_for("lora_linear")
    x = r.standard_normal((2, 5, 64), np.float32)
    w = r.standard_normal((32, 64), np.float32) * 0.1
    a = r.standard_normal((8, 64), np.float32) * 0.1
    b = r.standard_normal((32, 8), np.float32) * 0.1
    bias = r.standard_normal(32, np.float32) * 0.1
    y = lora.lora_linear(t(x), t(w), None, t(a), t(b), 2.0)
    # the biased projection (attention_bias/mlp_bias configs) as the function and as the wrapped layer
    base = torch.nn.Linear(64, 32, bias=True)
    layer = lora.LoraLinear(base, r=8, lora_alpha=16)
    with torch.no_grad():
        for param, value in ((base.weight, w), (base.bias, bias), (layer.lora_A.weight, a), (layer.lora_B.weight, b)):
            param.copy_(t(value))
    return ({"x": x, "weight": w, "bias": bias, "lora_A": a, "lora_B": b, "scaling": np.float32(2.0)},
            {"y": n(y), "y_bias": n(lora.lora_linear(t(x), t(w), t(bias), t(a), t(b), 2.0)), "y_layer": n(layer(t(x)))})


def _processed(ctx, **options):
    from dataclasses import replace
    return ctx.sft.load_processed_dataset(ROOT / ctx.cfg.family.tokenizer, ROOT / ctx.cfg.data.dir,
                                          "train", replace(ctx.args, **options))


def probe_data_tokens(ctx):
    fields = data_fields(lambda **o: _processed(ctx, **o), "input_ids", ctx.args.cutoff_len + 1, -1)
    return {}, {**fields, "n": np.array(len(_processed(ctx)))}


def probe_data_labels(ctx):
    return {}, data_fields(lambda **o: _processed(ctx, **o), "labels", ctx.args.cutoff_len + 1, -7)


def probe_collate(ctx):
    ds = _processed(ctx)
    return {}, collate_outputs(ctx.features, ctx.collator(), ds, n)


# ---- L2 / L3 -----------------------------------------------------------------------------------

def probe_decoder_layer(ctx):
    r, c = rng_for("decoder_layer"), ctx.config
    hidden = r.standard_normal((2, 7, c.hidden_size), np.float32)
    am = np.array([[1] * 7, [1] * 5 + [0] * 2], np.int32)
    pos = layer_positions(ctx.features, np.broadcast_to(np.arange(7, dtype=np.int32), (2, 7)).copy())
    out = ctx.layer0()(t(hidden), ctx.inputs(am, pos))
    return {"hidden": hidden, "attention_mask": am, "position_ids": pos}, {"out": n(out)}


LOGIT_SHAPES = {"logits_b2_t16_pad": (2, 16, [16, 11]),
                "logits_b3_t33_pad": (3, 33, [33, 20, 5])}


def _logits_case(ctx, name):
    b, T, lens = LOGIT_SHAPES[name]
    ids = rng_for(name).integers(0, ctx.config.vocab_size, (b, T)).astype(np.int32)
    am = (np.arange(T)[None] < np.array(lens)[:, None]).astype(np.int32)
    return ids, am


def _logits_probe(name):
    def probe(ctx):
        ids, am = _logits_case(ctx, name)
        return {"input_ids": ids, "attention_mask": am}, {"logits": n(ctx.model(t(ids).long(), t(am)))}
    return probe


def probe_logits_unmasked(ctx):
    """One unpadded row, no attention mask (the forward's default); an untied checkpoint also through its tied
    twin (a tied release is already that path)."""
    import tempfile

    ids = rng_for("logits_b1_t7").integers(0, ctx.config.vocab_size, (1, 7)).astype(np.int32)
    outputs = {"logits": n(ctx.model(t(ids).long()))}
    if not ctx.config.tie_word_embeddings:
        with tempfile.TemporaryDirectory() as tmp:
            tied = ctx.model_class.from_pretrained(tied_checkpoint(ctx.ckpt, Path(tmp)))
        outputs["logits_tied"] = n(tied(t(ids).long()))
    return {"input_ids": ids}, outputs


def probe_next_token_dist(ctx):
    ids, am = _logits_case(ctx, "logits_b3_t33_pad")
    return {"input_ids": ids, "attention_mask": am}, {"logits": n(ctx.model(t(ids).long(), t(am)))}


PROBES = {
    "layout": probe_layout, "param_tree": probe_param_tree, "lora_trainable": probe_lora_trainable,
    "rms_norm": probe_rms_norm, "layer_norm": probe_layer_norm, "rope": probe_rope, "alibi": probe_alibi,
    "mlp": probe_mlp, "activation": probe_activation, "attention_core": probe_attention_core, "attention_block": probe_attention_block,
    "qkv_split": probe_qkv_split, "attention_window": probe_attention_window,
    "lora_linear": probe_lora_linear, "data_tokens": probe_data_tokens, "data_labels": probe_data_labels,
    "collate": probe_collate, "decoder_layer": probe_decoder_layer,
    "logits_b1_t7": probe_logits_unmasked, **{name: _logits_probe(name) for name in LOGIT_SHAPES},
    "next_token_dist": probe_next_token_dist,
}


# ---- L4 ----------------------------------------------------------------------------------------

def _step_batches(ctx, steps: int, **options):
    """The first `steps` accumulation steps of epoch 0, collated exactly as the training run does (under
    `options`, TrainArgs overrides of the data, when given)."""
    ds, collate = _processed(ctx, **options), ctx.collator()
    idx = ctx.sft.step_example_indices(len(ds), ctx.args, 0)[:steps]
    return [[{k: n(v) if torch.is_tensor(v) else np.asarray(v) for k, v in collate([ds[i] for i in mb]).items()}
             for mb in step] for step in idx]


# what a collated batch hands the model, and its dtype on record (a vision-language batch: M-RoPE positions, pixels
# and grids besides the ids; its rope deltas are for decoding only)
BATCH_FIELDS = {"input_ids": np.int32, "attention_mask": np.int32, "labels": np.int32, "position_ids": np.int32,
                "pixel_values": np.float32, "image_grid_thw": np.int64, "input_features": np.float32,
                "feature_attention_mask": np.int64, "token_type_ids": np.int32, "image_sizes": np.int64}


def batch_arrays(batch: dict) -> dict[str, np.ndarray]:
    """A collated batch's model inputs as recorded arrays."""
    return {k: np.asarray(n(batch[k]) if torch.is_tensor(batch[k]) else batch[k]).astype(dtype)
            for k, dtype in BATCH_FIELDS.items() if k in batch}


def _flatten_steps(steps):
    return {f"s{i}.m{j}.{k}": v for i, step in enumerate(steps) for j, mb in enumerate(step)
            for k, v in batch_arrays(mb).items()}


def _lora_init(ctx):
    lora = importlib.import_module("torch_sources.training.lora")
    model = ctx.sft.load_model(ctx.ckpt, ctx.sft.lora_config(ctx.args), ctx.args.seed)
    return lora.lora_state_dict(model)


def probe_loss_step0(ctx):
    steps = _step_batches(ctx, 1)
    init = _lora_init(ctx)
    model = ctx.sft.load_model(ctx.ckpt, ctx.sft.lora_config(ctx.args), ctx.args.seed)
    loss, grads = ctx.sft.sft_step_loss_and_grads(model, init, [
        {k: torch.from_numpy(v) for k, v in mb.items()} for mb in steps[0]])
    ctx.step0_grads = grads
    inputs = {**_flatten_steps(steps), **{f"lora.{k}": v for k, v in init.items()}}
    return inputs, {"loss": np.float32(loss)}


def probe_loss_step0_train_on_prompt(ctx):
    """loss_step0 on the train_on_prompt rows, whose first position is labelled: the one place the two ways of
    counting num_items_in_batch (every labelled position, or the shifted labels) differ."""
    steps = _step_batches(ctx, 1, train_on_prompt=True)
    init = _lora_init(ctx)
    model = ctx.sft.load_model(ctx.ckpt, ctx.sft.lora_config(ctx.args), ctx.args.seed)
    loss, _ = ctx.sft.sft_step_loss_and_grads(model, init, [
        {k: torch.from_numpy(v) for k, v in mb.items()} for mb in steps[0]])
    return {**_flatten_steps(steps), **{f"lora.{k}": v for k, v in init.items()}}, {"loss": np.float32(loss)}


def probe_lora_grads_step0(ctx):
    inputs, _ = probe_loss_step0(ctx)
    return inputs, {k: np.asarray(v, np.float32) for k, v in ctx.step0_grads.items()}


def probe_fixed_steps(ctx):
    """k steps under the task's optimizer args, and again under FIXED_STEPS_VARIANT (grader/probes/training.py):
    weight decay on (the task's is 0.0, so a decay left at torch's default would hide) and the linear schedule."""
    steps = _step_batches(ctx, int(ctx.cfg.method.fixed_steps))
    init = _lora_init(ctx)
    if getattr(ctx, "fixed", None) is None:
        batches = [[{k: torch.from_numpy(v) for k, v in mb.items()} for mb in step] for step in steps]
        ctx.fixed = fixed_step_runs(lambda args: ctx.sft.train_steps(ctx.ckpt, init, batches, args), ctx.args,
                                    FIXED_STEPS_OPTIONS)
    return {**_flatten_steps(steps), **{f"lora.{k}": v for k, v in init.items()}}, ctx.fixed


def probe_fixed_steps_loss(ctx):
    inputs, (losses, _) = probe_fixed_steps(ctx)
    return inputs, losses


def probe_fixed_steps_params(ctx):
    inputs, (_, final) = probe_fixed_steps(ctx)
    return inputs, final


# ---- L5 / L6 -----------------------------------------------------------------------------------

def probe_e2e_step_losses(ctx):
    return {"seed": np.int64(ctx.args.seed)}, {"step_losses": np.asarray(ctx.run().step_losses, np.float32)}


def probe_e2e_eval_loss(ctx):
    return {"seed": np.int64(ctx.args.seed)}, {"before": np.float32(ctx.run().eval_loss_before),
                                               "after": np.float32(ctx.run().eval_loss_after)}


def probe_e2e_adapter(ctx):
    return {"seed": np.int64(ctx.args.seed)}, {k: np.asarray(v, np.float32)
                                               for k, v in ctx.run().lora_state_dict.items()}


def _heldout_batches(ctx, rope_index=None) -> list[dict[str, np.ndarray]]:
    """The eval split in order, in batches of per_device_eval_batch_size, padded as the source's
    evaluation pads them (sft._evaluate: the collator with pad id 0, to a multiple of 8; a vision-language task's
    also loads the rows' images, LF's fake image for a batch without one, and gives the model's M-RoPE positions
    from its rope_index)."""
    held_out = ctx.sft.load_processed_dataset(ROOT / ctx.cfg.family.tokenizer, ROOT / ctx.cfg.data.dir, "eval",
                                              ctx.args)
    mm = ctx.sft.multimodal_context(ctx.args, ROOT / ctx.cfg.family.tokenizer, ROOT / ctx.cfg.data.dir, rope_index)
    collate = ctx.sft.make_collator(ctx.args) if mm is None else \
        importlib.import_module("torch_sources.training.collator").SFTDataCollator(pad_token_id=0, mm=mm)
    size = ctx.args.per_device_eval_batch_size
    return [batch_arrays(collate(held_out[s:s + size])) for s in range(0, len(held_out), size)]


def _adapted_model(ctx, adapter: dict):
    lora = importlib.import_module("torch_sources.training.lora")
    model = ctx.sft.load_model(ctx.ckpt, ctx.sft.lora_config(ctx.args), ctx.args.seed)
    lora.load_lora_state_dict(model, adapter)
    return model


@torch.no_grad()
def _heldout_logits(ctx, model, batches) -> list[np.ndarray]:
    return [n(model(t(b["input_ids"]).long(), t(b["attention_mask"]).long(), **ctx.sft.model_inputs(b)))
            for b in batches]


def probe_heldout_loss(ctx):
    """Inputs: the held-out batches (the grader keeps the labels and computes the loss from the
    candidate's logits, catalog/heldout.py). Output: the source's eval loss of the seed run; the band
    is the spread of the seed-varied runs."""

    losses = [ctx.run().eval_loss_after if s == ctx.args.seed else ctx.train(s).eval_loss_after
              for s in ctx.cfg.method.band_seeds]
    ctx.band = (float(min(losses)), float(max(losses)))
    model = _adapted_model(ctx, ctx.result.lora_state_dict)
    batches = _heldout_batches(ctx, getattr(model, "rope_index", None))
    # the grader's loss on the source's own logits must be the source's eval_loss: same batches, same rule
    ours = eval_loss(_heldout_logits(ctx, model, batches), [b["labels"] for b in batches],
                     ctx.args.per_device_eval_batch_size)
    if not abs(ours - ctx.result.eval_loss_after) <= 1e-5 * abs(ctx.result.eval_loss_after):
        raise RuntimeError(f"catalog/heldout.py gives {ours!r} on the recorded held-out batches, "
                           f"the source's evaluation {ctx.result.eval_loss_after!r}")
    inputs = {f"b{i}.{k}": v for i, b in enumerate(batches) for k, v in b.items()}
    inputs["eval_batch_size"] = np.int64(ctx.args.per_device_eval_batch_size)
    # the reference output is the source's held-out loss alone: the band travels in /L6/band
    ctx.l6_attrs["heldout_loss"] = {"loss_before": float(ctx.result.eval_loss_before),
                                    "band_losses": [float(x) for x in ctx.band]}
    return inputs, {"loss": np.float32(ctx.result.eval_loss_after)}


PROBES.update({
    "loss_step0": probe_loss_step0, "lora_grads_step0": probe_lora_grads_step0,
    "loss_step0_train_on_prompt": probe_loss_step0_train_on_prompt,
    "fixed_steps_loss": probe_fixed_steps_loss, "fixed_steps_params": probe_fixed_steps_params,
    "e2e_step_losses": probe_e2e_step_losses, "e2e_adapter": probe_e2e_adapter,
    "e2e_eval_loss": probe_e2e_eval_loss, "heldout_loss": probe_heldout_loss,
})


def record_task(cfg, dev, console):
    """-> (records, L6 band, wall-clock of the end-to-end torch training run)."""
    ctx = Ctx(cfg)
    spec, checks = checks_for("training", ctx.method, ctx.features)
    extra = cfg.method.get("probes")  # the method's own probe module beside this one, found by name
    vision = importlib.import_module("recorder.probes.training_vision").PROBES  # picked by feature tags
    probes = {**PROBES, **vision, **(importlib.import_module(f"recorder.probes.{extra}").PROBES if extra else {})}
    specs = [s for s in spec + checks if s.name != "torch_free"]
    shared = [s for s in specs if s.level in ("L0", "L1", "L2", "L3")]  # the probes that read ctx.model
    records = run_probes(shared, probes, ctx, console)
    ctx.model = None  # L4 on load their own model: a release-sized model is never held twice
    gc.collect()
    records += run_probes([s for s in specs if s not in shared], probes, ctx, console)
    for r in records:  # what the L6 probes computed about the reference run (bands, before-training values)
        r.attrs.update(ctx.l6_attrs.get(r.name, {}))
    return records, ctx.band, ctx.wall
