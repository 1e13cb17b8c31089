"""Inputs that hold no answers: no child gets, among its inputs, what a check it answers must produce.

The grader runs one sealed child per group of levels and writes into its inputs file the recorded *inputs* of
every check it runs, keeping the recorded *outputs* as the answers. The sandbox stops a child from reading the
references, but not a check's probe from reading a sibling check's inputs in the same file: where check A's
expected output can be read off check B's inputs (PPO's L3 `rollout_generate` responses inside the rows L3
`rollout_logprobs_values` gets; its L1 `prompt_data` prompts inside `reward_score`'s rows), a candidate scores
A by copying. So the grader scans each child's inputs before it starts it (`scan_child`) and runs checks whose
answers another's inputs carry in separate children (`separate`); tests/grader/test_inputs_hold_no_answers.py scans
every reference's plan of children and fails on any pair.

The scan, for every pair of different checks A != B in one child: each expected output array of A is looked for
in the input arrays of B, exact values compared (as float64: an int64 answer is found in an int32 input; strings
as strings):
- whole: the flattened output is a contiguous window of a flattened input (equal arrays included, and any
  leading-axis slice of a bigger input);
- aligned (integer outputs): every row i (last axis) of the output sits inside row i of an integer input with as
  many rows (sampled responses inside the query + response rows built from them);
- rows: each row of the output is a contiguous window of a flattened input; an integer row not found as it is is
  looked for again without its leading and trailing pad runs (a token sequence inside a longer padded row).
Data too plain to tell anything (`_plain`, `_trivial`) is never looked for, and neither is an answer that A's own
inputs already hold (a transform that must leave some rows untouched: another check's copy gives nothing away).
What it cannot see: an answer cheaply computed from another check's inputs; the checkpoint and data directories.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Found", "scan_child", "separate"]

MIN_SIZE = 4      # fewer elements: scalars, (lo, hi) pairs, one shape; found anywhere, they carry no answer
MIN_DISTINCT = 3  # per output array: fewer distinct values are 0/1 masks, boolean flags, kept sets


@dataclass(frozen=True)
class Found:
    level: str
    answering: str  # "<check>/<output>"
    carrying: str   # "<check>/<input>"
    how: str
    answering_key: str = ""  # "<level>/<check>" of A
    carrying_key: str = ""  # of B

    def line(self, task: str) -> str:
        return f"{task}: child {self.level}: output {self.answering} found in input of {self.carrying} ({self.how})"


def _plain_rows(rows: np.ndarray) -> np.ndarray:
    """For each row of a 2-D array: too plain to look for (a match would be coincidence, and copying it tells
    nothing): under MIN_SIZE elements (scalars, pairs, shapes), or evenly spaced: constants (all-zero grads of
    a LoRA B init, all-equal response lengths) and arithmetic runs (positions, step indices, arange ids;
    ALiBi's slope * distance rows, which sit inside any linspace grid such as activation's x_core): a few
    numbers describe them, and every grid or position input holds some."""
    if rows.shape[1] < MIN_SIZE:
        return np.ones(len(rows), bool)
    d = np.diff(rows, axis=1)
    return np.all(np.abs(d - d[:, :1]) <= 1e-5 * np.abs(d[:, :1]), axis=1)


def _plain(values: np.ndarray) -> bool:
    return bool(_plain_rows(values.reshape(1, -1))[0])


def _trivial(values: np.ndarray) -> bool:
    """A whole output array not worth looking for: plain, or with under MIN_DISTINCT distinct values (a mask
    or flag array matches any other of the same padding; its rows are not looked for either)."""
    return _plain(values) or len(np.unique(values)) < MIN_DISTINCT


def _strip_pad(row: np.ndarray) -> np.ndarray:
    """An integer row without its leading and trailing runs (2 or more) of one value: left or right padding."""
    lo, hi = 0, len(row)
    if hi >= 2 and row[0] == row[1]:
        other = np.flatnonzero(row != row[0])
        lo = other[0] if len(other) else hi
    if hi - lo >= 2 and row[hi - 1] == row[hi - 2]:
        other = np.flatnonzero(row[lo:] != row[hi - 1])
        hi = lo + other[-1] + 1 if len(other) else lo
    return row[lo:hi]


class Haystack:
    """Every numeric input array of one child, flattened to float64 and concatenated with a NaN after each
    (NaN equals nothing: no window spans two arrays), sorted once: a query finds its rarest element's
    occurrences by binary search and compares only the few windows they anchor."""

    def __init__(self, arrays: list[tuple[str, str, np.ndarray]]):  # (check key, input name, array)
        parts, starts, pos = [np.full(1, np.nan)], [], 1
        self.names = [(key, name) for key, name, _ in arrays]
        self.arrays = [arr for _, _, arr in arrays]
        self.shapes = [np.shape(arr) for arr in self.arrays]
        for _, _, arr in arrays:
            parts += [np.asarray(arr, np.float64).ravel(), np.full(1, np.nan)]
            starts.append(pos)
            pos += parts[-2].size + 1
        self.starts = np.asarray(starts, np.int64)
        self.h = np.concatenate(parts)
        self.order = np.argsort(self.h, kind="stable")
        self.sorted = self.h[self.order]

    def absent(self, rows: np.ndarray) -> np.ndarray:
        """For each row of a 2-D float64 array: holds a value found in no input."""
        return np.any(np.searchsorted(self.sorted, rows, "left") == np.searchsorted(self.sorted, rows, "right"), axis=1)

    def holders(self, q: np.ndarray) -> set[int]:
        """Indices into self.names of the arrays that hold the 1-D float64 `q` as a contiguous window."""
        lo, hi = np.searchsorted(self.sorted, q, "left"), np.searchsorted(self.sorted, q, "right")
        j = int(np.argmin(hi - lo))  # the rarest element of q anchors the candidate windows
        starts = self.order[lo[j]:hi[j]] - j
        starts = starts[(starts >= 0) & (starts + q.size <= self.h.size)]
        # Element by element, rarest first, the candidates thin out at once: a common anchor (an image's flat
        # colour holds one pixel value thousands of times) never builds a [candidates, len(q)] window matrix
        for k in np.argsort(hi - lo, kind="stable"):
            if not starts.size:
                break
            starts = starts[self.h[starts + k] == q[k]]
        return {int(i) for i in np.searchsorted(self.starts, starts, "right") - 1}


def _aligned(rows: np.ndarray, arr: np.ndarray) -> bool:
    """Integer `rows` [R, L], R >= 2: does row i sit inside row i of the integer array `arr` for every i?"""
    if arr.dtype.kind not in "biu" or arr.ndim < 2 or arr.size // arr.shape[-1] != len(rows) \
            or arr.shape[-1] < rows.shape[1]:
        return False
    windows = np.lib.stride_tricks.sliding_window_view(arr.reshape(len(rows), -1), rows.shape[1], axis=1)
    return bool(np.all(np.any(np.all(windows == rows[:, None, :], axis=2), axis=1)))


def _string_window(q: list, hay: list) -> bool:
    return any(hay[i:i + len(q)] == q for i in range(len(hay) - len(q) + 1))


def scan_child(level: str, inputs: dict[str, dict[str, np.ndarray]],
               outputs: dict[str, dict[str, np.ndarray]]) -> list[Found]:
    """Every (output of A, input of B), A != B, in one child, where B's input holds A's answer or rows of it."""
    numeric = [(k, n, a) for k, arrs in inputs.items() for n, a in arrs.items() if a.dtype.kind in "biuf"]
    strings = [(k, n, a) for k, arrs in inputs.items() for n, a in arrs.items() if a.dtype.kind in "OUS"]
    hay = Haystack(numeric)
    found: list[Found] = []

    def others(a_key: str, held: set[int]) -> set[int]:  # held by B != A only, and not by A's own inputs
        return set() if any(hay.names[i][0] == a_key for i in held) else held

    def carrying(i: int) -> str:
        key, name = hay.names[i]
        return f"{key.split('/', 1)[1]}/{name}"

    def hit(answering: str, i: int, how: str) -> Found:  # A's answer inside numeric input number i
        return Found(level, answering, carrying(i), how, a_key, hay.names[i][0])

    for a_key, arrs in outputs.items():
        check = a_key.split("/", 1)[1]
        for out_name, out in arrs.items():
            answering = f"{check}/{out_name}"
            if out.dtype.kind in "OUS":  # names (L0 spec checks): the whole test on strings
                q = [str(x) for x in out.ravel()]
                if len(q) >= MIN_SIZE and len(set(q)) >= MIN_DISTINCT:
                    held = [(k, n) for k, n, a in strings if _string_window(q, [str(x) for x in a.ravel()])]
                    if all(k != a_key for k, _ in held):
                        found += [Found(level, answering, f"{k.split('/', 1)[1]}/{n}", "whole", a_key, k)
                                  for k, n in held]
                continue
            flat = np.asarray(out, np.float64).ravel()
            if _trivial(flat):
                continue
            whole = others(a_key, hay.holders(flat))
            for i in sorted(whole):
                how = ("equal" if hay.shapes[i] == out.shape
                       else f"whole {list(out.shape)} as a window of {list(hay.shapes[i])}")
                found.append(hit(answering, i, how))
            if out.ndim < 2:
                continue
            rows = flat.reshape(-1, out.shape[-1])
            if out.dtype.kind in "biu" and len(rows) >= 2 and rows.shape[1] >= MIN_SIZE:
                # every row inside the same row of a token input, plain rows too (a tiny model's sampled
                # responses are often one token repeated: row by row they say little, all aligned they are it)
                aligned = others(a_key, {i for i, arr in enumerate(hay.arrays) if _aligned(rows, arr)}) - whole
                for i in sorted(aligned):
                    found.append(hit(answering, i, f"all {len(rows)} token rows of "
                                 f"{list(out.shape)}, row i inside row i of {list(hay.shapes[i])}"))
                whole |= aligned
            plain = _plain_rows(rows)
            absent = hay.absent(rows)  # a row with a value no input holds is nowhere as it is (most float rows)
            matched: dict[int, list[np.ndarray]] = {}  # input index -> the rows (as matched) it holds
            for row, gone in zip(rows[~plain], absent[~plain]):
                q, held = row, set() if gone else hay.holders(row)
                if not held and out.dtype.kind in "biu" and not _plain(core := _strip_pad(row)):
                    q, held = core, hay.holders(core)  # e.g. a response padded otherwise than in the carrying row
                for i in others(a_key, held) - whole:
                    matched.setdefault(i, []).append(q)
            for i, held_rows in sorted(matched.items()):
                # rows together as plain as one pad-tailed block-id row ([5, -1, -1, ...], found at the end of
                # any -1-padded prompt that ends in 5) are coincidence: at least MIN_DISTINCT values between them
                if _trivial(np.concatenate(held_rows)):
                    continue
                what = "token rows" if out.dtype.kind in "biu" else "rows"
                found.append(hit(answering, i,
                             f"{len(held_rows)}/{int((~plain).sum())} non-plain {what} of {list(out.shape)} "
                             f"inside {list(hay.shapes[i])}"))
    return found


def separate(run, inputs: dict[str, dict[str, np.ndarray]], outputs: dict[str, dict[str, np.ndarray]],
             level: str = "") -> tuple[list[list], list[Found]]:
    """Split `run` (check specs with .key, in order) into children none of which holds a check together with
    a check whose inputs carry its answer; -> (the parts, in order, each in run order; what was found)."""
    found = scan_child(level, {s.key: inputs[s.key] for s in run}, {s.key: outputs[s.key] for s in run})
    apart = {(f.answering_key, f.carrying_key) for f in found} | {(f.carrying_key, f.answering_key) for f in found}
    parts: list[list] = []
    for s in run:  # greedy: the first part with nothing it must be kept from
        for part in parts:
            if not any((s.key, t.key) in apart for t in part):
                part.append(s)
                break
        else:
            parts.append([s])
    return parts, found
