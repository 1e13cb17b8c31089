"""Recording from, and grading with, a release directory given as `checkpoint=PATH` (issue 14).

The release here is the tiny llama3 checkpoint as a real one is published: bf16, sharded, with an index.
"""
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import h5py
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from catalog import provenance
from catalog.h5schema import ReferenceError, read_reference
from catalog.tasks import compose_task
from recorder.app import list_stale, record

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "assets/checkpoints/llama3"
LEVELS = "levels=[L0,L1,L3]"  # enough to prove the whole path; the full lattice is graded elsewhere


def load_tools():
    spec = importlib.util.spec_from_file_location("make_checkpoints", ROOT / "tools" / "make_checkpoints.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bf16_release(out: Path, max_shard_bytes: int = 60_000) -> Path:
    """The tiny llama3 checkpoint stored bf16 in ~60 kB shards + model.safetensors.index.json."""
    tools = load_tools()
    tensors = load_file(str(TINY / "model.safetensors"))
    tools.write_sharded(out, ((n, tensors[n].astype(ml_dtypes.bfloat16)) for n in sorted(tensors)), max_shard_bytes)
    for name in ("config.json", "generation_config.json"):
        (out / name).write_bytes((TINY / name).read_bytes())
    return out


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """(release dir, out dir): llama3-sft recorded from the bf16 release through the CLI."""
    tmp = tmp_path_factory.mktemp("release")
    release, out = bf16_release(tmp / "llama3-bf16"), tmp / "refs"
    r = subprocess.run([sys.executable, "-m", "recorder", "task=llama3-sft", f"checkpoint={release}",
                        f"out_dir={out}", LEVELS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return release, out


def test_release_is_sharded_bf16_with_an_index(recorded):
    release, _ = recorded
    index = json.loads((release / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in load_file(str(TINY / "model.safetensors")).values()) // 2


def test_provenance_names_the_release_and_the_upcast(recorded):
    release, out = recorded
    ref = read_reference(out / "llama3-sft.h5")
    a = ref.attrs
    n_tensors = len(load_file(str(TINY / "model.safetensors")))
    assert a["checkpoint_path"] == str(release)
    assert a["checkpoint_dtypes"] == {"bfloat16": n_tensors}
    assert a["dtype_policy"] == "upcast to float32" and a["dtype"] == "float32"
    assert a["fp32_param_bytes"] == sum(x.nbytes for x in load_file(str(TINY / "model.safetensors")).values())
    assert a["peak_rss_bytes"] >= a["rss_at_start_bytes"] > 0
    assert a["recorded_levels"] == ["L0", "L1", "L3"]
    assert {k.split("/")[0] for k in ref.checks} == {"L0", "L1", "L3"}
    assert a["checkpoint_sha256"] == provenance.sha256_dir(release)


def test_bf16_upcast_is_exact(recorded, tmp_path):
    """The bf16 release records what an fp32 checkpoint holding the same (bf16-rounded) values records."""
    release, out = recorded
    tools = load_tools()
    rounded = {n: a.astype(ml_dtypes.bfloat16).astype(np.float32) for n, a in load_file(str(TINY / "model.safetensors")).items()}
    fp32 = tools.write_checkpoint(tmp_path / "fp32", json.loads((TINY / "config.json").read_text()), rounded)
    cfg = compose_task("llama3-sft", [f"checkpoint={fp32}", f"out_dir={tmp_path / 'refs'}", "levels=[L3]"])
    record(cfg)
    a, b = read_reference(out / "llama3-sft.h5"), read_reference(tmp_path / "refs/llama3-sft.h5")
    assert b.attrs["checkpoint_dtypes"] == {"float32": len(rounded)}
    for key in ("L3/logits_b1_t7", "L3/logits_b3_t33_pad"):
        for name, ref in a.checks[key].outputs.items():
            np.testing.assert_array_equal(ref, b.checks[key].outputs[name], err_msg=f"{key}/{name}")


def test_stale_check_uses_the_recorded_release(recorded, capsys):
    _, out = recorded
    assert list_stale(out) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "stale=0"


def test_large_files_are_hashed_once(tmp_path, monkeypatch):
    """A release's multi-gigabyte shards are hashed once, then read from the cache until their stat changes."""
    monkeypatch.setattr(provenance, "HASH_CACHE_MIN_BYTES", 1 << 20)
    monkeypatch.setattr(provenance, "HASH_CACHE", tmp_path / "cache" / "sha256.json")
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "big.safetensors").write_bytes(np.random.default_rng(0).bytes(32 << 20))
    calls = []
    real = provenance.sha256_file
    monkeypatch.setattr(provenance, "sha256_file", lambda p: calls.append(Path(p).name) or real(p))
    first = provenance.sha256_dir(d)
    assert sorted(calls) == ["big.safetensors", "config.json"]
    calls.clear()
    started = time.perf_counter()
    assert provenance.sha256_dir(d) == first
    assert calls == ["config.json"] and time.perf_counter() - started < 0.5  # the 32 MiB file is not reread
    with open(d / "big.safetensors", "r+b") as f:  # same size, new bytes: the stamp moves, so it is rehashed
        f.write(b"\xff" * 16)
    calls.clear()
    assert provenance.sha256_dir(d) != first and "big.safetensors" in calls
    # the cached hash is the plain one: references recorded before the cache stay valid
    monkeypatch.setattr(provenance, "HASH_CACHE_MIN_BYTES", 1 << 40)
    assert provenance.sha256_dir(d) == provenance.sha256_dir(d)


def _record_exit(tmp_path, release) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recorder", "task=llama3-sft", f"checkpoint={release}",
                           f"out_dir={tmp_path / 'refs'}", "levels=[L0]"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_missing_shard_and_corrupt_index_are_clear_errors(tmp_path):
    release = bf16_release(tmp_path / "missing")
    (release / "model-00002-of-00005.safetensors").unlink()
    r = _record_exit(tmp_path, release)
    assert r.returncode == 1 and "names shard(s) missing" in r.stderr and "model-00002-of-00005" in r.stderr
    assert not (tmp_path / "refs/llama3-sft.h5").exists()

    release = bf16_release(tmp_path / "corrupt")
    (release / "model.safetensors.index.json").write_text('{"weight_map": {')
    r = _record_exit(tmp_path, release)
    assert r.returncode == 1 and "model.safetensors.index.json is not valid json" in r.stderr.replace("\n", "")


def test_grading_with_another_checkpoint_is_refused(recorded):
    from grader.app import grade

    release, out = recorded
    cfg = compose_task("llama3-sft")  # the family's tiny checkpoint, not the release the reference came from
    with pytest.raises(ReferenceError, match=rf"recorded from checkpoint {release} .* grade with checkpoint="):
        grade(cfg, ROOT, out, out / "reports", trusted=True, quiet=True)
    cfg = compose_task("llama3-sft", [f"checkpoint={release}"])  # the committed reference, from the tiny one
    with pytest.raises(ReferenceError, match="recorded from checkpoint assets/checkpoints/llama3"):
        grade(cfg, ROOT, ROOT / "references", out / "reports", trusted=True, quiet=True)


def test_grader_cli_refuses_a_mismatched_checkpoint(recorded):
    _, out = recorded
    r = subprocess.run([sys.executable, "-m", "grader", "task=llama3-sft", f"references={out}",
                        f"report_dir={out / 'reports'}", "trusted=true"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and "cannot grade llama3-sft" in r.stderr and "recorded from checkpoint" in r.stderr


def test_numpy_reader_maps_lazily(recorded):
    from conversion import safetensors_io

    release, _ = recorded
    state = safetensors_io.load_state_dict(release)
    big = state["model.embed_tokens.weight"]
    assert isinstance(big, np.memmap) and big.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(big.astype(np.float32), load_file(str(TINY / "model.safetensors"))[
        "model.embed_tokens.weight"].astype(ml_dtypes.bfloat16).astype(np.float32))
