"""One mutant: the oracle with one defect applied, graded at the level groups its edit can reach, and its record."""
from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from catalog.checks import checks_for
from catalog.h5schema import read_reference
from grader.isolation.forkserver import ForkServer
from grader.isolation.gate import fork_server_env
from grader.scoring.lattice import Check, earned_levels, strict_bar
from grader.scoring.reward import reward as compute_reward
from grader.sweep.baseline import _grade, _noise, _say, _scores, impact_of
from grader.sweep.defects import DEFAULT_NOISE, Defect, GATE_CHECK, LEVELS, ROOT, make_mutant


# ---- one mutant ------------------------------------------------------------------------------------

TIMED = ("L5", "L6")
MERGE = True  # the default of `merge` (sweep_task, the CLI, configs/sweep.yaml)
FORK = True   # the default of `fork`: a mutant's children are forks of a server that has imported jax


@contextmanager
def fork_server(compile_cache: Path | None, enabled: bool = True):
    """A grader/isolation/forkserver.py server for this sweep's mutants (None when disabled or where it cannot fork)."""
    if not enabled:
        yield None
        return
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
# reasons grade() gives every check of a child that did not finish (grader/isolation/gate.py, grader/app.py)
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
    finish is graded again group by group). `forkserver` (grader/isolation/forkserver.py): the mutant's children are
    trusted forks of an interpreter that has imported jax (the repo's own mutants only), else sealed children."""

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


def _bar(check: dict) -> float:
    """A graded check's strict bar (reports written before strict verdicts: the noise-free bar)."""
    return float(check.get("bar") or strict_bar(check["aspect"]))


def _check_order(task_class: str):
    """Sort key: a check's place in the class's catalog (catalog/checks.py), unknown keys last."""
    order = {s.key: i for i, s in enumerate(sum(checks_for(task_class), ()))}
    return lambda key: (order.get(key, len(order)), key)
