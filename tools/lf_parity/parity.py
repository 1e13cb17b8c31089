"""One task's parity record: LLaMA-Factory's run against the torch source's, cell by cell (docs/LF_PARITY.md)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from catalog.provenance import ROOT
from torch_sources.training import dpo, ppo, template
from tools.lf_parity import compare
from tools.lf_parity.harness import PPO_CONFIG, Job, make_job, ppo_injections, project_rows, project_run, run_lf

SDPA = ("LF's default attention (flash_attn auto) is HF's sdpa where the model has it (bloom: eager), the torch "
        "sources are HF's eager attention (the compared runs ask LF for eager: flash_attn disabled); the two round "
        "differently (~1e-6 in logits) and differ on rows with no key to attend to (pads beyond a sliding window), "
        "which only DPO's logits/* means read")
# training runs besides the task's own config, each through both frameworks: (the project's args overrides, LF-only
# arguments, None when it must match or the reason it may differ: a measured effect of LF's default)
TRAIN_VARIANTS = {
    "sft": {"train_on_prompt": ({"train_on_prompt": True}, {}, None), "sdpa": ({}, {"flash_attn": "auto"}, SDPA)},
    "dpo": {"sdpa": ({}, {"flash_attn": "auto"}, SDPA)},
    "ppo": {},
}

# why a cell has nothing to compare, where that is by design
NOT_COMPARABLE = {
    ("sft", "metrics"): "SFT logs only its loss (compared in losses)",
    ("ppo", "eval"): "LF's PPO has no evaluation (CustomPPOTrainer raises on an eval dataset); the project's "
                     "held-out reward is its own measure",
}
PPO_LOSSES = ("ppo/loss/policy", "ppo/loss/value", "ppo/loss/total")


def _reference_step_losses(task: str) -> np.ndarray | None:
    path = ROOT / "references" / f"{task}.h5"
    if not path.exists():
        return None
    with h5py.File(path, "r") as f:
        for name in ("L5/e2e_step_losses/outputs/step_losses", "L5/dpo_e2e_step_losses/outputs/step_losses"):
            if name in f:
                return f[name][()]
    return None


def _dpo_step_metrics(logs: list[dict], names) -> dict[str, list[float]]:
    steps = [log for log in logs if "rewards/chosen" in log]
    return {name: [float(log[name]) for log in steps] for name in names}


def _run_cells(job: Job, lf: dict, result) -> dict:
    """losses, adapter, eval and metrics of one training run."""
    cells = {"losses": compare.compare_values(lf["step_losses"], result.step_losses),
             "adapter": compare.compare_adapters(lf["adapter"], result.lora_state_dict)}
    before, after = lf["eval_before"] or {}, lf["eval_after"] or {}
    if job.method == "sft":
        cells["eval"] = compare.merge([compare.compare_values(before.get("eval_loss"), result.eval_loss_before),
                                       compare.compare_values(after.get("eval_loss"), result.eval_loss_after)])
    else:
        pairs = [(before.get(f"eval_{name}"), result.eval_before[name]) for name in ("loss", *dpo.METRICS)]
        pairs += [(after.get(f"eval_{name}"), result.eval_after[name]) for name in ("loss", *dpo.METRICS)]
        cells["eval"] = compare.merge([compare.compare_values(a, b) for a, b in pairs])
        lf_metrics = _dpo_step_metrics(lf["logs"], dpo.METRICS)
        cells["metrics"] = compare.merge([compare.compare_values(lf_metrics[name], result.step_metrics[name])
                                          for name in dpo.METRICS])
    return cells


def _ppo_cells(job: Job, lf: dict, result) -> dict:
    """PPO: the loss terms of every step (losses), every other TRL stat (metrics), the adapter and value head,
    the PPOConfig LF built against the project's args (config)."""
    stats = lf.get("step_stats") or []
    per_key = {k: [s.get(k, float("nan")) for s in stats] for k in result.step_stats}
    cells = {"losses": compare.merge([compare.compare_values(per_key[k], result.step_stats[k]) for k in PPO_LOSSES]),
             "metrics": compare.merge([compare.compare_values(per_key[k], result.step_stats[k])
                                       for k in result.step_stats if k not in PPO_LOSSES]),
             "adapter": compare.merge([compare.compare_adapters(lf["adapter"], result.lora_state_dict),
                                       compare.compare_adapters(
                                           {k: np.asarray(v, np.float32) for k, v in (lf.get("value_head") or {}).items()}
                                           if lf.get("value_head") else None, result.value_head)])}
    values = vars(job.args) | {"batch_size": job.args.batch_size}
    config = lf.get("ppo_config") or {}
    wrong = [f"{k}: LF {config.get(k)!r}, project {values[v]!r}" for k, v in PPO_CONFIG.items()
             if config.get(k) != values[v]]
    cells["config"] = {"max_abs": 0.0 if not wrong else None, "n": len(PPO_CONFIG), "error": "; ".join(wrong) or None}
    return cells


# The four places LF 0.9.5's PPO (on TRL 0.9.6) departs from the project's, each turned off in the compared run and
# measured on its own (docs/LF_PARITY.md): documented choices of the project, not injected behaviour.
PPO_ALIGNED = {"amp": False, "clip_every_step": True, "no_decay_is_zero": True, "sync_by_count": True}
PPO_EFFECTS = {
    "autocast": ({"amp": True}, "LF wraps get_rewards and batched_forward_pass in torch.autocast(device): bf16 on a "
                 "CPU (fp16 on CUDA) even in an fp32 run; the project records true fp32"),
    "clip_once": ({"clip_every_step": False}, "TRL 0.9.6 keeps PPOTrainer.model_params as a filter() iterator, so "
                  "only the run's first optimizer step is clipped to max_grad_norm; the project clips every step"),
    "no_decay_wd": ({"no_decay_is_zero": False}, "LF's PPO create_optimizer passes no weight_decay for its no-decay "
                    "group (the value head's bias), so torch AdamW's default 0.01 decays it; the project decays no "
                    "bias (HF Trainer's own optimizer gives that group 0.0)"),
    "last_step_sync": ({"sync_by_count": False}, "accelerate syncs every accumulate() while the dataloader yields its "
                       "last batch, so LF's last PPO step takes one optimizer step per mini-batch (each of loss / GA); "
                       "the project accumulates GA mini-batches in every step"),
}


def _ppo_parity(job: Job, record: dict, effects: bool) -> None:
    """PPO: the project's own run first (its rollouts are LF's), then LF's aligned run, then LF as it is with
    one alignment left out at a time (when effects)."""
    result = project_run(job)
    extra = ppo_injections(job, result)
    lf = run_lf(job, extra={**extra, **PPO_ALIGNED})
    record["cells"].update(_ppo_cells(job, lf, result))
    if not effects:
        return
    for name, (overrides, reason) in PPO_EFFECTS.items():  # LF as it is, one alignment left out at a time
        ejob = Job(**{**job.__dict__, "work": job.work / name, "variants": {}})
        elf = run_lf(ejob, extra={**ppo_injections(job, result), **PPO_ALIGNED, **overrides})
        for cell_name, cell in _ppo_cells(ejob, elf, result).items():
            if cell_name in ("losses", "adapter"):
                record["cells"][f"{name}.{cell_name}"] = {**cell, "reason": reason}


def template_cell(job: Job, lf: dict) -> dict:
    """The family's template as LF registers it against the source's register_template: its fields, and the
    template-fixed tokenizer's eos, pad, stop-word ids and generation eos ids (PPO's stop ids)."""
    facts = lf.get("template")
    if not facts:
        return {"max_abs": None, "n": 0, "error": "LF reported no template"}
    tpl = template.get_template(job.args.template)
    tokenizer = tpl.fix_special_tokens(template.load_tokenizer(job.tokenizer))
    ours = {k: (list(getattr(tpl, k)) if isinstance(getattr(tpl, k), tuple) else getattr(tpl, k))
            for k in facts if hasattr(tpl, k)}
    ours.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                stop_word_ids=[tokenizer.convert_tokens_to_ids(w) for w in tpl.stop_words],
                generation_eos_ids=list(ppo.generation_ids(job.tokenizer, job.args)[0]))
    wrong = [f"{k}: LF {facts.get(k)!r}, source {ours.get(k)!r}" for k in facts if facts.get(k) != ours.get(k)]
    return {"max_abs": 0.0 if not wrong else None, "n": len(facts), "error": "; ".join(wrong) or None}


def _source_rows(job: Job, overrides: dict) -> dict:
    try:
        return {split: project_rows(job, split, overrides) for split in ("train", "eval")}
    except ValueError as error:  # the template refuses the variant, as LF's does (compared in tokens)
        return {"refused": str(error)}


def task_parity(task: str, work: Path, train_variants: bool = True, ppo_effects: bool = True) -> dict:
    """{cell: comparison} for one task; cells: tokens, losses, adapter, eval, metrics, reference, <variant>.*"""
    job = make_job(task, work)
    if job.method == "ppo":
        job = Job(**{**job.__dict__, "train": False})  # tokens first; the PPO run needs the project's run
    lf = run_lf(job)
    source_rows = {variant: _source_rows(job, overrides) for variant, overrides in job.variants.items()}
    record = {"task": task, "method": job.method, "lf_wall_s": round(lf["wall_s"], 1),
              "torchaudio_standin": lf.get("torchaudio_standin"),
              "cells": {"tokens": compare.compare_tokens(lf["datasets"], source_rows),
                        "template": template_cell(job, lf)}}
    cells = record["cells"]
    if job.method == "ppo":
        _ppo_parity(make_job(task, work / "run"), record, ppo_effects)
    if job.train:
        result = project_run(job)
        cells.update(_run_cells(job, lf, result))
        reference = _reference_step_losses(task)
        cells["reference"] = (compare.compare_values(result.step_losses, reference) if reference is not None
                              else {"max_abs": None, "n": 0, "error": "no reference recorded"})
    for variant, (overrides, lf_overrides, reason) in (TRAIN_VARIANTS[job.method].items()
                                                       if train_variants and job.train else ()):
        vjob = make_job(task, work / variant, overrides, lf_overrides=lf_overrides)
        vjob = Job(**{**vjob.__dict__, "variants": {}})
        if "refused" in _source_rows(vjob, {}):
            for name in ("losses", "adapter", "eval"):
                cells[f"{variant}.{name}"] = {"max_abs": None, "n": 0, "error": None,
                                              "reason": f"{variant}: the template refuses it on both sides (tokens)"}
            continue
        vlf = run_lf(vjob)
        vresult = result if not overrides else project_run(vjob)
        for name, cell in _run_cells(vjob, vlf, vresult).items():
            cells[f"{variant}.{name}"] = cell if reason is None else {**cell, "reason": reason}
    for (method, name), reason in NOT_COMPARABLE.items():
        if method == job.method:
            cells.setdefault(name, {"max_abs": None, "n": 0, "error": None, "reason": reason})
    return record
