"""No check's recorded answer travels to the candidate as another check's input (grader/isolation/answers.py).

Every reference, every child the grader would start for it (grader.app: one per level group, split where a
check's inputs carry another's answer), scanned for an expected output of one check inside an input of
another in the same child: none. And the scan sees the real thing: on every PPO task, one child per level
would hand L3 `rollout_generate`'s sampled responses to the candidate inside `rollout_logprobs_values`'s rows.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from catalog import heldout, scorers
from catalog.checks import checks_for
from catalog.h5schema import read_reference
from catalog.tasks import compose_task, task_class, task_features, task_method
from grader.app import LEVEL_GROUPS, _separate
from grader.isolation.answers import scan_child

ROOT = Path(__file__).resolve().parents[2]
REFS = sorted((ROOT / "references").glob("*.h5"))


def _recorded(ref, key: str) -> dict[str, np.ndarray]:
    return heldout.child_inputs(ref.checks[key].inputs, {}) if key in scorers.SCORERS else ref.checks[key].inputs


def children(task: str, ref, split: bool = True):
    """[(group name, [check keys])] as grade() starts them with every level selected."""
    cfg = compose_task(task)
    spec, checks = checks_for(task_class(cfg), task_method(cfg), task_features(cfg))
    specs = [s for s in spec + checks if s.key in ref.checks]
    out = []
    for group in LEVEL_GROUPS[task_class(cfg)]:
        run = [s for s in specs if s.level in group]
        for part in (_separate(run, ref, group) if split else [run]) if run else []:
            out.append(("+".join(group), [s.key for s in part]))
    return out


def _scan(ref, name: str, keys: list[str]):
    return scan_child(name, {k: _recorded(ref, k) for k in keys}, {k: ref.checks[k].outputs for k in keys})


def test_the_scan_finds_planted_answers_and_nothing_plain():
    rng = np.random.default_rng(0)
    tokens = rng.integers(5, 500, (3, 6))
    padded = np.full((3, 20), 404)
    padded[:, 4:10] = tokens  # responses inside padded query + response rows
    runs = np.repeat([[7], [9], [11]], 4, axis=1)  # responses of one repeated token each: every row plain
    padded_runs = np.full((3, 10), 404)
    padded_runs[:, 2:6] = runs
    y = rng.standard_normal((4, 8)).astype(np.float32)
    same = rng.standard_normal((2, 8)).astype(np.float32)
    inputs = {"L3/a": {"x": rng.standard_normal(8).astype(np.float32)},
              "L3/b": {"ids": padded.astype(np.int32), "runs": padded_runs, "big": np.concatenate([y, 2 * y]),
                       "same": same, "mask": np.ones((3, 20), np.int32), "pos": np.arange(20),
                       "names": np.array(list("abcdef"))},
              "L3/c": {"y": y},
              "L3/d": {"same": same}}
    outputs = {"L3/a": {"tokens": tokens, "padded": np.pad(tokens, ((0, 0), (0, 3))),  # 0-padded, not 404-padded
                        "runs": runs, "runs_shuffled": runs[[1, 0, 2]],  # found row by row, not row i in row i
                        "y": y, "mask": np.ones((3, 6)), "len": np.full(3, 6), "pos": np.arange(8),
                        "names": np.array(list("bcde"))},
               "L3/b": {"z": np.zeros(1), "y": y},  # b's own `big` holds its y: c's copy of it gives nothing away
               "L3/c": {"y2": 2 * y},
               "L3/d": {"same": same}}  # d's answer is its own input (an identity): b's copy gives nothing away
    got = {(f.answering, f.carrying, f.how.split(" ")[0]) for f in scan_child("L3", inputs, outputs)}
    assert got == {("a/tokens", "b/ids", "all"), ("a/padded", "b/ids", "3/3"), ("a/runs", "b/runs", "all"),
                   ("a/y", "b/big", "whole"), ("a/y", "c/y", "equal"), ("c/y2", "b/big", "whole"),
                   ("a/names", "b/names", "whole")}, got


SMOKE = {"llama3-ppo", "qwen2-ppo", "llama3-dpo", "llama3-sft", "gemma4-chunked", "gpt-oss-core"}  # CI; all: slow


@pytest.mark.parametrize("path", [p if p.stem in SMOKE else pytest.param(p, marks=pytest.mark.slow) for p in REFS],
                         ids=[p.stem for p in REFS])
def test_no_child_gets_an_answer_among_its_inputs(path):
    ref = read_reference(path)
    lines = [f.line(path.stem) for name, keys in children(path.stem, ref) for f in _scan(ref, name, keys)]
    assert not lines, f"{len(lines)} recorded answers handed to the candidate as inputs:\n" + "\n".join(lines)


@pytest.mark.parametrize("task", ["llama3-ppo", "qwen2-ppo"])
def test_the_scan_sees_the_rollouts_a_shared_child_would_hand_over(task):
    ref = read_reference(ROOT / "references" / f"{task}.h5")
    found = [f for name, keys in children(task, ref, split=False) for f in _scan(ref, name, keys)]
    assert any(f.answering_key == "L3/rollout_generate" and f.carrying_key == "L3/rollout_logprobs_values"
               for f in found), found
    split = dict((name, keys) for name, keys in children(task, ref) if "L3/rollout_generate" in keys)
    assert "L3/rollout_logprobs_values" not in split["L3"]
