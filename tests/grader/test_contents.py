"""What a candidate may carry (grader/isolation/contents.py): sources and small configs, never a package or a reference."""
from __future__ import annotations

import base64
import io
import shutil
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from catalog.tasks import compose_task
from grader.app import grade
from grader.isolation.contents import MAX_LITERAL_BYTES, MAX_TREE_BYTES, binary_kind, inspect_tree

ROOT = Path(__file__).resolve().parents[2]


def _candidate(tmp_path: Path) -> Path:
    cand = tmp_path / "cand"
    for tree in ("jax_oracles", "serving_engine", "conversion"):
        shutil.copytree(ROOT / tree, cand / tree, ignore=shutil.ignore_patterns("__pycache__"))
    return cand


def _h5_bytes() -> bytes:
    buf = io.BytesIO()
    with h5py.File(buf, "w") as f:
        f["L1/rms_norm/outputs/y"] = np.arange(64, dtype=np.float32)
    return buf.getvalue()


def test_the_oracle_tree_carries_only_sources():
    assert inspect_tree(ROOT) == []


def test_a_vendored_package_an_archive_and_shared_objects_are_refused(tmp_path):
    cand = _candidate(tmp_path)
    vendored = cand / "jax_oracles" / "vendor" / "torch"
    vendored.mkdir(parents=True)
    (vendored / "__init__.py").write_text("")
    (cand / "jax_oracles" / "vendor" / "torch-2.13.0.dist-info").mkdir()
    (cand / "jax_oracles" / "vendor" / "_C.so").write_bytes(b"\x7fELF" + b"\x00" * 60)
    with zipfile.ZipFile(cand / "conversion" / "blob.py", "w") as z:  # a zip under a source's name
        z.writestr("torch/__init__.py", "")
    found = inspect_tree(cand)
    assert any("jax_oracles/vendor/torch/: a directory named after the forbidden package 'torch'" in o for o in found)
    assert any("dist-info/: installed package metadata" in o for o in found)
    assert any(o.startswith("jax_oracles/vendor/_C.so: not a Python source") for o in found)
    assert any(o.startswith("conversion/blob.py: zip data under a text name") for o in found)


def test_a_carried_reference_is_refused_as_a_file_and_as_a_literal(tmp_path):
    cand = _candidate(tmp_path)
    data = _h5_bytes()
    (cand / "serving_engine" / "table.json").write_bytes(data)  # HDF5 under a config's name
    b64 = base64.b64encode(data).decode()
    (cand / "jax_oracles" / "answers.py").write_text(f"BLOB = {b64!r}\n")  # small: decodes to HDF5
    (cand / "jax_oracles" / "big.py").write_text(f"X = {'A' * (MAX_LITERAL_BYTES + 1)!r}\n")
    found = inspect_tree(cand)
    assert "serving_engine/table.json: HDF5 data under a text name" in found
    assert any(o.startswith("jax_oracles/answers.py:1: a literal that decodes to HDF5") for o in found), found
    assert any(o.startswith("jax_oracles/big.py:1: a literal of") for o in found), found


def test_a_tree_over_its_size_is_refused(tmp_path):
    cand = _candidate(tmp_path)
    for i in range(MAX_TREE_BYTES // (1 << 20) + 1):
        (cand / "conversion" / f"pad{i}.txt").write_text("x" * ((1 << 20) - 100))
    assert any("over the" in o and "limit" in o for o in inspect_tree(cand))


def test_safetensors_and_npy_are_recognised_by_their_bytes():
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    assert binary_kind(len(header).to_bytes(8, "little") + header) == "safetensors"
    buf = io.BytesIO()
    np.save(buf, np.zeros(3))
    assert binary_kind(buf.getvalue()[:64]) == "numpy .npy"
    assert binary_kind(b"import numpy as np\n") is None


def test_a_candidate_carrying_a_reference_scores_zero_with_the_reason(tmp_path):
    cand = _candidate(tmp_path)
    (cand / "jax_oracles" / "answers.py").write_text(f"BLOB = {base64.b64encode(_h5_bytes()).decode()!r}\n")
    report = grade(compose_task("llama3-sft"), cand, ROOT / "references", tmp_path / "reports", quiet=True,
                   levels=("L1",), trusted=True)
    assert report["reward"] == 0.0 and report["gated"] and "decodes to HDF5" in report["gated"]
    assert all(c["score"] == 0.0 for c in report["checks"])


def test_a_candidate_smuggling_a_package_scores_zero_with_the_reason(tmp_path):
    cand = _candidate(tmp_path)
    (cand / "jax_oracles" / "third_party" / "torch").mkdir(parents=True)
    (cand / "jax_oracles" / "third_party" / "torch" / "__init__.py").write_text("")
    report = grade(compose_task("llama3-sft"), cand, ROOT / "references", tmp_path / "reports", quiet=True,
                   levels=("L1",), trusted=True)
    assert report["reward"] == 0.0 and "named after the forbidden package 'torch'" in report["gated"]
