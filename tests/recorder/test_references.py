"""The HDF5 contract: committed references follow the schema, are fresh, and bad files fail loudly."""
from pathlib import Path

import h5py
import numpy as np
import pytest

from catalog.checks import checks_for
from catalog.h5schema import CheckRecord, ReferenceError, ROOT_ATTRS, read_reference, write_reference
from catalog.provenance import stale_reasons
from catalog.tasks import compose_task, known_tasks, task_class, task_features, task_method

ROOT = Path(__file__).resolve().parents[2]
REFS = sorted((ROOT / "references").glob("*.h5"))


def _attrs(**over):
    a = {k: "x" for k in ROOT_ATTRS}
    a.update(schema_version=1, seed=0, wall_clock_s=1.0, package_versions={"torch": "2.13.0"},
             source_sha256={"a.py": "0" * 64})
    a.update(over)
    return a


def _tiny(path):
    rec = CheckRecord("L1", "op", "numeric", "tensor", {"x": np.ones(3, np.float32)}, {"y": np.zeros(3)})
    write_reference(path, _attrs(), [rec], band=(1.0, 2.0))


def test_every_committed_reference_has_a_task_and_is_fresh():
    assert REFS, "no committed references"
    for path in REFS:
        assert path.stem in known_tasks(), f"{path.name}: no task config"
        reasons = stale_reasons(path, compose_task(path.stem))
        assert not reasons, f"{path.name} is stale: {reasons} (re-record: make record TASK={path.stem})"


def test_committed_references_follow_the_schema():
    for path in REFS:
        ref = read_reference(path)
        cfg = compose_task(path.stem)
        spec, checks = checks_for(task_class(cfg), task_method(cfg), task_features(cfg))
        want = {c.key for c in spec + checks if c.name != "torch_free"}
        assert want == set(ref.checks), (f"{path.name}: lacks {sorted(want - set(ref.checks))}, holds checks of "
                                         f"another method {sorted(set(ref.checks) - want)}")
        for c in ref.checks.values():
            assert c.outputs, c.key
            for name, arr in c.outputs.items():
                if arr.dtype.kind == "f":
                    assert np.all(np.isfinite(arr)), f"{c.key}/{name} holds non-finite values"
        if task_class(compose_task(path.stem)) == "training":  # the seed-varied L6 band
            assert ref.band is not None and ref.band[0] <= ref.band[1]
        assert ref.attrs["dtype"] == "float32" and ref.attrs["wall_clock_s"] > 0


def test_round_trip(tmp_path):
    p = tmp_path / "t.h5"
    _tiny(p)
    ref = read_reference(p)
    assert ref.checks["L1/op"].measure == "tensor"
    np.testing.assert_array_equal(ref.checks["L1/op"].inputs["x"], np.ones(3))
    assert ref.attrs["package_versions"] == {"torch": "2.13.0"}
    assert list(ref.band) == [1.0, 2.0]


def test_truncated_file_is_a_clear_error(tmp_path):
    p = tmp_path / "t.h5"
    _tiny(p)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 3])
    with pytest.raises(ReferenceError, match="corrupt or truncated"):
        read_reference(p)


def test_garbage_and_missing_files_are_clear_errors(tmp_path):
    p = tmp_path / "g.h5"
    p.write_bytes(b"not an hdf5 file at all" * 10)
    with pytest.raises(ReferenceError, match="corrupt or truncated"):
        read_reference(p)
    with pytest.raises(ReferenceError, match="no such reference"):
        read_reference(tmp_path / "absent.h5")


def test_off_schema_files_are_rejected(tmp_path):
    p = tmp_path / "t.h5"
    _tiny(p)
    with h5py.File(p, "a") as f:
        f.attrs["schema_version"] = 99
    with pytest.raises(ReferenceError, match="schema_version"):
        read_reference(p)
    _tiny(p)
    with h5py.File(p, "a") as f:
        del f.attrs["checkpoint_sha256"]
    with pytest.raises(ReferenceError, match="checkpoint_sha256"):
        read_reference(p)
    _tiny(p)
    with h5py.File(p, "a") as f:
        f["L1/op"].attrs["measure"] = "vibes"
    with pytest.raises(ReferenceError, match="unknown measure"):
        read_reference(p)


def test_a_changed_source_makes_a_reference_stale(tmp_path, monkeypatch):
    import catalog.provenance as prov
    path = REFS[0]
    cfg = compose_task(path.stem)
    real = prov.sha256_file
    victim = prov.task_source_files(cfg)[0]
    monkeypatch.setattr(prov, "sha256_file", lambda p: "0" * 64 if Path(p) == victim else real(p))
    reasons = stale_reasons(path, cfg)
    assert any("source changed" in r and victim.name in r for r in reasons), reasons


def test_a_large_array_two_checks_share_is_stored_once_and_read_at_both(tmp_path):
    """The writer hard-links an array it already stored (a vision-language batch's pixels reach several checks)
    and gzips a large one; reading, and the comparison tool's walk by link, see every name with its values."""
    import h5py
    import numpy as np

    from catalog.h5schema import link_names

    pixels = np.random.default_rng(0).standard_normal((300, 96)).astype(np.float32)  # 112 KiB: compressed
    checks = [CheckRecord("L4", name, "numeric", "tensor", {"pixel_values": pixels}, {"y": np.ones(3, np.float32)})
              for name in ("loss_step0", "lora_grads_step0")]
    path = tmp_path / "t.h5"
    write_reference(path, _attrs(), checks)
    ref = read_reference(path)
    assert all(np.array_equal(ref.checks[c.key].inputs["pixel_values"], pixels) for c in checks)
    with h5py.File(path, "r") as f:
        a, b = (f[f"L4/{n}/inputs/pixel_values"] for n in ("loss_step0", "lora_grads_step0"))
        assert a.id == b.id and a.compression == "gzip"  # one object, two names
        assert {f"L4/{n}/inputs/pixel_values" for n in ("loss_step0", "lora_grads_step0")} <= set(link_names(f))
