"""`python -m grader.sweep`: the --task/--all path, and the Hydra multirun (one job per (task, defect), then one aggregation)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from catalog.h5schema import read_reference
from catalog.tasks import compose_task, recorded_tasks
from grader.sweep.baseline import IMPACT_MODES, _say, baseline_key, task_baseline
from grader.sweep.defects import Catalog, CLASSES, Defect, ROOT, _task_key, applicable, load_catalog
from grader.sweep.mutant import FORK, MERGE, _check_order, _job_fork_server, _noises, assemble, defect_record, grade_mutant
from grader.sweep.reports import write_reports
from grader.sweep.task import _progress_line, sweep_task


# ---- entry points --------------------------------------------------------------------------------

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
