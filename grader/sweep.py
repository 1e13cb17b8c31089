"""Seeded-defect sweep (DESIGN section 10): grade mutants of the oracles, report what the checks catch.

    python -m grader.sweep task=llama3-sft [defects=id1,id2] [limit=N] [levels=L1,L3] [jobs=2] [out=reports/sweep]
    python -m grader.sweep all=true [defects=...] [limit=N] [jobs=2]    # every task with a reference
    (`--task NAME`, `--all`, `--defects a,b`, `--limit N`, `--levels ...`, `--jobs N`, `--out DIR` are the
    same options; defects, limit and levels are for quick runs: a full sweep grades every applicable defect
    on all levels; jobs grades that many mutants at once)

The catalog is grader/defects.yaml (data, not code): each defect is one exact text edit to a copy
of jax_oracles/, serving_engine/ and conversion/. Per task the clean oracle is graded once (all
levels), then every defect that applies to the task's class, family and mode is graded on its own
mutant, `jobs` at a time (a grade is one sandboxed child per level group). All grades of a run share
one JAX persistent compilation cache, so a mutant recompiles only the programs its edit changed.

A check is *tripped* by a defect when its score falls below the clean oracle's score on that check by
more than the check's run-to-run noise. The noise is measured: the clean oracle is graded twice and
the noise is the larger of the two runs' score gap and a floor of 1e-6 (or the reference check
group's "noise" attribute, where a recording on a nondeterministic device sets one). On this CPU
both runs are bit-identical, so any drop above rounding is the defect's.
A defect is *caught* when it trips at least one check. A defect that trips the independence gate
zeroes every check; the per-check tally credits it to L0/torch_free only, so a torch import cannot
make every other check look sharp.

Writes reports/sweep/<task>.json and reports/sweep/<task>.md. `all` sweeps every recorded task and
prints as its last line `defects_caught=N/M checks_tripped=K/L` (over both classes; a defect counts
once per task it applies to; a check is one (class, level/name) pair, tripped when any defect on any
task of that class trips it).
"""
from __future__ import annotations

import argparse
import json
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


# ---- one task ------------------------------------------------------------------------------------

def _noise(ref, key: str, runs: list[dict]) -> float:
    """max(floor, the reference's recorded noise, the spread of the clean oracle's scores over `runs`)."""
    rec = ref.checks.get(key)
    recorded = rec.attrs.get("noise") if rec is not None else None
    scores = [run[key]["score"] for run in runs if key in run]
    spread = max(scores) - min(scores) if scores else 0.0
    return max(DEFAULT_NOISE, 0.0 if recorded is None else float(recorded), spread)


def _scores(report: dict) -> dict[str, dict]:
    return {f'{c["level"]}/{c["name"]}': c for c in report["checks"]}


def _grade(cfg, candidate: Path, report_dir: Path, levels, compile_cache: Path | None = None) -> dict:
    from grader.app import grade
    return grade(cfg, candidate, ROOT / "references", report_dir, quiet=True, levels=levels,
                 compile_cache=compile_cache)


def _say(msg: str) -> None:
    print(msg, flush=True)  # progress of a long run, also when stdout is a file


def sweep_task(task: str, defects, workdir: Path, progress=_say, levels: tuple[str, ...] | None = None,
               jobs: int = 1, compile_cache: Path | None = None) -> dict:
    """Grade the clean oracle and every applicable defect of `defects` on `task` -> the sweep result
    (what write_reports renders). Mutants are built under workdir and removed after. `levels` restricts
    every grade to those levels (quick runs and tests; L0/torch_free always runs); None = all levels.
    `jobs` mutants are graded at a time; `compile_cache` is one JAX cache directory they all share."""
    from grader.h5schema import read_reference
    from recorder.app import compose_task

    cfg = compose_task(task)
    task_class = _task_key(cfg)[0]
    order = _check_order(task_class)
    todo = applicable(defects, cfg)
    ref = read_reference(ROOT / "references" / f"{task}.h5")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=2) as pool:  # the clean oracle twice: its run-to-run noise
        clean_report, rerun = pool.map(lambda i: _grade(cfg, ROOT, workdir / f"reports-clean-{i}", levels,
                                                                 compile_cache), (0, 1))
    clean = _scores(clean_report)
    noise = {k: _noise(ref, k, [clean, _scores(rerun)]) for k in clean}
    progress(f"[{task}] clean oracle: reward={clean_report['reward']:.6f}, rerun {rerun['reward']:.6f}, "
             f"largest check noise {max(noise.values()):g} ({time.perf_counter() - started:.0f} s); "
             f"{len(todo)} defects apply")

    def grade_defect(d: Defect) -> dict:
        t0 = time.perf_counter()
        mutant = make_mutant(d, workdir / f"mutant-{d.id}")
        try:
            report = _grade(cfg, mutant, workdir / f"reports-{d.id}", levels, compile_cache)
        finally:
            shutil.rmtree(mutant, ignore_errors=True)
        scores = _scores(report)
        tripped = sorted((k for k in clean if k in scores and scores[k]["score"] < clean[k]["score"] - noise[k]),
                         key=order)
        levels_tripped = sorted({k.split("/")[0] for k in tripped})
        # Strictly caught: a check the clean oracle passes strictly fails its strict bar (costs a level).
        failed_strict = sorted((k for k in clean if k in scores and clean[k]["score"] >= _bar(clean[k])
                                and scores[k]["score"] < _bar(scores[k])), key=order)
        return {
            "id": d.id, "description": d.description, "file": d.file, "expected_levels": list(d.levels),
            "reward": report["reward"], "reward_drop": clean_report["reward"] - report["reward"],
            "gated": bool(report.get("gated")), "caught": bool(tripped), "tripped": tripped,
            "strict_caught": bool(failed_strict), "failed_strict": failed_strict,
            "earned_levels": report["earned_levels"],
            "levels_tripped": levels_tripped,
            "expected_levels_missed": [lv for lv in d.levels if lv not in levels_tripped
                                       and (levels is None or lv in levels)],
            "scores": {k: scores[k]["score"] for k in tripped},
            "reasons": {k: scores[k]["reason"] for k in tripped if scores[k].get("reason")},
            "seconds": time.perf_counter() - t0,
        }

    # Each grade is a chain of sandboxed child processes: threads are enough to keep `jobs` of them busy.
    records: dict[str, dict] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(grade_defect, d): d for d in todo}
        for done in as_completed(futures):
            rec = done.result()
            records[rec["id"]] = rec
            progress(f"[{task}] {len(records)}/{len(todo)} {rec['id']}: reward={rec['reward']:.6f} "
                     f"{'caught' if rec['caught'] else 'NOT CAUGHT'}, "
                     f"{'strictly' if rec['strict_caught'] else 'NOT STRICTLY'} (L{rec['earned_levels']}), "
                     f"{len(rec['tripped'])} checks tripped "
                     f"(levels {','.join(rec['levels_tripped']) or '-'}; {rec['seconds']:.0f} s)")
    records = [records[d.id] for d in todo]  # catalog order, whatever order they finished in

    checks = {}
    for key in sorted(clean, key=order):
        by = [r["id"] for r in records if key in r["tripped"] and (not r["gated"] or key == GATE_CHECK)]
        checks[key] = {"clean_score": clean[key]["score"], "clean_reason": clean[key].get("reason"),
                       "noise": noise[key], "tripped_by": by}
    return {
        "task": task, "task_class": task_class, "clean_reward": clean_report["reward"],
        "clean_rerun_reward": rerun["reward"],
        "clean_earned_levels": clean_report["earned_levels"], "default_noise": DEFAULT_NOISE,
        "levels": list(levels) if levels else list(LEVELS), "defects": records, "checks": checks,
        "totals": {"defects_caught": sum(r["caught"] for r in records), "defects": len(records),
                   "strict_caught": sum(r["strict_caught"] for r in records),
                   "checks_tripped": sum(bool(c["tripped_by"]) for c in checks.values()), "checks": len(checks)},
        "seconds": time.perf_counter() - started,
    }


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
        "", "## Defects", "",
        "| defect | reward | drop | caught | strict (level) | levels tripped | checks tripped | expected level missed "
        "| bug |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in r["defects"]:
        gated = " (gated)" if d["gated"] else ""
        lines.append(f"| `{d['id']}` | {d['reward']:.6f} | {d['reward_drop']:.2e} | "
                     f"{'yes' if d['caught'] else '**NO**'}{gated} | "
                     f"{'yes' if d.get('strict_caught') else '**NO**'} (L{d.get('earned_levels', '?')}) | "
                     f"{','.join(d['levels_tripped']) or '-'} | "
                     f"{_fmt_checks(d['tripped'])} | {','.join(d['expected_levels_missed']) or '-'} | "
                     f"{d['description']} |")
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


def _run(task: str, catalog: Catalog, ids, limit, out_dir: Path, levels=None, jobs: int = 1) -> dict:
    defects = _select(catalog, ids)
    if limit is not None:  # the first `limit` of those that apply to this task
        from recorder.app import compose_task
        defects = applicable(defects, compose_task(task))[:limit]
    with tempfile.TemporaryDirectory(prefix=f"t2j-sweep-{task}-") as tmp, shared_compile_cache() as cache:
        result = sweep_task(task, defects, Path(tmp), levels=levels, jobs=jobs, compile_cache=cache)
    js, md = write_reports(result, out_dir, catalog.untripped_rationale)
    t = result["totals"]
    _say(f"[{task}] defects_caught={t['defects_caught']}/{t['defects']} "
          f"strict_caught={t['strict_caught']}/{t['defects']} "
          f"checks_tripped={t['checks_tripped']}/{t['checks']} -> {md}")
    return result


def main_all(out_dir: Path = ROOT / "reports" / "sweep", ids: list[str] | None = None,
             limit: int | None = None, catalog: Catalog | None = None,
             levels: tuple[str, ...] | None = None, jobs: int = 1) -> tuple[int, int, int, int]:
    """Sweep every recorded task; last printed line `defects_caught=N/M strict_caught=S/M checks_tripped=K/L`."""
    catalog = catalog or load_catalog()
    caught = total = strict = 0
    checks: dict[tuple[str, str], bool] = {}
    for task in recorded_tasks():
        r = _run(task, catalog, ids, limit, out_dir, levels, jobs)
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    ids = [i for i in (args.defects or "").split(",") if i] or None
    out = Path(args.out)
    levels = tuple(lv for lv in (args.levels or "").split(",") if lv) or None
    if str(args.all).lower() in ("true", "1", "yes"):
        main_all(out, ids, args.limit, levels=levels, jobs=args.jobs)
    elif args.task:
        if args.task not in recorded_tasks():
            raise SystemExit(f"no reference for task {args.task!r}; recorded: {', '.join(recorded_tasks())}")
        _run(args.task, load_catalog(), ids, args.limit, out, levels, args.jobs)
    else:
        raise SystemExit("pass task=NAME or all=true (see python -m grader.sweep --help)")


if __name__ == "__main__":
    main()
