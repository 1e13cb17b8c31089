"""Runs in .venv-lf, never in .venv: LLaMA-Factory's data pipeline for one vision-language family (plugins.py).

    .venv-lf/bin/python tools/lf_parity/plugins_lf.py WORK_DIR

WORK_DIR/job.json (written by tools/lf_parity/plugins.py) names the model dir (checkpoint + tokenizer + processor
files), the template, the dataset_info.json datasets of each stage and the rows each collated batch takes. For every
stage (sft, rm, ppo) LF's own load_tokenizer, get_template_and_fix_tokenizer and get_dataset (converter, the
template's mm_plugin, the stage's dataset processor) tokenize both splits, and LF's collators collate the named rows:
SFTDataCollatorWith4DAttentionMask as LF's SFT workflow builds it (pad_to_multiple_of 8, IGNORE_INDEX label pad),
PairwiseDataCollatorWithPadding as its DPO workflow does (pad_to_multiple_of 8), and MultiModalDataCollatorForSeq2Seq
with the tokenizer padding on the left as its PPO workflow does (no pad_to_multiple_of). model=None: none of these
families has a rope index, and the collators read the model for nothing else.

Installed, and nothing else: lf_child's torchaudio stand-in (LF's mm_plugin imports torchaudio at module level) and,
without torchvision, lf_child's install_no_video_processor (InternVLProcessor loads a video processor, which
transformers 5.6 builds on torchvision; the data has no videos).

    .venv-lf/bin/python tools/lf_parity/plugins_lf.py WORK_DIR --source

runs the torch source's collators (job "source") on the same rows under .venv-lf's Pillow instead, and writes only
WORK_DIR/lf/source_pixels.npz: the source resizes with the installed PIL (vision_processing.resize_pil), whose last
bit is version dependent, so a pixel difference that vanishes here is the two environments' Pillows, not the source.

Written: WORK_DIR/lf/rows.npz (rows/<stage>/<split>/<i>/<column>), WORK_DIR/lf/batches.npz
(<stage>/<split>/<batch>/<key>) and WORK_DIR/lf/meta.json (each row's resolved image paths, the plugin and the
processor LF built).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lf_child import install_no_video_processor, install_torchaudio_standin  # noqa: E402

PROCESSOR_FIELDS = ("image_seq_length", "image_token", "image_token_id", "image_max_pixels", "image_min_pixels",
                    "image_do_pan_and_scan", "crop_to_patches", "patch_size", "vision_feature_select_strategy",
                    "num_additional_image_tokens")


def source_pixels(work: Path, job: dict) -> None:
    """The torch source's collated pixel_values of every batch, computed under this interpreter's Pillow."""
    import importlib

    import numpy as np
    import PIL

    sys.path.insert(0, job["source"]["root"])
    out = {}
    for stage, spec in job["stages"].items():
        module = importlib.import_module(f"torch_sources.training.{stage}")
        load = getattr(module, job["source"]["loaders"][stage])
        args = getattr(module, job["source"]["args"][stage])(template=job["args"]["template"],
                                                            cutoff_len=job["args"]["cutoff_len"])
        collate = module.make_collator(args, job["source"]["tokenizer"], data_dir=spec["media_dir"])
        for split in ("train", "eval"):
            rows = load(job["source"]["tokenizer"], spec["media_dir"], split, args)
            for name, indices in spec["batches"][split].items():
                batch = collate([rows[i] for i in indices])
                out[f"{stage}/{split}/{name}/pixel_values"] = batch["pixel_values"].numpy()
    np.savez(work / "lf" / "source_pixels.npz", pillow=np.asarray(PIL.__version__), **out)


def main(work: Path) -> None:
    job = json.loads((work / "job.json").read_text())
    out = work / "lf"
    out.mkdir(exist_ok=True)
    if "--source" in sys.argv[2:]:
        return source_pixels(work, job)
    install_torchaudio_standin()
    install_no_video_processor()

    import numpy as np
    import torch

    from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
    from llamafactory.data.collator import (MultiModalDataCollatorForSeq2Seq, PairwiseDataCollatorWithPadding,
                                            SFTDataCollatorWith4DAttentionMask)
    from llamafactory.extras.constants import IGNORE_INDEX
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_tokenizer

    rows, batches, meta = {}, {}, {"images": {}, "batch_keys": {}}
    for stage, spec in job["stages"].items():
        # PPO's get_train_args wants a reward model; only DataArguments and ModelArguments feed the data pipeline,
        # so every stage is parsed as sft and get_dataset is told the stage
        args = {**job["args"], "stage": "sft", "dataset": spec["train"], "eval_dataset": spec["eval"],
                "media_dir": spec["media_dir"], "output_dir": str(work / "lf_out" / stage)}
        model_args, data_args, training_args, _, _ = get_train_args(args)
        module = load_tokenizer(model_args)
        tokenizer, processor = module["tokenizer"], module["processor"]
        template = get_template_and_fix_tokenizer(tokenizer, data_args)
        datasets = get_dataset(template, model_args, data_args, training_args, stage=spec["lf_stage"], **module)
        meta.setdefault("plugin", type(template.mm_plugin).__name__)
        meta.setdefault("processor", None if processor is None else type(processor).__name__)
        if processor is not None:
            meta.setdefault("image_processor", type(processor.image_processor).__name__)
            meta.setdefault("processor_fields", {k: getattr(processor, k, None) for k in PROCESSOR_FIELDS})
        if stage == "sft":
            collator = SFTDataCollatorWith4DAttentionMask(
                template=template, model=None, pad_to_multiple_of=8, label_pad_token_id=IGNORE_INDEX,
                block_diag_attn=model_args.block_diag_attn, neat_packing=data_args.neat_packing,
                attn_implementation="eager", compute_dtype=torch.float32, **module)
        elif stage == "dpo":
            collator = PairwiseDataCollatorWithPadding(template=template, model=None, pad_to_multiple_of=8,
                                                       label_pad_token_id=IGNORE_INDEX, **module)
        else:
            tokenizer.padding_side = "left"  # LF's run_ppo, before it builds the collator
            collator = MultiModalDataCollatorForSeq2Seq(template=template, model=None, **module)
        for split in ("train", "eval"):
            dataset = datasets[f"{split}_dataset"]
            keep = [c for c in dataset.column_names if c.endswith(("input_ids", "attention_mask", "labels"))]
            for i, row in enumerate(dataset):
                for column in keep:
                    rows[f"rows/{stage}/{split}/{i}/{column}"] = np.asarray(row[column], np.int64)
            meta["images"][f"{stage}/{split}"] = [[str(p) for p in (images or [])] for images in dataset["images"]]
            for name, indices in spec["batches"][split].items():
                features = [json.loads(json.dumps(dataset[i])) for i in indices]  # fresh lists: the collator edits
                batch = collator(features)
                meta["batch_keys"][f"{stage}/{split}/{name}"] = sorted(batch)
                for key, value in batch.items():
                    if torch.is_tensor(value):
                        batches[f"{stage}/{split}/{name}/{key}"] = value.detach().cpu().numpy()
    np.savez(out / "rows.npz", **rows)
    np.savez(out / "batches.npz", **batches)
    import PIL

    meta["pillow"] = PIL.__version__
    (out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(Path(sys.argv[1]))
