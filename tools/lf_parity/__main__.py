"""python -m tools.lf_parity task=llama3-sft|all|a,b [out=reports/lf_parity] [table=docs/LF_PARITY.md]
[train_variants=true] [ppo_effects=llama3-ppo|all|none]: each training task through LLaMA-Factory (in .venv-lf,
`make lf-env`) and through the torch source; one json per task under out/, and the table (task x tokens, losses,
adapter, eval, metrics) when asked: the tasks with a record under out/ are rendered from it, every other row of
the file's table is kept as it was (table.write_table), so a run of some tasks loses none. train_variants: the train_on_prompt and sdpa runs; ppo_effects: the PPO tasks
whose LF-as-it-is runs (one alignment left out at a time, four more LF runs each) are measured.
only=template: LF's template of each task (one untrained LF run each, seconds) into the existing records.
Exit status 1 when a comparable cell is off by more than 1e-5 or a cell could not be compared for a reason
that is not documented (parity.NOT_COMPARABLE)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from catalog.provenance import ROOT
from catalog.tasks import compose_task, known_tasks, task_method
from tools.lf_parity.harness import Job, make_job, run_lf
from tools.lf_parity.parity import task_parity, template_cell
from tools.lf_parity.table import failing_cells, write_table


def training_tasks() -> list[str]:
    return [t for t in known_tasks() if task_method(compose_task(t)) is not None]


def parse(argv: list[str]) -> dict:
    options = {"task": "llama3-sft", "out": "reports/lf_parity", "table": None, "train_variants": "true",
               "ppo_effects": "llama3-ppo", "only": ""}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in options:
            raise SystemExit(f"unknown argument {item!r}; usage: {__doc__.splitlines()[0]}")
        options[key] = value
    return options


def main(argv: list[str]) -> int:
    options = parse(argv)
    tasks = training_tasks() if options["task"] == "all" else options["task"].split(",")
    unknown = [t for t in tasks if t not in training_tasks()]
    if unknown:
        raise SystemExit(f"not a training task: {', '.join(unknown)}; training tasks: {', '.join(training_tasks())}")
    out = ROOT / options["out"]
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for task in tasks:
        if options["only"] == "template":
            job = make_job(task, out / "work" / task / "template", train=False)
            job = Job(**{**job.__dict__, "variants": {"default": {}}})
            path = out / f"{task}.json"
            record = json.loads(path.read_text()) if path.exists() else {"task": task, "cells": {}}
            record["cells"]["template"] = template_cell(job, run_lf(job))
            path.write_text(json.dumps(record, indent=1))
            print(f"{task}: template {'ok' if not record['cells']['template']['error'] else 'DIFFERS'}", flush=True)
            records.append(record)
            continue
        elif options["only"]:
            raise SystemExit(f"only={options['only']!r}: the one partial run is only=template")
        try:
            effects = options["ppo_effects"] == "all" or task in options["ppo_effects"].split(",")
            record = task_parity(task, out / "work" / task, options["train_variants"] == "true", effects)
        except Exception as error:  # one task's failure is its row of the table, not the end of the sweep
            record = {"task": task, "cells": {"run": {"max_abs": None, "n": 0,
                                                      "error": f"{type(error).__name__}: {error}"[:2000]}}}
        (out / f"{task}.json").write_text(json.dumps(record, indent=1))
        bad = failing_cells(record)
        print(f"{task}: {'ok' if not bad else 'DIFFERS ' + ', '.join(bad)}", flush=True)
        records.append(record)
    if options["table"]:
        every = [json.loads((out / f"{t}.json").read_text()) for t in training_tasks() if (out / f"{t}.json").exists()]
        write_table(every, ROOT / options["table"])
    return 1 if any(failing_cells(r) for r in records) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
