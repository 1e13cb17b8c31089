"""`python -m tools.lf_parity.gemma3_window`: Gemma 3's image-block mask against the sliding window, transformers 5.6
(LF's environment, .venv-lf) against the torch source (equal to transformers 5.24, the fidelity target).

One batch of tests/models/test_gemma3_model.py (two 16-token images in a row, a second row with one), run through the
tiny checkpoint as shipped (sliding_window 8: every image block longer than the window) and through a copy whose
window is 64 (no block past it). Prints each window's max |logit difference| over the real tokens: large at 8,
fp32 noise at 64 (parity.GEMMA3_WINDOW). Exit 1 when the 64 run differs by more than 1e-5.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from catalog.provenance import ROOT
from tools.lf_parity.harness import LF_PYTHON

WINDOWS = (8, 64)
HF_CHILD = """
import sys, numpy as np, torch
from transformers import Gemma3ForConditionalGeneration
work = sys.argv[1]
b = np.load(f"{work}/batch.npz")
for w in sys.argv[2:]:
    hf = Gemma3ForConditionalGeneration.from_pretrained(f"{work}/ckpt{w}", attn_implementation="eager",
                                                        dtype=torch.float32).train()
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(b["ids"]), attention_mask=torch.tensor(b["mask"]),
                 pixel_values=torch.tensor(b["pixels"]), token_type_ids=torch.tensor(b["types"]),
                 labels=torch.tensor(b["ids"])).logits
    np.save(f"{work}/hf{w}.npy", out.numpy())
"""


def main() -> int:
    sys.path.insert(0, str(ROOT / "tests" / "models"))
    import test_gemma3_model as t  # the batch and the checkpoint path of the fidelity test

    ids, mask, pixels, types = t.BATCHES["two-images"]
    with tempfile.TemporaryDirectory(prefix="t2j-gemma3-window-") as tmp:
        work = Path(tmp)
        np.savez(work / "batch.npz", ids=ids, mask=mask, pixels=pixels, types=types)
        ours = {}
        for w in WINDOWS:
            ckpt = work / f"ckpt{w}"
            shutil.copytree(t.CKPT, ckpt)
            config = json.loads((ckpt / "config.json").read_text())
            config["text_config"]["sliding_window"] = w
            (ckpt / "config.json").write_text(json.dumps(config, indent=2))
            src = t.tg.Gemma3ForConditionalGeneration.from_pretrained(ckpt)
            with torch.no_grad():
                ours[w] = src(torch.tensor(ids), torch.tensor(mask), pixel_values=torch.tensor(pixels),
                              token_type_ids=torch.tensor(types)).numpy()
        subprocess.run([str(LF_PYTHON), "-c", HF_CHILD, str(work), *map(str, WINDOWS)], check=True,
                       capture_output=True, text=True)
        diffs = {w: float(np.abs(np.load(work / f"hf{w}.npy") - ours[w])[mask.astype(bool)].max()) for w in WINDOWS}
    for w, d in diffs.items():
        print(f"sliding_window {w}: max |logit(transformers 5.6) - logit(source)| = {d:.3g}")
    return 0 if diffs[max(WINDOWS)] <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
