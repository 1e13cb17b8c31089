"""The training class's properties, candidate half: runs inside the sealed, torch-free child.

PROBES[name](ctx, inputs) runs the candidate's JAX tree (jax_oracles.*, conversion.*) through the public names
docs/CONTRACTS.md lists on the inputs the torch half (twin/torch_side/training.py) drew, and returns the same
outputs. Modules are imported lazily, so one that fails to import fails only the properties that need it.
"""
from __future__ import annotations

import importlib
from functools import cached_property
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from twin.shared import flat_config, grouped, importable, layout_arrays

__all__ = ["make_ctx", "PROBES"]

jax.config.update("jax_default_matmul_precision", "highest")  # fp32 parity with torch (docs/CONTRACTS.md)


def _jm(path: str):
    """'models/llama3.py' or 'training.sft' -> the candidate's jax_oracles module."""
    return importlib.import_module("jax_oracles." + path.removesuffix(".py").replace("/", "."))


class _Ctx:
    """The task's config and assets; the candidate's modules, config, params and model, each loaded on first use."""

    def __init__(self, meta: dict):
        task = meta["task"]
        self.fam, self.method = task["family"], task["method"]
        self.assets = {k: Path(v) for k, v in meta["assets"].items()}
        lm = self.fam.get("language_model") or {}  # a vision-language family's decoder, else the family's own
        self.lm_path = lm.get("module", self.fam["model_module"])
        self.lm_prefix = lm.get("prefix", self.fam["model_prefix"])

    family = cached_property(lambda self: _jm(self.fam["model_module"]))
    lm = cached_property(lambda self: _jm(self.lm_path))
    conversion = cached_property(lambda self: importlib.import_module(
        "conversion." + Path(self.fam["model_module"]).stem))
    sft = cached_property(lambda self: _jm("training.sft"))
    lora = cached_property(lambda self: _jm("training.lora"))
    loss = cached_property(lambda self: _jm("training.loss"))
    optimizer = cached_property(lambda self: _jm("training.optimizer"))
    workflow = cached_property(lambda self: _jm(self.method["workflow"]))

    @cached_property
    def config(self):
        return getattr(self.family, f"{self.fam['model_prefix']}Config").from_pretrained(self.assets["checkpoint"])

    @cached_property
    def lm_config(self):  # a vision-language family's decoder config, a text family's own
        return getattr(self.config, "text", self.config)

    @cached_property
    def params(self) -> dict:
        return self.conversion.load_params(self.assets["checkpoint"])

    @cached_property
    def args(self):
        return getattr(self.workflow, self.method["args"])(**self.method["train"], template=self.fam["template"])

    @cached_property
    def model(self):
        name = self.fam.get("model_class") or f"{self.fam['model_prefix']}ForCausalLM"
        return getattr(self.family, name)(self.config, lora_scaling=self.sft.lora_config(self.args).scaling)

    @cached_property
    def layer0(self) -> dict:
        """Decoder layer 0's params (the family yaml's `layers` path: model.layers -> model/layers_0)."""
        *root, name = self.fam["layers"].split(".")
        tree = self.params
        for key in (*root, f"{name}_0"):
            tree = tree[key]
        return tree

    def lm_cls(self, suffix: str):
        return getattr(self.lm, f"{self.lm_prefix}{suffix}")


def make_ctx(meta: dict) -> _Ctx:
    return _Ctx(meta)


def _host(out: dict) -> dict[str, np.ndarray]:
    """Outputs as the torch half gives them: numpy, integers int64, floats float32, bools bool."""
    kinds = {"i": np.int64, "u": np.int64, "f": np.float32}
    arrays = {k: np.asarray(v) for k, v in jax.device_get(out).items()}
    return {k: v.astype(kinds[v.dtype.kind]) if v.dtype.kind in kinds else v for k, v in arrays.items()}


def _j(inp: dict, *names) -> list:
    return [jnp.asarray(inp[n]) for n in names]


def _forward_kwargs(inp) -> dict:
    return {"position_ids": jnp.asarray(inp["position_ids"])} if "position_ids" in inp else {}


# ---- L0 -----------------------------------------------------------------------------------------

def probe_config(ctx, inp):
    return flat_config(ctx.config)


def probe_param_tree(ctx, inp):
    return layout_arrays(ctx.conversion.hf_layout(ctx.params))


def probe_importable(ctx, inp):
    return importable(inp["modules"])


# ---- L1 operators -------------------------------------------------------------------------------

def probe_rms_norm(ctx, inp):
    return {"y": ctx.lm.rms_norm(*_j(inp, "x", "weight"), ctx.config.norm_eps)}


def probe_layer_norm(ctx, inp):
    return {"y": ctx.lm.layer_norm(*_j(inp, "x", "weight", "bias"), ctx.config.norm_eps)}


def probe_rope(ctx, inp):
    fam, c = ctx.family, ctx.config
    inv = fam.rope_inv_freq(c)
    factor = fam.rope_attention_factor(c) if hasattr(fam, "rope_attention_factor") else 1.0  # YaRN's, longrope's
    cos, sin = fam.rope_cos_sin(inv, jnp.asarray(inp["position_ids"]), *(() if factor == 1.0 else (factor,)))
    return {"inv_freq": inv, "cos": cos, "sin": sin, "x_rot": fam.apply_rope(jnp.asarray(inp["x"]), cos, sin)}


def probe_alibi(ctx, inp):
    slopes = {f"slopes_{i}": ctx.lm.alibi_slopes(int(h)) for i, h in enumerate(inp["head_counts"])}
    return {**slopes, "bias": ctx.lm.alibi_bias(slopes["slopes_0"], jnp.asarray(inp["attention_mask"]))}


def probe_mrope(ctx, inp):
    inputs = ctx.family.layer_inputs(ctx.config, *_j(inp, "attention_mask", "position_ids"))
    return {"cos": inputs.cos, "sin": inputs.sin}


def probe_qkv_split(ctx, inp):
    return dict(zip("qkv", ctx.family.split_qkv(ctx.config, jnp.asarray(inp["fused"]))))


def probe_causal_mask(ctx, inp):
    return {"mask": ctx.lm.causal_mask(jnp.asarray(inp["attention_mask"]))}


def probe_eager_attention(ctx, inp):
    q, k, v, mask, bias = _j(inp, "q", "k", "v", "mask", "bias")
    scale = ctx.config.head_dim ** -0.5
    return {"out": ctx.lm.eager_attention(q, k, v, mask, scale),
            "out_bias": ctx.lm.eager_attention(q, k, v, mask, scale, bias)}


def probe_mlp(ctx, inp):
    mlp = ctx.lm_cls("MLP")(ctx.lm_config)
    return {"y": mlp.apply({"params": ctx.layer0["mlp"]}, jnp.asarray(inp["x"]))}


def probe_lora_linear(ctx, inp):
    x, w, bias, a, b = _j(inp, "x", "weight", "bias", "lora_A", "lora_B")
    scaling = ctx.sft.lora_config(ctx.args).scaling
    layer = ctx.lora.LoraLinear(w.shape[0], use_bias=True, scaling=scaling)  # Flax layout: kernel [in,out], A [in,r]
    y_layer = layer.apply({"params": {"kernel": w.T, "bias": bias}, "lora": {"lora_A": a.T, "lora_B": b.T}}, x)
    return {"y": ctx.lora.lora_linear(x, w, None, a, b, scaling),
            "y_bias": ctx.lora.lora_linear(x, w, bias, a, b, scaling), "y_layer": y_layer}


# ---- L2 / L3 ------------------------------------------------------------------------------------

def probe_decoder_layer(ctx, inp):
    hidden = jnp.asarray(inp["hidden"])
    positions = _j(inp, "position_ids") if "position_ids" in inp else []
    inputs = ctx.family.layer_inputs(ctx.config, jnp.asarray(inp["attention_mask"]), *positions)
    attention_params = ctx.layer0[ctx.fam["attention"]]
    attention = ctx.lm_cls("Attention")(ctx.lm_config).apply({"params": attention_params}, hidden, inputs)
    out = ctx.lm_cls("DecoderLayer")(ctx.lm_config).apply({"params": ctx.layer0}, hidden, inputs)
    return {"attention": attention, "out": out}


def probe_logits(ctx, inp):
    return {"logits": ctx.model.apply({"params": ctx.params}, *_j(inp, "input_ids", "attention_mask"),
                                      **_forward_kwargs(inp))}


def probe_jit_static(ctx, inp):
    traces = []

    def forward(variables, ids, mask, kwargs):
        traces.append(ids.shape)  # runs once per trace, never per call
        return ctx.model.apply(variables, ids, mask, **kwargs)

    jitted = jax.jit(forward)
    for ids in _j(inp, "input_ids", "input_ids_2"):
        jax.block_until_ready(jitted({"params": ctx.params}, ids, jnp.asarray(inp["attention_mask"]),
                                     _forward_kwargs(inp)))
    return {"traces": np.int32(len(traces))}


def probe_vision_tower(ctx, inp):
    out = ctx.model.apply({"params": ctx.params}, jnp.asarray(inp["pixel_values"]), np.asarray(inp["image_grid_thw"]),
                          method="encode_images")
    return out if isinstance(out, dict) else {"image_embeds": out}


# ---- L4 -----------------------------------------------------------------------------------------

def _adapters(inp) -> dict[str, np.ndarray]:
    return {k[len("lora."):]: v for k, v in inp.items() if k.startswith("lora.")}


def _lora_grads(ctx, inp):
    """The SFT loss (token mean) with the drawn adapters, and its grads w.r.t. them as PEFT names."""
    ids, mask, labels = _j(inp, "input_ids", "attention_mask", "labels")

    def loss(tree):
        logits = ctx.model.apply({"params": ctx.params, "lora": tree}, ids, mask, **_forward_kwargs(inp))
        return ctx.loss.causal_lm_loss(logits, labels)

    value, grads = jax.jit(jax.value_and_grad(loss))(ctx.lora.lora_tree_from_state_dict(_adapters(inp)))
    return value, ctx.lora.lora_state_dict(grads)


def probe_loss_and_grads(ctx, inp):
    loss, grads = _lora_grads(ctx, inp)
    return {"loss": loss, **grads}


def probe_grad_liveness(ctx, inp):
    return {k: np.bool_((np.asarray(g) != 0).any()) for k, g in _lora_grads(ctx, inp)[1].items()}


def probe_dpo_loss(ctx, inp):
    w, a = ctx.workflow, ctx.args
    logps, valid = w.get_batch_logps(*_j(inp, "logits", "labels"))
    n = logps.shape[0] // 2
    losses, chosen, rejected = w.dpo_loss(logps[:n], logps[n:], *_j(inp, "ref_chosen_logps", "ref_rejected_logps"),
                                          a.pref_beta, a.dpo_label_smoothing)
    return {"logps": logps, "valid_length": valid, "losses": losses, "chosen_rewards": chosen,
            "rejected_rewards": rejected}


def probe_dpo_batch(ctx, inp):
    variables = {"params": ctx.params, "lora": ctx.lora.lora_tree_from_state_dict(_adapters(inp))}
    batch = {k: jnp.asarray(v) for k, v in inp.items() if not k.startswith("lora.")}
    loss, metrics = ctx.workflow.batch_loss_metrics(ctx.model, variables, batch, ctx.args)
    return {"loss": loss, **{k.replace("/", "."): v for k, v in metrics.items()}}


def probe_ppo_loss(ctx, inp):
    w, a = ctx.workflow, ctx.args
    x = {k: jnp.asarray(v) for k, v in inp.items()}
    values = w.value_head(x["hidden"], x["weight"], x["bias"])
    masked, adv, returns = w.compute_advantages(values, x["rewards"], x["mask"], a.gamma, a.lam, a.ppo_whiten_rewards)
    pg, vf, stats = w.ppo_loss(x["old_logprobs"], masked, x["logits"], x["vpreds"], x["logprobs"], x["mask"], adv,
                               returns, a)
    return {"values": values, "masked_values": masked, "advantages": adv, "returns": returns, "loss_p": pg,
            "loss_v": vf, **{f"stats.{k.replace('/', '.')}": v for k, v in stats.items()}}


# ---- L5 -----------------------------------------------------------------------------------------

def probe_optimizer_step(ctx, inp):
    """create_optimizer over as many steps as there are grad rounds; the schedule's lr at each, then the adapters."""
    opt, a, lora = ctx.optimizer, ctx.args, ctx.lora
    steps = len({k.split(".", 1)[0] for k in inp if k.startswith("grad")})
    tree = lora.lora_tree_from_state_dict(_adapters(inp))
    tx = opt.create_optimizer(a, steps)
    state = tx.init(tree)
    for s in range(steps):
        grads = lora.lora_tree_from_state_dict({k[len(f"grad{s}."):]: v for k, v in inp.items()
                                                if k.startswith(f"grad{s}.")})
        updates, state = tx.update(grads, state, tree)
        tree = optax.apply_updates(tree, updates)
    schedule = opt.get_scheduler(a.lr_scheduler_type, a.learning_rate, opt.get_warmup_steps(steps, a.warmup_ratio),
                                 steps)
    return {"lr": np.array([schedule(s) for s in range(steps)], np.float32), **lora.lora_state_dict(tree)}


def probe_train_step(ctx, inp):
    """The workflow's train_steps -> the step losses, then the adapters."""
    if ctx.method["name"] == "ppo":
        return _ppo_train_step(ctx, inp)
    steps = [grouped(step, "m") for step in grouped(inp, "s")]
    losses, adapter = ctx.workflow.train_steps(ctx.assets["checkpoint"], _adapters(inp), steps, ctx.args)
    return {"losses": np.array(losses, np.float32), **adapter}


def _ppo_train_step(ctx, inp):
    """PPO's train_steps (rollouts included) -> each step's responses, then the STATS per step, the adapters and
    the value head."""
    w = ctx.workflow
    steps = [[{k: np.asarray(v).tolist() for k, v in row.items()} for row in grouped(step, "p")]
             for step in grouped(inp, "s")]
    head = {k: v for k, v in inp.items() if k.startswith("v_head.")}
    eos, pad = w.generation_ids(ctx.assets["tokenizer"], ctx.args)
    stats, responses, adapter, head = w.train_steps(ctx.assets["checkpoint"], ctx.assets["reward_model"],
                                                    _adapters(inp), head, steps, ctx.args, eos, pad,
                                                    ctx.assets["tokenizer"], ctx.assets["data"])  # data: images
    return {**{f"responses.s{i}": r for i, r in enumerate(responses)},
            **{f"stats.{k.replace('/', '.')}": np.array(v, np.float32) for k, v in stats.items()}, **adapter, **head}


def _hosted(fn):
    def probe(ctx, inp):
        return _host(fn(ctx, inp))
    probe.__name__, probe.__doc__ = fn.__name__, fn.__doc__
    return probe


PROBES = {name[len("probe_"):]: _hosted(fn) for name, fn in list(globals().items()) if name.startswith("probe_")}
