"""Where a sweep mutant's time goes: per level-group child (wall time against its checks' own seconds), the
gate, the staging; bare interpreter and `import jax` costs. Run on an idle machine (flock /tmp/t2j-cpu.lock):

    python bench/sweep_profile.py llama3-sft train-rope-theta-default train-labels-not-shifted

Grades the clean oracle twice (cold, then warm compilation cache) and each named mutant once, one at a time,
in sealed children, as the sweep before issue 14 did (docs/SWEEP.md, "Where a mutant's time went")."""
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from grader.isolation import gate, sandbox
from grader.sweep import baseline, defects as defects_mod  # noqa: E402
from catalog.tasks import compose_task  # noqa: E402

log = []


def _timed(name, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        out = fn(*a, **k)
        log.append((name, time.perf_counter() - t0))
        return out
    return wrapper


for _name in ("run_sandboxed", "static_scan", "run_import_linter", "_stage"):
    setattr(gate, _name, _timed(_name, getattr(gate, _name)))


def main(task: str, defect_ids: list[str]) -> None:
    cfg = compose_task(task)
    v = sandbox.ensure_sandbox()
    for code in ("pass", "import numpy", "import jax"):
        t0 = time.perf_counter()
        subprocess.run([str(v.python), "-I", "-c", code], check=True)
        print(f"bare interpreter, {code!r}: {time.perf_counter() - t0:.2f} s", flush=True)
    defects = {d.id: d for d in defects_mod.load_catalog().defects}
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory() as cache:
        tmp, cache = Path(tmp), Path(cache)
        for label, did in [("clean, cold cache", None), ("clean, warm cache", None)] + [(d, d) for d in defect_ids]:
            log.clear()
            cand = defects_mod.make_mutant(defects[did], tmp / f"m-{did}") if did else defects_mod.ROOT
            t0 = time.perf_counter()
            rep = baseline._grade(cfg, cand, tmp / f"r-{label}", None, cache)
            total = time.perf_counter() - t0
            by_level: dict[str, float] = {}
            for c in rep["checks"]:
                if c["name"] != "torch_free":
                    by_level[c["level"]] = by_level.get(c["level"], 0.0) + c["seconds"]
            children = [s for n, s in log if n == "run_sandboxed"]
            other = "; ".join(f"{n} {s:.2f}" for n, s in log if n != "run_sandboxed")
            print(f"{label}: {total:.1f} s, reward {rep['reward']:.6f}; {other}", flush=True)
            for (level, checks), child in zip(sorted(by_level.items()), children):
                print(f"   {level}: child {child:.2f} s, its checks {checks:.2f} s, fixed {child - checks:.2f} s",
                      flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
