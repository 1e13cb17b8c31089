"""The recorder's command line: clear errors for bad input, never a silent wrong file."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "recorder", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_unknown_task_lists_the_valid_ones():
    r = _run("task=no-such-task")
    assert r.returncode != 0
    assert "no-such-task" in r.stderr and "llama3-sft" in r.stderr


def test_missing_task_is_an_error():
    r = _run()
    assert r.returncode == 2 and "llama3-sft" in r.stderr


def test_unwritable_output_path(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory should be")
    r = _run("task=llama3-sft", f"out_dir={blocker}/refs")
    assert r.returncode == 1 and "cannot create output directory" in r.stderr


def test_missing_checkpoint(tmp_path):
    r = _run("task=llama3-sft", f"family.checkpoint={tmp_path}/nothing", f"out_dir={tmp_path}")
    assert r.returncode == 1 and "config.json" in r.stderr
    assert not list(tmp_path.glob("*.h5"))


def test_stale_listing_ends_with_a_count():
    r = _run("stale=true")
    assert r.returncode == 0
    assert r.stdout.strip().splitlines()[-1].startswith("stale=")


def _datasets(path):
    """Every dataset's bytes (attributes such as `created` and wall-clock legitimately differ)."""
    import h5py
    import numpy as np
    out = {}

    from catalog.h5schema import link_names

    with h5py.File(path, "r") as f:
        for name in link_names(f):  # by link: an array shared by several checks counts at each name
            obj = f[name]
            if isinstance(obj, h5py.Dataset):  # strings by value, numbers by their exact bytes
                out[name] = repr(obj.asstr()[()].tolist()) if obj.dtype.kind == "O" else np.asarray(obj[()]).tobytes()
    return out


@pytest.mark.slow  # CI time (~40 s): make test-full
def test_re_recording_on_the_same_cpu_reproduces_identical_datasets(tmp_path):
    for d in ("a", "b"):
        r = _run("task=llama3-core", f"out_dir={tmp_path / d}")
        assert r.returncode == 0, r.stderr[-2000:]
    a, b = _datasets(tmp_path / "a/llama3-core.h5"), _datasets(tmp_path / "b/llama3-core.h5")
    assert a.keys() == b.keys() and len(a) > 50
    assert [k for k in a if a[k] != b[k]] == []


@pytest.mark.slow  # CI time (~33 s): make test-full
def test_multirun_records_several_tasks_in_parallel(tmp_path):
    r = _run("-m", "task=llama3-core,gemma4-core", "hydra/launcher=local", f"out_dir={tmp_path}",
             f"hydra.sweep.dir={tmp_path}/multirun", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.glob("*.h5")) == ["gemma4-core.h5", "llama3-core.h5"]
