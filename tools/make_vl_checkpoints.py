"""Tiny vision-language checkpoints in the releases' HF layouts, from numpy: every `tools/vl_checkpoints_<family>.py`
builder (`make_<family>(out_dir)`), found by name, written to assets/checkpoints/<family>.

The Qwen-VL token ids keep the release's layout shifted into the tiny vocabulary: 400 <|endoftext|> .. 413
<|video_pad|> mirror 151643 .. 151656 (<|vision_start|> 409, <|vision_end|> 410, <|vision_pad|> 411, <|image_pad|>
412); the other families' own special tokens take ids 400.. in their TOKENIZER rows. `python
tools/make_vl_checkpoints.py [family ...]` reproduces the files byte for byte. A builder here is a staged family whose
tasks are not registered yet (issue 34: gemma3, paligemma, llava_next, internvl); once registered, it becomes its
tools/checkpoints_<family>.py.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from make_checkpoints import ASSETS, ROOT  # noqa: E402

__all__ = ["VL_SPECIALS", "VL_IDS", "vl_builders", "main"]

# 151643.. in the release; the same order from 400 here
VL_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
               "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
VL_IDS = {tok: 400 + i for i, tok in enumerate(VL_SPECIALS)}


def vl_builders() -> dict:
    """{family: make_<family>} of every tools/vl_checkpoints_<family>.py."""
    found = {}
    for path in sorted(Path(__file__).resolve().parent.glob("vl_checkpoints_*.py")):
        family = path.stem[len("vl_checkpoints_"):]
        found[family] = getattr(importlib.import_module(path.stem), f"make_{family}")
    return found


def main(argv: list[str] | None = None) -> None:
    builders = vl_builders()
    for name in (argv if argv is not None else sys.argv[1:]) or sorted(builders):
        out = builders[name](ASSETS / name)
        print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
