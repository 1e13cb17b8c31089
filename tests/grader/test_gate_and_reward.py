"""Lattice prefix semantics, the spec-gated reward, and the three layers of the independence gate."""
import json
import math
import socket
import textwrap
from pathlib import Path

import pytest

from grader.isolation.gate import run_import_linter, run_sandboxed, static_scan
from grader.scoring.lattice import Check, earned_levels, strict_bar, summarise
from grader.scoring.reward import reward, reward_parts

REPO = Path(__file__).resolve().parents[2]


def chk(level, aspect, score, name=None, reason=None):
    measure = "pass" if aspect == "spec" else "tensor"
    return Check(level, name or f"{level}_{aspect}_{score}", aspect, measure, score, reason)


def write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


# ---------------------------------------------------------------- lattice

ALL_PASS = [chk("L0", "spec", 1.0), chk("L1", "numeric", 0.999), chk("L2", "numeric", 1.0),
            chk("L3", "numeric", 0.9995), chk("L4", "behavioral", 0.999), chk("L5", "behavioral", 1.0),
            chk("L6", "behavioral", 0.99991)]


def test_all_levels_passing_earns_l6():
    assert earned_levels(ALL_PASS) == 6


def test_a_task_earns_a_prefix_only():
    results = [c for c in ALL_PASS if c.level != "L2"] + [chk("L2", "numeric", 0.9989)]
    assert earned_levels(results) == 1  # L3..L6 pass but sit above the failed L2 (0.9989 < the 0.999 bar)
    noisy = Check("L2", "noisy", "numeric", "tensor", 0.9989, bar=strict_bar("numeric", noise=2e-4))
    assert noisy.bar == pytest.approx(0.998) and noisy.passed  # a measured noise widens that check's bar only
    assert earned_levels([c for c in results if c.level != "L2"] + [noisy]) == 6


def test_strict_bar():
    assert strict_bar("spec") == 1.0 and strict_bar("spec", 0.05) == 1.0
    assert strict_bar("numeric") == strict_bar("behavioral", 1e-5) == pytest.approx(0.999)  # the 1e-3 floor
    assert strict_bar("numeric", 1e-3) == pytest.approx(0.99)
    for bad in (-1e-3, 0.5, math.nan):
        with pytest.raises(ValueError):
            strict_bar("numeric", bad)
    with pytest.raises(ValueError):  # a spec check's bar is exactly 1
        Check("L0", "x", "spec", "pass", 1.0, bar=0.99)


def test_spec_checks_need_exactly_one():
    results = [c for c in ALL_PASS if c.level != "L0"] + [chk("L0", "spec", 0.999999)]
    assert earned_levels(results) == -1


def test_a_level_with_no_checks_is_not_earned():
    assert earned_levels([c for c in ALL_PASS if c.level != "L4"]) == 3
    assert earned_levels([]) == -1


def test_summarise_is_the_plain_mean_per_level():
    results = [chk("L1", "numeric", 0.5), chk("L1", "numeric", 1.0), chk("L0", "spec", 1.0)]
    assert summarise(results) == {"L0": 1.0, "L1": 0.75}
    assert list(summarise(results)) == ["L0", "L1"]


def test_check_rejects_bad_values():
    with pytest.raises(ValueError):
        chk("L1", "numeric", math.nan)
    with pytest.raises(ValueError):
        chk("L7", "numeric", 1.0)
    with pytest.raises(ValueError):
        chk("L1", "accuracy", 1.0)


# ---------------------------------------------------------------- reward

def test_reward_literal():
    results = [chk("L0", "spec", 1.0, "a"), chk("L0", "spec", 1.0, "b"), chk("L0", "spec", 0.0, "c"),
               chk("L0", "spec", 1.0, "d"),
               chk("L1", "numeric", 0.9), chk("L3", "numeric", 0.7),
               chk("L5", "behavioral", 0.5)]
    # spec 3/4; numeric mean 0.8; behavioral 0.5; R = 0.75 * (0.8 + 0.5) / 2
    assert reward(results) == pytest.approx(0.75 * 0.65)
    parts = reward_parts(results)
    assert parts.spec_pass_fraction == 0.75
    assert parts.dimensions == pytest.approx({"numeric": 0.8, "behavioral": 0.5})


def test_spec_failure_multiplies():
    similarity = [chk("L1", "numeric", 0.9), chk("L4", "behavioral", 0.7)]
    passing = reward([chk("L0", "spec", 1.0, "x"), chk("L0", "spec", 1.0, "y")] + similarity)
    failing = reward([chk("L0", "spec", 1.0, "x"), chk("L0", "spec", 0.99, "y")] + similarity)
    assert passing == pytest.approx(0.8)
    assert failing == pytest.approx(0.5 * 0.8)  # an almost-passing spec check still fails


def test_failed_checks_count_as_zero_with_a_reason():
    crashed = Check.failed("L5", "e2e_step_losses", "behavioral", "scalar", "timeout", seconds=61.0)
    results = [chk("L0", "spec", 1.0), chk("L1", "numeric", 1.0), chk("L4", "behavioral", 1.0), crashed]
    assert reward(results) == pytest.approx((1.0 + 0.5) / 2)
    assert reward_parts(results).failures == ("L5/e2e_step_losses: timeout",)


def test_only_dimensions_that_ran_count():
    assert reward([chk("L0", "spec", 1.0), chk("L1", "numeric", 0.6)]) == pytest.approx(0.6)
    assert reward([chk("L0", "spec", 1.0)]) == 0.0  # nothing measured, nothing earned


def test_reward_is_not_rounded_to_pass_fail():
    just_below = reward([chk("L0", "spec", 1.0), chk("L1", "numeric", 0.989)])
    assert just_below == pytest.approx(0.989)


# ---------------------------------------------------------------- static scan

def test_static_scan_catches_direct_and_dynamic_imports(tmp_path):
    write(tmp_path, {
        "jax_oracles/__init__.py": "",
        "jax_oracles/models/helper.py": "import numpy as np\n\nimport torch.nn as nn\n",
        "conversion/llama3.py": "from transformers import AutoModelForCausalLM\n",
        "serving_engine/runner.py": "import importlib\nm = importlib.import_module('torch')\n",
        "serving_engine/sneaky.py": "x = __import__('vllm.engine')\nexec('import peft')\n",
        "serving_engine/fine.py": "import jax\nfrom . import torch_like\nimport torchmetrics_free\n",
        "tests/test_vs_torch.py": "import torch\n",          # tests may compare against torch
        "references/notes.py": "import torch\n",           # never part of the candidate
        "torch_sources/models/llama3.py": "import torch\n",  # not the candidate's code
    })
    assert static_scan(tmp_path) == [
        "conversion/llama3.py:1: transformers",
        "jax_oracles/models/helper.py:3: torch.nn",
        "serving_engine/runner.py:2: torch",
        "serving_engine/sneaky.py:1: vllm.engine",
        "serving_engine/sneaky.py:2: peft",
    ]


def test_static_scan_clean_candidate_and_unparseable_file(tmp_path):
    write(tmp_path, {"jax_oracles/__init__.py": "import jax\n", "conversion/util.py": "import numpy\n"})
    assert static_scan(tmp_path) == []
    write(tmp_path, {"conversion/broken.py": "def f(:\n"})
    assert [s.split(":")[0] for s in static_scan(tmp_path)] == ["conversion/broken.py"]


@pytest.mark.parametrize("source, module", [
    ('import importlib\nimportlib.import_module("tor" + "ch")\n', "torch"),
    ('name = f"{\'torch\'}_sources.models"\n__import__(name)\n', "torch_sources.models"),
    ('mod = "hcrot"[::-1]\n__import__(mod)\n', "torch"),
    ('import importlib\nimportlib.import_module(".".join(["transformers", "models"]))\n', "transformers.models"),
    ('import runpy\nrunpy.run_module("recorder")\n', "recorder"),
    ('exec("import " + "peft")\n', "peft"),
    # programs handed to another interpreter, and shell commands
    ('import subprocess, sys\nsubprocess.run([sys.executable, "-I", "-c", "import torch; print(torch.ones(1))"])\n',
     "torch"),
    ('import sys, subprocess\nPROG = "import sys\\nfrom vllm import LLM\\n"\nsubprocess.run([sys.executable, "-c", PROG])\n',
     "vllm"),
    ('import os\nos.system("python3 -c \'import trl\'")\n', "trl"),
    ('import subprocess\nsubprocess.run(["python", "-m", "torch.utils.collect_env"])\n', "torch.utils.collect_env"),
    ('open("/tmp/x.py", "w").write("import torchaudio\\n")\n', "torchaudio"),
])
def test_static_scan_reads_programs_in_strings_and_names_built_at_run_time(tmp_path, source, module):
    write(tmp_path, {"jax_oracles/__init__.py": "", "jax_oracles/cheat.py": source})
    assert {s.rsplit(": ", 1)[1] for s in static_scan(tmp_path)} == {module}, static_scan(tmp_path)


def test_static_scan_leaves_prose_and_look_alikes_alone(tmp_path):
    write(tmp_path, {"jax_oracles/__init__.py": '"""Never import torch here: the grader forbids it."""\n',
                     "jax_oracles/ok.py": 'def f():\n    "we do not import torch"\n    return "torchlike", "important"\n'
                                          'x = "-c"\ny = ["-c", "print(1)"]\n'})
    assert static_scan(tmp_path) == []


# ---------------------------------------------------------------- import-linter

def test_import_linter_catches_an_indirect_import(tmp_path):
    write(tmp_path, {"a/__init__.py": "from b import helper\n", "b/__init__.py": "",
                     "b/helper.py": "import torch\n"})
    ok, text = run_import_linter(tmp_path)
    assert not ok
    assert "a -> b.helper" in text and "b.helper -> torch" in text


def test_import_linter_keeps_a_clean_candidate(tmp_path):
    write(tmp_path, {"jax_oracles/__init__.py": "from jax_oracles import ops\n",
                     "jax_oracles/ops.py": "import numpy\n"})
    (tmp_path / "conversion").mkdir()  # an empty mirror directory is no package: not an error
    ok, text = run_import_linter(tmp_path)
    assert ok, text


def test_import_linter_follows_namespace_packages(tmp_path):
    # no __init__.py anywhere: still the candidate's code, and never merged with the repo's oracles
    write(tmp_path, {"serving_engine/runner.py": "from serving_engine.kernels import paged\n",
                     "serving_engine/kernels/paged.py": "import vllm\n"})
    ok, text = run_import_linter(tmp_path)
    assert not ok
    assert "serving_engine.kernels.paged -> vllm" in text


# ---------------------------------------------------------------- sandboxed run

def run(tmp_path, entry_source: str, timeout_s=30.0, extra=None, trusted=False):
    cand = write(tmp_path / "cand", {"jax_oracles/__init__.py": "", "jax_oracles/entry.py": entry_source,
                                     "references/task.json": '{"secret": 1}', **(extra or {})})
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    (inputs / "inputs.json").write_text(json.dumps({"x": [1, 2, 3]}))
    out = tmp_path / "out"
    out.mkdir()
    result = run_sandboxed(cand, "jax_oracles.entry:main", inputs, out, timeout_s, inputs_name="inputs.json",
                           outputs_name="outputs.json", trusted=trusted)
    return result, out / "outputs.json"


@pytest.mark.sandbox
def test_sandbox_clean_candidate_writes_its_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("T2J_TEST_SOURCES", str(REPO / "torch_sources"))
    result, outputs = run(tmp_path, """
        import importlib.util, json, os
        import numpy as np
        def main(inputs_path, outputs_path):
            x = json.load(open(inputs_path))["x"]
            json.dump({"sum": int(np.sum(x)), "cwd": os.getcwd(), "file": __file__,
                       "sees_references": os.path.exists("references"),
                       "torch_found": importlib.util.find_spec("torch") is not None,
                       "repo_serving_engine": importlib.util.find_spec("serving_engine") is not None,
                       "env_sources": os.environ.get("T2J_TEST_SOURCES"),
                       "jax_platforms": os.environ.get("JAX_PLATFORMS")}, open(outputs_path, "w"))
    """)
    assert result.ok and result.reason is None, result.stderr_tail
    out = json.loads(outputs.read_text())
    assert out["sum"] == 6
    assert not out["cwd"].startswith(str(tmp_path)) and not out["file"].startswith(str(tmp_path))
    assert out["sees_references"] is False
    assert out["torch_found"] is False          # torch is installed here, hidden in the child
    assert out["repo_serving_engine"] is False  # the repo's oracle must not leak into a candidate
    assert out["env_sources"] is None
    assert out["jax_platforms"] == "cpu"


@pytest.mark.sandbox
def test_sandbox_blocks_torch_import(tmp_path):
    result, outputs = run(tmp_path, """
        def main(inputs_path, outputs_path):
            from jax_oracles import helper
            open(outputs_path, "w").write("{}")
        """, extra={"jax_oracles/helper.py": "import torch\n"})
    assert not result.ok and result.reason == "torch import", result.stderr_tail
    assert not outputs.exists()


@pytest.mark.sandbox
def test_sandbox_blocks_repo_torch_sources(tmp_path):
    result, _ = run(tmp_path, """
        def main(inputs_path, outputs_path):
            import torch_sources.models
        """)
    assert result.reason == "torch import", result.stderr_tail


@pytest.mark.sandbox
@pytest.mark.parametrize("how", ["socket.create_connection(('127.0.0.1', PORT), timeout=2)",
                                 "socket.socket().connect(('127.0.0.1', PORT))",
                                 "socket.socket().connect_ex(('127.0.0.1', PORT))"])
def test_sandbox_blocks_sockets(tmp_path, how):
    with socket.socket() as server:  # a live listener: the connection would succeed without the gate
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        result, outputs = run(tmp_path, f"""
            import socket
            def main(inputs_path, outputs_path):
                {how.replace("PORT", str(port))}
                open(outputs_path, "w").write("{{}}")
            """)
        server.settimeout(0.2)
        with pytest.raises(socket.timeout):
            server.accept()
    assert not result.ok and result.reason == "network access", result.stderr_tail
    assert not outputs.exists()


@pytest.mark.sandbox
def test_sandbox_timeout(tmp_path):
    result, _ = run(tmp_path, """
        import time
        def main(inputs_path, outputs_path):
            print("started", flush=True)
            time.sleep(60)
        """, timeout_s=3.0)
    assert not result.ok and result.reason == "timeout"
    assert 3.0 <= result.seconds < 15.0
    assert "started" in result.stdout_tail


@pytest.mark.sandbox
def test_sandbox_crash_and_missing_output(tmp_path):
    result, _ = run(tmp_path, """
        def main(inputs_path, outputs_path):
            raise RuntimeError("shape mismatch in layer 3")
        """)
    assert not result.ok and result.reason.startswith("exit 1:")
    assert "shape mismatch in layer 3" in result.reason
    result, _ = run(tmp_path / "again", """
        def main(inputs_path, outputs_path):
            pass
        """)
    assert result.reason == "no output"
