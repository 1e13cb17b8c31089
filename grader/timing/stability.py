"""Verdict stability: the oracle at its ceiling, and the too-slow defects failing on time, under every condition.

    python -m grader.timing.stability [tasks=llama3-sft,llama3-chunked] [conditions=idle,hogs,pair,half]
                               [levels=all|L5,L6] [defects=true] [out=reports/stability]

For each condition, each task's oracle is graded in its own process, and so is each catalogued too-slow
defect that applies to the task (at the timed levels it targets):

  idle   nothing else running
  hogs   two CPU-bound processes beside the grading, all along
  pair   two gradings of the same task at once (both must pass)
  half   the grading and everything it starts pinned to one core (`taskset`): half this 2-core machine

Pass: every oracle grading reaches its ceiling (reward >= 0.999 and every check at or over its strict bar; with
levels=all that is strict L6), and every too-slow defect loses a timed check to a timeout of the grader's clock.
Writes out/stability.{json,md}: per condition and task, the reward, the strict level, the slowest timed level's
CPU seconds over its budget, the wall time; the last line is `stable=true|false runs=N`. Exit status 0 when
stable, 1 otherwise. Plain key=value arguments (compose_task starts its own Hydra context per task).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from catalog.tasks import compose_task
from grader.app import grade
from grader.sweep.defects import applicable, load_catalog, make_mutant

ROOT = Path(__file__).resolve().parents[2]
CONDITIONS = ("idle", "hogs", "pair", "half")
TOO_SLOW = ("train-step-not-jitted", "serve-engine-step-not-jitted")  # the catalog's "too slow:" defects
DEFAULT_TASKS = ("llama3-sft", "llama3-chunked")
KEYS = ("tasks", "conditions", "levels", "defects", "out")


def _one(task: str, defect: str | None, levels: str, out: Path) -> None:
    """In a process of its own: grade the oracle (or a mutant) of `task`, write the report to `out`."""

    cfg = compose_task(task)
    with tempfile.TemporaryDirectory(prefix="t2j-stability-") as tmp:
        candidate, lv = ROOT, None if levels == "all" else tuple(levels.split(","))
        if defect:
            d = next(d for d in load_catalog().defects if d.id == defect)
            candidate, lv = make_mutant(d, Path(tmp) / "mutant"), tuple(d.levels)
        started = time.perf_counter()
        report = grade(cfg, candidate, ROOT / "references", Path(tmp) / "reports", quiet=True, levels=lv)
        report["wall_s"] = time.perf_counter() - started
    out.write_text(json.dumps(report, default=float))


def _spawn(task: str, defect: str | None, levels: str, out: Path, pin: bool) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "grader.timing.stability", "--one", task, defect or "-", levels, str(out)]
    if pin:
        cmd = ["taskset", "-c", str(min(os.sched_getaffinity(0))), *cmd]
    with open(f"{out}.log", "wb") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)


def _slowest(report: dict) -> dict | None:
    timed = [(lv, b) for lv, b in (report.get("budgets") or {}).items() if b.get("used_cpu_s") is not None]
    if not timed:
        return None
    lv, b = max(timed, key=lambda x: x[1]["used_cpu_s"] / x[1]["budget_cpu_s"])
    return {"level": lv, "used_cpu_s": b["used_cpu_s"], "budget_cpu_s": b["budget_cpu_s"],
            "fraction": round(b["used_cpu_s"] / b["budget_cpu_s"], 3), "used_wall_s": b["used_wall_s"],
            "speed": b.get("speed")}


def _verdict(report: dict, defect: str | None) -> tuple[bool, str]:
    checks = report.get("checks") or []
    if defect:
        timed_out = [f'{c["level"]}/{c["name"]}' for c in checks if c["level"] in ("L5", "L6")
                     and c["score"] < c["bar"] and (c.get("reason") or "").startswith("timeout")]
        return bool(timed_out), f"fails on time at {', '.join(timed_out)}" if timed_out else "NOT caught on time"
    below = [f'{c["level"]}/{c["name"]} {c["score"]:.4f} {c.get("reason") or ""}'.strip()
             for c in checks if c["score"] < c["bar"]]
    ok = not below and report.get("reward", 0.0) >= 0.999
    return ok, "at its ceiling" if ok else "below its ceiling: " + "; ".join(below)


def run_condition(condition: str, tasks, levels: str, defects: bool, work: Path) -> list[dict]:
    jobs = [(t, None) for t in tasks]
    if defects:
        catalog = [d for d in load_catalog().defects if d.id in TOO_SLOW]
        jobs += [(t, d.id) for t in tasks for d in applicable(catalog, compose_task(t))]
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2 if condition == "hogs" else 0)]
    rows = []
    try:
        for task, defect in jobs:
            copies = 2 if condition == "pair" else 1
            outs = [work / f"{condition}-{task}-{defect or 'oracle'}-{i}.json" for i in range(copies)]
            started = time.perf_counter()
            procs = [_spawn(task, defect, levels, o, condition == "half") for o in outs]
            for p in procs:
                p.wait()
            for i, (p, o) in enumerate(zip(procs, outs)):
                if p.returncode != 0 or not o.is_file():
                    log = Path(f"{o}.log").read_text(errors="replace")[-1500:]
                    rows.append({"condition": condition, "task": task, "defect": defect, "copy": i, "ok": False,
                                 "verdict": f"grading crashed (exit {p.returncode}): {log}"})
                    continue
                report = json.loads(o.read_text())
                ok, verdict = _verdict(report, defect)
                rows.append({"condition": condition, "task": task, "defect": defect, "copy": i, "ok": ok,
                             "verdict": verdict, "reward": report["reward"], "strict_level": report["earned_levels"],
                             "slowest_timed": _slowest(report), "wall_s": round(time.perf_counter() - started, 1)})
            print(_line(rows[-1]), file=sys.stderr, flush=True)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    return rows


def _line(r: dict) -> str:
    s = r.get("slowest_timed") or {}
    timed = f"{s['level']} {s['used_cpu_s']:.1f}/{s['budget_cpu_s']:.1f} CPU-s ({s['fraction']:.2f}, speed " \
            f"{s.get('speed') or 1:.2f})" if s else "-"
    return (f"[{r['condition']}] {r['task']} {r['defect'] or 'oracle'}#{r['copy']}: "
            f"{'ok' if r['ok'] else 'FAIL'} {r['verdict']}; reward={r.get('reward', 0):.4f} "
            f"strict=L{r.get('strict_level')} slowest {timed} wall {r.get('wall_s', 0):.0f} s")


def markdown(rows: list[dict]) -> str:
    head = "| condition | task | graded | verdict | reward | strict | slowest timed level: CPU-s / budget | wall s |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s = r.get("slowest_timed")
        timed = f"{s['level']} {s['used_cpu_s']:.1f} / {s['budget_cpu_s']:.1f} ({s['fraction']:.2f})" if s else ""
        strict = "" if r.get("defect") or r.get("strict_level") is None else f"L{r['strict_level']}"
        lines.append(f"| {r['condition']} | {r['task']} | {r['defect'] or 'oracle'} | "
                     f"{'ok' if r['ok'] else '**FAIL**'}: {r['verdict'][:120]} | {r.get('reward', 0):.4f} | {strict} | "
                     f"{timed} | {r.get('wall_s', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one"]:
        task, defect, levels, out = argv[1:5]
        _one(task, None if defect == "-" else defect, levels, Path(out))
        return 0
    p = argparse.ArgumentParser(prog="python -m grader.timing.stability", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="key=value", help=f"keys: {', '.join(KEYS)}")
    args = {"tasks": ",".join(DEFAULT_TASKS), "conditions": ",".join(CONDITIONS), "levels": "all",
            "defects": "true", "out": str(ROOT / "reports" / "stability")}
    for item in p.parse_args(argv).overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in KEYS:
            p.error(f"expected key=value with key in {', '.join(KEYS)}, got {item!r}")
        args[key] = value
    conditions = [c for c in args["conditions"].split(",") if c]
    if bad := [c for c in conditions if c not in CONDITIONS]:
        p.error(f"unknown conditions {bad}: choose from {', '.join(CONDITIONS)}")
    tasks = [t for t in args["tasks"].split(",") if t]
    out = Path(args["out"])
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="t2j-stability-") as work:
        for condition in conditions:
            rows += run_condition(condition, tasks, args["levels"], args["defects"].lower() == "true", Path(work))
    (out / "stability.json").write_text(json.dumps(rows, indent=2, default=float))
    (out / "stability.md").write_text(markdown(rows) + "\n")
    print(markdown(rows))
    stable = bool(rows) and all(r["ok"] for r in rows)
    print(f"stable={'true' if stable else 'false'} runs={len(rows)}")
    return 0 if stable else 1


if __name__ == "__main__":
    sys.exit(main())
