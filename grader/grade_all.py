"""Grade every recorded task and write one summary: `make grade-all`.

    python -m grader.grade_all [candidate=PATH] [out=reports/all] [tasks=llama3-sft,gemma4-core] [coverage=false]

candidate  a tree that mirrors the layout (jax_oracles/, serving_engine/, conversion/); default: this
           repo's own oracles
out        where <task>.json and the summary (summary.md, summary.html, summary.json, PNGs; see
           grader.scoring.report) go; default reports/all under the repo root
tasks      comma-separated subset; default every task that has references/<task>.h5
coverage   true (default): each child runs under branch coverage of the candidate's packages, kept in the
           task reports for `python -m grader.coverage`; false skips it

Tasks are graded one after another (each already runs its levels in sandboxed children and the
tasks would compete for the same cores). A task whose grading raises becomes an error row and
the run goes on. The markdown table goes to stdout, progress to stderr; the last line is
`mean_reward=<4 decimals> tasks=<N>`. Exit status: 0, or 1 when any task errored (after
everything was written), or 2 for bad arguments or no references at all.

Plain key=value arguments parsed by argparse, not Hydra: compose_task starts its own Hydra
context per task, which a surrounding @hydra.main would forbid.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

from catalog.tasks import compose_task
from grader.app import ROOT, grade
from grader.scoring.report import markdown_table, write_report

__all__ = ["grade_tasks", "main", "recorded_tasks"]

KEYS = ("candidate", "out", "tasks", "coverage")


def recorded_tasks(references: Path = ROOT / "references") -> list[str]:
    return sorted(p.stem for p in references.glob("*.h5"))


def _error_report(task: str, candidate: Path, exc: BaseException) -> dict:
    return {"task": task, "candidate": str(candidate), "reward": 0.0, "earned_levels": -1,
            "error": "".join(traceback.format_exception_only(type(exc), exc)).strip(),
            "traceback": traceback.format_exc(), "checks": [], "series": {}}


def grade_tasks(tasks: list[str], candidate: Path, out_dir: Path,
                references: Path = ROOT / "references", coverage: bool = False) -> list[dict]:
    """Grade each task in turn into out_dir/<task>.json; one raising becomes an error row. With `coverage`
    each report keeps the lines and branches its children executed (python -m grader.coverage reads them)."""
    reports = []
    for i, task in enumerate(tasks, 1):
        started = time.perf_counter()
        try:
            report = grade(compose_task(task), candidate, references, out_dir, quiet=True, coverage=coverage)
        except Exception as exc:  # noqa: BLE001 -- one broken task must not cost the others
            report = _error_report(task, candidate, exc)
        report["wall_s"] = time.perf_counter() - started
        out_dir.mkdir(parents=True, exist_ok=True)  # rewritten with wall_s, so grader.scoring.report can re-render it
        (out_dir / f"{task}.json").write_text(json.dumps(report, indent=2, default=float))
        outcome = (f"ERROR {report['error'].splitlines()[-1]}" if report.get("error")
                   else f"reward={report['reward']:.4f} earned=L{report['earned_levels']}")
        print(f"[{i}/{len(tasks)}] {task}: {outcome} ({report['wall_s']:.0f} s)", file=sys.stderr, flush=True)
        reports.append(report)
    return reports


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m grader.grade_all", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help=f"keys: {', '.join(KEYS)}")
    ns = parser.parse_args(argv)
    args = {"candidate": None, "out": None, "tasks": None, "coverage": "true"}
    for item in ns.overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in KEYS:
            parser.error(f"expected key=value with key in {', '.join(KEYS)}, got {item!r}")
        args[key] = value
    return argparse.Namespace(**args)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    candidate = Path(args.candidate).resolve() if args.candidate else ROOT
    out_dir = Path(args.out).resolve() if args.out else ROOT / "reports" / "all"
    tasks = [t for t in args.tasks.split(",") if t] if args.tasks else recorded_tasks()
    if not tasks:
        print(f"no references under {ROOT / 'references'}: run `make record-all` first", file=sys.stderr)
        return 2
    coverage = str(args.coverage).lower() in ("true", "1", "yes")
    reports = grade_tasks(tasks, candidate, out_dir, coverage=coverage)
    summary = write_report(reports, out_dir)
    print(markdown_table(summary["rows"]))
    print(f"report: {out_dir / 'summary.html'}", file=sys.stderr)
    print(f"mean_reward={summary['mean_reward']:.4f} tasks={summary['tasks']}")
    return 1 if any(r.get("error") for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
