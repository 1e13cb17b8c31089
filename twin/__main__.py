"""python -m twin task=T [candidate=PATH] [seed=N] [only=a,b] [out=DIR] [trusted=true] [checkpoint=PATH]

The live twin: the task's properties on fresh inputs from `seed`, through the torch source here and the candidate
(default: this repo's own solution trees) in a sealed child; a table, then `<out>/<task>-seed<N>.json`
(default out: outputs/twin), then the last line `twin: E established, V violated, N not established`.
Exit 0 when every property is established, 1 when one is not, 2 on bad input."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from grader.isolation.sandbox import SandboxUnavailable
from twin.harness import TwinReport, run_twin
from twin.properties import ESTABLISHED, VIOLATED
from twin.spec import ROOT

KEYS = {"task": None, "candidate": str(ROOT), "seed": "0", "only": None, "out": "outputs/twin", "trusted": "false",
        "checkpoint": None, "timeout": "900"}
console = Console(width=160)


def parse(argv: list[str]) -> dict:
    args = dict(KEYS)
    for a in argv:
        key, eq, value = a.partition("=")
        if not eq or key not in KEYS:
            raise ValueError(f"bad argument {a!r}: expected key=value with key one of {', '.join(KEYS)}")
        args[key] = value
    if not args["task"]:
        raise ValueError("task=NAME is required")
    if args["trusted"] not in ("true", "false"):
        raise ValueError(f"trusted must be true or false, not {args['trusted']!r}")
    args["seed"], args["timeout"] = int(args["seed"]), float(args["timeout"])
    return args


def _fig(x, fmt):
    return "" if x is None else format(x, fmt)


def print_report(report: TwinReport) -> None:
    t = Table(title=f"twin of {report.task}, seed {report.seed} ({report.isolation})")
    for col in ("property", "status", "tensor (first divergent, else closest call)", "max|d|", "rel", "digits",
                "modules / why"):
        t.add_column(col)
    for r in report.results:
        colour = {ESTABLISHED: "green", VIOLATED: "red"}.get(r.status, "yellow")
        d = r.first_divergent or max(r.tensors, key=lambda x: x.max_rel, default=None)
        why = r.candidate_error or r.torch_error and f"torch side: {r.torch_error}" or (d and d.why) or ""
        t.add_row(r.prop.key, f"[{colour}]{r.status}[/]", d and f"{d.name} {list(d.shape)}" or "",
                  _fig(d and d.max_abs, ".2e"), _fig(d and d.max_rel, ".2e"), _fig(d and d.digits, ".1f"),
                  (", ".join(r.prop.modules) + (f": {why.splitlines()[-1][:200]}" if why else ""))
                  if r.status != ESTABLISHED else "")
    console.print(t)
    if report.child_failure:
        console.print(f"[red]the candidate's child failed:[/] {report.child_failure[-1500:]}")


def main(argv: list[str]) -> int:
    try:
        a = parse(argv)
        report = run_twin(a["task"], a["candidate"], a["seed"], trusted=a["trusted"] == "true",
                          only=tuple(a["only"].split(",")) if a["only"] else None, timeout_s=a["timeout"],
                          checkpoint=a["checkpoint"])
    except (ValueError, SandboxUnavailable, FileNotFoundError) as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    print_report(report)
    out = Path(a["out"])
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{report.task}-seed{report.seed}.json"
    path.write_text(json.dumps(report.to_json(), indent=2, default=float))
    c = report.counts()
    first = report.first_failing
    print(f"report: {path}")
    if first is not None:
        print(f"first failing: {first.prop.key} ({first.status}) in {', '.join(first.prop.modules)}")
    print(f"twin: {c['established']} established, {c['violated']} violated, {c['not established']} not established")
    return 0 if first is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
