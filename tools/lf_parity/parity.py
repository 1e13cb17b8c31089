"""One task's parity record: LLaMA-Factory's run against the torch source's, cell by cell (docs/LF_PARITY.md)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np

from catalog.provenance import ROOT
from torch_sources.training import dpo, ppo, template
from torch_sources.training.mm_plugin import TowerPlugin, find_medias, read_processor_files
from tools.lf_parity import compare
from tools.lf_parity.harness import (PPO_CONFIG, RELEASE_PREPROCESSOR, Job, make_job, ppo_injections,
                                     project_batches, project_rows, project_run, run_lf,
                                     text_hidden_size)

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

# LF as it is on Pillow: the compared runs with images put the project's Pillow first on LF's path
# (harness.PILLOW_OVERLAY); this run leaves LF's own 11.3.0, and measures what the pass order moves
PILLOW = ("LF's lock holds Pillow 11.3.0 (gradio's pin), the project 13.0.0; Pillow 13.0 runs a downscale's two "
          "resampling passes vertical-first where the height shrinks by more than twice the width (11.3 always "
          "horizontal-first), so a tall image's pixels move by a grey level (python -m tools.lf_parity.plugins: "
          "identical under one Pillow). The compared run gives LF the project's Pillow; this one leaves LF's own: "
          "what the pass order moves, measured, not judged")

# why a cell has nothing to compare, where that is by design
NOT_COMPARABLE = {
    ("sft", "metrics"): "SFT logs only its loss (compared in losses)",
    ("ppo", "eval"): "LF's PPO has no evaluation (CustomPPOTrainer raises on an eval dataset); the project's "
                     "held-out reward is its own measure",
}
PPO_LOSSES = ("ppo/loss/policy", "ppo/loss/value", "ppo/loss/total")
# A vision-language PPO task: LF's own run is attempted (train_ppo as for text, nothing injected yet when it
# stops) and where it stops is recorded; the run's cells carry this reason and that message
VL_PPO = ("LF 0.9.5's PPO cannot run a vision-language model (transformers 5.6, TRL 0.9.6): TRL's "
          "PPOTrainer.prepare_dataloader drops every dataset column its value-head model's forward does not name "
          "(PPOConfig.remove_unused_columns, True by default; LF leaves it), images and labels among them, so LF's "
          "multimodal collator sees a batch without images, adds its fake image and writes its IGNORE_INDEX labels "
          "in front of features[0]['labels'], which is gone; and past that, ppo_train hands get_inputs (generate) "
          "and the PPO step only input_ids and attention_mask. The value head itself is built (LF's "
          "configure_visual_model copies text_config.hidden_size to the top-level config). The project's VL PPO "
          "keeps the images and passes the pixels, and what each family adds (grids and M-RoPE positions, token "
          "types, image sizes), to generation and the forward (docs/ARCHITECTURE.md, torch_sources/training/ppo.py)")
VL_PPO_STOP = "KeyError: 'labels'"  # the message LF's run must stop with for VL_PPO to be the reason
VL_PPO_CELLS = ("losses", "adapter", "metrics", "config")
# Qwen2.5-Omni's PPO stops earlier, building its value head (observed: the message below, before any dataset column)
OMNI_PPO = ("LF 0.9.5's PPO cannot build a value head on Qwen2.5-Omni (transformers 5.6, TRL 0.9.6): LF loads "
            "Qwen2_5OmniForConditionalGeneration (AutoModelForTextToWaveform) and keeps its thinker, whose config "
            "(Qwen2_5OmniThinkerConfig) has no hidden_size, only text_config.hidden_size; LF's configure_visual_model "
            "copies text_config.hidden_size up only on the config it loaded, the top-level Qwen2_5OmniConfig (which "
            "has thinker_config, no text_config: nothing is copied), and TRL 0.9.6's ValueHead.__init__ assigns "
            "hidden_size only from config.hidden_size, word_embed_proj_dim or an encoder-decoder's decoder, so "
            "nn.Linear(hidden_size, 1) raises UnboundLocalError in AutoModelForCausalLMWithValueHead.from_pretrained "
            "(LF's load_model, add_valuehead). Past it, LF's PPO would meet the Qwen-VL stop as well (TRL drops the "
            "images and labels columns; ppo_train hands generation only input_ids and attention_mask). The project's "
            "Omni PPO keeps the images and the fake audio (torch_sources/training/ppo.py)")
OMNI_PPO_STOP = "UnboundLocalError: cannot access local variable 'hidden_size'"
# model_type -> (reason, the message LF's PPO run must stop with); every other VL model: VL_PPO, VL_PPO_STOP
PPO_STOPS = {"qwen2_5_omni": (OMNI_PPO, OMNI_PPO_STOP)}
# Qwen2.5-Omni: the release's feature extractor pads every audio to 300 s, the source's to 30 s (a finding on the
# cells it moves: template and collated batches; the thinker reads only the masked-in frames, so nothing else moves)
OMNI_AUDIO_CHUNK = ("the torch source's Whisper settings for Qwen2.5-Omni (torch_sources/models/audio_processing.py "
                    "WhisperFeatureConfig.qwen2_omni, and its JAX twin) keep WhisperFeatureExtractor's class default "
                    "chunk_length 30 s (n_samples 480000, 3000 frames); Qwen2.5-Omni-7B's preprocessor_config.json "
                    "ships chunk_length 300 (n_samples 4800000, nb_max_frames 30000), and LF's Qwen2OmniPlugin calls "
                    "the extractor with padding='max_length', so LF pads every audio (the collator's fake 0.1 s one "
                    "included) to 30000 frames, the source to 3000. The frames they share are identical and LF's "
                    "extra ones are masked out; the thinker keeps only masked-in frames (get_audio_features), so "
                    "losses, adapter, metrics and eval agree. An audio longer than 30 s would be cut by the source "
                    "(truncation) and not by LF, and so get fewer audio tokens")
# LF's SFT trainer with a processor (a vision-language task) normalizes the loss its own way, and the torch source
# follows it (torch_sources/training/sft.py loads_processor); the hf_loss_kwargs runs restore HF's own rule in LF and
# measure what LF's choice changes (an effect, not judged).
MM_LOSS = ("LF 0.9.5's CustomSeq2SeqTrainer sets model_accepts_loss_kwargs = False whenever a processor is loaded "
           "(any multimodal model: 'avoid wrong loss under gradient accumulation', transformers PR 36044), so HF's "
           "Trainer passes no num_items_in_batch: each micro-batch's loss is the model's own mean over its own "
           "shifted labels, divided by GA. The torch source does the same (sft.loads_processor). The hf_loss_kwargs "
           "run is LF's run with HF's own value of model_accepts_loss_kwargs restored and nothing else changed: "
           "what LF's choice moves, measured, not judged")
HF_LOSS_KWARGS = "hf_loss_kwargs"  # the cell prefix of those runs


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
    """losses, adapter, eval and metrics of one training run (and, with images, its collated batches)."""
    cells = {"losses": compare.compare_values(lf["step_losses"], result.step_losses),
             "adapter": compare.compare_adapters(lf["adapter"], result.lora_state_dict)}
    if job.mm:
        cells["batches"] = compare.compare_batches(lf.get("batches"), project_batches(job))
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


def _vl_ppo_parity(job: Job, record: dict) -> None:
    """A vision-language PPO task: LF's own PPO run, expected to stop (VL_PPO); its cells carry the reason and
    the message LF stopped with. A stop for any other reason, or a run that goes through, is an error."""
    hidden = text_hidden_size(job.checkpoint)
    extra = {"rollouts": [], "minibatch_orders": [], "value_head_dropout": job.args.value_head_dropout,
             "ppo_config_keys": sorted(PPO_CONFIG), "value_head_init": ppo.init_value_head(hidden, job.args.seed),
             **PPO_ALIGNED}
    why, expected = PPO_STOPS.get(job.model_type, (VL_PPO, VL_PPO_STOP))
    try:
        run_lf(job, extra=extra)
        stop, error = None, "LF's PPO ran on a vision-language model: compare it (parity._ppo_parity) instead"
    except RuntimeError as failure:
        lines = [line for line in str(failure).splitlines() if line.strip()]
        stop = lines[-1].strip() if lines else str(failure)
        error = None if expected in stop else f"LF's PPO stopped elsewhere: {stop}"
    seen = job.work / "lf" / "result.json"  # what the child saw before LF stopped
    seen = json.loads(seen.read_text()) if seen.exists() else {}
    observed = {"lf_stop": stop, "dataset_columns": seen.get("ppo_dataset_columns"),
                "value_head_in_features": seen.get("value_head_in_features")}
    columns = observed["dataset_columns"] or {}
    if why is VL_PPO:
        if error is None and "images" in (columns.get("trl_kept") or ["images"]):
            error = f"TRL kept the images column ({observed['dataset_columns']}): VL_PPO is not why LF stopped"
        observation = (f". Observed: TRL keeps {columns.get('trl_kept')} of LF's {columns.get('lf')}; the value "
                       f"head takes {observed['value_head_in_features']} features; LF stops at {stop}")
    else:  # stopped in load_model: no value head, no dataset seen
        if error is None and (observed["value_head_in_features"] is not None or columns):
            error = f"LF built the value head or its PPO dataloader ({observed}): {expected} is not why it stopped"
        observation = f". Observed: LF stops at {stop}, before its PPO trainer is built"
    reason = why + (observation if error is None else "")
    for name in VL_PPO_CELLS:  # an unexpected stop is an error, not a documented reason
        record["cells"][name] = ({"max_abs": None, "n": 0, "error": None, "reason": reason, **observed}
                                 if error is None else {"max_abs": None, "n": 0, "error": error, **observed})




def _mm_loss_finding(job: Job, lf: dict, cells: dict, prefix: str, result) -> bool:
    """Where LF's SFT trainer turned model_accepts_loss_kwargs off against HF's own rule (MM_LOSS, which the source
    follows): run LF again with HF's value restored (cells hf_loss_kwargs.<prefix>*: a measured effect, not
    judged). True when it applied."""
    flags = lf.get("model_accepts_loss_kwargs") or {}
    if job.method != "sft" or flags.get("lf") is not False or flags.get("hf") is not True:
        return False
    ajob = Job(**{**job.__dict__, "work": job.work / HF_LOSS_KWARGS, "variants": {}})
    alf = run_lf(ajob, extra={"hf_loss_kwargs": True})
    for name, cell in _run_cells(ajob, alf, result).items():
        cells[f"{HF_LOSS_KWARGS}.{prefix}{name}"] = {**cell, "reason": MM_LOSS}
    return True


# a plugin's facts LF has and the source, by design, does not: not compared, the reason in the cell's note
MM_NOT_COMPARED = {"intern_vl": {"video_token": "LF's intern_vl template registers a video token; the source's tower "
                                                "plugins take images only and refuse a video (the data has none)"}}
# Gemma 3 under LF's transformers 5.6: on a sliding layer the image block's bidirectional attention is OR-ed in after
# the window, so image tokens farther apart than sliding_window see each other; transformers 5.24 (the fidelity
# target, tests/models/test_gemma3_model.py) and the source cut them at the window, AND(window, OR(causal, block)).
# The tiny checkpoint's 16-token image blocks exceed its window of 8; a release's 256 tokens sit inside its 1024.
GEMMA3_WINDOW = ("transformers 5.6 (LF's lock) ORs Gemma 3's image-block mask in after the sliding window, 5.24 (the "
                 "source's fidelity target) keeps the window over it: with the tiny checkpoint's 16 image tokens "
                 "past its window of 8, logits differ by up to 1.67 on one batch; with the window at 64 (no block "
                 "past it) by 2.6e-6 (python -m tools.lf_parity.gemma3_window). A release (window 1024, 256 tokens "
                 "an image) is unaffected")
# the transformers 5.6 class each tower's source processor is bit-equal to (tests/models/test_*_processing.py), LF's
# PIL backend where torchvision is absent
TOWER_IMAGE_PROCESSORS = {"gemma3": "Gemma3ImageProcessorPil", "paligemma": "SiglipImageProcessorPil",
                          "llava_next": "LlavaNextImageProcessorPil", "intern_vl": "GotOcr2ImageProcessorPil"}


def _tower_size(plugin) -> tuple[dict, dict | None]:
    """The source config's size and crop_size as HF's size dicts."""
    c = plugin.image_processor
    if hasattr(c, "shortest_edge"):  # LLaVA-NeXT's CLIP-style processor
        return {"shortest_edge": c.shortest_edge}, {"height": c.crop_size[0], "width": c.crop_size[1]}
    if hasattr(c, "height"):  # SigLIP, Gemma 3
        return {"height": c.height, "width": c.width}, None
    return {"height": c.size[0], "width": c.size[1]}, None  # GotOcr2 (InternVL): one tile


def _tower_ours(job: Job, plugin) -> dict:
    """A bound TowerPlugin as lf_child.mm_facts(tower=True) reports LF's: the plugin, the processor class the
    release names, the image processor class the source is bit-equal to, and each setting both read."""
    c, proc = plugin.image_processor, plugin.processor_config
    pre, _ = read_processor_files(job.tokenizer)
    size, crop = _tower_size(plugin)
    # what transformers' processor holds: the token it expands each image into (InternVL's is the context token),
    # Gemma 3's whole image sequence, InternVL's framing (the source's expansions: mm_plugin.internvl_expand)
    tokens = {"processor_image_token": plugin.image_token, "processor_boi_token": None,
              "processor_full_image_sequence": None, "processor_start_image_token": None,
              "processor_end_image_token": None}
    if plugin.name == "gemma3":
        tokens.update(processor_boi_token=plugin.boi_token, processor_full_image_sequence=(
            f"\n\n{plugin.boi_token}{plugin.image_token * plugin.image_seq_length}{plugin.eoi_token}\n\n"))
    if plugin.name == "intern_vl":
        tokens.update(processor_image_token="<IMG_CONTEXT>", processor_start_image_token="<img>",
                      processor_end_image_token="</img>")
    return {"plugin": plugin.name, "image_token": plugin.image_token, "video_token": None, "audio_token": None,
            "vision_bos_token": None, "vision_eos_token": None, "expand_mm_tokens": True,
            "processor": proc.get("processor_class"), "image_processor": TOWER_IMAGE_PROCESSORS[plugin.name],
            "image_max_pixels": plugin.image_max_pixels, "image_min_pixels": plugin.image_min_pixels,
            **{k: (list(v) if isinstance(v, tuple) else v) for k in ("image_mean", "image_std", "do_resize",
                                                                      "resample", "do_rescale", "rescale_factor",
                                                                      "do_normalize", "do_convert_rgb")
               for v in [getattr(c, k)]},
            "size": size, "crop_size": crop,
            "image_grid_pinpoints": ([list(p) for p in c.image_grid_pinpoints]
                                     if hasattr(c, "image_grid_pinpoints") else None),
            "do_center_crop": getattr(c, "do_center_crop", None), "do_pad": getattr(c, "do_pad", None),
            "crop_to_patches": getattr(c, "crop_to_patches", None), "min_patches": getattr(c, "min_patches", None),
            "max_patches": getattr(c, "max_patches", None),
            # the source refuses pan-and-scan on and keeps the file's off value (the releases ship null)
            "do_pan_and_scan": pre.get("do_pan_and_scan", False) if plugin.name == "gemma3" else None,
            "processor_image_seq_length": proc.get("image_seq_length"),
            "processor_num_additional_image_tokens": proc.get("num_additional_image_tokens"),
            "processor_patch_size": proc.get("patch_size"),
            "processor_vision_feature_select_strategy": proc.get("vision_feature_select_strategy"), **tokens}


def _mm_ours(job: Job) -> dict | None:
    """The source's mm plugin as lf_child.mm_facts reports LF's (None: a template without one)."""
    plugin = template.get_template(job.args.template).bind(job.tokenizer).mm_plugin
    if plugin is None:
        return None
    if isinstance(plugin, TowerPlugin):
        return _tower_ours(job, plugin)
    c = plugin.image_processor
    audio = {}
    if plugin.audio_token is not None:  # Qwen2OmniPlugin: its audio span and the release's WhisperFeatureExtractor
        f = plugin.feature_extractor
        audio = {"audio_bos_token": plugin.audio_bos_token, "audio_eos_token": plugin.audio_eos_token,
                 "feature_extractor": "WhisperFeatureExtractor",
                 **{f"audio_{k}": getattr(f, k) for k in ("feature_size", "sampling_rate", "hop_length",
                                                          "chunk_length", "n_fft", "padding_value", "n_samples")},
                 "audio_dither": 0.0}  # models/audio_processing.py: no dither, as the releases ship it
    return audio | {"plugin": plugin.name, "image_token": plugin.image_token, "video_token": plugin.video_token,
            "audio_token": plugin.audio_token, "vision_bos_token": plugin.vision_bos_token,
            "vision_eos_token": plugin.vision_eos_token, "expand_mm_tokens": True,
            # the processor the release names, and the HF image processor the source is bit-equal to
            "processor": RELEASE_PREPROCESSOR.get(job.model_type, {}).get("processor_class"),
            "image_processor": "Qwen2VLImageProcessorPil",
            "image_max_pixels": plugin.image_max_pixels, "image_min_pixels": plugin.image_min_pixels,
            "min_pixels": c.min_pixels, "max_pixels": c.max_pixels, "patch_size": c.patch_size,
            "temporal_patch_size": c.temporal_patch_size, "merge_size": c.merge_size,
            "image_mean": list(c.image_mean), "image_std": list(c.image_std), "do_resize": c.do_resize,
            "resample": c.resample, "do_rescale": c.do_rescale, "rescale_factor": c.rescale_factor,
            "do_normalize": c.do_normalize, "do_convert_rgb": c.do_convert_rgb}


def template_cell(job: Job, lf: dict) -> dict:
    """The family's template as LF registers it against the source's register_template: its fields, and the
    template-fixed tokenizer's eos, pad, stop-word ids and generation eos ids (PPO's stop ids). With images,
    also its mm plugin (LF's plugin name and tokens) and the processor LF loaded from the release's
    preprocessor_config.json (class, pixel bounds, every image-processor setting) against the source's plugin
    (the classes: the processor the release names, and Qwen2VLImageProcessorPil, which the source is bit-equal
    to)."""
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
    n = len(facts)
    notes = []
    if job.mm or lf.get("mm"):
        lf_mm, our_mm = lf.get("mm") or {}, _mm_ours(job) or {}
        skip = MM_NOT_COMPARED.get(our_mm.get("plugin"), {})
        wrong += [f"mm {k}: LF {lf_mm.get(k)!r}, source {our_mm.get(k)!r}" for k in sorted(lf_mm.keys() | our_mm.keys())
                  if lf_mm.get(k) != our_mm.get(k) and k not in skip]
        notes += [f"mm {k} not compared (LF {lf_mm.get(k)!r}): {why}" for k, why in skip.items()]
        n += len(our_mm) - len(skip)
    cell = {"max_abs": 0.0 if not wrong else None, "n": n, "error": "; ".join(wrong) or None}
    return {**cell, "note": "; ".join(notes)} if notes else cell


def _source_rows(job: Job, overrides: dict) -> dict:
    """The source's processed rows per split; with images, each row's paths resolved against media_dir as LF's
    converter resolves them (the source keeps them as written and resolves them in its collator)."""
    try:
        rows = {split: project_rows(job, split, overrides) for split in ("train", "eval")}
    except ValueError as error:  # the template refuses the variant, as LF's does (compared in tokens)
        return {"refused": str(error)}
    if job.mm:
        rows = {split: [{**row, "images": find_medias(row.get("images") or [], str(job.media_dir))}
                        for row in split_rows] for split, split_rows in rows.items()}
    return rows


def _audio_chunk_findings(job: Job, cells: dict) -> None:
    """Mark the cells the source's 30 s audio padding moves (OMNI_AUDIO_CHUNK): the template's chunk_length and
    n_samples, and the collated batches' audio frames. Marked cells are still judged (they fail)."""
    for name, cell in cells.items():
        error = cell.get("error") or ""
        if name == "template" and "audio_chunk_length" in error or name.endswith("batches") and "audio frames" in error:
            cell["finding"] = OMNI_AUDIO_CHUNK


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
    if job.method == "ppo" and job.mm:
        _vl_ppo_parity(make_job(task, work / "run"), record)
    elif job.method == "ppo":
        _ppo_parity(make_job(task, work / "run"), record, ppo_effects)
    if job.train:
        result = project_run(job)
        cells.update(_run_cells(job, lf, result))
        reference = _reference_step_losses(task)
        cells["reference"] = (compare.compare_values(result.step_losses, reference) if reference is not None
                              else {"max_abs": None, "n": 0, "error": "no reference recorded"})
        _mm_loss_finding(job, lf, cells, "", result)
    for variant, (overrides, lf_overrides, reason) in (TRAIN_VARIANTS[job.method].items()
                                                       if train_variants and job.train else ()):
        vjob = make_job(task, work / variant, overrides, lf_overrides=lf_overrides)
        vjob = Job(**{**vjob.__dict__, "variants": {}})
        if "refused" in _source_rows(vjob, {}):
            for name in ("losses", "adapter", "eval"):
                cells[f"{variant}.{name}"] = {"max_abs": None, "n": 0, "error": None,
                                              "reason": f"{variant}: the template refuses it on both sides (tokens)"}
            continue
        vlf = run_lf(vjob)  # LF as it is: the source follows its loss rule under a processor too (MM_LOSS)
        vresult = result if not overrides else project_run(vjob)
        for name, cell in _run_cells(vjob, vlf, vresult).items():
            cells[f"{variant}.{name}"] = cell if reason is None else {**cell, "reason": reason}
        if reason is None:
            _mm_loss_finding(vjob, vlf, cells, f"{variant}.", vresult)
    if job.mm and job.train and job.method != "ppo" and train_variants:
        pjob = Job(**{**job.__dict__, "work": work / "pillow", "variants": {}, "pillow_overlay": False})
        for name, cell in _run_cells(pjob, run_lf(pjob), result).items():
            cells[f"pillow.{name}"] = {**cell, "reason": PILLOW}
    for (method, name), reason in NOT_COMPARABLE.items():
        if method == job.method:
            cells.setdefault(name, {"max_abs": None, "n": 0, "error": None, "reason": reason})
    _audio_chunk_findings(job, cells)
    if job.model_type == "gemma3":  # still judged: LF on its transformers differs
        for name, cell in cells.items():
            if name.split(".")[-1] in ("losses", "adapter", "eval", "metrics") and "reason" not in cell:
                cell["finding"] = GEMMA3_WINDOW
    return record
