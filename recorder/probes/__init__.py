"""Torch-side probes: build each check's inputs and record the source's outputs on them."""
from __future__ import annotations

import time

from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from catalog.h5schema import CheckRecord


def run_probes(specs, probes: dict, ctx, console) -> list[CheckRecord]:
    """Run every catalogued check's probe in catalog order, with a progress bar (only the config's `levels`,
    where it names some)."""
    levels = ctx.cfg.get("levels")
    specs = [s for s in specs if not levels or s.level in levels]
    missing = [s.key for s in specs if s.name not in probes]
    if missing:
        raise RuntimeError(f"no probe for {missing}")
    records = []
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as bar:
        job = bar.add_task(f"recording {ctx.cfg.task_name}", total=len(specs))
        for s in specs:
            bar.update(job, description=f"{ctx.cfg.task_name}: {s.key}")
            started = time.perf_counter()
            inputs, outputs = probes[s.name](ctx)
            records.append(CheckRecord(s.level, s.name, s.aspect, s.measure, inputs, outputs,
                                       {"seconds": time.perf_counter() - started}))
            bar.advance(job)
    return records
