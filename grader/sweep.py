"""Seeded-defect sweep (DESIGN section 10): grade mutants of the oracles, report what the checks catch.

    python -m grader.sweep task=llama3-sft [defects=id1,id2] [limit=N] [levels=L1,L3] [jobs=2] [out=reports/sweep]
    python -m grader.sweep all=true [defects=...] [limit=N] [jobs=2]    # every task with a reference
    (`--task NAME`, `--all`, `--defects a,b`, `--limit N`, `--levels ...`, `--jobs N`, `--out DIR`, `--impact
    line|file|off`, `--cache DIR`, `--refresh` are the same options; defects, limit and levels are for quick
    runs: a full sweep grades every applicable defect; jobs grades that many mutants at once)

    # the same as a Hydra multirun over (task, defect), one job per mutant (configs/sweep.yaml):
    python -m grader.sweep -m task=llama3-sft,llama3-chunked 'defect=glob(*)' hydra/launcher=local
    python -m grader.sweep aggregate=true [task=llama3-sft]   # then the reports and the last line

The catalog is grader/defects.yaml (data, not code): each defect is one exact text edit to a copy
of jax_oracles/, serving_engine/ and conversion/. Per task the clean oracle is graded twice (its noise)
and once under branch coverage (which lines each level group's sandboxed child executes): the task's
*baseline*, kept on disk in <out>/.cache/<task>/<key>/ where the key is a sha256 of everything it depends
on (baseline_key: the solution trees, references/<task>.h5, the grader package with its catalog, the
composed task config, the assets the child reads, the verifier environment's distributions, the levels and
the impact mode), so a change of any of them recomputes it. Then every defect that applies to the task's
class, family and mode is graded on its own mutant, `jobs` at a time, at the level groups that can execute
its edit only (grader/impact.py: the edited statements, or the whole file where a line-level answer could
be unsound); a group that cannot keeps the clean oracle's scores, marked reused in the record (same code
executed on the same inputs on a deterministic CPU: same result). The independence gate (L0/torch_free)
runs for every mutant. A defect whose edit no group executes is reported, not caught, with the reason.
All grades of a run share one JAX persistent compilation cache, so a mutant recompiles only the programs
its edit changed (the multirun keeps it in <out>/.cache/xla).

In the multirun each job grades one mutant and writes its record to <out>/.cache/<task>/<key>/records/;
a (task, defect) pair whose defect does not apply is recorded as such and skipped. The first job of a task
computes the baseline under a file lock (the others wait for it) and with the machine to itself (an
exclusive lock that mutant gradings take shared: a baseline's timed levels are the bar); the aggregation
step writes the same reports as the --task/--all path.

A check is *tripped* by a defect when its score falls below the clean oracle's score on that check by
more than the check's run-to-run noise. The noise is measured: the clean oracle is graded twice and
the noise is the larger of the two runs' score gap and a floor of 1e-6 (or the reference check
group's "noise" attribute, where a recording on a nondeterministic device sets one). On this CPU
both runs are bit-identical, so any drop above rounding is the defect's.
A defect is *caught* when it trips at least one check. A defect that trips the independence gate
zeroes every check; the per-check tally credits it to L0/torch_free only, so a torch import cannot
make every other check look sharp.

Writes reports/sweep/<task>.json and reports/sweep/<task>.md. `all` (and `aggregate`) prints as its last
line `defects_caught=N/M strict_caught=S/M checks_tripped=K/L` (over both classes; a defect counts
once per task it applies to; a check is one (class, level/name) pair, tripped when any defect on any
task of that class trips it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CATALOG = Path(__file__).with_name("defects.yaml")
FAMILY_CATALOGS = Path(__file__).with_name("defects")  # defects/<family>.yaml: each family's signature bugs
SOLUTION_TREES = ("jax_oracles", "serving_engine", "conversion")
DEFAULT_NOISE = 1e-6
CLASSES = ("training", "serving")
LEVELS = ("L0", "L1", "L2", "L3", "L4", "L5", "L6")
GATE_CHECK = "L0/torch_free"

__all__ = ["CATALOG", "Defect", "Catalog", "load_catalog", "applicable", "apply_defect", "make_mutant",
           "sweep_task", "write_reports", "main_all", "main"]


# ---- the catalog ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Defect:
    id: str
    task_class: str            # "training" | "serving" (`class` in the yaml)
    families: tuple[str, ...]  # () = all
    modes: tuple[str, ...]     # () = all (serving only)
    levels: tuple[str, ...]    # levels whose checks it is expected to trip
    file: str                  # relative to the candidate root
    old: str
    new: str
    description: str
    methods: tuple[str, ...] = ()  # training only: () = every method (the edited code serves them all)
    features: tuple[str, ...] = ()  # training only: family features the edited shared code serves (all needed)

    def applies_to(self, task_class: str, family: str, mode: str | None, method: str | None = None,
                   features=None) -> bool:
        return (self.task_class == task_class and (not self.families or family in self.families)
                and (not self.modes or mode is None or mode in self.modes)
                and (not self.methods or method is None or method in self.methods)
                and (features is None or set(self.features) <= set(features)))


@dataclass(frozen=True)
class Catalog:
    defects: tuple[Defect, ...]
    untripped_rationale: dict[str, str]


def _names(value, field: str, did: str) -> tuple[str, ...]:
    if value in (None, "all"):
        return ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"defect {did}: {field} must be `all` or a list of names, got {value!r}")
    return tuple(value)


def load_catalog(path: Path = CATALOG) -> Catalog:
    """The main catalog, plus (for the default path) every grader/defects/<family>.yaml beside it."""
    raw = yaml.safe_load(Path(path).read_text())
    entries, rationale = list(raw["defects"]), dict(raw.get("untripped_rationale") or {})
    if Path(path) == CATALOG:
        for extra in sorted(FAMILY_CATALOGS.glob("*.yaml")):
            more = yaml.safe_load(extra.read_text()) or {}
            entries += more.get("defects") or []
            rationale.update(more.get("untripped_rationale") or {})
    defects = []
    for d in entries:
        did = d["id"]
        if d["class"] not in CLASSES:
            raise ValueError(f"defect {did}: class {d['class']!r} not in {CLASSES}")
        if not str(d["file"]).startswith(tuple(f"{t}/" for t in SOLUTION_TREES)):
            raise ValueError(f"defect {did}: file {d['file']} is not under {SOLUTION_TREES}")
        levels = tuple(d.get("levels") or ())
        if not levels or set(levels) - set(LEVELS):
            raise ValueError(f"defect {did}: levels must be a non-empty list of {LEVELS}, got {levels}")
        defects.append(Defect(did, d["class"], _names(d.get("families"), "families", did),
                              _names(d.get("modes"), "modes", did), levels, d["file"], d["edit"]["old"],
                              d["edit"]["new"], " ".join(str(d["description"]).split()),
                              _names(d.get("methods"), "methods", did), _names(d.get("features"), "features", did)))
    ids = [d.id for d in defects]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate defect ids: {sorted({i for i in ids if ids.count(i) > 1})}")
    return Catalog(tuple(defects), rationale)


def _task_key(cfg) -> tuple:
    from recorder.app import task_class, task_features, task_method
    return (task_class(cfg), cfg.family.name, cfg.mode.name if "mode" in cfg else None, task_method(cfg),
            task_features(cfg))


def applicable(defects, cfg) -> list[Defect]:
    """The defects that apply to the composed task config's class, family, mode and method."""
    key = _task_key(cfg)
    return [d for d in defects if d.applies_to(*key)]


def apply_defect(root: Path, defect: Defect) -> None:
    """Edit root/defect.file in place; the edit target must occur exactly once."""
    path = Path(root) / defect.file
    text = path.read_text()
    count = text.count(defect.old)
    if count != 1:
        raise ValueError(f"defect {defect.id}: edit target occurs {count} times in {defect.file}, not once")
    path.write_text(text.replace(defect.old, defect.new))


def make_mutant(defect: Defect, dst: Path, source: Path = ROOT) -> Path:
    """A copy of the solution trees of `source` under dst, with the defect applied."""
    dst = Path(dst)
    for tree in SOLUTION_TREES:
        shutil.copytree(source / tree, dst / tree, ignore=shutil.ignore_patterns("__pycache__"))
    apply_defect(dst, defect)
    return dst


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
    from grader.app import grade
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
    file, the grader package (its probes, checks, budgets and this catalog), the composed task config, the
    assets the child reads (checkpoint, tokenizer, data), the verifier environment's installed distributions,
    the levels graded and the impact mode. Any change of these recomputes the baseline."""
    from omegaconf import OmegaConf

    from grader.app import _asset_paths
    from grader.sandbox import _verifier_dir
    h = hashlib.sha256(f"t2j-sweep-baseline {CACHE_VERSION} {task} {levels} {impact}\n".encode())
    for rel in (*SOLUTION_TREES, f"references/{task}.h5", "grader"):
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
    from grader.app import LEVEL_GROUPS
    return {"+".join(g): g for g in LEVEL_GROUPS[task_class] if levels is None or set(g) & set(levels)}


def _depends(task_class: str, ref, levels) -> dict[str, tuple[str, ...]]:
    """group -> the groups whose outputs its child consumes (training L6 runs on L5's adapter)."""
    from grader import heldout
    groups = _groups(task_class, None)
    of = lambda key: next(g for g, lvs in groups.items() if key.split("/")[0] in lvs)  # noqa: E731
    if heldout.ADAPTER_KEY not in ref.checks:
        return {}
    return {of(k): (of(heldout.ADAPTER_KEY),) for k in heldout.SCORERS if k in ref.checks}


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
            from grader.budget import BudgetPolicy
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
    """grader.impact.Impact of `defect` on the baseline's level groups (every group graded when impact is off)."""
    from grader.impact import Anchors, Impact, edited_spans, group_impact
    groups = list(base["groups"])
    if impact == "off":
        return Impact({g: True for g in groups}, {g: "impact analysis off" for g in groups})
    old = (Path(source) / defect.file).read_text()
    spans = edited_spans(old, old.replace(defect.old, defect.new)) if impact == "line" else Anchors((), "impact=file")
    executed = {g: base["coverage"].get(g, {}) if base["coverage_ok"].get(g) else None for g in groups}
    return group_impact(defect.file, spans, executed, {g: tuple(d) for g, d in base["depends"].items()})


# ---- one mutant ------------------------------------------------------------------------------------

TIMED = ("L5", "L6")
MERGE = True  # the default of `merge` (sweep_task, the CLI, configs/sweep.yaml)
FORK = True   # the default of `fork`: a mutant's children are forks of a server that has imported jax


@contextmanager
def fork_server(compile_cache: Path | None, enabled: bool = True):
    """A grader/forkserver.py server for this sweep's mutants (None when disabled or where it cannot fork)."""
    if not enabled:
        yield None
        return
    from grader.forkserver import ForkServer
    from grader.gate import fork_server_env
    try:
        server = ForkServer(fork_server_env(compile_cache))
    except (RuntimeError, OSError) as e:
        _say(f"no fork server ({e}): sealed children")
        yield None
        return
    try:
        yield server
    finally:
        server.close()


_SERVERS: dict[str, object] = {}


def _job_fork_server(compile_cache: Path, enabled: bool):
    """A multirun worker's fork server, kept for the worker's next jobs (closed at exit)."""
    if not enabled:
        return None
    key = str(compile_cache)
    if key not in _SERVERS:
        import atexit
        ctx = fork_server(compile_cache)
        _SERVERS[key] = ctx.__enter__()
        atexit.register(ctx.__exit__, None, None, None)
    return _SERVERS[key]
# reasons grade() gives every check of a child that did not finish (grader/gate.py, grader/app.py)
_CHILD_FAILURES = ("timeout", "torch import", "network access", "reads references/", "no output", "no outputs written")


def _merged_groups(graded_levels) -> tuple[tuple[str, ...], ...]:
    """One child for every graded untimed level, one for each timed level (their budgets are per child)."""
    untimed = tuple(lv for lv in graded_levels if lv not in TIMED)
    return ((untimed,) if untimed else ()) + tuple((lv,) for lv in graded_levels if lv in TIMED)


def _child_failed(report: dict) -> bool:
    return any(c.get("reason") and (c["reason"] in _CHILD_FAILURES
                                    or c["reason"].startswith(("exit ", "untrusted output")))
               for c in report["checks"] if c["level"] not in TIMED)


def grade_mutant(defect: Defect, cfg, base: dict, workdir: Path, levels=None, compile_cache: Path | None = None,
                 impact: str = "line", merge: bool = False, forkserver=None) -> dict:
    """Grade one mutant at the level groups that can execute its edit; the others keep the clean scores
    (marked reused). The gate (L0/torch_free) runs whatever the impact. -> the per-defect record.
    `merge`: the graded untimed levels run in one sandboxed child instead of one each (a child that does not
    finish is graded again group by group). `forkserver` (grader/forkserver.py): the mutant's children are
    trusted forks of an interpreter that has imported jax (the repo's own mutants only), else sealed children."""
    from grader.lattice import Check, earned_levels
    from grader.reward import reward as compute_reward

    t0 = time.perf_counter()
    imp = impact_of(defect, base, impact)
    graded_levels = tuple(lv for g, lvs in base["groups"].items() if imp.graded[g] for lv in lvs
                          if levels is None or lv in levels)
    mutant = make_mutant(defect, Path(workdir) / f"mutant-{defect.id}")
    merged_child = merge and len([lv for lv in graded_levels if lv not in TIMED]) > 1
    fork = {"trusted": True, "forkserver": forkserver} if forkserver is not None else {}
    try:
        report = _grade(cfg, mutant, Path(workdir) / f"reports-{defect.id}", graded_levels, compile_cache,
                        **({"groups": _merged_groups(graded_levels)} if merged_child else {}), **fork)
        if merged_child and _child_failed(report):  # a crash or hang costs the merged child: grade group by group
            report = _grade(cfg, mutant, Path(workdir) / f"reports-{defect.id}-groups", graded_levels, compile_cache,
                            **fork)
    finally:
        shutil.rmtree(mutant, ignore_errors=True)
    clean = {f'{c["level"]}/{c["name"]}': c for c in base["clean"]}
    produced = _scores(report)
    if report.get("gated"):  # the gate zeroes every check, as a full grade does
        merged, reused = produced, []
        reward, earned = report["reward"], report["earned_levels"]
    else:
        merged = {k: produced.get(k, c) for k, c in clean.items()}
        reused = [k for k in clean if k not in produced]
        checks = [Check.from_report(c) for c in merged.values()]
        reward, earned = compute_reward(checks), earned_levels(checks)
    return {"report": {"checks": list(merged.values()), "reward": reward, "earned_levels": earned,
                       "gated": report.get("gated")},
            "reused": reused, "impact": imp.why, "graded_groups": [g for g in base["groups"] if imp.graded[g]],
            "seconds": time.perf_counter() - t0}


def defect_record(defect: Defect, graded: dict, base: dict, noise: dict, order, levels=None) -> dict:
    """The sweep's per-defect record from grade_mutant's output (what the reports render)."""
    clean = {f'{c["level"]}/{c["name"]}': c for c in base["clean"]}
    report = graded["report"]
    scores = {f'{c["level"]}/{c["name"]}': c for c in report["checks"]}
    tripped = sorted((k for k in clean if k in scores and scores[k]["score"] < clean[k]["score"] - noise[k]),
                     key=order)
    levels_tripped = sorted({k.split("/")[0] for k in tripped})
    # Strictly caught: a check the clean oracle passes strictly fails its strict bar (costs a level).
    failed_strict = sorted((k for k in clean if k in scores and clean[k]["score"] >= _bar(clean[k])
                            and scores[k]["score"] < _bar(scores[k])), key=order)
    rec = {
        "id": defect.id, "description": defect.description, "file": defect.file,
        "expected_levels": list(defect.levels),
        "reward": report["reward"], "reward_drop": base["clean_reward"] - report["reward"],
        "gated": bool(report.get("gated")), "caught": bool(tripped), "tripped": tripped,
        "strict_caught": bool(failed_strict), "failed_strict": failed_strict,
        "earned_levels": report["earned_levels"],
        "levels_tripped": levels_tripped,
        "expected_levels_missed": [lv for lv in defect.levels if lv not in levels_tripped
                                   and (levels is None or lv in levels)],
        "scores": {k: scores[k]["score"] for k in tripped},
        "reasons": {k: scores[k]["reason"] for k in tripped if scores[k].get("reason")},
        "graded_groups": graded["graded_groups"],
        "reused_checks": len(graded["reused"]),  # clean scores kept: their groups cannot execute the edit
        "impact": graded["impact"],
        "seconds": graded["seconds"],
    }
    if not graded["graded_groups"]:
        rec["not_executed"] = ("no level group's child executes the edit (only the gate ran): "
                               + "; ".join(f"{g}: {w}" for g, w in graded["impact"].items()))
    return rec


def _noises(base: dict, ref) -> dict[str, float]:
    clean, rerun = ({f'{c["level"]}/{c["name"]}': c for c in base[k]} for k in ("clean", "rerun"))
    return {k: _noise(ref, k, [clean, rerun]) for k in clean}


def assemble(task: str, task_class: str, base: dict, records: list[dict], levels, seconds: float) -> dict:
    """The sweep result of one task (what write_reports renders) from the baseline and the defect records."""
    from grader.h5schema import read_reference
    order = _check_order(task_class)
    noise = _noises(base, read_reference(ROOT / "references" / f"{task}.h5"))
    clean = {f'{c["level"]}/{c["name"]}': c for c in base["clean"]}
    checks = {}
    for key in sorted(clean, key=order):
        by = [r["id"] for r in records if key in r["tripped"] and (not r["gated"] or key == GATE_CHECK)]
        checks[key] = {"clean_score": clean[key]["score"], "clean_reason": clean[key].get("reason"),
                       "noise": noise[key], "tripped_by": by}
    graded = sum(len(r.get("graded_groups", base["groups"])) for r in records)
    return {
        "task": task, "task_class": task_class, "clean_reward": base["clean_reward"],
        "clean_rerun_reward": base["clean_rerun_reward"],
        "clean_earned_levels": base["clean_earned_levels"], "default_noise": DEFAULT_NOISE,
        "levels": list(levels) if levels else list(LEVELS), "defects": records, "checks": checks,
        "totals": {"defects_caught": sum(r["caught"] for r in records), "defects": len(records),
                   "strict_caught": sum(r["strict_caught"] for r in records),
                   "checks_tripped": sum(bool(c["tripped_by"]) for c in checks.values()), "checks": len(checks),
                   "groups_graded": graded, "groups_total": len(base["groups"]) * len(records)},
        "impact": base.get("impact", "off"), "baseline_key": base["key"],
        "seconds": seconds,
    }


# ---- one task ------------------------------------------------------------------------------------

def sweep_task(task: str, defects, workdir: Path, progress=_say, levels: tuple[str, ...] | None = None,
               jobs: int = 1, compile_cache: Path | None = None, impact: str = "line",
               cache_dir: Path | None = None, refresh: bool = False, merge: bool = MERGE, fork: bool = FORK) -> dict:
    """Grade the clean oracle and every applicable defect of `defects` on `task` -> the sweep result
    (what write_reports renders). Mutants are built under workdir and removed after. `levels` restricts
    every grade to those levels (quick runs and tests; L0/torch_free always runs); None = all levels.
    `jobs` mutants are graded at a time; `compile_cache` is one JAX cache directory they all share.
    `impact` (line | file | off): grade each mutant only at the level groups whose clean child executes the
    edited lines (or file), reusing the clean scores elsewhere (grader/impact.py). The clean baseline is kept
    in `cache_dir` (default workdir/baseline-cache) under a key of everything it depends on. `merge`: a mutant's
    graded untimed levels share one sandboxed child (grade_mutant); `fork`: the mutants' children are forks of
    a fork server (grader/forkserver.py; the clean baseline is graded in sealed children)."""
    from grader.h5schema import read_reference
    from recorder.app import compose_task

    if impact not in IMPACT_MODES:
        raise ValueError(f"impact must be one of {IMPACT_MODES}, got {impact!r}")
    cfg = compose_task(task)
    task_class = _task_key(cfg)[0]
    order = _check_order(task_class)
    todo = applicable(defects, cfg)
    ref = read_reference(ROOT / "references" / f"{task}.h5")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    base = task_baseline(task, cfg, ref, levels, Path(cache_dir or workdir / "baseline-cache"), workdir,
                         compile_cache, impact, progress, refresh)
    noise = _noises(base, ref)
    untrusted = [g for g, ok in base["coverage_ok"].items() if not ok] if impact != "off" else []
    progress(f"[{task}] clean oracle: reward={base['clean_reward']:.6f}, rerun {base['clean_rerun_reward']:.6f}, "
             f"largest check noise {max(noise.values()):g} ({time.perf_counter() - started:.0f} s); "
             f"{len(todo)} defects apply" + (f"; coverage untrusted at {', '.join(untrusted)}" if untrusted else ""))

    def grade_defect(d: Defect) -> dict:
        graded = grade_mutant(d, cfg, base, workdir, levels, compile_cache, impact, merge, server)
        return defect_record(d, graded, base, noise, order, levels)

    # Each grade is a chain of sandboxed child processes: threads are enough to keep `jobs` of them busy.
    records: dict[str, dict] = {}
    with fork_server(compile_cache, fork and bool(todo)) as server, \
            ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(grade_defect, d): d for d in todo}
        for done in as_completed(futures):
            rec = done.result()
            records[rec["id"]] = rec
            progress(_progress_line(task, len(records), len(todo), rec))
    records = [records[d.id] for d in todo]  # catalog order, whatever order they finished in
    return assemble(task, task_class, base, records, levels, time.perf_counter() - started)


def _progress_line(task: str, i: int, n: int, rec: dict) -> str:
    return (f"[{task}] {i}/{n} {rec['id']}: reward={rec['reward']:.6f} "
            f"{'caught' if rec['caught'] else 'NOT CAUGHT'}, "
            f"{'strictly' if rec['strict_caught'] else 'NOT STRICTLY'} (L{rec['earned_levels']}), "
            f"{len(rec['tripped'])} checks tripped "
            f"(levels {','.join(rec['levels_tripped']) or '-'}; "
            f"graded {','.join(rec['graded_groups']) or 'gate only'}; "
            f"{rec['seconds']:.0f} s)")


def _bar(check: dict) -> float:
    """A graded check's strict bar (reports written before strict verdicts: the noise-free bar)."""
    from grader.lattice import strict_bar
    return float(check.get("bar") or strict_bar(check["aspect"]))


def _check_order(task_class: str):
    """Sort key: a check's place in the class's catalog (grader/checks.py), unknown keys last."""
    from grader.checks import checks_for
    order = {s.key: i for i, s in enumerate(sum(checks_for(task_class), ()))}
    return lambda key: (order.get(key, len(order)), key)


# ---- reports -------------------------------------------------------------------------------------

def write_reports(result: dict, out_dir: Path, rationale: dict[str, str] | None = None) -> tuple[Path, Path]:
    """reports/sweep/<task>.json and .md from a sweep_task result."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    task, rationale = result["task"], rationale or {}
    untripped = {k: rationale.get(k, "(no rationale in grader/defects.yaml)")
                 for k, c in result["checks"].items() if not c["tripped_by"]}
    result = {**result, "untripped": untripped}
    js = out_dir / f"{task}.json"
    js.write_text(json.dumps(result, indent=2, default=float))
    md = out_dir / f"{task}.md"
    md.write_text(_markdown(result))
    return js, md


def _fmt_checks(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", +{len(keys) - limit} more" if len(keys) > limit else "")


def _markdown(r: dict) -> str:
    t = r["totals"]
    lines = [
        f"# Seeded-defect sweep: {r['task']} ({r['task_class']})", "",
        f"Clean oracle reward {r['clean_reward']:.6f} (earned L{r['clean_earned_levels']}). "
        f"**{t['defects_caught']}/{t['defects']} defects caught, {t['strict_caught']}/{t['defects']} strictly "
        f"(each costs a level), {t['checks_tripped']}/{t['checks']} checks tripped** "
        f"({r['seconds'] / 60:.1f} min).", "",
        "A check is tripped when its score falls below the clean oracle's by more than its run-to-run noise "
        f"(measured: the larger of {r['default_noise']:g} and the score gap between two clean gradings, or the "
        "reference's `noise` attribute where one was recorded). A defect is caught when it trips a check, and "
        "strictly caught when a check the clean oracle passes strictly falls below its strict bar. Catalog: "
        "`grader/defects.yaml`." + ("" if r["levels"] == list(LEVELS) else f" Levels graded: {', '.join(r['levels'])}."),
    ]
    if r.get("impact", "off") != "off" and "groups_graded" in t:
        lines += ["", f"Impact analysis (`grader/impact.py`, {r['impact']} level): {t['groups_graded']} of "
                      f"{t['groups_total']} level-group gradings ran; a group whose clean child never executes a "
                      "defect's edit keeps the clean scores (the independence gate runs for every mutant)."]
    lines += [
        "", "## Defects", "",
        "| defect | reward | drop | caught | strict (level) | levels tripped | checks tripped | expected level missed "
        "| graded at | bug |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in r["defects"]:
        gated = " (gated)" if d["gated"] else ""
        graded = ",".join(d["graded_groups"]) or "gate only" if "graded_groups" in d else "all"
        lines.append(f"| `{d['id']}` | {d['reward']:.6f} | {d['reward_drop']:.2e} | "
                     f"{'yes' if d['caught'] else '**NO**'}{gated} | "
                     f"{'yes' if d.get('strict_caught') else '**NO**'} (L{d.get('earned_levels', '?')}) | "
                     f"{','.join(d['levels_tripped']) or '-'} | "
                     f"{_fmt_checks(d['tripped'])} | {','.join(d['expected_levels_missed']) or '-'} | {graded} | "
                     f"{d['description']} |")
    unexecuted = [d for d in r["defects"] if d.get("not_executed")]
    if unexecuted:
        lines += ["", "## Defects whose edit no level group executes (not caught)", ""]
        lines += [f"- `{d['id']}`: {d['not_executed']}" for d in unexecuted]
    lines += ["", "## Checks", "", "| check | clean score | noise | tripped by |", "|---|---|---|---|"]
    for key in sorted(r["checks"], key=_check_order(r["task_class"])):
        c = r["checks"][key]
        by = c["tripped_by"]
        note = f" ({c['clean_reason']})" if c.get("clean_reason") else ""
        lines.append(f"| `{key}` | {c['clean_score']:.9f}{note} | {c['noise']:g} | "
                     f"{f'{len(by)}: ' + ', '.join(by) if by else '**none**'} |")
    if r["untripped"]:
        lines += ["", "## Checks no defect tripped", ""]
        lines += [f"- `{k}`: {why}" for k, why in r["untripped"].items()]
    return "\n".join(lines) + "\n"


# ---- entry points --------------------------------------------------------------------------------

def recorded_tasks() -> list[str]:
    return sorted(p.stem for p in (ROOT / "references").glob("*.h5"))


def _select(catalog: Catalog, ids: list[str] | None) -> list[Defect]:
    defects = list(catalog.defects)
    if ids:
        unknown = sorted(set(ids) - {d.id for d in defects})
        if unknown:
            raise SystemExit(f"unknown defect ids: {', '.join(unknown)}")
        defects = [d for d in defects if d.id in ids]
    return defects


@contextmanager
def shared_compile_cache():
    """One JAX persistent compilation cache for every grade of a sweep, bound writable into each
    sandboxed child. Most of a mutant's functions are the oracle's, so their XLA programs come from
    the cache; a program is keyed by its HLO, so an edited one compiles afresh. A shared writable
    directory is a channel from one child to the next: the sweep grades only its own mutants of
    the oracles, so it may; the grader never does this for a candidate. Removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="t2j-sweep-xla-") as cache:
        yield Path(cache)


def _run(task: str, catalog: Catalog, ids, limit, out_dir: Path, levels=None, jobs: int = 1, impact: str = "line",
         cache_dir: Path | None = None, refresh: bool = False, merge: bool = MERGE, fork: bool = FORK) -> dict:
    defects = _select(catalog, ids)
    if limit is not None:  # the first `limit` of those that apply to this task
        from recorder.app import compose_task
        defects = applicable(defects, compose_task(task))[:limit]
    cache_dir = Path(cache_dir) if cache_dir else Path(out_dir) / ".cache"
    with tempfile.TemporaryDirectory(prefix=f"t2j-sweep-{task}-") as tmp, shared_compile_cache() as cache:
        result = sweep_task(task, defects, Path(tmp), levels=levels, jobs=jobs, compile_cache=cache, impact=impact,
                            cache_dir=cache_dir, refresh=refresh, merge=merge, fork=fork)
    return _report(result, out_dir, catalog)


def _report(result: dict, out_dir: Path, catalog: Catalog) -> dict:
    js, md = write_reports(result, out_dir, catalog.untripped_rationale)
    t = result["totals"]
    _say(f"[{result['task']}] defects_caught={t['defects_caught']}/{t['defects']} "
         f"strict_caught={t['strict_caught']}/{t['defects']} "
         f"checks_tripped={t['checks_tripped']}/{t['checks']} -> {md}")
    return result


def _totals(results: list[dict]) -> tuple[int, int, int, int]:
    """Print the per-class check lines and the last line `defects_caught=N/M strict_caught=S/M checks_tripped=K/L`."""
    caught = total = strict = 0
    checks: dict[tuple[str, str], bool] = {}
    for r in results:
        caught += r["totals"]["defects_caught"]
        strict += r["totals"]["strict_caught"]
        total += r["totals"]["defects"]
        for key, c in r["checks"].items():
            checks[(r["task_class"], key)] = checks.get((r["task_class"], key), False) or bool(c["tripped_by"])
    for cls in CLASSES:
        keys = [k for (c, k) in checks if c == cls]
        if keys:
            missed = [k for k in keys if not checks[(cls, k)]]
            _say(f"{cls}: checks_tripped={len(keys) - len(missed)}/{len(keys)}"
                 + (f" (never tripped: {', '.join(missed)})" if missed else ""))
    tripped = sum(checks.values())
    _say(f"defects_caught={caught}/{total} strict_caught={strict}/{total} checks_tripped={tripped}/{len(checks)}")
    return caught, total, tripped, len(checks)


def main_all(out_dir: Path = ROOT / "reports" / "sweep", ids: list[str] | None = None,
             limit: int | None = None, catalog: Catalog | None = None,
             levels: tuple[str, ...] | None = None, jobs: int = 1, impact: str = "line",
             cache_dir: Path | None = None, refresh: bool = False, merge: bool = MERGE,
             fork: bool = FORK) -> tuple[int, int, int, int]:
    """Sweep every recorded task; last printed line `defects_caught=N/M strict_caught=S/M checks_tripped=K/L`."""
    catalog = catalog or load_catalog()
    return _totals([_run(task, catalog, ids, limit, out_dir, levels, jobs, impact, cache_dir, refresh, merge, fork)
                    for task in recorded_tasks()])


# ---- the Hydra multirun: one job per (task, defect), then one aggregation ---------------------------

def _job_paths(task: str, cfg, levels, impact: str, cache_dir: Path) -> tuple[str, Path]:
    key = baseline_key(task, cfg, levels, impact)
    return key, Path(cache_dir) / task / key[:16] / "records"


def run_job(task: str, defect_id: str, out_dir: Path, cache_dir: Path | None = None, levels=None,
            impact: str = "line", catalog: Catalog | None = None, merge: bool = MERGE,
            fork: bool = FORK) -> dict | None:
    """One multirun job: grade one mutant of `task` (its record goes to <cache>/<task>/<key>/records/<id>.json);
    a defect that does not apply to the task is recorded as such (<cache>/<task>/not-applicable/) and skipped.
    The task's clean baseline is computed by the first job that needs it (under a file lock) and shared through
    the cache; its gradings hold an exclusive CPU lock that every mutant grading holds shared, so no mutant runs
    beside them."""
    from grader.h5schema import read_reference
    from recorder.app import compose_task

    catalog = catalog or load_catalog()
    defect = {d.id: d for d in catalog.defects}.get(defect_id)
    if defect is None:
        raise SystemExit(f"unknown defect id {defect_id!r}")
    if task not in recorded_tasks():
        raise SystemExit(f"no reference for task {task!r}")
    cache_dir = Path(cache_dir) if cache_dir else Path(out_dir) / ".cache"
    cfg = compose_task(task)
    if not applicable([defect], cfg):  # recorded without hashing anything: most pairs of a full multirun
        skipped = cache_dir / task / "not-applicable"
        skipped.mkdir(parents=True, exist_ok=True)
        (skipped / f"{defect_id}.json").write_text(json.dumps({"id": defect_id, "applicable": False}))
        return None
    key, records = _job_paths(task, cfg, levels, impact, cache_dir)
    records.mkdir(parents=True, exist_ok=True)
    ref = read_reference(ROOT / "references" / f"{task}.h5")
    compile_cache = cache_dir / "xla"  # persistent across jobs: keyed by the programs themselves
    compile_cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"t2j-sweep-{task}-{defect_id}-") as tmp:
        tmp = Path(tmp)
        if not (records.parent / "baseline.json").is_file():  # the machine to itself: timed levels are the bar
            with _cpu_lock(cache_dir, exclusive=True):
                base = task_baseline(task, cfg, ref, levels, cache_dir, tmp, compile_cache, impact)
        else:
            base = task_baseline(task, cfg, ref, levels, cache_dir, tmp, compile_cache, impact)
        with _cpu_lock(cache_dir, exclusive=False):
            graded = grade_mutant(defect, cfg, base, tmp, levels, compile_cache, impact, merge,
                                  _job_fork_server(compile_cache, fork))
    rec = defect_record(defect, graded, base, _noises(base, ref), _check_order(_task_key(cfg)[0]), levels)
    rec["applicable"] = True
    out = records / f"{defect_id}.json"
    out.with_suffix(".partial").write_text(json.dumps(rec, default=float))
    os.replace(out.with_suffix(".partial"), out)
    _say(_progress_line(task, 1, 1, rec))
    return rec


@contextmanager
def _cpu_lock(cache_dir: Path, exclusive: bool):
    """<cache>/.cpu.lock: a mutant grading holds it shared, a baseline computation exclusive (never both in one
    process at once, so two jobs cannot wait on each other)."""
    import fcntl
    path = Path(cache_dir) / ".cpu.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def aggregate(tasks: list[str] | None, out_dir: Path, cache_dir: Path | None = None, levels=None,
              impact: str = "line", ids: list[str] | None = None,
              catalog: Catalog | None = None) -> tuple[int, int, int, int]:
    """The multirun's last step: from the baseline and the job records under the current keys, write
    reports/sweep/<task>.json/.md for each task and print the same last line as `all=true`. Tasks: those
    given, else every recorded task that has a baseline under its current key. A defect without a record
    (its job did not run, or ran against other code) stops it, naming them."""
    from recorder.app import compose_task
    catalog = catalog or load_catalog()
    cache_dir = Path(cache_dir) if cache_dir else Path(out_dir) / ".cache"
    results, missing = [], {}
    for task in tasks or recorded_tasks():
        cfg = compose_task(task)
        key, records = _job_paths(task, cfg, levels, impact, cache_dir)
        base_path = records.parent / "baseline.json"
        if not base_path.is_file():
            if tasks:
                missing[task] = ["(no baseline: no job of this task ran against the current code)"]
            continue
        base = json.loads(base_path.read_text())
        todo = applicable(_select(catalog, ids), cfg)
        recs, lost = [], []
        for d in todo:
            p = records / f"{d.id}.json"
            (recs.append(json.loads(p.read_text())) if p.is_file() else lost.append(d.id))
        if lost:
            missing[task] = lost
            continue
        seconds = base["seconds"] + sum(r["seconds"] for r in recs)
        results.append(_report(assemble(task, _task_key(cfg)[0], base, recs, levels, seconds), out_dir, catalog))
    if missing:
        raise SystemExit("not graded under the current code (run the multirun first): " + "; ".join(
            f"{t}: {', '.join(ids_[:10])}{f' +{len(ids_) - 10} more' if len(ids_) > 10 else ''}"
            for t, ids_ in missing.items()))
    if not results:
        raise SystemExit(f"no sweep records under {cache_dir}: run the multirun first")
    return _totals(results)


HYDRA_KEYS = ("defect=", "aggregate=", "hydra", "+", "~")  # task=, impact=, levels= ... are both spellings


def _hydra_mode(argv: list[str]) -> bool:
    return any(a in ("-m", "--multirun") or a.startswith(HYDRA_KEYS) for a in argv)


def _register_defects() -> None:
    """Every catalog id as an option of the `defect` config group, so `defect=glob(*)` sweeps the catalog."""
    from hydra.core.config_store import ConfigStore
    cs = ConfigStore.instance()
    for d in load_catalog().defects:
        cs.store(group="defect", name=d.id, node={"id": d.id})


def hydra_job(cfg) -> None:
    """The Hydra task function (configs/sweep.yaml)."""
    out = ROOT / cfg.out
    cache = Path(cfg.cache) if cfg.cache else None
    levels = tuple(cfg.levels) if cfg.levels else None
    if cfg.aggregate:
        task = cfg.get("task_name")
        aggregate([task] if task else None, out, cache, levels, cfg.impact, list(cfg.defects) if cfg.defects else None)
        return
    if "task_name" not in cfg or cfg.get("defect") is None:
        raise SystemExit("a sweep job needs task=NAME and defect=ID (or -m ... 'defect=glob(*)'); "
                         "aggregate=true writes the reports")
    run_job(cfg.task_name, cfg.defect.id, out, cache, levels, cfg.impact, merge=bool(cfg.merge), fork=bool(cfg.fork))


def _parse(argv: list[str]) -> argparse.Namespace:
    # Hydra-style `key=value` tokens are accepted as `--key value`, so both spellings work.
    argv = [f"--{a}" if "=" in a and not a.startswith("-") else a for a in argv]
    p = argparse.ArgumentParser(prog="python -m grader.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", help="one task (a references/<task>.h5 must exist)")
    p.add_argument("--all", nargs="?", const="true", default="false", help="sweep every recorded task")
    p.add_argument("--defects", help="comma-separated defect ids (default: every applicable defect)")
    p.add_argument("--limit", type=int, help="at most this many applicable defects per task")
    p.add_argument("--levels", help="comma-separated levels to grade (quick runs; default: all)")
    p.add_argument("--jobs", type=int, default=1, help="mutants graded at a time (default 1)")
    p.add_argument("--out", default=str(ROOT / "reports" / "sweep"), help="report directory")
    p.add_argument("--impact", default="line", choices=IMPACT_MODES,
                   help="grade a mutant only where its edit is executed: line (default), file, or off (every level)")
    p.add_argument("--merge", default=str(MERGE).lower(),
                   help="true: a mutant's graded untimed levels share one sandboxed child (default %(default)s)")
    p.add_argument("--fork", default=str(FORK).lower(),
                   help="true: a mutant's children are forks of a server that imported jax once (default %(default)s)")
    p.add_argument("--cache", help="baseline cache directory (default: <out>/.cache)")
    p.add_argument("--refresh", nargs="?", const="true", default="false",
                   help="recompute the clean baseline even when the cache has one for the current key")
    return p.parse_args(argv)


def _true(v) -> bool:
    return str(v).lower() in ("true", "1", "yes")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if _hydra_mode(argv):
        return _hydra_main(argv)
    args = _parse(argv)
    ids = [i for i in (args.defects or "").split(",") if i] or None
    out = Path(args.out)
    levels = tuple(lv for lv in (args.levels or "").split(",") if lv) or None
    cache = Path(args.cache) if args.cache else None
    if _true(args.all):
        main_all(out, ids, args.limit, levels=levels, jobs=args.jobs, impact=args.impact, cache_dir=cache,
                 refresh=_true(args.refresh), merge=_true(args.merge), fork=_true(args.fork))
    elif args.task:
        if args.task not in recorded_tasks():
            raise SystemExit(f"no reference for task {args.task!r}; recorded: {', '.join(recorded_tasks())}")
        _run(args.task, load_catalog(), ids, args.limit, out, levels, args.jobs, args.impact, cache,
             _true(args.refresh), _true(args.merge), _true(args.fork))
    else:
        raise SystemExit("pass task=NAME or all=true (see python -m grader.sweep --help)")


def _hydra_main(argv: list[str]) -> None:
    import hydra
    _register_defects()
    sys.argv = [sys.argv[0], *argv]
    hydra.main(version_base=None, config_path=str(ROOT / "configs"), config_name="sweep")(hydra_job)()


try:  # the joblib launcher's workers compose `defect=<id>` after importing this module
    _register_defects()
except ImportError:  # no hydra installed: the --task/--all path needs none
    pass


if __name__ == "__main__":
    # Run through the importable module, so the multirun's workers find hydra_job (and the defect group) there.
    from grader.sweep import main as _main
    _main()
