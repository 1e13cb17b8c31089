"""The training class's properties, torch half (the trusted process).

Each property draws fresh random inputs from (seed, key), runs the torch source on them and returns the outputs the
candidate's half (twin/candidate_side/training.py) must reproduce, earliest intermediate first. Everything is read
through the public names docs/CONTRACTS.md lists and the family yaml (model_module, model_prefix, model_class,
language_model, layers, attention, features): no per-family code. A property's `modules` are the candidate files
that define what it exercises, found from where the torch twin of each piece is defined (the mirror rule).
"""
from __future__ import annotations

import dataclasses
import importlib
import types
import zlib
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from torch_sources.models.loading import tensor_index
from twin.properties import CONVERSION_RULES, Property
from twin.shared import flat_config, grouped, layout_arrays

__all__ = ["properties", "make_ctx", "draw", "run"]

B, T = 2, 10     # every random batch: two rows (the second right-padded), ten positions
STEPS = 3        # optimizer_step: warmup step (lr 0), a clipped and an unclipped step
ROWS = 2         # train_step: rows (pairs) of the task's data per micro-batch
TOWER_GRID = (1, 4, 6)  # vision_tower: one image of 4 x 6 patches (t, h, w), a multiple of the merge size


def _tm(path: str) -> types.ModuleType:
    """'models/llama3.py' or 'training.sft' -> the torch_sources module."""
    return importlib.import_module("torch_sources." + path.removesuffix(".py").replace("/", "."))


def _twin_file(module: str) -> str:
    return "jax_oracles/" + module.removeprefix("torch_sources.").replace(".", "/") + ".py"


def _files(*objs) -> tuple[str, ...]:
    """The candidate files defining the JAX twins of objs (functions, classes with their torch_sources bases,
    module instances, modules), in order, once each."""
    names = []
    for o in objs:
        if isinstance(o, types.ModuleType):
            names.append(o.__name__)
            continue
        cls = type(o) if isinstance(o, torch.nn.Module) else o if isinstance(o, type) else None
        names += [c.__module__ for c in cls.__mro__] if cls else [o.__module__]
    return tuple(dict.fromkeys(_twin_file(m) for m in names if m.startswith("torch_sources.")))


def _dataclass_types(obj) -> list[type]:
    """The config's dataclass types, nested ones included (Rope, a vision config, a text config)."""
    if not dataclasses.is_dataclass(obj):
        return []
    return [type(obj)] + [c for f in dataclasses.fields(obj) for c in _dataclass_types(getattr(obj, f.name))]


class _Task:
    """The task's torch modules, names and args (no weights: properties() reads only these)."""

    def __init__(self, spec):
        self.spec, fam, method = spec, spec.family, spec.cfg["method"]
        lm = fam.get("language_model") or {}
        self.family, self.lm = _tm(fam["model_module"]), _tm(lm.get("module", fam["model_module"]))
        self.prefix, self.lm_prefix = fam["model_prefix"], lm.get("prefix", fam["model_prefix"])
        self.model_class = getattr(self.family, fam.get("model_class") or f"{self.prefix}ForCausalLM")
        self.layers, self.attention = fam["layers"], fam["attention"]
        self.ckpt = spec.assets["checkpoint"]
        self.config = getattr(self.family, f"{self.prefix}Config").from_pretrained(self.ckpt)
        self.lm_config = getattr(self.config, "text", self.config)  # a vision-language family's decoder config
        self.sft, self.lora, self.loss, self.optimizer = (
            _tm(f"training.{m}") for m in ("sft", "lora", "loss", "optimizer"))
        self.workflow = _tm(method["workflow"])
        self.args = getattr(self.workflow, method["args"])(**method["train"], template=fam["template"])
        self.conversion = f"conversion/{Path(fam['model_module']).stem}.py"
        self.mirrored = [_tm(m) for m in dict.fromkeys([fam["model_module"], *(fam.get("mirrored") or ())])]

    @cached_property
    def shell(self) -> torch.nn.Module:
        """The model's module tree on the meta device (no weights): which classes a layer is built from."""
        with torch.device("meta"):
            return self.model_class(self.config)

    def layer0(self, model=None) -> torch.nn.Module:
        return (model or self.shell).get_submodule(f"{self.layers}.0")

    def lm_cls(self, suffix: str):
        return getattr(self.lm, f"{self.lm_prefix}{suffix}")


def properties(spec) -> list[Property]:
    t = _Task(spec)
    f, lm, layer0 = spec.features, t.lm, t.layer0()
    model_files = _files(t.model_class, t.family, layer0, getattr(layer0, t.attention), layer0.mlp, t.lora)
    lora_files = tuple(dict.fromkeys(_files(t.loss, t.lora) + model_files))

    def p(key, what, *objs, rtol=1e-4):
        return Property(key, what, _files(*objs), rtol)

    props = [
        # exact: both sides parse the same config.json, so no field may differ even by a float32 rounding
        p("L0/config", "Config.from_pretrained(checkpoint): every field", *_dataclass_types(t.config), rtol=0.0),
        Property("L0/param_tree", "conversion hf_layout(load_params) = the checkpoint's tensor names and shapes",
                 (t.conversion, CONVERSION_RULES)),
        Property("L0/importable", "every module the task needs imports",
                 _files(*t.mirrored, t.lm, t.lora, t.optimizer, t.loss, t.sft, t.workflow) + (t.conversion,)),
    ]
    ops = [  # (feature or None for every family, property, what, the torch twins it calls)
        ("norm:rms", "rms_norm", "rms_norm on random x", lambda: (lm.rms_norm,)),
        ("norm:layer", "layer_norm", "layer_norm on random x", lambda: (lm.layer_norm,)),
        ("pos:rope", "rope", "rope_inv_freq, rope_cos_sin at random positions, apply_rope",
         lambda: (t.family.rope_inv_freq, t.family.rope_cos_sin, t.family.apply_rope)),
        ("pos:alibi", "alibi", "alibi_slopes (config and random head counts), alibi_bias of a padded mask",
         lambda: (lm.alibi_slopes, lm.alibi_bias)),
        ("pos:mrope", "mrope", "layer_inputs' M-RoPE cos/sin on three distinct position streams",
         lambda: (t.family.layer_inputs, _tm("models/mrope.py"))),
        ("qkv:fused", "qkv_split", "split_qkv of a random fused projection", lambda: (t.family.split_qkv,)),
        (None, "causal_mask", "causal_mask of a right-padded mask", lambda: (lm.causal_mask,)),
        (None, "eager_attention", "eager_attention (GQA) under a padded causal mask, with and without a bias",
         lambda: (lm.eager_attention,)),
        (None, "mlp", "decoder layer 0's MLP (checkpoint weights) on random x",
         lambda: (t.lm_cls("MLP"), layer0.mlp, t.lora)),
        (None, "lora_linear", "lora_linear (with and without bias) and the LoraLinear layer",
         lambda: (t.lora.lora_linear, t.lora.LoraLinear)),
    ]
    props += [p(f"L1/{name}", what, *objs()) for feature, name, what, objs in ops if feature is None or feature in f]
    props += [
        p("L2/decoder_layer", "layer 0 (checkpoint weights): its attention, then the layer, on random hidden states",
          t.family, layer0, getattr(layer0, t.attention), layer0.mlp, t.lora),
        Property("L3/logits", "the whole model's logits on random right-padded ids, no LoRA", model_files),
        Property("L3/jit_static", "diagnostic: the jitted forward traces once for two inputs of one shape",
                 model_files),
    ]
    if hasattr(t.shell, "encode_images") and "vision:qwen" in f:  # a grid-based tower: random pixels, any grid
        props.append(p("L3/vision_tower", "encode_images on random pixels", t.family,
                       t.shell.get_submodule(spec.family.get("vision_tower", "visual"))))
    props += [
        Property("L4/loss_and_grads", "causal_lm_loss and the LoRA grads (random A and B) on random ids and labels",
                 lora_files),
        Property("L4/grad_liveness", "diagnostic: which LoRA grads are nonzero", lora_files),
    ]
    if spec.method == "dpo":
        props.append(p("L4/dpo_loss", "get_batch_logps on random logits, dpo_loss on random log-probs", t.workflow))
    if spec.method == "dpo" and "vision:tower" not in spec.features:
        # a fixed-size tower's collated batch always carries an image (LF's fake one when a row has none), whose
        # features the JAX step takes precomputed: text-only pairs are no batch of these tasks (gemma3's and
        # paligemma's JAX forward refuses them), so their DPO batch is run end to end by L5/train_step
        props.append(Property("L4/dpo_batch", "batch_loss_metrics with random LoRA on random pairs",
                              _files(t.workflow) + lora_files))
    if spec.method == "ppo":
        props.append(p("L4/ppo_loss", "value_head, compute_advantages and ppo_loss on random tensors", t.workflow))
    props += [
        p("L5/optimizer_step", f"{STEPS} AdamW steps (clip, schedule, the task's TrainArgs) on random grads",
          t.optimizer),
        p("L5/train_step", f"the workflow's train_steps: {STEPS - 1} steps on the task's data from random adapters",
          t.workflow, t.optimizer),
    ]
    return props


# ---- the context ------------------------------------------------------------------------------

class _Ctx(_Task):
    def __init__(self, spec):
        super().__init__(spec)
        self.props = {p.key: p for p in properties(spec)}
        self.model = self.model_class.from_pretrained(self.ckpt).eval()

    @cached_property
    def lora_model(self) -> torch.nn.Module:
        """The task's model with LoRA injected (the workflow's load_model), adapters set per probe."""
        return self.sft.load_model(self.ckpt, self.sft.lora_config(self.args), self.args.seed)

    @cached_property
    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v.shape for k, v in self.lora.lora_state_dict(self.lora_model).items()}

    @cached_property
    def train_rows(self) -> list[dict]:
        """The task's train split through its workflow's own loader (processed, pairwise or prompt rows)."""
        load = getattr(self.workflow, DATA_LOADERS[self.spec.method])
        return load(self.spec.assets["tokenizer"], self.spec.assets["data"], "train", self.args)

    @property
    def rope_index(self):
        return getattr(self.model, "rope_index", None)


def make_ctx(spec) -> _Ctx:
    return _Ctx(spec)


def draw(ctx: _Ctx, seed: int) -> dict[str, dict[str, np.ndarray]]:
    return {key: DRAW[p.name](ctx, np.random.default_rng([seed, zlib.crc32(key.encode())]))
            for key, p in ctx.props.items()}


def run(ctx: _Ctx, key: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    kinds = {"i": np.int64, "u": np.int64, "f": np.float32}  # the candidate half's output dtypes too
    out = {k: v.detach().cpu().numpy() if torch.is_tensor(v) else np.asarray(v)
           for k, v in RUN[ctx.props[key].name](ctx, inputs).items()}
    return {k: v.astype(kinds[v.dtype.kind]) if v.dtype.kind in kinds else v for k, v in out.items()}


# ---- drawing ----------------------------------------------------------------------------------

def _t(x) -> torch.Tensor:
    """numpy -> torch; integers as int64 (embeddings, cross-entropy and the masks take them)."""
    x = torch.from_numpy(np.ascontiguousarray(x))
    return x.long() if not x.is_floating_point() and x.dtype != torch.bool else x


def _normal(r, *shape, scale=1.0) -> np.ndarray:
    return (r.standard_normal(shape) * scale).astype(np.float32)


def _padded_mask(r, rows=B, width=T) -> np.ndarray:
    """i32[rows, width]: row 0 full, the others right-padded to a random length >= 2."""
    lens = np.concatenate([[width], r.integers(2, width, rows - 1)])
    return (np.arange(width)[None] < lens[:, None]).astype(np.int32)


def _positions(ctx, r, rows=B, width=T) -> dict[str, np.ndarray]:
    """An M-RoPE family's position ids: three distinct non-decreasing streams i32[3,B,T], far apart (text would give
    three equal rows, and close ones small angle differences: either hides a section split wrong); {} for the others
    (the forward's own 0..T-1)."""
    if "pos:mrope" not in ctx.spec.features:
        return {}
    return {"position_ids": np.cumsum(r.integers(0, 50, (3, rows, width)), -1).astype(np.int32)}


def _ids(ctx, r, rows=B, width=T) -> dict[str, np.ndarray]:
    mask = _padded_mask(r, rows, width)
    ids = r.integers(0, ctx.config.vocab_size, (rows, width)).astype(np.int32)
    return {"input_ids": ids, "attention_mask": mask, **_positions(ctx, r, rows, width)}


def _labels(r, batch) -> np.ndarray:
    """Random labels: the ids, a third of them and every pad position -100 (some rows' first position labelled)."""
    keep = (r.random(batch["input_ids"].shape) > 0.33) & (batch["attention_mask"] > 0)
    return np.where(keep, batch["input_ids"], -100).astype(np.int32)


def _adapters(ctx, r) -> dict[str, np.ndarray]:
    """Random LoRA adapters, A and B both nonzero (B = 0 would leave A's grads dead), as lora.<PEFT name>."""
    out = {}
    for name, shape in ctx.adapter_shapes.items():
        scale = 1 / np.sqrt(shape[1]) if ".lora_A." in name else 0.05  # A: the init's range; B: a small update
        out[f"lora.{name}"] = _normal(r, *shape, scale=scale)
    return out


def _draw_nothing(ctx, r):
    return {}


def _draw_importable(ctx, r):
    return {"modules": np.array([f.removesuffix(".py").replace("/", ".") for f in ctx.props["L0/importable"].modules])}


def _draw_norm(ctx, r):
    """Rows at scales from 3e-4 to 3, so that some rows' mean square (variance) is near eps and eps shows."""
    D = ctx.config.hidden_size
    scales = (10 ** r.uniform(-3.5, 0.5, (B, T, 1))).astype(np.float32)
    return {"x": scales * (_normal(r, B, T, D, scale=3) + 1.5), "weight": 1 + _normal(r, D, scale=0.1),
            "bias": _normal(r, D, scale=0.1)}


def _draw_rope(ctx, r):
    c = ctx.config
    pos = np.sort(r.integers(0, ctx.lm_config.max_position_embeddings, (B, T)), -1).astype(np.int32)
    return {"position_ids": pos, "x": _normal(r, B, T, c.num_attention_heads, c.head_dim)}


def _draw_alibi(ctx, r):
    mask = _padded_mask(r, 3)
    mask[2, : r.integers(1, T - 1)] = 0  # row 2 padded on the left too: the bias counts real keys only
    return {"head_counts": np.array([ctx.config.num_attention_heads, *r.integers(1, 40, 2)], np.int64),
            "attention_mask": mask}


def _draw_mask(ctx, r):
    return {"attention_mask": _padded_mask(r)}


def _draw_mrope(ctx, r):
    return {"attention_mask": _padded_mask(r), **_positions(ctx, r)}


def _draw_qkv_split(ctx, r):
    c = ctx.config
    return {"fused": _normal(r, B, T, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim)}


def _draw_attention(ctx, r):
    c = ctx.config
    mask = _padded_mask(r).astype(bool)
    return {"q": _normal(r, B, T, c.num_attention_heads, c.head_dim),
            "k": _normal(r, B, T, c.num_key_value_heads, c.head_dim),
            "v": _normal(r, B, T, c.num_key_value_heads, c.head_dim),
            "mask": np.tril(np.ones((T, T), bool))[None] & mask[:, None, :],
            "bias": _normal(r, B, c.num_attention_heads, 1, T)}


def _draw_mlp(ctx, r):
    return {"x": _normal(r, B, T, ctx.config.hidden_size)}


def _draw_lora_linear(ctx, r):
    n_in, n_out, rank = 24, 16, ctx.args.lora_rank
    return {"x": _normal(r, B, T, n_in), "weight": _normal(r, n_out, n_in, scale=0.2),
            "bias": _normal(r, n_out, scale=0.2), "lora_A": _normal(r, rank, n_in, scale=0.2),
            "lora_B": _normal(r, n_out, rank, scale=0.2)}


def _draw_hidden(ctx, r):
    return {"hidden": _normal(r, B, T, ctx.config.hidden_size), "attention_mask": _padded_mask(r),
            **_positions(ctx, r)}


def _draw_jit_static(ctx, r):
    return {**_ids(ctx, r), "input_ids_2": r.integers(0, ctx.config.vocab_size, (B, T)).astype(np.int32)}


def _draw_vision_tower(ctx, r):
    v = ctx.config.vision
    grid = np.array([TOWER_GRID], np.int64)
    width = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    return {"pixel_values": _normal(r, int(np.prod(grid)), width), "image_grid_thw": grid}


def _draw_lora_batch(ctx, r):
    batch = _ids(ctx, r)
    return {**batch, "labels": _labels(r, batch), **_adapters(ctx, r)}


def _draw_dpo_loss(ctx, r):
    logits = _normal(r, 2 * B, T, 13, scale=2)
    batch = {"input_ids": r.integers(0, 13, (2 * B, T)), "attention_mask": _padded_mask(r, 2 * B)}
    return {"logits": logits, "labels": _labels(r, batch), "ref_chosen_logps": _normal(r, B, scale=5) - 20,
            "ref_rejected_logps": _normal(r, B, scale=5) - 20}


def _draw_dpo_batch(ctx, r):
    batch = _ids(ctx, r, 2 * B)
    return {**batch, "labels": _labels(r, batch), **_adapters(ctx, r)}


def _draw_ppo_loss(ctx, r):
    D, V = ctx.config.hidden_size, 13
    mask = _padded_mask(r).astype(np.float32)
    old = -np.abs(_normal(r, B, T, scale=2))
    return {"hidden": _normal(r, B, T, D), "weight": _normal(r, 1, D, scale=D ** -0.5), "bias": _normal(r, 1),
            "rewards": _normal(r, B, T), "mask": mask, "old_logprobs": old,
            "logprobs": old + _normal(r, B, T, scale=0.3),  # ratios on both sides of the clip range
            "vpreds": _normal(r, B, T), "logits": _normal(r, B, T, V, scale=2)}


def _draw_optimizer_step(ctx, r):
    """Adapters and STEPS rounds of grads (grad<s>.<PEFT name>): global norms near 10, clipped to max_grad_norm, but
    the middle round's near 0.01, which the clip leaves alone."""
    grads = {f"grad{s}.{k[len('lora.'):]}": v * (1e-3 if s == 1 else 1.0)
             for s in range(STEPS) for k, v in _adapters(ctx, r).items()}
    return {**_adapters(ctx, r), **grads}


DATA_LOADERS = {"sft": "load_processed_dataset", "dpo": "load_pairwise_dataset", "ppo": "load_prompt_dataset"}


def _data_rows(ctx, r, n):
    """n random rows of the task's processed train split."""
    return [ctx.train_rows[i] for i in r.choice(len(ctx.train_rows), n, replace=False)]


def _draw_train_step(ctx, r):
    """STEPS - 1 optimizer steps (the first at the warmup's lr 0, the next at the full lr) from random adapters, each
    of the task's gradient_accumulation_steps micro-batches, ROWS random rows of its data collated by its collator
    (s<i>.m<j>.<field>); PPO: each step's batch_size prompts (s<i>.p<j>.<field>, variable length) and a random
    value head."""
    a = ctx.spec.assets
    if ctx.spec.method == "ppo":
        head = ctx.workflow.init_value_head(ctx.config.hidden_size, int(r.integers(1 << 30)))
        prompts = {f"s{s}.p{i}.{k}": np.array(v, str if k == "images" else np.int64) for s in range(STEPS - 1)
                   for i, row in enumerate(_data_rows(ctx, r, ctx.args.batch_size)) for k, v in row.items()}
        return {**_adapters(ctx, r), **head, **prompts}
    collate = ctx.workflow.make_collator(ctx.args, a["tokenizer"], data_dir=a["data"], rope_index=ctx.rope_index)
    batches = {f"s{s}.m{m}.{k}": v.numpy() if torch.is_tensor(v) else np.asarray(v)
               for s in range(STEPS - 1) for m in range(ctx.args.gradient_accumulation_steps)
               for k, v in collate(_data_rows(ctx, r, ROWS)).items()}
    return {**_adapters(ctx, r), **batches}


# ---- running ----------------------------------------------------------------------------------

def _run_config(ctx, inp):
    return flat_config(ctx.config)


def _run_param_tree(ctx, inp):
    index = tensor_index(ctx.ckpt)  # the checkpoint's headers: what the torch source loads, no tensor read
    return layout_arrays({name: entry["shape"] for name, (_, entry) in index.items()})


def _run_importable(ctx, inp):
    return {str(m): np.int32(1) for m in inp["modules"]}


def _run_rms_norm(ctx, inp):
    return {"y": ctx.lm.rms_norm(_t(inp["x"]), _t(inp["weight"]), ctx.config.norm_eps)}


def _run_layer_norm(ctx, inp):
    return {"y": ctx.lm.layer_norm(_t(inp["x"]), _t(inp["weight"]), _t(inp["bias"]), ctx.config.norm_eps)}


def _run_rope(ctx, inp):
    fam, c = ctx.family, ctx.config
    inv = fam.rope_inv_freq(c)
    factor = fam.rope_attention_factor(c) if hasattr(fam, "rope_attention_factor") else 1.0  # YaRN's, longrope's
    cos, sin = fam.rope_cos_sin(inv, _t(inp["position_ids"]), *(() if factor == 1.0 else (factor,)))
    return {"inv_freq": inv, "cos": cos, "sin": sin, "x_rot": fam.apply_rope(_t(inp["x"]), cos, sin)}


def _run_alibi(ctx, inp):
    counts = [int(h) for h in inp["head_counts"]]
    slopes = {f"slopes_{i}": ctx.lm.alibi_slopes(h) for i, h in enumerate(counts)}
    return {**slopes, "bias": ctx.lm.alibi_bias(slopes["slopes_0"], _t(inp["attention_mask"]))}


def _run_mrope(ctx, inp):
    inputs = ctx.family.layer_inputs(ctx.config, _t(inp["attention_mask"]), _t(inp["position_ids"]))
    return {"cos": inputs.cos, "sin": inputs.sin}


def _run_qkv_split(ctx, inp):
    return dict(zip("qkv", ctx.family.split_qkv(ctx.config, _t(inp["fused"]))))


def _run_causal_mask(ctx, inp):
    return {"mask": ctx.lm.causal_mask(_t(inp["attention_mask"]))}


def _run_eager_attention(ctx, inp):
    q, k, v, mask, bias = (_t(inp[n]) for n in ("q", "k", "v", "mask", "bias"))
    scale = ctx.config.head_dim ** -0.5
    return {"out": ctx.lm.eager_attention(q, k, v, mask, scale),
            "out_bias": ctx.lm.eager_attention(q, k, v, mask, scale, bias)}


@torch.no_grad()
def _run_mlp(ctx, inp):
    return {"y": ctx.layer0(ctx.model).mlp(_t(inp["x"]))}


@torch.no_grad()
def _run_lora_linear(ctx, inp):
    x, w, bias, a, b = (_t(inp[n]) for n in ("x", "weight", "bias", "lora_A", "lora_B"))
    scaling = ctx.sft.lora_config(ctx.args).scaling
    base = torch.nn.Linear(w.shape[1], w.shape[0])
    layer = ctx.lora.LoraLinear(base, a.shape[0], ctx.args.lora_alpha)
    for param, value in ((base.weight, w), (base.bias, bias), (layer.lora_A.weight, a), (layer.lora_B.weight, b)):
        param.copy_(value)
    return {"y": ctx.lora.lora_linear(x, w, None, a, b, scaling),
            "y_bias": ctx.lora.lora_linear(x, w, bias, a, b, scaling), "y_layer": layer(x)}


@torch.no_grad()
def _run_decoder_layer(ctx, inp):
    layer = ctx.layer0(ctx.model)
    hidden = _t(inp["hidden"])
    positions = [_t(inp["position_ids"])] if "position_ids" in inp else []
    inputs = ctx.family.layer_inputs(ctx.config, _t(inp["attention_mask"]), *positions)
    return {"attention": getattr(layer, ctx.attention)(hidden, inputs), "out": layer(hidden, inputs)}


def _forward_kwargs(inp) -> dict:
    return {"position_ids": _t(inp["position_ids"])} if "position_ids" in inp else {}


@torch.no_grad()
def _run_logits(ctx, inp):
    return {"logits": ctx.model(_t(inp["input_ids"]), _t(inp["attention_mask"]), **_forward_kwargs(inp))}


def _run_jit_static(ctx, inp):
    return {"traces": np.int32(1)}  # what a static-shape forward does: one trace for every input of one shape


@torch.no_grad()
def _run_vision_tower(ctx, inp):
    out = ctx.model.encode_images(_t(inp["pixel_values"]), _t(inp["image_grid_thw"]))
    return out if isinstance(out, dict) else {"image_embeds": out}


def _adapter_inputs(inp) -> dict[str, np.ndarray]:
    return {k[len("lora."):]: v for k, v in inp.items() if k.startswith("lora.")}


def _lora_grads(ctx, inp) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """The SFT loss (token mean) of the LoRA model with the drawn adapters, and the adapters' grads (PEFT names)."""
    model = ctx.lora_model
    ctx.lora.load_lora_state_dict(model, _adapter_inputs(inp))
    model.zero_grad(set_to_none=True)
    logits = model(_t(inp["input_ids"]), _t(inp["attention_mask"]), **_forward_kwargs(inp))
    loss = ctx.loss.causal_lm_loss(logits, _t(inp["labels"]))
    loss.backward()
    params = {ctx.lora.PEFT_PREFIX + k: p for k, p in model.named_parameters()}
    return loss, {k: torch.zeros_like(params[k]) if params[k].grad is None else params[k].grad
                  for k in ctx.adapter_shapes}  # canonical order; an adapter the loss never reaches: zero


def _run_loss_and_grads(ctx, inp):
    loss, grads = _lora_grads(ctx, inp)
    return {"loss": loss, **grads}


def _run_grad_liveness(ctx, inp):
    return {k: np.bool_((g != 0).any()) for k, g in _lora_grads(ctx, inp)[1].items()}


def _run_dpo_loss(ctx, inp):
    w, a = ctx.workflow, ctx.args
    logps, valid = w.get_batch_logps(_t(inp["logits"]), _t(inp["labels"]))
    n = logps.shape[0] // 2  # chosen rows first
    losses, chosen, rejected = w.dpo_loss(logps[:n], logps[n:], _t(inp["ref_chosen_logps"]),
                                          _t(inp["ref_rejected_logps"]), a.pref_beta, a.dpo_label_smoothing)
    return {"logps": logps, "valid_length": valid, "losses": losses, "chosen_rewards": chosen,
            "rejected_rewards": rejected}


@torch.no_grad()
def _run_dpo_batch(ctx, inp):
    ctx.lora.load_lora_state_dict(ctx.lora_model, _adapter_inputs(inp))
    batch = {k: _t(v) for k, v in inp.items() if not k.startswith("lora.")}
    loss, metrics = ctx.workflow.batch_loss_metrics(ctx.lora_model, batch, ctx.args)
    return {"loss": loss, **{k.replace("/", "."): np.float32(v) for k, v in metrics.items()}}


def _run_ppo_loss(ctx, inp):
    w, a = ctx.workflow, ctx.args
    x = {k: _t(v) for k, v in inp.items()}
    values = w.value_head(x["hidden"], x["weight"], x["bias"])
    masked, adv, returns = w.compute_advantages(values, x["rewards"], x["mask"], a.gamma, a.lam,
                                                a.ppo_whiten_rewards)
    pg, vf, stats = w.ppo_loss(x["old_logprobs"], masked, x["logits"], x["vpreds"], x["logprobs"], x["mask"], adv,
                               returns, a)
    return {"values": values, "masked_values": masked, "advantages": adv, "returns": returns, "loss_p": pg,
            "loss_v": vf, **{f"stats.{k.replace('/', '.')}": v for k, v in stats.items()}}


def _run_optimizer_step(ctx, inp):
    """sft's step order: clip, AdamW step, scheduler step; the lr each step used, then the adapters."""
    params = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in _adapter_inputs(inp).items()}
    optimizer, scheduler = ctx.optimizer.create_optimizer(params.items(), ctx.args, STEPS)
    lrs = []
    for s in range(STEPS):
        for k, p in params.items():
            p.grad = torch.from_numpy(inp[f"grad{s}.{k}"].copy())
        if ctx.args.max_grad_norm > 0:
            ctx.optimizer.clip_grad_norm(params.values(), ctx.args.max_grad_norm)
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return {"lr": np.array(lrs, np.float32), **{k: p.detach() for k, p in params.items()}}


def _run_train_step(ctx, inp):
    """The workflow's train_steps -> the step losses, then the adapters."""
    if ctx.spec.method == "ppo":
        return _ppo_train_step(ctx, inp)
    steps = [grouped(step, "m") for step in grouped(inp, "s")]
    losses, adapter = ctx.workflow.train_steps(ctx.ckpt, _adapter_inputs(inp), steps, ctx.args)
    return {"losses": np.array(losses, np.float32), **adapter}


def _ppo_train_step(ctx, inp):
    """PPO's train_steps (rollouts included) -> each step's responses, then the STATS per step, the adapters and
    the value head."""
    a, w = ctx.spec.assets, ctx.workflow
    steps = [[{k: v.tolist() for k, v in row.items()} for row in grouped(step, "p")] for step in grouped(inp, "s")]
    head = {k: v for k, v in inp.items() if k.startswith("v_head.")}
    eos, pad = w.generation_ids(a["tokenizer"], ctx.args)
    stats, responses, adapter, head = w.train_steps(ctx.ckpt, a["reward_model"], _adapter_inputs(inp), head, steps,
                                                    ctx.args, eos, pad, a["tokenizer"], a["data"])  # data: images
    return {**{f"responses.s{i}": r for i, r in enumerate(responses)},
            **{f"stats.{k.replace('/', '.')}": np.array(v, np.float32) for k, v in stats.items()}, **adapter, **head}


DRAW = {"config": _draw_nothing, "param_tree": _draw_nothing, "importable": _draw_importable,
        "rms_norm": _draw_norm, "layer_norm": _draw_norm, "rope": _draw_rope, "alibi": _draw_alibi,
        "mrope": _draw_mrope, "qkv_split": _draw_qkv_split, "causal_mask": _draw_mask,
        "eager_attention": _draw_attention, "mlp": _draw_mlp, "lora_linear": _draw_lora_linear,
        "decoder_layer": _draw_hidden, "logits": _ids, "jit_static": _draw_jit_static,
        "vision_tower": _draw_vision_tower, "loss_and_grads": _draw_lora_batch, "grad_liveness": _draw_lora_batch,
        "dpo_loss": _draw_dpo_loss, "dpo_batch": _draw_dpo_batch, "ppo_loss": _draw_ppo_loss,
        "optimizer_step": _draw_optimizer_step, "train_step": _draw_train_step}
RUN = {name[len("_run_"):]: fn for name, fn in globals().items() if name.startswith("_run_")}
