"""Write the small vision-language datasets: assets/data/sft_vl/{train,eval}.json and assets/data/dpo_vl/{...}.

LLaMA-Factory's alpaca multimodal form: `<image>` placeholders opening the instruction and an `images` list of file
names of the shipped assets/images/*.png (tools/make_images.py), which LF's converter resolves against `media_dir`
(its default: the dataset dir). Each dataset dir carries copies of the images (git stores each blob once), so the
dir is self-contained: LF's default finds them, and so does a grading that copies the dir into its sandbox. A row without an image has no `images` key. The answers come from the pixels the model is
shown: the decoded PNG after LF's regularization (jax_oracles/models/vision_processing.preprocess_image_lf).
- corner: "What color is the top left corner?" -> "The top left corner is red.": the corner block's (a square of
  min(H, W) // 6 pixels) mean colour named by its largest channel (red, green, blue), or white / black (mean above /
  below 128) when the three channels lie within 32 of each other
- shape: "Is the image wide or tall?" -> "It is wide." / "It is tall." / "It is square." (the file's width vs height)
- pair, two images: "Which image is wider?" -> "The first image." / "The second image." (the files' widths)
- text: the text SFT tasks without an image (tools/make_datasets.py's generators and, for DPO, its mistakes)
- describe: "Describe the four corners." -> the four corner sentences (about 90 tokens), on a 4-token image: the row
  LF's infer_seqlen cuts inside the response, its prompt and image tokens whole (one in train, one in eval)

Sized for cutoff_len 128 with the qwen2_vl template and Qwen2-VL's image processor (4 to 15 tokens an image here):
qwen2_vl's default system prompt alone is 25 tokens of the tiny tokenizer, so a prompt with an image never stays
under half of 64, and at cutoff 64 infer_seqlen would cut the describe row's prompt with its response (its image
tokens with it). At 128 only the describe rows are cut, in the response (tests/training/test_mm_pipeline.py).
DPO rows: the same tasks, chosen = the right answer, rejected = a wrong one (another colour, the other shape or
image, the text task's typical mistake, the corners with one colour wrong).

Each (image, corner), image and ordered image pair is asked once: train and eval draw from one shuffled list each
(`np.random.default_rng(SEED)` for SFT, `SEED + 1` for DPO), so the eval questions are held out. The json is written
with a fixed layout: `python tools/make_vl_datasets.py` reproduces the committed files byte for byte.
"""

from __future__ import annotations

import shutil
import sys
from itertools import permutations
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # jax_oracles (numpy only here)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/ is not a package
from jax_oracles.models.vision_processing import preprocess_image_lf, read_png  # noqa: E402
from make_datasets import TASKS, make_preference_example, write_rows  # noqa: E402

__all__ = ["IMAGE_DIR", "SFT_DIR", "DPO_DIR", "SEED", "CUTOFF_LEN", "IMAGES", "CORNERS", "corner_color",
           "make_sft_vl", "make_dpo_vl", "main"]

IMAGE_DIR = ROOT / "assets" / "images"  # LF's media_dir for these rows
SFT_DIR = ROOT / "assets" / "data" / "sft_vl"
DPO_DIR = ROOT / "assets" / "data" / "dpo_vl"
SEED = 32  # issue 32
CUTOFF_LEN = 128  # the cutoff the rows are sized for
IMAGES = ("alpha_56x56.png", "exact_112x84.png", "gradient_64x48.png", "gray_20x60.png", "portrait_40x100.png",
          "strip_250x2.png", "wide_150x90.png")
SMALL_IMAGES = ("alpha_56x56.png", "gradient_64x48.png", "portrait_40x100.png")  # 4 tokens each (Qwen2-VL)
CORNERS = ("top left", "top right", "bottom left", "bottom right")
COLORS = ("red", "green", "blue", "white", "black")
# rows per task: (train, eval); SFT 24 + 8, DPO 16 + 8
SFT_COUNTS = {"corner": (10, 3), "shape": (4, 1), "pair": (4, 2), "text": (5, 1), "describe": (1, 1)}
DPO_COUNTS = {"corner": (6, 3), "shape": (2, 1), "pair": (3, 2), "text": (4, 1), "describe": (1, 1)}


def _shown(name: str) -> np.ndarray:  # uint8[H,W,3]: what LF hands the image processor
    return preprocess_image_lf(read_png(IMAGE_DIR / name))


def _size(name: str) -> tuple[int, int]:  # (width, height) of the file
    h, w, _ = read_png(IMAGE_DIR / name).shape
    return w, h


def corner_color(name: str, corner: str) -> str:
    """The colour name of a corner block of the image as the model is shown it."""
    image = _shown(name).astype(np.float64)
    k = min(image.shape[:2]) // 6
    rows = slice(0, k) if corner.startswith("top") else slice(-k, None)
    cols = slice(0, k) if corner.endswith("left") else slice(-k, None)
    mean = image[rows, cols].reshape(-1, 3).mean(0)
    if mean.max() - mean.min() < 32:
        return "white" if mean.mean() >= 128 else "black"
    return COLORS[int(np.argmax(mean))]


def _corner_sentence(corner: str, color: str) -> str:
    return f"The {corner} corner is {color}."


def _shape(name: str) -> str:
    w, h = _size(name)
    return "wide" if w > h else "tall" if h > w else "square"


def _corner(item, rng):
    name, corner = item
    right = corner_color(name, corner)
    wrong = [c for c in COLORS if c != right][int(rng.integers(len(COLORS) - 1))]
    return ({"instruction": f"<image>What color is the {corner} corner?", "input": "", "images": [name]},
            _corner_sentence(corner, right), _corner_sentence(corner, wrong))


def _shape_row(name, rng):
    right = _shape(name)
    wrong = "tall" if right != "tall" else "wide"
    return {"instruction": "<image>Is the image wide or tall?", "input": "", "images": [name]}, \
        f"It is {right}.", f"It is {wrong}."


def _pair(item, rng):
    first, second = item
    answers = ("The first image.", "The second image.")
    right = 0 if _size(first)[0] > _size(second)[0] else 1
    return ({"instruction": "<image><image>Which image is wider?", "input": "", "images": [first, second]},
            answers[right], answers[1 - right])


def _describe(name, rng):
    colors = [corner_color(name, c) for c in CORNERS]
    flip = int(rng.integers(len(CORNERS)))  # the rejected description gets this corner wrong
    wrong = list(colors)
    wrong[flip] = [c for c in COLORS if c != colors[flip]][int(rng.integers(len(COLORS) - 1))]
    return ({"instruction": "<image>Describe the four corners.", "input": "", "images": [name]},
            " ".join(_corner_sentence(c, x) for c, x in zip(CORNERS, colors)),
            " ".join(_corner_sentence(c, x) for c, x in zip(CORNERS, wrong)))


def _items(rng: np.random.Generator) -> dict[str, list]:
    """Each task's questions in a random order (train takes the first, eval the next)."""
    items = {"corner": [(n, c) for n in IMAGES for c in CORNERS], "shape": list(IMAGES),
             "pair": list(permutations(IMAGES, 2)), "describe": list(SMALL_IMAGES)}
    return {task: [xs[i] for i in rng.permutation(len(xs))] for task, xs in items.items()}


MAKERS = {"corner": _corner, "shape": _shape_row, "pair": _pair, "describe": _describe}


def _make(rng: np.random.Generator, counts: dict, preference: bool) -> tuple[list[dict], list[dict]]:
    items, splits = _items(rng), ([], [])
    for task, (n_train, n_eval) in counts.items():
        for split, (lo, hi) in zip(splits, ((0, n_train), (n_train, n_train + n_eval))):
            for i in range(lo, hi):
                if task == "text":
                    if preference:
                        row = make_preference_example(rng)
                        while row["chosen"] == row["rejected"]:  # a miscount can land on the right count
                            row = make_preference_example(rng)
                        split.append(row)
                    else:
                        instruction, inp, output = TASKS[int(rng.integers(len(TASKS)))](rng)
                        split.append({"instruction": instruction, "input": inp, "output": output})
                    continue
                row, right, wrong = MAKERS[task](items[task][i], rng)
                split.append({**row, "chosen": right, "rejected": wrong} if preference else {**row, "output": right})
    return tuple([split[i] for i in rng.permutation(len(split))] for split in splits)


def make_sft_vl(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    return _make(np.random.default_rng(seed), SFT_COUNTS, preference=False)


def make_dpo_vl(seed: int = SEED + 1) -> tuple[list[dict], list[dict]]:
    return _make(np.random.default_rng(seed), DPO_COUNTS, preference=True)


def main(argv: list[str] | None = None) -> None:
    del argv
    for out_dir, (train, held_out) in ((SFT_DIR, make_sft_vl()), (DPO_DIR, make_dpo_vl())):
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in sorted({p for row in train + held_out for p in row.get("images", ())}):
            shutil.copyfile(IMAGE_DIR / name, out_dir / name)  # LF's media_dir default: the dataset dir
        write_rows(out_dir / "train.json", train)
        write_rows(out_dir / "eval.json", held_out)
        print(f"wrote {(out_dir / 'train.json').relative_to(ROOT)} ({len(train)} rows), "
              f"{(out_dir / 'eval.json').relative_to(ROOT)} ({len(held_out)} rows)")


if __name__ == "__main__":
    main(sys.argv[1:])
