"""The cluster path's local twin (issue 37): the recorder's and the sweep's Hydra multiruns through submitit's local
executor (configs/hydra/launcher/local_submitit.yaml: each job's launcher and Hydra state pickled by cloudpickle,
unpickled and run in a fresh process, its logs and its JobReturn in <sweep dir>/.submitit/<job id>/, the result
pickled back and collected, as on Slurm) give what the joblib launcher (local.yaml) gives: the same references, bit
for bit, and the same sweep verdicts."""
import json
import pickle
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from catalog.h5schema import link_names

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = ("local", "local_submitit")  # joblib, and submitit's local executor
TASKS = ("llama3-sft", "llama3-core")  # a training and a serving task, every level: ~5 s and ~10 s each here

# The attributes that name when, where or how long, so differ between any two recordings; every other attribute
# (the provenance hashes and package versions included: same code, same environment) must be equal.
VOLATILE = {
    "created": "the UTC second the file was written",
    "wall_clock_s": "the end-to-end torch run's wall-clock seconds",
    "seconds": "each check's recording wall-clock seconds (an attribute of every check's group)",
    "peak_rss_bytes": "the recording process's peak RSS: a loky worker and a submitit job imported different things",
    "rss_at_start_bytes": "the process's RSS when the recording began: likewise",
}


def _py(module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind == "O" or b.dtype.kind == "O":  # variable-length strings: the values, not the pointers
        return a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist()
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _differences(x: Path, y: Path) -> tuple[list[str], int]:
    """Every link's attributes (VOLATILE aside) and every dataset's dtype, shape and bytes, x against y."""
    out, datasets = [], 0
    with h5py.File(x, "r") as f, h5py.File(y, "r") as g:
        names_f, names_g = set(link_names(f)), set(link_names(g))
        out += [f"{n}: only in {'the first' if n in names_f else 'the second'}" for n in sorted(names_f ^ names_g)]
        for name, a, b in [("/", f, g)] + [(n, f[n], g[n]) for n in sorted(names_f & names_g)]:
            keys = (set(a.attrs) | set(b.attrs)) - set(VOLATILE)
            out += [f"{name}: attribute {k} differs" for k in sorted(keys)
                    if k not in a.attrs or k not in b.attrs or not _same(a.attrs[k], b.attrs[k])]
            if isinstance(a, h5py.Dataset):
                datasets += 1
                if not isinstance(b, h5py.Dataset) or not _same(a[()], b[()]):
                    out.append(f"{name}: data differs")
    return out, datasets


def _submitit_results(sweep_dir: Path) -> list:
    """Each submitit job's collected JobReturn (<sweep dir>/.submitit/<id>/<id>_0_result.pkl: ("success", ret))."""
    results = []
    for path in sorted((sweep_dir / ".submitit").glob("*/*_0_result.pkl")):
        outcome, ret = pickle.loads(path.read_bytes())
        assert outcome == "success", (path, ret)
        results.append(ret)
    return results


def _ran_through(launcher: str, sweep_dir: Path, jobs: int) -> None:
    """Through submitit: a pickled submission, a log pair and a collected result per job, each run in the repo
    (hydra.job.chdir false); through joblib: no submitit folder at all."""
    from hydra.core.utils import JobStatus
    if launcher == "local":
        assert not (sweep_dir / ".submitit").exists()
        return
    results = _submitit_results(sweep_dir)
    assert len(results) == jobs and len(list((sweep_dir / ".submitit").glob("*/*_submitted.pkl"))) == jobs
    assert all(r.status == JobStatus.COMPLETED and Path(r.working_dir) == ROOT for r in results)
    for log in (sweep_dir / ".submitit").glob("*/*_0_log.out"):
        assert "Job completed successfully" in log.read_text(), log


@pytest.mark.slow  # ~1 min on 2 cores: two tasks recorded twice
def test_the_submitit_local_launcher_records_the_same_references_as_joblib(tmp_path):
    for launcher in LAUNCHERS:
        out, sweep = tmp_path / launcher, tmp_path / f"{launcher}-multirun"
        r = _py("recorder", "-m", f"task={','.join(TASKS)}", f"hydra/launcher={launcher}", f"out_dir={out}",
                f"hydra.sweep.dir={sweep}")
        assert r.returncode == 0, (launcher, r.stderr[-3000:])
        assert sorted(p.stem for p in out.glob("*.h5")) == sorted(TASKS), launcher
        _ran_through(launcher, sweep, len(TASKS))
        if launcher != "local":
            assert sorted(ret.overrides[0] for ret in _submitit_results(sweep)) == sorted(f"task={t}" for t in TASKS)
    for task in TASKS:
        diffs, datasets = _differences(tmp_path / "local" / f"{task}.h5", tmp_path / "local_submitit" / f"{task}.h5")
        assert diffs == [] and datasets > 50, (task, diffs[:20])


# At L1 only (three clean L1 gradings for the baseline, then one child per graded mutant): two edits L1 executes and
# catches (the template's eos, the collator's pad mask) and one it never executes (the loss shift: not caught, its
# clean scores reused), so the verdicts compared hold both outcomes.
SWEEP_TASK = "llama3-sft"
SWEEP_DEFECTS = ("train-template-eos-not-replaced", "train-collator-pad-mask-ones", "train-labels-not-shifted")
VERDICT = ("caught", "strict_caught", "tripped", "failed_strict", "graded_groups", "levels_tripped")


@pytest.mark.slow  # ~1 min on 2 cores: a baseline and three mutants, twice
@pytest.mark.sandbox
def test_the_submitit_local_launcher_gives_the_sweep_the_same_verdicts_as_joblib(tmp_path):
    verdicts = {}
    for launcher in LAUNCHERS:
        out, sweep = tmp_path / launcher, tmp_path / f"{launcher}-multirun"  # each its own baseline cache
        r = _py("grader.sweep", "-m", f"task={SWEEP_TASK}", f"defect={','.join(SWEEP_DEFECTS)}", "levels=[L1]",
                f"out={out}", f"hydra/launcher={launcher}", f"hydra.sweep.dir={sweep}")
        assert r.returncode == 0, (launcher, r.stderr[-3000:])
        _ran_through(launcher, sweep, len(SWEEP_DEFECTS))
        records = list((out / ".cache" / SWEEP_TASK).glob("*/records/*.json"))
        assert sorted(p.stem for p in records) == sorted(SWEEP_DEFECTS), launcher  # every job's record, collected
        r = _py("grader.sweep", "aggregate=true", f"task={SWEEP_TASK}", "levels=[L1]", f"out={out}",
                f"defects=[{','.join(SWEEP_DEFECTS)}]", f"hydra.run.dir={tmp_path / f'{launcher}-aggregate'}")
        assert r.returncode == 0, (launcher, r.stderr[-3000:])
        assert r.stdout.strip().splitlines()[-1].startswith("defects_caught=2/3 strict_caught=2/3"), r.stdout[-2000:]
        report = json.loads((out / f"{SWEEP_TASK}.json").read_text())
        verdicts[launcher] = {d["id"]: {k: d.get(k) for k in VERDICT} for d in report["defects"]}
    joblib, submitit = (verdicts[launcher] for launcher in LAUNCHERS)
    assert sorted(joblib) == sorted(SWEEP_DEFECTS)
    assert {d for d, v in joblib.items() if v["caught"]} == {d for d, v in submitit.items() if v["caught"]} == {
        "train-template-eos-not-replaced", "train-collator-pad-mask-ones"}
    assert {d for d, v in joblib.items() if v["strict_caught"]} == {d for d, v in submitit.items()
                                                                    if v["strict_caught"]}
    assert joblib == submitit  # and the same checks tripped, the same level groups graded
