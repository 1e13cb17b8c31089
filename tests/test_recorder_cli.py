"""The recorder's command line: clear errors for bad input, never a silent wrong file."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
