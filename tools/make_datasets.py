"""Write the synthetic alpaca SFT dataset under assets/data/sft/{train,eval}.json.

Alpaca rows (instruction / input / output, plus LLaMA-Factory's optional "history" of
[[user, assistant], ...] turns for a few multi-turn rows and an optional "system" prompt). The
tasks are templated string transforms over a small word list, so a LoRA on the tiny random Llama
can learn their format and vocabulary and measurably lower the held-out loss.

System prompts make some rows longer than cutoff_len (64), so the shipped data exercises
LLaMA-Factory's truncation (`infer_seqlen`): a long prompt on a single-turn row cuts the source
(the user turn and even the assistant header); a one-sentence prompt on a multi-turn row leaves
the second turn a partial budget, which cuts its prompt, its answer (labels end without the
<|eot_id|>) or drops it. tests/training/test_hf_trainer_semantics.py asserts each case occurs.

`np.random.default_rng(SEED)` draws the turns (train first, then eval);
`np.random.default_rng(SEED + 1)` then draws the system prompts. Two streams keep every turn as
it was before system prompts existed, and with them tools/make_tokenizer.py's BPE, which is
trained on the turns only. The json is written with a fixed layout, so
`python tools/make_datasets.py` reproduces the committed files byte for byte.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

__all__ = ["TASKS", "SYSTEM_SENTENCES", "MISTAKES", "make_example", "make_split", "add_system_prompts", "make_sft",
           "make_preference_example", "make_dpo", "main"]

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "assets" / "data" / "sft"
SEED = 0
NUM_TRAIN, NUM_EVAL = 96, 24
DPO_DIR = ROOT / "assets" / "data" / "dpo"
DPO_SEED = SEED + 2  # its own stream: the SFT files stay byte-identical
NUM_DPO_TRAIN, NUM_DPO_EVAL = 64, 24
MULTI_TURN_FRACTION = 0.125  # 1 row in 8 carries one earlier (user, assistant) turn
SYSTEM_FRACTION = 0.25  # of the single-turn rows; every multi-turn row gets a system prompt
MAX_SYSTEM_SENTENCES = 3  # 3 sentences (~60 tokens) alone fill most of cutoff_len

WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree",
         "fish", "bird", "star", "cake", "milk", "box", "hat", "rain")
LETTERS = "abcdefghij"
NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five")
SYSTEM_SENTENCES = ("You are a careful assistant.", "Follow the instruction exactly.",
                    "Answer with the result only.", "Do not explain your answer.",
                    "Keep the words in lower case unless told otherwise.",
                    "Use only the words of the input.", "Never add a greeting.")


def _words(rng: np.random.Generator, lo: int, hi: int) -> list[str]:
    return [WORDS[i] for i in rng.choice(len(WORDS), size=int(rng.integers(lo, hi + 1)), replace=False)]


def _reverse(rng):
    w = _words(rng, 2, 4)
    return "Reverse the words.", " ".join(w), " ".join(w[::-1])


def _sort_letters(rng):
    letters = [LETTERS[i] for i in rng.choice(len(LETTERS), size=int(rng.integers(3, 6)), replace=False)]
    return "Sort the letters.", "".join(letters), "".join(sorted(letters))


def _uppercase(rng):
    w = _words(rng, 1, 3)
    return "Uppercase the words.", " ".join(w), " ".join(w).upper()


def _count(rng):
    w = _words(rng, 1, 5)
    return "Count the words.", " ".join(w), f"There are {NUMBER_WORDS[len(w)]} words."


def _first_word(rng):
    w = _words(rng, 2, 4)
    return "Repeat the first word.", " ".join(w), w[0]


def _count_to(rng):  # no input: exercises the instruction-only path of the alpaca converter
    n = int(rng.integers(2, 6))
    return f"Count to {n}.", "", " ".join(str(i) for i in range(1, n + 1))


TASKS = (_reverse, _sort_letters, _uppercase, _count, _first_word, _count_to)


def _user_text(instruction: str, inp: str) -> str:
    # LLaMA-Factory's alpaca converter joins a non-empty input under the instruction with "\n".
    return instruction + ("\n" + inp if inp else "")


def make_example(rng: np.random.Generator) -> dict:
    """One alpaca row; with probability MULTI_TURN_FRACTION it gets one earlier turn."""
    multi_turn = bool(rng.random() < MULTI_TURN_FRACTION)
    instruction, inp, output = TASKS[int(rng.integers(len(TASKS)))](rng)
    row = {"instruction": instruction, "input": inp, "output": output}
    if multi_turn:
        h_instruction, h_input, h_output = TASKS[int(rng.integers(len(TASKS)))](rng)
        row["history"] = [[_user_text(h_instruction, h_input), h_output]]
    return row


def _wrong_count(rng, inp, out):
    right = NUMBER_WORDS.index(out.split()[2])
    wrong = [w for i, w in enumerate(NUMBER_WORDS) if i not in (0, right)]
    return f"There are {wrong[int(rng.integers(len(wrong)))]} words."


def _wrong_count_to(rng, inp, out):
    n = len(out.split())
    return " ".join(str(i) for i in range(1, n + (1 if rng.random() < 0.5 else 0) + (0 if n > 2 else 1)))


# The typical wrong answer of each task (DPO's rejected response): the input copied back, the wrong end,
# a miscount. A LoRA can learn to prefer the transform, so DPO measurably raises held-out accuracy.
MISTAKES = {
    "Reverse the words.": lambda rng, inp, out: inp,
    "Sort the letters.": lambda rng, inp, out: inp if inp != out else out[::-1],
    "Uppercase the words.": lambda rng, inp, out: inp,
    "Count the words.": _wrong_count,
    "Repeat the first word.": lambda rng, inp, out: inp.split()[-1],
}


def make_preference_example(rng: np.random.Generator) -> dict:
    """One alpaca preference row: the transform's answer is chosen, its typical mistake rejected."""
    instruction, inp, output = TASKS[int(rng.integers(len(TASKS)))](rng)
    mistake = MISTAKES.get(instruction, _wrong_count_to)
    return {"instruction": instruction, "input": inp, "chosen": output, "rejected": mistake(rng, inp, output)}


def make_split(rng: np.random.Generator, n: int, exclude: set[str] = frozenset()) -> list[dict]:
    """n distinct rows not in exclude (keys are the row's canonical json)."""
    rows, seen = [], set(exclude)
    while len(rows) < n:
        row = make_example(rng)
        key = json.dumps(row, sort_keys=True)
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


def _system_prompt(rng: np.random.Generator, num_sentences: int) -> str:
    picked = rng.choice(len(SYSTEM_SENTENCES), size=num_sentences, replace=False)
    return " ".join(SYSTEM_SENTENCES[i] for i in picked)


def add_system_prompts(rng: np.random.Generator, rows: list[dict]) -> None:
    """In place: one sentence on every multi-turn row (its first turn still fits; the second gets
    what budget is left), 1..MAX_SYSTEM_SENTENCES on a SYSTEM_FRACTION of the single-turn rows."""
    for row in rows:
        if row.get("history"):
            row["system"] = _system_prompt(rng, 1)
        elif rng.random() < SYSTEM_FRACTION:
            row["system"] = _system_prompt(rng, int(rng.integers(1, MAX_SYSTEM_SENTENCES + 1)))


def make_sft(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    rng = np.random.default_rng(seed)
    train = make_split(rng, NUM_TRAIN)
    held_out = make_split(rng, NUM_EVAL, exclude={json.dumps(r, sort_keys=True) for r in train})
    system_rng = np.random.default_rng(seed + 1)
    add_system_prompts(system_rng, train)
    add_system_prompts(system_rng, held_out)
    return train, held_out


def make_dpo(seed: int = DPO_SEED) -> tuple[list[dict], list[dict]]:
    """Distinct preference rows, train then eval; a quarter carry a system prompt (some rows get cut)."""
    rng, rows, seen = np.random.default_rng(seed), [], set()
    while len(rows) < NUM_DPO_TRAIN + NUM_DPO_EVAL:
        row = make_preference_example(rng)
        key = json.dumps({k: row[k] for k in ("instruction", "input")}, sort_keys=True)
        if key not in seen and row["chosen"] != row["rejected"]:
            seen.add(key)
            rows.append(row)
    for row in rows:
        if rng.random() < SYSTEM_FRACTION:
            row["system"] = _system_prompt(rng, int(rng.integers(1, MAX_SYSTEM_SENTENCES + 1)))
    # one row without a rejected response, which LF's pairwise pipeline drops (graded: the processed row count)
    unpaired = {"instruction": "Count to 2.", "input": "", "chosen": "1 2", "rejected": None}
    return rows[:NUM_DPO_TRAIN] + [unpaired], rows[NUM_DPO_TRAIN:]


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text(json.dumps(rows, indent=2, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> None:
    del argv
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    train, held_out = make_sft()
    write_rows(OUT_DIR / "train.json", train)
    write_rows(OUT_DIR / "eval.json", held_out)
    DPO_DIR.mkdir(parents=True, exist_ok=True)
    pairs, held_out_pairs = make_dpo()
    write_rows(DPO_DIR / "train.json", pairs)
    write_rows(DPO_DIR / "eval.json", held_out_pairs)
    for d, a, b in ((OUT_DIR, train, held_out), (DPO_DIR, pairs, held_out_pairs)):
        print(f"wrote {(d / 'train.json').relative_to(ROOT)} ({len(a)} rows), "
              f"{(d / 'eval.json').relative_to(ROOT)} ({len(b)} rows)")


if __name__ == "__main__":
    main(sys.argv[1:])
