"""The clean baseline of one task: the oracle graded twice (its noise) and once under coverage, cached on disk by a key over everything it depends on."""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from pathlib import Path

from catalog import heldout, scorers
from grader.app import LEVEL_GROUPS, _asset_paths, grade
from grader.isolation.sandbox import _verifier_dir
from grader.sweep.defects import DEFAULT_NOISE, Defect, GATE_CHECK, ROOT, SOLUTION_TREES, _task_key
from grader.sweep.impact import Anchors, Impact, edited_spans, group_impact
from grader.timing.budget import BudgetPolicy


# ---- the clean baseline of one task (cached on disk) -----------------------------------------------

CACHE_VERSION = 1
IMPACT_MODES = ("line", "file", "off")
# the coverage grading only measures which code each child executes: its timed levels get room for the
# tracer's slowdown (a check that times out under it leaves that group without trustworthy coverage)
COVERAGE_BUDGET = dict(headroom=6.0, factor=4.0, grace_s=30.0)  # branch coverage slows the child ~2-3x


def _noise(ref, key: str, runs: list[dict]) -> float:
    """max(floor, the reference's recorded noise, the spread of the clean oracle's scores over `runs`)."""
    rec = ref.checks.get(key)
    recorded = rec.attrs.get("noise") if rec is not None else None
    scores = [run[key]["score"] for run in runs if key in run]
    spread = max(scores) - min(scores) if scores else 0.0
    return max(DEFAULT_NOISE, 0.0 if recorded is None else float(recorded), spread)


def _scores(report: dict) -> dict[str, dict]:
    return {f'{c["level"]}/{c["name"]}': c for c in report["checks"]}


def _grade(cfg, candidate: Path, report_dir: Path, levels, compile_cache: Path | None = None, **kw) -> dict:
    return grade(cfg, candidate, ROOT / "references", report_dir, quiet=True, levels=levels,
                 compile_cache=compile_cache, **kw)


def _say(msg: str) -> None:
    print(msg, flush=True)  # progress of a long run, also when stdout is a file


def _hash_tree(h, base: Path, rel: str) -> None:
    root = base / rel
    paths = [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    for p in paths:
        h.update(p.relative_to(base).as_posix().encode() + b"\0")
        st = p.stat()
        if st.st_size <= 64 << 20:
            h.update(hashlib.sha256(p.read_bytes()).digest())
        else:  # a release's gigabytes: size and mtime stand for the bytes
            h.update(f"{st.st_size}:{st.st_mtime_ns}".encode())


def baseline_key(task: str, cfg, levels: tuple[str, ...] | None, impact: str) -> str:
    """sha256 of everything the clean grading and its coverage depend on: the solution trees, the reference
    file, the grader and catalog packages (probes, checks, workloads, budgets, the defect catalog), the composed
    task config, the
    assets the child reads (checkpoint, tokenizer, data), the verifier environment's installed distributions,
    the levels graded and the impact mode. Any change of these recomputes the baseline."""
    from omegaconf import OmegaConf

    h = hashlib.sha256(f"t2j-sweep-baseline {CACHE_VERSION} {task} {levels} {impact}\n".encode())
    for rel in (*SOLUTION_TREES, f"references/{task}.h5", "grader", "catalog"):
        _hash_tree(h, ROOT, rel)
    h.update(OmegaConf.to_yaml(cfg, resolve=True).encode())
    for rel in _asset_paths(cfg).values():
        p = Path(rel)
        _hash_tree(h, p.parent if p.is_absolute() else ROOT, p.name if p.is_absolute() else rel)
    site = sorted(p.name for p in _verifier_dir().glob("lib/python*/site-packages/*.dist-info"))
    h.update("\n".join(site).encode())
    return h.hexdigest()


@contextmanager
def _file_lock(path: Path):
    """An exclusive lock on `path` (created): the first job of a multirun computes the baseline, the others wait."""
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _groups(task_class: str, levels) -> dict[str, tuple[str, ...]]:
    return {"+".join(g): g for g in LEVEL_GROUPS[task_class] if levels is None or set(g) & set(levels)}


def _depends(task_class: str, ref, levels) -> dict[str, tuple[str, ...]]:
    """group -> the groups whose outputs its child consumes (training L6 runs on L5's adapter)."""
    groups = _groups(task_class, None)
    of = lambda key: next(g for g, lvs in groups.items() if key.split("/")[0] in lvs)  # noqa: E731
    if heldout.ADAPTER_KEY not in ref.checks:
        return {}
    return {of(k): (of(heldout.ADAPTER_KEY),) for k in scorers.SCORERS if k in ref.checks}


BASELINE_ATTEMPTS = 3


class BaselineError(RuntimeError):
    """The clean oracle does not reach its ceiling here: a sweep of the task would judge nothing."""


def below_ceiling(*reports: dict) -> list[str]:
    """The checks of clean gradings under their strict bar, with the reason: '' when every one is at its ceiling."""
    out = {}
    for r in reports:
        for c in r["checks"]:
            if c["score"] < c["bar"]:
                out[f'{c["level"]}/{c["name"]}'] = f'{c["level"]}/{c["name"]} {c["score"]:.6f} ({c.get("reason") or "score"})'
    return [out[k] for k in sorted(out)]


def task_baseline(task: str, cfg, ref, levels, cache_dir: Path, workdir: Path, compile_cache: Path | None,
                  impact: str = "line", progress=_say, refresh: bool = False) -> dict:
    """The clean oracle graded twice (its run-to-run noise) and, unless impact is off, once more under branch
    coverage (which code each level group's child executes): computed once per key (baseline_key) and kept
    in cache_dir/<task>/<key>/baseline.json; concurrent jobs wait on a file lock while the first computes it.
    A clean grading below its ceiling (a check under its strict bar, a timeout on a loaded machine among them)
    is refused and graded again, up to BASELINE_ATTEMPTS times, then BaselineError; only a baseline at its
    ceiling is cached."""
    key = baseline_key(task, cfg, levels, impact)
    path = Path(cache_dir) / task / key[:16] / "baseline.json"
    with _file_lock(Path(cache_dir) / task / ".lock"):
        if path.is_file() and not refresh:
            base = json.loads(path.read_text())
            if base.get("key") == key:
                progress(f"[{task}] clean baseline from the cache ({path.parent.name})")
                return base
        started = time.perf_counter()
        for attempt in range(1, BASELINE_ATTEMPTS + 1):
            with ThreadPoolExecutor(max_workers=2) as pool:  # the clean oracle twice: its run-to-run noise
                clean_report, rerun = pool.map(lambda i: _grade(
                    cfg, ROOT, workdir / f"reports-clean-{attempt}-{i}", levels, compile_cache), (0, 1))
            below = below_ceiling(clean_report, rerun)
            if not below:
                break
            # every defect is judged against this baseline: one below its ceiling would make the defects that
            # cost the same checks uncatchable (a timeout on a loaded machine, docs/SWEEP.md), so it is refused
            progress(f"[{task}] the clean oracle scores below its ceiling at {', '.join(below)}: refused, "
                     f"{'grading it again' if attempt < BASELINE_ATTEMPTS else 'giving up'}")
        else:
            raise BaselineError(f"{task}: the clean oracle scored below its ceiling {BASELINE_ATTEMPTS} times "
                                f"({'; '.join(below)}): no defect of this task can be judged against it; "
                                f"nothing cached")
        coverage, coverage_ok = {}, {}
        task_class = _task_key(cfg)[0]
        groups = _groups(task_class, levels)
        if impact != "off":
            cov = _grade(cfg, ROOT, workdir / "reports-clean-coverage", levels, compile_cache, coverage=True,
                         budget=BudgetPolicy(**COVERAGE_BUDGET))
            clean, traced = _scores(clean_report), _scores(cov)
            by_group = cov.get("coverage_by_group") or {}
            for g, lvs in groups.items():
                keys = [k for k in clean if k.split("/")[0] in lvs and k != GATE_CHECK]
                coverage[g] = {rel: {"lines": e["lines"]} for rel, e in by_group.get(g, {}).items()}
                # trusted where the traced child reported its lines and reproduced every clean score of its group
                coverage_ok[g] = not keys or (bool(coverage[g]) and all(
                    k in traced and traced[k]["score"] == clean[k]["score"] for k in keys))
        base = {"key": key, "task": task, "levels": list(levels) if levels else None, "impact": impact,
                "clean": clean_report["checks"], "rerun": rerun["checks"],
                "clean_reward": clean_report["reward"], "clean_rerun_reward": rerun["reward"],
                "clean_earned_levels": clean_report["earned_levels"],
                "groups": {g: list(lvs) for g, lvs in groups.items()},
                "depends": {g: list(d) for g, d in _depends(task_class, ref, levels).items()},
                "coverage": coverage, "coverage_ok": coverage_ok, "seconds": time.perf_counter() - started}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.partial")
        tmp.write_text(json.dumps(base, default=float))
        os.replace(tmp, path)
        return base


def impact_of(defect: Defect, base: dict, impact: str = "line", source: Path = ROOT):
    """grader.sweep.impact.Impact of `defect` on the baseline's level groups (every group graded when impact is off)."""
    groups = list(base["groups"])
    if impact == "off":
        return Impact({g: True for g in groups}, {g: "impact analysis off" for g in groups})
    old = (Path(source) / defect.file).read_text()
    spans = edited_spans(old, old.replace(defect.old, defect.new)) if impact == "line" else Anchors((), "impact=file")
    executed = {g: base["coverage"].get(g, {}) if base["coverage_ok"].get(g) else None for g in groups}
    return group_impact(defect.file, spans, executed, {g: tuple(d) for g, d in base["depends"].items()})
