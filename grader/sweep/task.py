"""One task's sweep: its baseline, then every applicable defect's mutant, `jobs` at a time."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from catalog.h5schema import read_reference
from catalog.tasks import compose_task
from grader.sweep.baseline import IMPACT_MODES, _say, task_baseline
from grader.sweep.defects import Defect, ROOT, _task_key, applicable
from grader.sweep.mutant import FORK, MERGE, _check_order, _noises, assemble, defect_record, fork_server, grade_mutant


# ---- one task ------------------------------------------------------------------------------------

def sweep_task(task: str, defects, workdir: Path, progress=_say, levels: tuple[str, ...] | None = None,
               jobs: int = 1, compile_cache: Path | None = None, impact: str = "line",
               cache_dir: Path | None = None, refresh: bool = False, merge: bool = MERGE, fork: bool = FORK) -> dict:
    """Grade the clean oracle and every applicable defect of `defects` on `task` -> the sweep result
    (what write_reports renders). Mutants are built under workdir and removed after. `levels` restricts
    every grade to those levels (quick runs and tests; L0/torch_free always runs); None = all levels.
    `jobs` mutants are graded at a time; `compile_cache` is one JAX cache directory they all share.
    `impact` (line | file | off): grade each mutant only at the level groups whose clean child executes the
    edited lines (or file), reusing the clean scores elsewhere (grader/sweep/impact.py). The clean baseline is kept
    in `cache_dir` (default workdir/baseline-cache) under a key of everything it depends on. `merge`: a mutant's
    graded untimed levels share one sandboxed child (grade_mutant); `fork`: the mutants' children are forks of
    a fork server (grader/isolation/forkserver.py; the clean baseline is graded in sealed children)."""

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
