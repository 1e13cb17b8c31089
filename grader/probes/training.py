"""Run the training-class checks on a candidate (the twin of recorder/probes/training.py).

Runs inside the sandboxed child: gets an inputs-only file, imports the candidate's mirrored
modules (jax_oracles.*, conversion.*), writes one output group per check. A probe that raises is
that check's failure, never the run's.
"""
from __future__ import annotations

import importlib
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from catalog.layout import layout_arrays
from catalog.family import language_model, model_class_name
from catalog.workloads import FIXED_STEPS_OPTIONS, collate_outputs, data_fields, fixed_step_runs, tied_checkpoint
from grader.probes.common import run_probes

jax.config.update("jax_default_matmul_precision", "highest")


class Ctx:
    def __init__(self, meta):
        self.meta = meta
        task = meta["task"]
        fam = task["family"]
        self.assets = meta["assets"]
        self.train = task["method"]["train"]
        self.method = task["method"]["name"]
        self.method_cfg = task["method"]  # configs/method/<name>.yaml: workflow, args, entry, probes
        self.prefix = fam["model_prefix"]
        modname = fam["model_module"][:-3].replace("/", ".")
        self.family = importlib.import_module(f"jax_oracles.{modname}")
        self.model_class = getattr(self.family, model_class_name(fam))
        lm_module, self.lm_prefix = language_model(fam)  # the decoder the layer checks read
        self.lm = importlib.import_module("jax_oracles." + lm_module[:-3].replace("/", "."))
        self.conversion = importlib.import_module(f"conversion.{modname.split('.')[-1]}")
        self.template = fam["template"]
        self.features = frozenset(fam["features"])
        self.layers, self.attention = fam["layers"], fam["attention"]
        self._params = None

    @property
    def params(self):
        if self._params is None:
            self._params = self.conversion.load_params(self.assets["checkpoint"])
        return self._params

    @property
    def config(self):
        return self.cls("Config").from_pretrained(self.assets["checkpoint"])

    @property
    def lm_config(self):
        """The decoder's config: a vision-language family's text config, a text family's own."""
        return getattr(self.config, "text", self.config)

    def cls(self, suffix):
        return getattr(self.family, f"{self.prefix}{suffix}")

    def lm_cls(self, suffix):
        return getattr(self.lm, f"{self.lm_prefix}{suffix}")

    @property
    def rope_index(self):
        """The model's rope_index (M-RoPE families: LF's collator asks the model for positions), else None."""
        return getattr(self.model_class(self.config), "rope_index", None)

    def collator(self):
        return self.sft.make_collator(self.args, self.assets["tokenizer"], data_dir=self.assets["data"],
                                      rope_index=self.rope_index)

    def forward(self, variables, batch: dict, prefix: str = ""):
        """The model's public forward on a recorded batch: ids and mask, jitted; a vision-language batch also
        hands over what it recorded of position_ids, pixel_values and image_grid_thw (the grids are host data
        and the rope index host numpy, so that forward runs eagerly)."""
        model = self.model_class(self.config)
        ids, mask = jnp.asarray(batch[prefix + "input_ids"]), jnp.asarray(batch[prefix + "attention_mask"])
        extra = {k: np.asarray(batch[prefix + k]) for k in MODEL_FIELDS if prefix + k in batch}
        if not extra and not hasattr(model, "rope_index"):
            if getattr(self, "_jitted_apply", None) is None:  # one compile per shape across the batches
                self._jitted_apply = jax.jit(model.apply)
            return self._jitted_apply(variables, ids, mask)
        return model.apply(variables, ids, mask, **extra)

    @property
    def sft(self):
        return importlib.import_module("jax_oracles.training.sft")

    @property
    def workflow(self):
        return importlib.import_module(f"jax_oracles.{self.method_cfg['workflow']}")

    @property
    def lora(self):
        return importlib.import_module("jax_oracles.training.lora")

    @property
    def args(self):
        return getattr(self.workflow, self.method_cfg["args"])(**self.train, template=self.template)

    @property
    def layer0_params(self):
        """Params of decoder layer 0 (the family yaml's `layers` path: model.layers -> model/layers_0)."""
        *root, name = self.layers.split(".")
        tree = self.params
        for key in (*root, f"{name}_0"):
            tree = tree[key]
        return tree

    def inputs(self, inp):
        """The family's LayerInputs from the check's attention_mask and position_ids."""
        return self.family.layer_inputs(self.config, jnp.asarray(inp["attention_mask"]),
                                        jnp.asarray(inp["position_ids"]))

    def run(self):
        """The candidate's own entry point from the raw dataset (once for every L5 check)."""
        if getattr(self, "result", None) is None:
            entry = getattr(self.workflow, self.method_cfg["entry"])
            paths = [self.assets[k] for k in ("checkpoint", "tokenizer", "data", "reward_model") if k in self.assets]
            self.result = entry(*paths, self.args)  # PPO also takes its reward model
        return self.result


def n(x):
    return np.asarray(jax.device_get(x))


# what a vision-language batch adds (Omni's: LF's fake audio, its log-mel frames and their mask; the towers' token
# types and image sizes)
MODEL_FIELDS = ("position_ids", "pixel_values", "image_grid_thw", "input_features", "feature_attention_mask",
                "token_type_ids", "image_sizes")


# ---- L0 spec -----------------------------------------------------------------------------------

def probe_layout(ctx, inp):
    missing = []
    for entry in inp["names"]:
        path, name = str(entry).split(":")
        mod = "jax_oracles." + path[:-3].replace("/", ".")
        try:
            if not hasattr(importlib.import_module(mod), name):
                missing.append(f"{mod}.{name}")
        except ImportError as e:
            missing.append(f"{mod} ({e})")
    if missing:
        print("layout: missing", ", ".join(missing[:20]))
    return {"missing": np.array(len(missing))}


def probe_param_tree(ctx, inp):
    return layout_arrays(ctx.conversion.hf_layout(ctx.params))


def probe_lora_trainable(ctx, inp):
    lora = importlib.import_module("jax_oracles.training.lora")
    tree = lora.init_lora_tree(ctx.params, ctx.sft.lora_config(ctx.args), seed=0)
    sd = lora.lora_state_dict(tree)
    names = sorted(sd)
    return {"names": np.array(names), "shapes": np.array([np.shape(sd[k]) for k in names], np.int64)}


# ---- L1 operators ------------------------------------------------------------------------------

def probe_rms_norm(ctx, inp):
    return {"y": n(ctx.lm.rms_norm(inp["x"], inp["weight"], ctx.config.norm_eps))}


def probe_layer_norm(ctx, inp):
    x, w, b = (jnp.asarray(inp[k]) for k in ("x", "weight", "bias"))
    return {"y": n(ctx.family.layer_norm(x, w, b, ctx.config.norm_eps))}


def probe_rope(ctx, inp):
    inv = ctx.family.rope_inv_freq(ctx.config)
    cos, sin = ctx.family.rope_cos_sin(inv, jnp.asarray(inp["position_ids"]))
    out = {"inv_freq": n(inv), "cos": n(cos), "sin": n(sin),
           "x_rot": n(ctx.family.apply_rope(jnp.asarray(inp["x"]), cos, sin))}
    if "unscaled_config" in inp:
        unscaled = ctx.cls("Config").from_hf(json.loads(str(inp["unscaled_config"])))
        out["inv_freq_unscaled"] = n(ctx.family.rope_inv_freq(unscaled))
    return out


def probe_alibi(ctx, inp):
    out = {f"slopes_{h}": n(ctx.family.alibi_slopes(int(h))) for h in inp["head_counts"]}
    slopes = ctx.family.alibi_slopes(ctx.config.num_attention_heads)
    out["bias"] = n(ctx.family.alibi_bias(slopes, jnp.asarray(inp["attention_mask"])))
    return out


def probe_mlp(ctx, inp):
    mlp = ctx.lm_cls("MLP")(ctx.lm_config)
    return {"y": n(mlp.apply({"params": ctx.layer0_params["mlp"]}, jnp.asarray(inp["x"])))}


def probe_activation(ctx, inp):
    mlp = ctx.lm_cls("MLP")(ctx.lm_config)
    return {f"y_{k[2:]}": n(mlp.apply({}, jnp.asarray(inp[k]), method="activation")) for k in inp if k.startswith("x_")}


def probe_attention_block(ctx, inp):
    attn = ctx.lm_cls("Attention")(ctx.lm_config)
    out = attn.apply({"params": ctx.layer0_params[ctx.attention]}, jnp.asarray(inp["x"]), ctx.inputs(inp))
    return {"out": n(out)}


def probe_qkv_split(ctx, inp):
    q, k, v = ctx.family.split_qkv(ctx.config, jnp.asarray(inp["fused"]))
    return {"q": n(q), "k": n(k), "v": n(v)}


def probe_attention_window(ctx, inp):
    c = ctx.config
    mask = ctx.family.causal_mask(jnp.asarray(inp["attention_mask"]), c.sliding_window)
    out = ctx.family.eager_attention(jnp.asarray(inp["q"]), jnp.asarray(inp["k"]), jnp.asarray(inp["v"]), mask,
                                     c.head_dim ** -0.5)
    return {"mask": n(mask).astype(np.int8), "out": n(out)}


def probe_attention_core(ctx, inp):
    c = ctx.lm_config
    mask = ctx.lm.causal_mask(jnp.asarray(inp["attention_mask"]))
    out = ctx.lm.eager_attention(jnp.asarray(inp["q"]), jnp.asarray(inp["k"]), jnp.asarray(inp["v"]), mask,
                                     c.head_dim ** -0.5)
    return {"out": n(out)}


def probe_lora_linear(ctx, inp):
    lora = importlib.import_module("jax_oracles.training.lora")
    x, w, bias, a, b = (jnp.asarray(inp[k]) for k in ("x", "weight", "bias", "lora_A", "lora_B"))
    scaling = float(inp["scaling"])
    layer = lora.LoraLinear(w.shape[0], use_bias=True, scaling=scaling)
    y_layer = layer.apply({"params": {"kernel": w.T, "bias": bias}, "lora": {"lora_A": a.T, "lora_B": b.T}}, x)
    return {"y": n(lora.lora_linear(x, w, None, a, b, scaling)), "y_bias": n(lora.lora_linear(x, w, bias, a, b, scaling)),
            "y_layer": n(y_layer)}


def _processed(ctx, **options):
    from dataclasses import replace
    return ctx.sft.load_processed_dataset(ctx.assets["tokenizer"], ctx.assets["data"], "train",
                                          replace(ctx.args, **options))


def probe_data_tokens(ctx, inp):
    fields = data_fields(lambda **o: _processed(ctx, **o), "input_ids", ctx.args.cutoff_len + 1, -1)
    return {**fields, "n": np.array(len(_processed(ctx)))}


def probe_data_labels(ctx, inp):
    return data_fields(lambda **o: _processed(ctx, **o), "labels", ctx.args.cutoff_len + 1, -7)


def probe_collate(ctx, inp):
    return collate_outputs(ctx.features, ctx.collator(), _processed(ctx), np.asarray)


# ---- L2 / L3 -----------------------------------------------------------------------------------

def probe_decoder_layer(ctx, inp):
    layer = ctx.lm_cls("DecoderLayer")(ctx.lm_config)
    out = layer.apply({"params": ctx.layer0_params}, jnp.asarray(inp["hidden"]), ctx.inputs(inp))
    return {"out": n(out)}


def probe_logits(ctx, inp):
    return {"logits": n(ctx.forward({"params": ctx.params}, inp))}


def probe_logits_unmasked(ctx, inp):
    """One unpadded row, no attention mask (the forward's default); an untied checkpoint also through its tied twin."""
    ids = jnp.asarray(inp["input_ids"])
    out = {"logits": n(ctx.model_class(ctx.config).apply({"params": ctx.params}, ids))}
    if not ctx.config.tie_word_embeddings:
        with tempfile.TemporaryDirectory() as tmp:
            tied = tied_checkpoint(ctx.assets["checkpoint"], Path(tmp))
            tied_params, tied_config = ctx.conversion.load_params(tied), ctx.cls("Config").from_pretrained(tied)
        out["logits_tied"] = n(ctx.model_class(tied_config).apply({"params": tied_params}, ids))
    return out


PROBES = {
    "layout": probe_layout, "param_tree": probe_param_tree, "lora_trainable": probe_lora_trainable,
    "rms_norm": probe_rms_norm, "layer_norm": probe_layer_norm, "rope": probe_rope, "alibi": probe_alibi,
    "mlp": probe_mlp, "activation": probe_activation, "attention_core": probe_attention_core, "attention_block": probe_attention_block,
    "qkv_split": probe_qkv_split, "attention_window": probe_attention_window,
    "lora_linear": probe_lora_linear, "data_tokens": probe_data_tokens, "data_labels": probe_data_labels,
    "collate": probe_collate, "decoder_layer": probe_decoder_layer,
    "logits_b1_t7": probe_logits_unmasked, "logits_b2_t16_pad": probe_logits, "logits_b3_t33_pad": probe_logits,
    "next_token_dist": probe_logits,
}


def _unflatten_steps(inp):
    """{"s0.m1.input_ids": ...} -> [[{input_ids, attention_mask, labels}, ...micro], ...steps]"""
    steps: dict[int, dict[int, dict]] = {}
    for key, value in inp.items():
        if key.startswith("s"):
            s_, m_, field = key.split(".", 2)
            steps.setdefault(int(s_[1:]), {}).setdefault(int(m_[1:]), {})[field] = np.asarray(value)
    return [[steps[i][j] for j in sorted(steps[i])] for i in sorted(steps)]


def _lora_from_inputs(inp):
    return {k[len("lora."):]: np.asarray(v) for k, v in inp.items() if k.startswith("lora.")}


def _step0(ctx, inp):
    if getattr(ctx, "step0", None) is None:
        model = ctx.sft.load_model(ctx.assets["checkpoint"], ctx.sft.lora_config(ctx.args), ctx.args.seed)
        ctx.step0 = ctx.sft.sft_step_loss_and_grads(model, _lora_from_inputs(inp), _unflatten_steps(inp)[0])
    return ctx.step0


def probe_loss_step0(ctx, inp):
    return {"loss": np.float32(_step0(ctx, inp)[0])}


def probe_loss_step0_train_on_prompt(ctx, inp):
    model = ctx.sft.load_model(ctx.assets["checkpoint"], ctx.sft.lora_config(ctx.args), ctx.args.seed)
    loss, _ = ctx.sft.sft_step_loss_and_grads(model, _lora_from_inputs(inp), _unflatten_steps(inp)[0])
    return {"loss": np.float32(loss)}


def probe_lora_grads_step0(ctx, inp):
    return {k: np.asarray(v, np.float32) for k, v in _step0(ctx, inp)[1].items()}


def _fixed(ctx, inp):
    """(losses, final adapter) of the task's optimizer args and of FIXED_STEPS_OPTIONS, keys prefixed as recorded."""
    if getattr(ctx, "fixed", None) is None:
        init, steps = _lora_from_inputs(inp), _unflatten_steps(inp)
        ctx.fixed = fixed_step_runs(lambda args: ctx.sft.train_steps(ctx.assets["checkpoint"], init, steps, args),
                                    ctx.args, FIXED_STEPS_OPTIONS)
    return ctx.fixed


def probe_fixed_steps_loss(ctx, inp):
    return _fixed(ctx, inp)[0]


def probe_fixed_steps_params(ctx, inp):
    return _fixed(ctx, inp)[1]


def _e2e(ctx):
    return ctx.run()


def probe_e2e_step_losses(ctx, inp):
    return {"step_losses": np.asarray(_e2e(ctx).step_losses, np.float32)}


def probe_e2e_eval_loss(ctx, inp):
    return {"before": np.float32(_e2e(ctx).eval_loss_before), "after": np.float32(_e2e(ctx).eval_loss_after)}


def probe_e2e_adapter(ctx, inp):
    return {k: np.asarray(v, np.float32) for k, v in _e2e(ctx).lora_state_dict.items()}


def probe_heldout_loss(ctx, inp):
    """Logits of the candidate's public forward, with the adapter its own L5 run produced (handed in
    as adapter.<PEFT name>), on the held-out batches b<i>.*. Never the candidate's train_sft or
    evaluate: the grader computes the loss from these logits (catalog/heldout.py)."""
    lora = importlib.import_module("jax_oracles.training.lora")
    model = ctx.sft.load_model(ctx.assets["checkpoint"], ctx.sft.lora_config(ctx.args), ctx.args.seed)
    adapter = lora.lora_tree_from_state_dict({k[len("adapter."):]: np.asarray(v) for k, v in inp.items()
                                              if k.startswith("adapter.")})
    num_batches = len([k for k in inp if k.startswith("b") and k.endswith(".input_ids")])
    out = {}
    for i in range(num_batches):
        logits = ctx.forward({"params": model.params, "lora": adapter}, inp, f"b{i}.")
        out[f"b{i}.logits"] = n(logits).astype(np.float32)
    return out


PROBES.update({
    "loss_step0": probe_loss_step0, "lora_grads_step0": probe_lora_grads_step0,
    "loss_step0_train_on_prompt": probe_loss_step0_train_on_prompt,
    "fixed_steps_loss": probe_fixed_steps_loss, "fixed_steps_params": probe_fixed_steps_params,
    "e2e_step_losses": probe_e2e_step_losses, "e2e_adapter": probe_e2e_adapter,
    "e2e_eval_loss": probe_e2e_eval_loss, "heldout_loss": probe_heldout_loss,
})


def method_probes(meta) -> dict:
    """These probes and the task's method's own (configs/method/<name>.yaml `probes`: a module beside this one),
    found by name: a new method registers in its config, not here."""
    extra = meta["task"]["method"].get("probes")
    vision = importlib.import_module("grader.probes.training_vision").PROBES  # picked by feature tags
    return {**PROBES, **vision, **(importlib.import_module(f"grader.probes.{extra}").PROBES if extra else {})}


def main(inputs_path, outputs_path):
    run_probes(inputs_path, outputs_path, Ctx, method_probes)
