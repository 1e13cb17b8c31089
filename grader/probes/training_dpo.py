"""Run the DPO checks on a candidate (the twin of recorder/probes/training_dpo.py), inside the sandboxed
child: the candidate's jax_oracles.training.dpo through its public names, on the recorded inputs only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from catalog.workloads import DPO_FIXED_STEPS_OPTIONS, collate_outputs, dpo_eval_outputs, dpo_trajectory_outputs, fixed_step_runs, metric_key, pad_rows, width_dependent_metrics
from grader.probes.training import _lora_from_inputs, _unflatten_steps, n

FIELDS = ("input_ids", "attention_mask", "labels")


def _pairs(ctx) -> list[dict]:
    return ctx.workflow.load_pairwise_dataset(ctx.assets["tokenizer"], ctx.assets["data"], "train", ctx.args)


# ---- L1 data -----------------------------------------------------------------------------------

def _pair_fields(ctx, field: str, fill: int) -> dict[str, np.ndarray]:
    width = ctx.args.cutoff_len + 1
    return {f"{key}_{field}": pad_rows([list(ex[f"{key}_{field}"])[:width] for ex in _pairs(ctx)], width, fill)
            for key in ("chosen", "rejected")}


def probe_pairwise_tokens(ctx, inp):
    return {**_pair_fields(ctx, "input_ids", -1), "n": np.array(len(_pairs(ctx)))}


def probe_pairwise_labels(ctx, inp):
    return _pair_fields(ctx, "labels", -7)


def _collator(ctx):
    return ctx.workflow.make_collator(ctx.args, ctx.assets["tokenizer"], data_dir=ctx.assets["data"],
                                      rope_index=ctx.rope_index)


def probe_pairwise_collate(ctx, inp):
    return collate_outputs(ctx.features, _collator(ctx), _pairs(ctx), np.asarray)


# ---- L3 / L4 -----------------------------------------------------------------------------------

def _model(ctx):
    return ctx.workflow.load_model(ctx.assets["checkpoint"], ctx.workflow.lora_config(ctx.args), ctx.args.seed)


def probe_sequence_logps(ctx, inp):
    model = _model(ctx)
    variables = {"params": model.params, "lora": ctx.lora.lora_tree_from_state_dict(_lora_from_inputs(inp))}
    batch = {k: jnp.asarray(inp[k]) for k in FIELDS}
    if "position_ids" in inp:  # a Qwen-VL batch: its M-RoPE positions
        batch["position_ids"] = jnp.asarray(inp["position_ids"])
    if "token_type_ids" in inp:  # Gemma 3's and PaliGemma's: the image blocks' attention
        batch["token_type_ids"] = jnp.asarray(inp["token_type_ids"])
    batch.update(_tower_features(ctx, model, inp))  # a vision-language batch: the frozen tower's image features
    out = ctx.workflow.concatenated_forward(model.module, variables, batch)
    ref_chosen, ref_rejected = ctx.workflow.reference_log_probs(model.module, variables, batch)
    return {"chosen_logps": n(out["chosen_logps"]), "rejected_logps": n(out["rejected_logps"]),
            "ref_chosen_logps": n(ref_chosen), "ref_rejected_logps": n(ref_rejected)}


def _tower_features(ctx, model, inp) -> dict:
    """The recorded pixels (and Omni's fake audio) through the candidate's frozen towers, as the forward's keywords."""
    if "pixel_values" not in inp:
        return {}
    extra = {k: np.asarray(inp[k]) for k in ("image_grid_thw", "image_sizes") if k in inp}
    encoded = ctx.sft.encode_images(model, np.asarray(inp["pixel_values"]), **extra)
    features = dict(encoded) if isinstance(encoded, dict) else {"image_embeds": encoded}
    if "input_features" in inp:  # Omni: LF's fake audio through the candidate's audio tower
        features["audio_embeds"] = ctx.sft.encode_audio(model, np.asarray(inp["input_features"]),
                                                        np.asarray(inp["feature_attention_mask"]))
    return features


def _step0(ctx, inp):
    if getattr(ctx, "dpo_step0", None) is None:
        ctx.dpo_step0 = ctx.workflow.dpo_step_loss_metrics_and_grads(_model(ctx), _lora_from_inputs(inp),
                                                                     _unflatten_steps(inp)[0], ctx.args)
    return ctx.dpo_step0


def probe_dpo_loss_step0(ctx, inp):
    return {"loss": np.float32(_step0(ctx, inp)[0])}


def probe_dpo_metrics_step0(ctx, inp):
    return {metric_key(k): np.float32(v) for k, v in _step0(ctx, inp)[1].items()}


def probe_dpo_grads_step0(ctx, inp):
    return {k: np.asarray(v, np.float32) for k, v in _step0(ctx, inp)[2].items()}


def _fixed(ctx, inp):
    if getattr(ctx, "dpo_fixed", None) is None:
        init, steps = _lora_from_inputs(inp), _unflatten_steps(inp)
        ctx.dpo_fixed = fixed_step_runs(
            lambda args: ctx.workflow.train_steps(ctx.assets["checkpoint"], init, steps, args), ctx.args,
            DPO_FIXED_STEPS_OPTIONS)
    return ctx.dpo_fixed


def probe_dpo_fixed_steps_loss(ctx, inp):
    return _fixed(ctx, inp)[0]


def probe_dpo_fixed_steps_params(ctx, inp):
    return _fixed(ctx, inp)[1]


# ---- L5 / L6 -----------------------------------------------------------------------------------

def probe_dpo_e2e_step_losses(ctx, inp):
    return {"step_losses": np.asarray(ctx.run().step_losses, np.float32)}


def probe_dpo_e2e_metrics(ctx, inp):
    return dpo_trajectory_outputs(ctx.run().step_metrics, inp["rewarded_steps"], width_dependent_metrics(ctx.features))


def probe_dpo_e2e_eval(ctx, inp):
    return dpo_eval_outputs(ctx.run().eval_before, ctx.run().eval_after, width_dependent_metrics(ctx.features))


def probe_heldout_preference(ctx, inp):
    """Policy and reference logits of the candidate's public forward, with the adapter its own L5 run produced
    (adapter.<PEFT name>), on the held-out pairwise batches b<i>.*. Never its train_dpo or evaluate: the
    grader computes loss and accuracy from these logits (catalog/heldout.py)."""
    model = _model(ctx)
    adapter = ctx.lora.lora_tree_from_state_dict({k[len("adapter."):]: np.asarray(v) for k, v in inp.items()
                                                  if k.startswith("adapter.")})
    variables = {"params": model.params, "lora": adapter}
    num_batches = len([k for k in inp if k.startswith("b") and k.endswith(".input_ids")])
    out = {}
    for i in range(num_batches):
        out[f"b{i}.logits"] = n(ctx.forward(variables, inp, f"b{i}.")).astype(np.float32)
        out[f"b{i}.ref_logits"] = n(ctx.forward(ctx.lora.disable_adapter(variables), inp, f"b{i}.")).astype(np.float32)
    return out


PROBES = {
    "pairwise_tokens": probe_pairwise_tokens, "pairwise_labels": probe_pairwise_labels,
    "pairwise_collate": probe_pairwise_collate, "sequence_logps": probe_sequence_logps,
    "dpo_loss_step0": probe_dpo_loss_step0, "dpo_metrics_step0": probe_dpo_metrics_step0,
    "dpo_grads_step0": probe_dpo_grads_step0, "dpo_fixed_steps_loss": probe_dpo_fixed_steps_loss,
    "dpo_fixed_steps_params": probe_dpo_fixed_steps_params, "dpo_e2e_step_losses": probe_dpo_e2e_step_losses,
    "dpo_e2e_metrics": probe_dpo_e2e_metrics, "dpo_e2e_eval": probe_dpo_e2e_eval,
    "heldout_preference": probe_heldout_preference,
}
