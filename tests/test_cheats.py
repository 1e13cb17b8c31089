"""The grader against cheating or broken candidates: each is a copy of the oracles with one planted
cheat, graded on the few levels it touches. The grader must always return a report, score the
cheat 0 (or well below the bar) with a reason that names it, and leave the untouched checks alone."""
import json
import shutil
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from grader.app import grade
from grader.gate import run_sandboxed, static_scan
from grader.h5schema import read_arrays, write_arrays
from grader.probes.common import run_probes
from recorder.app import compose_task

ROOT = Path(__file__).resolve().parents[1]
TASK = "llama3-sft"
LLAMA = "jax_oracles/models/llama3.py"
RMS_NORM_DEF = "def rms_norm(x, weight, eps: float):  # x: [..., D]  weight: f32[D]\n"
L1 = ("rms_norm", "rope", "mlp", "attention_core", "lora_linear", "data_tokens", "data_labels", "collate")
# the mlp check loads the params, which traces the whole model (conversion: jax.eval_shape(model.init)),
# so a cheat inside rms_norm that raises reaches it too
BESIDE_RMS_NORM = ("rope", "attention_core", "lora_linear", "data_tokens", "data_labels", "collate")


def _candidate(tmp_path: Path) -> Path:
    cand = tmp_path / "cand"
    for tree in ("jax_oracles", "serving_engine", "conversion"):
        shutil.copytree(ROOT / tree, cand / tree, ignore=shutil.ignore_patterns("__pycache__"))
    return cand


def _plant(cand: Path, rel: str, anchor: str, code: str, indent: str = "    ") -> None:
    """Insert `code` (the start of a function body) right after the line `anchor`."""
    p = cand / rel
    text = p.read_text()
    assert text.count(anchor) == 1, f"{rel}: the anchor must occur exactly once"
    body = textwrap.indent(textwrap.dedent(code).strip("\n"), indent) + "\n"
    p.write_text(text.replace(anchor, anchor + body))


def _grade(cand, tmp_path, levels, **kw) -> dict:
    report = grade(compose_task(TASK), cand, ROOT / "references", tmp_path / "reports", quiet=True,
                   levels=levels, **kw)
    # the grader returned a full report and wrote it, whatever the candidate did
    assert json.loads((tmp_path / "reports" / f"{TASK}.json").read_text())["checks"] == report["checks"]
    assert report["checks"] and all(0.0 <= c["score"] <= 1.0 for c in report["checks"])
    return report


def _by_name(report, level="L1") -> dict:
    return {c["name"]: c for c in report["checks"] if c["level"] == level}


def _assert_untouched(checks: dict, *names) -> None:
    for name in names:
        assert checks[name]["score"] >= 0.999 and checks[name]["reason"] is None, checks[name]


# ---------------------------------------------------------------- (a) torch imported at run time

def test_a_torch_import_built_at_run_time_scores_zero_on_its_check(tmp_path):
    cand = _candidate(tmp_path)
    _plant(cand, LLAMA, RMS_NORM_DEF, '__import__("importlib").import_module("tor" + "ch")')
    assert static_scan(cand) == []  # the name is built at run time: only the sandbox can stop it
    report = _grade(cand, tmp_path, ("L1",))
    checks = _by_name(report)
    assert checks["rms_norm"]["score"] == 0.0
    assert "torch import" in checks["rms_norm"]["reason"], checks["rms_norm"]
    _assert_untouched(checks, *BESIDE_RMS_NORM)


# ---------------------------------------------------------------- (b) reading references/

# The answer would score 1 if the file could be read: the cheat returns the recorded output itself.
_READ_BY = {
    "open": """
        with open(path, "rb") as f:
            blob = io.BytesIO(f.read())
        with h5py.File(blob, "r") as f:
            return f["L1/rms_norm/outputs/y"][()]
        """,
    "h5py": """
        with h5py.File(path, "r") as f:
            return f["L1/rms_norm/outputs/y"][()]
        """,
}


@pytest.mark.parametrize("how", sorted(_READ_BY))
def test_reading_the_references_scores_zero(tmp_path, how):
    cand = _candidate(tmp_path)
    parts = list(ROOT.parts)  # no literal path in the candidate: it is joined at run time
    _plant(cand, LLAMA, RMS_NORM_DEF, textwrap.dedent(f"""
        import io, os
        import h5py
        path = os.path.join(*{parts!r}, "refer" + "ences", "{TASK}" + ".h5")
        """) + textwrap.dedent(_READ_BY[how]))
    report = _grade(cand, tmp_path, ("L1",))
    checks = _by_name(report)
    assert checks["rms_norm"]["score"] == 0.0
    assert "reads references/" in checks["rms_norm"]["reason"], checks["rms_norm"]
    _assert_untouched(checks, *BESIDE_RMS_NORM)


_CHANNELS = """
import glob, json, os, pathlib, shutil, subprocess, sys
import h5py
import numpy as np

def attempts(d, scratch):
    f = os.path.join(d, "ref.h5")
    def symlink():
        os.symlink(d, os.path.join(scratch, "alias"))
        return open(os.path.join(scratch, "alias", "ref.h5"), "rb").read()
    def chdir_then_open():
        here = os.getcwd()
        try:
            os.chdir(d)
            return open("ref.h5", "rb").read()
        finally:
            os.chdir(here)
    return {
        "open": lambda: open(f, "rb").read(),
        "os.open": lambda: os.read(os.open(f, os.O_RDONLY), 8),
        "dir_fd": lambda: os.read(os.open(os.path.join(os.path.basename(d), "ref.h5"), os.O_RDONLY,
                                          dir_fd=os.open(os.path.dirname(d), os.O_RDONLY)), 8),
        "pathlib": lambda: pathlib.Path(f).read_bytes(),
        "numpy": lambda: np.fromfile(f, np.uint8).size,
        "listdir": lambda: os.listdir(d),
        "scandir": lambda: [e.name for e in os.scandir(d)],
        "glob": lambda: glob.glob(os.path.join(d, "*")),
        "copy": lambda: shutil.copy(f, os.path.join(scratch, "copy.h5")),
        "hardlink": lambda: os.link(f, os.path.join(scratch, "hard.h5")) or True,
        "symlink": symlink,
        "chdir": chdir_then_open,
        "h5py": lambda: h5py.File(f, "r")["x"][()].size,
        "h5py.h5f": lambda: h5py.h5f.open(f.encode()),
        "subprocess": lambda: subprocess.run(["cat", f], check=True, capture_output=True).stdout,
        # the path goes through stdin, out of the spawn's sight: the child's own guard refuses it
        "python child": lambda: subprocess.run(
            [sys.executable, "-c", "import sys; open(sys.stdin.read(), 'rb').read()"],
            input=f.encode(), check=True, capture_output=True),
    }

def main(inputs_path, outputs_path):
    cfg = json.load(open(inputs_path))
    result = {}
    for name, attempt in attempts(cfg["dir"], cfg["scratch"]).items():
        try:
            result[name] = "read" if attempt() else "nothing"
        except (PermissionError, subprocess.CalledProcessError) as e:
            text = str(e) + str(getattr(e, "stderr", b"") or b"")
            result[name] = "refused" if "reads references/" in text else f"other: {text[:200]}"
        except Exception as e:
            result[name] = f"other: {type(e).__name__}: {e}"[:200]
    json.dump(result, open(outputs_path, "w"))
"""


def _channels(tmp_path, deny: bool) -> dict:
    secret, scratch = tmp_path / ("secret" if deny else "open"), tmp_path / f"scratch-{deny}"
    secret.mkdir()
    scratch.mkdir()
    with h5py.File(secret / "ref.h5", "w") as f:
        f["x"] = np.arange(3)
    cand = tmp_path / f"cand-{deny}"
    (cand / "jax_oracles").mkdir(parents=True)
    (cand / "jax_oracles" / "__init__.py").write_text("")
    (cand / "jax_oracles" / "entry.py").write_text(_CHANNELS)
    inputs, outputs = tmp_path / f"in-{deny}.json", tmp_path / f"out-{deny}.json"
    inputs.write_text(json.dumps({"dir": str(secret), "scratch": str(scratch)}))
    res = run_sandboxed(cand, "jax_oracles.entry:main", inputs, outputs, 60.0,
                        deny_read=(secret,) if deny else ())
    assert res.ok, res.stderr_tail
    return json.loads(outputs.read_text())


def test_every_python_file_channel_to_a_denied_directory_is_refused(tmp_path):
    refused = _channels(tmp_path, deny=True)
    # glob swallows the OSError and finds nothing; every other channel raises
    assert not {k: v for k, v in refused.items() if v != ("nothing" if k == "glob" else "refused")}
    allowed = _channels(tmp_path, deny=False)  # the same attempts on a directory not denied succeed
    assert not {k: v for k, v in allowed.items() if v != "read"}
    assert set(allowed) == set(refused) and len(refused) == 16


def test_a_run_killed_by_reading_references_says_so(tmp_path):
    cand = tmp_path / "cand"
    (cand / "jax_oracles").mkdir(parents=True)
    (cand / "jax_oracles" / "entry.py").write_text(
        f"def main(inputs_path, outputs_path):\n    open({str(ROOT / 'references' / (TASK + '.h5'))!r}, 'rb')\n")
    inputs = tmp_path / "in.json"
    inputs.write_text("{}")
    res = run_sandboxed(cand, "jax_oracles.entry:main", inputs, tmp_path / "out.json", 60.0)
    assert not res.ok and res.reason == "reads references/", (res.reason, res.stderr_tail)


# ---------------------------------------------------------------- (c) echoing the inputs

def test_echoing_the_input_is_not_the_answer(tmp_path):
    cand = _candidate(tmp_path)
    _plant(cand, LLAMA, RMS_NORM_DEF, "return x")
    checks = _by_name(_grade(cand, tmp_path, ("L1",)))
    assert checks["rms_norm"]["score"] < 0.9, checks["rms_norm"]  # rms(x) ~ 3: the norm ratio catches it
    _assert_untouched(checks, *(n for n in L1 if n != "rms_norm"))


# ---------------------------------------------------------------- (d) hangs

def test_a_hanging_check_times_out_alone(tmp_path):
    cand = _candidate(tmp_path)
    _plant(cand, LLAMA, "def eager_attention(q, k, v, mask, scale: float):\n", """
        while True:
            pass
        """)
    started = time.perf_counter()
    checks = _by_name(_grade(cand, tmp_path, ("L1",), check_timeout_s=6.0))  # the others take ~2 s at most
    for name in ("attention_core", "mlp"):  # mlp traces the whole model (see BESIDE_RMS_NORM)
        assert checks[name]["score"] == 0.0 and checks[name]["reason"].startswith("timeout"), checks[name]
        assert 6.0 <= checks[name]["seconds"] < 20.0, checks[name]
    _assert_untouched(checks, "rms_norm", "rope", "lora_linear", "data_tokens", "data_labels", "collate")
    assert time.perf_counter() - started < 60.0


def test_run_probes_limits_each_check_and_keeps_going(tmp_path):
    inputs, outputs = tmp_path / "in.h5", tmp_path / "out.h5"
    checks = ["L1/spin", "L1/swallow", "L1/stubborn", "L1/fine", "L5/slow", "L1/crash"]
    write_arrays(inputs, {}, attrs={"meta": {"checks": checks, "check_timeout_s": 0.3, "time_budget_s": 0.6}})

    def spin(ctx, inp):
        while True:
            pass

    def swallow(ctx, inp):  # the alarm is no Exception, and it re-fires until the probe lets go
        while True:
            try:
                time.sleep(10)
            except Exception:
                pass

    def stubborn(ctx, inp):  # catches the first alarms and returns as if nothing happened
        for _ in range(3):
            try:
                time.sleep(10)
            except BaseException:
                pass
        return {"y": np.zeros(1)}

    def slow(ctx, inp):
        time.sleep(10)

    probes = {"spin": spin, "swallow": swallow, "stubborn": stubborn, "slow": slow,
              "fine": lambda ctx, inp: {"y": np.ones(2)}, "crash": lambda ctx, inp: 1 / 0}
    started = time.perf_counter()
    run_probes(inputs, outputs, lambda meta: None, probes)
    assert time.perf_counter() - started < 8.0
    groups, attrs = read_arrays(outputs)
    errors = attrs["errors"]
    assert set(groups) == {"L1/fine"} and np.array_equal(groups["L1/fine"]["y"], np.ones(2))
    for key in ("L1/spin", "L1/swallow", "L1/stubborn", "L5/slow"):
        assert errors[key].startswith("timeout"), errors
    assert 0.6 <= attrs["seconds"]["L5/slow"] < 3.0  # L5/L6 are limited by the budget, not check_timeout_s
    assert errors["L1/crash"].startswith("crash: ZeroDivisionError")


# ---------------------------------------------------------------- (e) NaN

def test_a_nan_output_scores_zero(tmp_path):
    cand = _candidate(tmp_path)
    _plant(cand, LLAMA, "    def __call__(self, x):  # f32[B,T,D]\n", "x = x * jnp.nan", indent=" " * 8)
    checks = _by_name(_grade(cand, tmp_path, ("L1",)))
    assert checks["mlp"]["score"] == 0.0 and "non-finite" in checks["mlp"]["reason"], checks["mlp"]
    _assert_untouched(checks, *(n for n in L1 if n != "mlp"))


# ---------------------------------------------------------------- (f) a candidate that does not import

def test_a_syntax_error_scores_every_check_zero(tmp_path):
    cand = _candidate(tmp_path)
    with open(cand / LLAMA, "a") as f:
        f.write("\ndef half_migrated(:\n")
    report = _grade(cand, tmp_path, ("L1",))
    assert report["reward"] == 0.0 and report["gated"]
    for c in report["checks"]:
        assert c["score"] == 0.0 and "llama3.py" in c["reason"] and "unparseable" in c["reason"], c


def test_a_module_that_fails_at_import_scores_its_levels_zero(tmp_path):
    cand = _candidate(tmp_path)
    with open(cand / LLAMA, "a") as f:
        f.write('\nraise RuntimeError("half-migrated module")\n')
    report = _grade(cand, tmp_path, ("L1",))
    checks = _by_name(report)
    assert set(checks) == set(L1)
    for c in checks.values():
        assert c["score"] == 0.0 and "half-migrated module" in c["reason"], c
        assert c["reason"].startswith("setup: crash: RuntimeError"), c
