"""The twin's verdicts on what is not a port: its comparison (NaN never agrees, shapes and exact kinds), a
candidate with nothing in it (every property not established, with the child's reason) and one that imports
torch (independence violated, the sealed child refusing the import), and the CLI's exit codes."""
from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from grader.app import ROOT
from twin.__main__ import main as twin_main
from twin.compare import compare_outputs, diff
from twin.harness import run_twin
from twin.properties import ESTABLISHED, NOT_ESTABLISHED, VIOLATED, Property


def test_diff_agrees_within_rtol_of_the_torch_scale_and_never_on_nan():
    want = np.float32([100.0, -3.0, 0.5])
    assert diff("x", want + np.float32([5e-3, 0, 0]), want, 1e-4).agrees        # 5e-3 <= 1e-4 x 100
    assert not diff("x", want + np.float32([0, 0, 2e-2]), want, 1e-4).agrees
    nan = np.float32([np.nan, 1.0])
    assert not diff("x", nan, nan, 1e-4).agrees and diff("x", nan, nan, 1e-4).why == "non-finite entries"
    inf = np.float32([-np.inf, 1.0])
    assert diff("x", inf, inf, 1e-4).agrees                                      # a masked logit on both sides
    assert diff("x", np.zeros(3), np.zeros(4), 1e-4).why == "shape (3,) != (4,)"
    assert not diff("ids", np.int32([1, 2]), np.int32([1, 3]), 1e-4).agrees       # integers compare exactly
    assert not diff("s", np.array(["a"]), np.array([1]), 1e-4).agrees
    missing = diff("x", None, want, 1e-4)
    assert not missing.agrees and math.isinf(missing.max_abs)


def test_the_first_divergent_tensor_is_the_first_in_the_torch_order():
    prop = Property("L2/decoder_layer", "a layer", ("jax_oracles/models/llama3.py",))
    want = {"attention": np.ones(3, np.float32), "mlp": np.ones(3, np.float32), "out": np.ones(3, np.float32)}
    got = {"out": np.zeros(3), "mlp": np.zeros(3), "attention": np.ones(3, np.float32)}
    tensors, first = compare_outputs(prop, got, want)
    assert [t.name for t in tensors] == ["attention", "mlp", "out"] and first.name == "mlp"


@pytest.mark.sandbox
def test_an_empty_candidate_establishes_nothing_and_says_why(tmp_path):
    (tmp_path / "jax_oracles").mkdir()
    (tmp_path / "jax_oracles" / "__init__.py").write_text("")
    report = run_twin("llama3-core", tmp_path, seed=0, only=("independent", "config", "prefill"))
    by_key = {r.prop.key: r for r in report.results}
    assert by_key["L0/independent"].status == ESTABLISHED
    for key in ("L0/config", "L3/prefill"):
        assert by_key[key].status == NOT_ESTABLISHED
        assert "ModuleNotFoundError" in by_key[key].candidate_error, by_key[key].candidate_error
    assert report.first_failing.prop.key == "L0/config"


@pytest.mark.sandbox
def test_a_candidate_that_imports_torch_is_violated_and_blocked(tmp_path, capsys):
    for name in ("jax_oracles", "serving_engine", "conversion"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    sampler = tmp_path / "serving_engine" / "sampler.py"
    src = sampler.read_text()
    assert src.count("from __future__ import annotations\n") == 1
    sampler.write_text(src.replace("from __future__ import annotations\n",
                                   "from __future__ import annotations\nimport torch  # a leftover\n"))
    rc = twin_main(["task=llama3-core", f"candidate={tmp_path}", "only=independent,sampler_greedy",
                    f"out={tmp_path / 'out'}"])
    out = capsys.readouterr().out
    assert rc == 1 and "first failing: L0/independent (violated)" in out, out
    report = run_twin("llama3-core", tmp_path, only=("sampler_greedy",))
    (r,) = report.results
    assert r.status == NOT_ESTABLISHED and "t2j-gate: blocked import" in r.candidate_error


def test_bad_arguments_exit_2(capsys):
    assert twin_main(["task=no-such-task"]) == 2
    assert twin_main(["tsak=llama3-sft"]) == 2
    assert twin_main(["task=llama3-sft", "trusted=maybe"]) == 2
    assert "valid tasks" in capsys.readouterr().out
