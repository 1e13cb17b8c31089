"""Record the DPO checks of the training class (catalog/checks.py, methods ("dpo",)) from
torch_sources/training/dpo.py. The shared training checks (operators, layer, logits, L0) come from
recorder/probes/training.py; the JAX twin of this file is grader/probes/training_dpo.py.
"""
from __future__ import annotations

import numpy as np
import torch

from catalog.heldout import preference_metrics
from catalog.provenance import ROOT
from catalog.workloads import DPO_FIXED_STEPS_OPTIONS, collate_outputs, dpo_eval_outputs, dpo_trajectory_outputs, fixed_step_runs, metric_key, pad_rows, rewarded_steps, width_dependent_metrics
from recorder.probes.training import _flatten_steps, _lora_init, batch_arrays, n, rng_for, t

ADAPTER_SCALE = 0.05  # lora_B of the step-0 checks: a policy that differs from the reference


def _pairs(ctx, split: str = "train") -> list[dict]:
    return ctx.workflow.load_pairwise_dataset(ROOT / ctx.cfg.family.tokenizer, ROOT / ctx.cfg.data.dir, split,
                                              ctx.args)


def _collator(ctx, rope_index=None):
    """train_dpo's collator (a vision-language template's loads the rows' images and takes the rope index)."""
    return ctx.workflow.make_collator(ctx.args, ROOT / ctx.cfg.family.tokenizer, data_dir=ROOT / ctx.cfg.data.dir,
                                      rope_index=rope_index or ctx.rope_index)


# ---- L1 data -----------------------------------------------------------------------------------

def _pair_fields(ctx, field: str, fill: int) -> dict[str, np.ndarray]:
    width = ctx.args.cutoff_len + 1
    return {f"{key}_{field}": pad_rows([ex[f"{key}_{field}"][:width] for ex in _pairs(ctx)], width, fill)
            for key in ("chosen", "rejected")}


def probe_pairwise_tokens(ctx):
    return {}, {**_pair_fields(ctx, "input_ids", -1), "n": np.array(len(_pairs(ctx)))}


def probe_pairwise_labels(ctx):
    return {}, _pair_fields(ctx, "labels", -7)


def probe_pairwise_collate(ctx):
    return {}, collate_outputs(ctx.features, _collator(ctx), _pairs(ctx), n)


# ---- L3 / L4 -----------------------------------------------------------------------------------

def _step_batches(ctx, steps: int, short_last: bool = False):
    """The first `steps` accumulation steps of epoch 0, collated exactly as train_dpo does. short_last: the last
    step holds one micro-batch of one pair less, as an epoch's last step may (HF divides by the micro-batches
    it holds; a static-shape twin pads that step with a filler micro-batch and a filler pair)."""
    ds, collate = _pairs(ctx), _collator(ctx)
    idx = ctx.workflow.step_example_indices(len(ds), ctx.args, 0)[:steps]
    if short_last:
        idx[-1] = [idx[-1][0][:-1]]
    return [[{k: n(v) for k, v in collate([ds[i] for i in mb]).items()} for mb in step] for step in idx]


def _adapter(ctx) -> dict[str, np.ndarray]:
    """The LoRA init with a nonzero lora_B (from numpy), so the policy is not the reference."""
    r = rng_for("dpo_adapter")
    return {k: (v if ".lora_A." in k else (r.standard_normal(v.shape) * ADAPTER_SCALE).astype(np.float32))
            for k, v in _lora_init(ctx).items()}


def _torch_batch(mb: dict) -> dict[str, torch.Tensor]:
    """A recorded batch as the torch workflow takes it: ids, masks, labels, positions and grids long; pixels float."""
    return {k: torch.from_numpy(np.asarray(v)).to(torch.float32 if np.asarray(v).dtype.kind == "f" else torch.long)
            for k, v in batch_arrays(mb).items()}


def probe_sequence_logps(ctx):
    mb = _step_batches(ctx, 1)[0][0]
    adapter = _adapter(ctx)
    model = ctx.workflow.load_model(ctx.ckpt, ctx.workflow.lora_config(ctx.args), ctx.args.seed)
    ctx.lora.load_lora_state_dict(model, adapter)
    batch = _torch_batch(mb)
    with torch.no_grad():
        out = ctx.workflow.concatenated_forward(model, batch)
    ref_chosen, ref_rejected = ctx.workflow.reference_log_probs(model, batch)
    inputs = {**batch_arrays(mb), **{f"lora.{k}": v for k, v in adapter.items()}}
    return inputs, {"chosen_logps": n(out["chosen_logps"]), "rejected_logps": n(out["rejected_logps"]),
                    "ref_chosen_logps": n(ref_chosen), "ref_rejected_logps": n(ref_rejected)}


def _step0(ctx):
    if getattr(ctx, "dpo_step0", None) is None:
        steps, adapter = _step_batches(ctx, 1), _adapter(ctx)
        model = ctx.workflow.load_model(ctx.ckpt, ctx.workflow.lora_config(ctx.args), ctx.args.seed)
        loss, metrics, grads = ctx.workflow.dpo_step_loss_metrics_and_grads(
            model, adapter, [_torch_batch(mb) for mb in steps[0]], ctx.args)
        inputs = {**_flatten_steps(steps), **{f"lora.{k}": v for k, v in adapter.items()}}
        ctx.dpo_step0 = inputs, loss, metrics, grads
    return ctx.dpo_step0


def probe_dpo_loss_step0(ctx):
    inputs, loss, _, _ = _step0(ctx)
    return inputs, {"loss": np.float32(loss)}


def probe_dpo_metrics_step0(ctx):
    inputs, _, metrics, _ = _step0(ctx)
    return inputs, {metric_key(k): np.float32(v) for k, v in metrics.items()}


def probe_dpo_grads_step0(ctx):
    inputs, _, _, grads = _step0(ctx)
    return inputs, {k: np.asarray(v, np.float32) for k, v in grads.items()}


def _fixed(ctx):
    """k steps from the LoRA init (the last one short) under the task's args and under DPO_FIXED_STEPS_OPTIONS."""
    if getattr(ctx, "dpo_fixed", None) is None:
        steps, init = _step_batches(ctx, int(ctx.cfg.method.fixed_steps), short_last=True), _lora_init(ctx)
        batches = [[_torch_batch(mb) for mb in step] for step in steps]
        losses, final = fixed_step_runs(lambda args: ctx.workflow.train_steps(ctx.ckpt, init, batches, args),
                                        ctx.args, DPO_FIXED_STEPS_OPTIONS)
        ctx.dpo_fixed = ({**_flatten_steps(steps), **{f"lora.{k}": v for k, v in init.items()}}, losses, final)
    return ctx.dpo_fixed


def probe_dpo_fixed_steps_loss(ctx):
    inputs, losses, _ = _fixed(ctx)
    return inputs, losses


def probe_dpo_fixed_steps_params(ctx):
    inputs, _, final = _fixed(ctx)
    return inputs, final


# ---- L5 / L6 -----------------------------------------------------------------------------------

def probe_dpo_e2e_step_losses(ctx):
    return {"seed": np.int64(ctx.args.seed)}, {"step_losses": np.asarray(ctx.run().step_losses, np.float32)}


def probe_dpo_e2e_metrics(ctx):
    steps = rewarded_steps(ctx.run().step_metrics)
    return ({"seed": np.int64(ctx.args.seed), "rewarded_steps": steps},
            dpo_trajectory_outputs(ctx.run().step_metrics, steps, width_dependent_metrics(ctx.features)))


def probe_dpo_e2e_eval(ctx):
    return {"seed": np.int64(ctx.args.seed)}, dpo_eval_outputs(ctx.run().eval_before, ctx.run().eval_after,
                                                                 width_dependent_metrics(ctx.features))


def _heldout_batches(ctx, rope_index=None) -> list[dict[str, np.ndarray]]:
    """The eval pairs in order, in batches of per_device_eval_batch_size, collated as the source's
    evaluation collates them (to a multiple of 8; text rows padded with 0, whose id no log-prob reads; a
    vision-language task's with its images and M-RoPE positions, as train_dpo's evaluation does)."""
    held_out, size = _pairs(ctx, "eval"), ctx.args.per_device_eval_batch_size
    collate = _collator(ctx, rope_index) if "data:images" in ctx.features else ctx.workflow.make_collator(ctx.args)
    return [batch_arrays(collate(held_out[s:s + size])) for s in range(0, len(held_out), size)]


def _adapted_model(ctx, adapter: dict):
    model = ctx.workflow.load_model(ctx.ckpt, ctx.workflow.lora_config(ctx.args), ctx.args.seed)
    ctx.lora.load_lora_state_dict(model, adapter)
    return model


@torch.no_grad()
def _heldout_logits(ctx, model, batches) -> tuple[list[np.ndarray], list[np.ndarray]]:
    policy, reference = [], []
    for b in batches:
        tb = _torch_batch(b)
        ids, mask, extra = tb["input_ids"], tb["attention_mask"], ctx.sft.model_inputs(tb)
        policy.append(n(model(ids, mask, **extra)))
        with ctx.lora.disable_adapter(model):
            reference.append(n(model(ids, mask, **extra)))
    return policy, reference


def probe_heldout_preference(ctx):
    """Inputs: the held-out pairwise batches and the loss's constants (the grader keeps the labels and computes
    loss and accuracy from the candidate's policy and reference logits, catalog/heldout.py). Outputs: the
    source's eval loss and accuracy of the seed run; the bands are the spread of the seed-varied runs."""

    runs = [ctx.run() if s == ctx.args.seed else ctx.train(s) for s in ctx.cfg.method.band_seeds]
    metrics = {"loss": "loss", "accuracy": "rewards/accuracies"}
    spread = {m: [float(r.eval_after[k]) for r in runs] for m, k in metrics.items()}
    model = _adapted_model(ctx, ctx.run().lora_state_dict)
    batches = _heldout_batches(ctx, getattr(model, "rope_index", None))
    a = ctx.args
    ours = preference_metrics(*_heldout_logits(ctx, model, batches), [b["labels"] for b in batches],
                              a.pref_beta, a.dpo_label_smoothing, a.pref_ftx)
    theirs = {m: float(ctx.run().eval_after[k]) for m, k in metrics.items()}
    if abs(ours["loss"] - theirs["loss"]) > 1e-5 * abs(theirs["loss"]) or ours["accuracy"] != theirs["accuracy"]:
        raise RuntimeError(f"catalog/heldout.py gives {ours} on the recorded held-out batches, the source's "
                           f"evaluation {theirs}")
    ctx.band = (min(spread["loss"]), max(spread["loss"]))
    ctx.l6_attrs["heldout_preference"] = {
        **{f"band_{m}": [min(v), max(v)] for m, v in spread.items()},
        **{f"{m}_before": float(ctx.run().eval_before[k]) for m, k in metrics.items()}}
    inputs = {f"b{i}.{k}": v for i, b in enumerate(batches) for k, v in b.items()}
    inputs.update(eval_batch_size=np.int64(a.per_device_eval_batch_size), beta=np.float64(a.pref_beta),
                  label_smoothing=np.float64(a.dpo_label_smoothing), ftx=np.float64(a.pref_ftx))
    return inputs, {m: np.float32(v) for m, v in theirs.items()}


PROBES = {
    "pairwise_tokens": probe_pairwise_tokens, "pairwise_labels": probe_pairwise_labels,
    "pairwise_collate": probe_pairwise_collate, "sequence_logps": probe_sequence_logps,
    "dpo_loss_step0": probe_dpo_loss_step0, "dpo_metrics_step0": probe_dpo_metrics_step0,
    "dpo_grads_step0": probe_dpo_grads_step0, "dpo_fixed_steps_loss": probe_dpo_fixed_steps_loss,
    "dpo_fixed_steps_params": probe_dpo_fixed_steps_params, "dpo_e2e_step_losses": probe_dpo_e2e_step_losses,
    "dpo_e2e_metrics": probe_dpo_e2e_metrics, "dpo_e2e_eval": probe_dpo_e2e_eval,
    "heldout_preference": probe_heldout_preference,
}
