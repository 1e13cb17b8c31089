"""The fixed-size towers' data pipeline (issue 34: gemma3, paligemma, llava_next, intern_vl) through LLaMA-Factory and
through the torch source, side by side; no training (these families have no tasks yet).

    python -m tools.lf_parity.plugins [--work DIR] [family ...]   # default: all four, in temp dirs

Exit status 1 on a difference that is not the Pillow gap below. --work DIR keeps each family's LF model dir, job and
dumps (DIR/<family>/lf/{rows,batches}.npz) instead of a temp dir.

For each family a temp dir becomes LF's model dir: the checkpoint's files, the tokenizer's and the processor files
beside it (preprocessor_config.json, processor_config.json), linked; and, where transformers 5.6's processor reads
named tokens off the tokenizer that the tiny tokenizer_config.json does not name, a copy of that file with them under
`extra_special_tokens` (RELEASE_TOKEN_NAMES: no id, vocabulary or encoding changes). plugins_lf.py then runs, in
.venv-lf, LF's load_tokenizer, get_template_and_fix_tokenizer and get_dataset (stages sft, rm, ppo over the VL data)
and its collators on the first rows of each split: a batch of the first rows (images, and text rows among them) and
a batch of the first rows without images (LF's fake 64x64 image). The torch source runs the same rows through
sft.load_processed_dataset / dpo.load_pairwise_dataset / ppo.load_prompt_dataset and each workflow's make_collator.
Compared: every row's ids, masks and labels exactly (and its resolved image paths), each batch's integer tensors
exactly and pixel_values at 1e-6 (PIXEL_ATOL). cutoff_len 320 (CUTOFF_LEN), LF's defaults otherwise.

The source resizes with the installed PIL (vision_processing.resize_pil), and Pillow 13.0 (.venv) orders its two
resampling passes differently from <= 12.1 (.venv-lf has 11.3.0, gradio's pin): a pixel difference is rerun with the
source's collators under .venv-lf's Pillow (plugins_lf.py --source) and marked "environment" where that is identical.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from catalog.provenance import ROOT
from torch_sources.training import dpo, ppo, sft
from torch_sources.training.mm_plugin import find_medias

LF_PYTHON = ROOT / ".venv-lf" / "bin" / "python"
CHILD = Path(__file__).with_name("plugins_lf.py")
CUTOFF_LEN = 320
PIXEL_ATOL = 1e-6
BATCH_SIZE = 4  # the methods' per_device_train_batch_size (configs/method/*.yaml): SFT rows, DPO pairs, PPO prompts
SFT_DATA, DPO_DATA = ROOT / "assets" / "data" / "sft_vl", ROOT / "assets" / "data" / "dpo_vl"  # PPO: the SFT rows
# family -> LF's template name (the source's is the same)
FAMILIES = {"gemma3": "gemma3", "paligemma": "paligemma", "llava_next": "llava_next", "internvl": "intern_vl"}
# What transformers 5.6's processors read off the tokenizer by name, spelled as the releases' tokenizer_config.json
# (google/gemma-3-4b-it, OpenGVLab/InternVL3-1B-hf) name them; without them AutoProcessor raises AttributeError and
# LF's load_tokenizer goes on without a processor (then refuses the images):
# - Gemma3Processor.__init__: tokenizer.image_token_id, .boi_token, .image_token, .eoi_token;
# - InternVLProcessor.__init__: tokenizer.start_image_token(_id), .end_image_token(_id), .context_image_token(_id),
#   .video_token (the tiny tokenizer has no <video> token: only the name is read, never its id).
# PaliGemmaProcessor and LlavaNextProcessor fall back to "<image>" (the tiny tokenizers' id 403) without a name.
RELEASE_TOKEN_NAMES = {
    "gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    "internvl": {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                 "video_token": "<video>"},
}
# stage -> (LF's get_dataset stage, data dir, dataset_info columns)
STAGES = {
    "sft": ("sft", SFT_DATA, {"prompt": "instruction", "query": "input", "response": "output", "images": "images"}),
    "dpo": ("rm", DPO_DATA, {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected",
                             "images": "images"}),
    "ppo": ("ppo", SFT_DATA, {"prompt": "instruction", "query": "input", "response": "output", "images": "images"}),
}
# keys LF's collator returns that the source's does not, and why that is not a difference
LF_ONLY = {("ppo", "labels"): "LF's PPO collator pads the rows' response labels too; its PPO trainer reads only "
                              "input_ids and attention_mask of the batch (the source's prompt collator has no labels)"}


@dataclass(frozen=True)
class Cell:
    error: str | None  # None: identical
    n: int  # rows, or tensors, compared
    note: str = ""
    pixels_only: bool = False  # the only difference is pixel_values'
    environment: str | None = None  # a pixel difference that vanishes with the source run under LF's Pillow

    def __str__(self):
        if self.error is None:
            return f"identical ({self.n}{', ' + self.note if self.note else ''})"
        return self.error + (f" [{self.environment}]" if self.environment else "")


def model_dir(family: str, out: Path) -> Path:
    """LF's model dir: checkpoint + tokenizer + processor files, linked; tokenizer_config.json copied with the
    RELEASE_TOKEN_NAMES of the family under extra_special_tokens."""
    out.mkdir(parents=True, exist_ok=True)
    assets = ROOT / "assets"
    for src in [*(assets / "checkpoints" / family).iterdir(), *(assets / "tokenizer" / family).iterdir()]:
        if not (out / src.name).exists():
            (out / src.name).symlink_to(src.resolve())
    return with_release_token_names(out, family)


def with_release_token_names(out: Path, family: str) -> Path:
    """out/tokenizer_config.json (a link to the tiny tokenizer's) rewritten as a file with the family's
    RELEASE_TOKEN_NAMES under extra_special_tokens; nothing for a family without them, nothing twice."""
    if family in RELEASE_TOKEN_NAMES and (out / "tokenizer_config.json").is_symlink():
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").unlink()  # the link: written anew, the tiny tokenizer's file untouched
        extra = {**config.get("extra_special_tokens", {}), **RELEASE_TOKEN_NAMES[family]}
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "extra_special_tokens": extra}, indent=2))
    return out


def batch_rows(data: Path, split: str) -> dict[str, list[int]]:
    """The collated batches of a split: its first BATCH_SIZE rows, and its first BATCH_SIZE rows without images."""
    rows = json.loads((data / f"{split}.json").read_text())
    out = {"first": list(range(min(BATCH_SIZE, len(rows))))}
    text = [i for i, row in enumerate(rows) if not row.get("images")][:BATCH_SIZE]
    if text:
        out["no_images"] = text
    return out


def write_job(family: str, work: Path) -> dict:
    data_dir = work / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    info, stages = {}, {}
    for stage, (lf_stage, data, columns) in STAGES.items():
        for split in ("train", "eval"):
            entry = {"file_name": str(data / f"{split}.json"), "formatting": "alpaca", "columns": columns}
            if stage == "dpo":
                entry["ranking"] = True
            info[f"{stage}_{split}"] = entry
        stages[stage] = {"lf_stage": lf_stage, "train": f"{stage}_train", "eval": f"{stage}_eval",
                         "media_dir": str(data),  # the rows' image names are their data dir's (the source's default)
                         "batches": {split: batch_rows(data, split) for split in ("train", "eval")}}
    (data_dir / "dataset_info.json").write_text(json.dumps(info, indent=1))
    args = {"model_name_or_path": str(model_dir(family, work / "model")), "template": FAMILIES[family],
            "do_train": True, "finetuning_type": "lora", "dataset_dir": str(data_dir),
            "cutoff_len": CUTOFF_LEN, "overwrite_cache": True, "report_to": "none", "bf16": False, "fp16": False,
            "trust_remote_code": False}
    source = {"root": str(ROOT), "tokenizer": str(ROOT / "assets" / "tokenizer" / family),
              "loaders": {"sft": "load_processed_dataset", "dpo": "load_pairwise_dataset",
                          "ppo": "load_prompt_dataset"},
              "args": {"sft": "TrainArgs", "dpo": "DPOArgs", "ppo": "PPOArgs"}}
    job = {"family": family, "args": args, "stages": stages, "source": source}
    (work / "job.json").write_text(json.dumps(job, indent=1))
    return job


def _child(work: Path, *flags: str, timeout_s: float = 900) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(work / "hf_cache"),
                "TOKENIZERS_PARALLELISM": "false", "PYTHONNOUSERSITE": "1",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2")})
    proc = subprocess.run([str(LF_PYTHON), str(CHILD), str(work), *flags], cwd=work, env=env, capture_output=True,
                          text=True, timeout=timeout_s)
    (work / f"lf_child{''.join(flags)}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{CHILD.name} {' '.join(flags)} in {work} failed (exit {proc.returncode}):\n"
                           + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:]))


def run_lf(family: str, work: Path) -> tuple[dict, dict, dict]:
    """plugins_lf.py in .venv-lf -> (rows, batches, meta)."""
    if not LF_PYTHON.exists():
        raise FileNotFoundError(f"{LF_PYTHON} is missing: run `make lf-env` first")
    write_job(family, work)
    _child(work)
    with np.load(work / "lf" / "rows.npz") as f:
        rows = {k: f[k] for k in f.files}
    with np.load(work / "lf" / "batches.npz") as f:
        batches = {k: f[k] for k in f.files}
    return rows, batches, json.loads((work / "lf" / "meta.json").read_text())


def _args(stage: str, family: str):
    cls = {"sft": sft.TrainArgs, "dpo": dpo.DPOArgs, "ppo": ppo.PPOArgs}[stage]
    return cls(template=FAMILIES[family], cutoff_len=CUTOFF_LEN)  # media_dir: the data dir


def source_stage(family: str, stage: str, spec: dict) -> tuple[dict, dict]:
    """The torch source's rows of both splits ({split: [row]}) and its collated batches ({split/name: {key: array}})."""
    tokenizer, args, data = ROOT / "assets" / "tokenizer" / family, _args(stage, family), STAGES[stage][1]
    load = {"sft": sft.load_processed_dataset, "dpo": dpo.load_pairwise_dataset, "ppo": ppo.load_prompt_dataset}[stage]
    module = {"sft": sft, "dpo": dpo, "ppo": ppo}[stage]
    collate = module.make_collator(args, tokenizer, data_dir=data)
    rows, batches = {}, {}
    for split in ("train", "eval"):
        rows[split] = load(tokenizer, data, split, args)
        for name, indices in spec["batches"][split].items():
            batch = collate([rows[split][i] for i in indices])
            batches[f"{split}/{name}"] = {k: np.asarray(v) for k, v in batch.items()}
    return rows, batches


def _first_difference(a: np.ndarray, b: np.ndarray, atol: float | None) -> str | None:
    if a.shape != b.shape:
        return f"shape LF {a.shape}, source {b.shape}"
    if atol is None:
        bad = np.argwhere(a != b)
        if len(bad):
            i = tuple(int(x) for x in bad[0])
            return f"[{', '.join(map(str, i))}] LF {a[i]}, source {b[i]} ({len(bad)} differ)"
        return None
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    if not np.all(np.isfinite(diff)):
        return "a non-finite value"
    if diff.size and diff.max() > atol:
        i = tuple(int(x) for x in np.unravel_index(diff.argmax(), diff.shape))
        return (f"max |diff| {diff.max():.3g} at {list(i)} (LF {a[i]:.7g}, source {b[i]:.7g}; "
                f"{(diff > atol).sum()} > {atol})")
    return None


def compare_rows(stage: str, split: str, lf_rows: dict, lf_images: list, ours: list[dict], data: Path) -> Cell:
    prefix = f"rows/{stage}/{split}/"
    n_lf = len({k.split("/")[3] for k in lf_rows if k.startswith(prefix)})
    if n_lf != len(ours):
        return Cell(f"rows: LF {n_lf}, source {len(ours)}", 0)
    for i, row in enumerate(ours):
        lf = {k[len(f'{prefix}{i}/'):]: v for k, v in lf_rows.items() if k.startswith(f"{prefix}{i}/")}
        if lf.keys() != {k for k in row if k != "images"}:
            return Cell(f"row {i}: columns LF {sorted(lf)}, source {sorted(k for k in row if k != 'images')}", i)
        for column in sorted(lf):
            wrong = _first_difference(lf[column], np.asarray(row[column], np.int64), None)
            if wrong:
                return Cell(f"row {i} {column}{wrong}", i)
        ours_images = [os.path.realpath(p) for p in find_medias(row.get("images") or [], data)]
        if [os.path.realpath(p) for p in lf_images[i]] != ours_images:
            return Cell(f"row {i} images: LF {lf_images[i]}, source {ours_images}", i)
    return Cell(None, len(ours), "rows")


def compare_batch(stage: str, lf: dict, ours: dict) -> Cell:
    notes = [f"LF-only {k}" for k in sorted(lf.keys() - ours.keys()) if (stage, k) in LF_ONLY]
    missing = sorted(k for k in lf.keys() - ours.keys() if (stage, k) not in LF_ONLY)
    extra = sorted(ours.keys() - lf.keys())
    if missing or extra:
        return Cell(f"keys: LF only {missing}, source only {extra}", 0)
    for key in sorted(ours):
        atol = PIXEL_ATOL if np.issubdtype(ours[key].dtype, np.floating) else None
        wrong = _first_difference(lf[key], ours[key], atol)
        if wrong:
            return Cell(f"{key}{'' if wrong.startswith('[') else ': '}{wrong}", 0, pixels_only=key == "pixel_values")
    shapes = ", ".join(f"{k} {list(ours[k].shape)}" for k in sorted(ours) if k not in ("attention_mask", "labels"))
    return Cell(None, len(ours), "; ".join([shapes, *notes]) if notes else shapes)


def family_parity(family: str, work: Path) -> dict:
    """{(stage, split): {"rows": Cell, <batch name>: Cell}} and LF's plugin facts."""
    lf_rows, lf_batches, meta = run_lf(family, work)
    job = json.loads((work / "job.json").read_text())
    cells = {}
    for stage, spec in job["stages"].items():
        rows, batches = source_stage(family, stage, spec)
        for split in ("train", "eval"):
            cell = {"rows": compare_rows(stage, split, lf_rows, meta["images"][f"{stage}/{split}"], rows[split],
                                         STAGES[stage][1])}
            for name in spec["batches"][split]:
                prefix = f"{stage}/{split}/{name}/"
                lf = {k[len(prefix):]: v for k, v in lf_batches.items() if k.startswith(prefix)}
                cell[name] = compare_batch(stage, lf, batches[f"{split}/{name}"])
            cells[(stage, split)] = cell
    pixel_cells = [(stage, split, name) for (stage, split), cell in cells.items() for name, c in cell.items()
                   if c.pixels_only]
    if pixel_cells:  # the source again, under LF's Pillow (plugins_lf.py --source)
        _child(work, "--source")
        with np.load(work / "lf" / "source_pixels.npz") as f:
            theirs = {k: f[k] for k in f.files}
        ours = str(importlib.metadata.version("pillow"))
        for stage, split, name in pixel_cells:
            key = f"{stage}/{split}/{name}/pixel_values"
            if _first_difference(lf_batches[key], theirs[key], PIXEL_ATOL) is None:
                cell = cells[(stage, split)][name]
                cells[(stage, split)][name] = replace(cell, environment=(
                    f"environment: the source under LF's Pillow {theirs['pillow']} is identical; here Pillow {ours}"))
    return {"cells": cells, "meta": {k: v for k, v in meta.items() if k not in ("images", "batch_keys")}}


def render(family: str, result: dict) -> str:
    meta = result["meta"]
    lines = [f"## {family} (template {FAMILIES[family]}; LF: {meta.get('plugin')}, {meta.get('processor')}, "
             f"{meta.get('image_processor')}; Pillow: LF {meta.get('pillow')}, source "
             f"{importlib.metadata.version('pillow')})", "",
             "| stage | split | rows | first rows | rows without images |",
             "|---|---|---|---|---|"]
    for (stage, split), cell in result["cells"].items():
        lines.append(f"| {stage} | {split} | {cell['rows']} | {cell.get('first', '-')} | "
                     f"{cell.get('no_images', '- (every row has images)')} |")
    return "\n".join(lines)


def failures(result: dict, environment: bool = True) -> list[str]:
    """Every difference (environment=False: only those that are not the Pillow gap)."""
    return [f"{stage}/{split}/{name}: {cell}" for (stage, split), cells in result["cells"].items()
            for name, cell in cells.items() if cell.error is not None and (environment or cell.environment is None)]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    keep = None
    if "--work" in argv:
        i = argv.index("--work")
        keep, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    families = argv or list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}: one of {list(FAMILIES)}")
    source = []
    for family in families:
        if keep is not None:
            result = family_parity(family, keep / family)
        else:
            with tempfile.TemporaryDirectory(prefix=f"lf_plugins_{family}_") as tmp:
                result = family_parity(family, Path(tmp))
        print(render(family, result), "\n", flush=True)
        source += [f"{family} {f}" for f in failures(result, environment=False)]
    print("source differences:" if source else "no source differences (environment ones, if any, are marked above)")
    print("\n".join(source))
    return 1 if source else 0


if __name__ == "__main__":
    sys.exit(main())
