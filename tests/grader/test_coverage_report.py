"""Coverage of the graded code: the child's coverage member is untrusted data, the analysis names what no
check reaches, and exclusions need a reason and must exist (grader/coverage.py, grader/isolation/exchange.py)."""
import importlib
import json
import sys
import zipfile

import numpy as np
import pytest

from grader import coverage as gcov
from grader.isolation.exchange import UntrustedOutput, read_coverage, read_outputs, write_outputs
from grader.probes.common import _start_coverage, _stop_coverage

CONFIG = "serving_engine/config.py"


def test_coverage_member_round_trips_and_outputs_still_read(tmp_path):
    path = tmp_path / "out.zip"
    cov = {CONFIG: {"lines": [1, 2, 5], "arcs": [[-1, 1], [1, 2]]}}
    write_outputs(path, {"L1/x": {"y": np.ones(3, np.float32)}}, {}, {"L1/x": 0.1}, coverage=cov)
    assert read_coverage(path) == cov
    groups, errors, _ = read_outputs(path, ["L1/x"])  # the extra member does not upset the outputs
    assert list(groups) == ["L1/x"] and errors == {}
    write_outputs(path, {}, {}, {})
    assert read_coverage(path) == {}


@pytest.mark.parametrize("bad", [
    {"../../etc/passwd.py": {"lines": [1], "arcs": []}},
    {"torch_sources/models/llama3.py": {"lines": [1], "arcs": []}},  # not candidate code
    {CONFIG: {"lines": ["1"], "arcs": []}},
    {CONFIG: {"lines": [1], "arcs": [[1, 2, 3]]}},
    {CONFIG: {"lines": [True], "arcs": []}},
    {CONFIG: {"lines": [1]}},
    [1, 2],
])
def test_coverage_member_is_validated(tmp_path, bad):
    path = tmp_path / "out.zip"
    write_outputs(path, {}, {}, {})
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("coverage.json", json.dumps(bad))
    with pytest.raises(UntrustedOutput):
        read_coverage(path)


def test_child_side_collects_candidate_lines_relative_to_the_root():
    sys.modules.pop("serving_engine.config", None)
    cov = _start_coverage()
    try:
        mod = importlib.import_module("serving_engine.config")
        mod.EngineConfig(mode="ragged", max_num_batched_tokens=256)
    finally:
        data = _stop_coverage(cov)
    assert CONFIG in data and all(not k.startswith("/") for k in data)
    assert data[CONFIG]["lines"] and data[CONFIG]["arcs"]
    assert _stop_coverage(None) is None


def test_analysis_names_the_missed_lines_and_applies_exclusions():
    text = (gcov.ROOT / CONFIG).read_text().splitlines()
    defs = [i + 1 for i, line in enumerate(text) if line.lstrip().startswith(("class ", "from ", "import "))]
    executed = {CONFIG: {"lines": set(defs), "arcs": {(-1, d) for d in defs}}}  # only these lines ran
    plain = gcov.analyze(executed, ("serving_engine",), {"patterns": [], "blocks": []})[CONFIG]
    assert plain["imported"] and plain["missing_lines"] and plain["statements"] > len(plain["missing_lines"])
    block = "def __post_init__(self):"
    first = next(i + 1 for i, line in enumerate(text) if line.strip() == block)
    assert first in plain["missing_lines"]
    excl = {"patterns": [{"regex": r"^\s*raise ValueError", "reason": "validation"}],
            "blocks": [{"file": CONFIG, "block": block, "reason": "test"}]}
    less = gcov.analyze(executed, ("serving_engine",), excl)[CONFIG]
    assert first not in less["missing_lines"] and len(less["missing_lines"]) < len(plain["missing_lines"])
    assert less["excluded_lines"] > 0
    never = gcov.analyze({}, ("serving_engine",), {"patterns": [], "blocks": []})
    assert not never[CONFIG]["imported"] and len(never[CONFIG]["missing_lines"]) == never[CONFIG]["statements"]


def test_exclusions_need_a_reason_and_a_real_block(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text("blocks:\n  - {file: serving_engine/config.py, block: 'def nowhere('}\n")
    with pytest.raises(ValueError, match="reason"):
        gcov.load_exclusions(bad)
    missing = {"patterns": [], "blocks": [{"file": CONFIG, "block": "def nowhere(", "reason": "r"}]}
    with pytest.raises(ValueError, match="not found"):
        gcov.analyze({}, ("serving_engine",), missing)
    shipped = gcov.load_exclusions()  # the repo's own list parses, every entry reasoned
    assert all(e["reason"] for kind in shipped.values() for e in kind)


def test_a_graded_run_under_coverage_reports_the_candidates_executed_lines(tmp_path):
    from grader.app import ROOT, grade
    from catalog.tasks import compose_task
    report = grade(compose_task("llama3-sft"), ROOT, ROOT / "references", tmp_path, quiet=True, levels=("L1",),
                   only_checks=("rms_norm",), coverage=True)
    assert report["reward"] > 0 and all(c["reason"] is None for c in report["checks"]), report["checks"]
    executed = report["coverage"]["jax_oracles/models/llama3.py"]
    assert executed["lines"] and executed["arcs"]
    assert not any(path.startswith(("grader/", "tests/")) for path in report["coverage"])


def test_every_shipped_exclusion_names_code_that_exists():
    """A stale entry (its code renamed or gone) would hide nothing today and something wrong tomorrow: each
    block starts a line of its file, each pattern matches a line of the graded trees."""
    import re
    shipped = gcov.load_exclusions()
    for e in shipped["blocks"]:
        lines = (gcov.ROOT / e["file"]).read_text().splitlines()
        assert any(line.strip().startswith(e["block"]) for line in lines), e
    sources = [line for root in gcov.SCOPES["all"]["oracle"] + gcov.SCOPES["all"]["torch"]
               for path in (gcov.ROOT / root).rglob("*.py") for line in path.read_text().splitlines()]
    for e in shipped["patterns"]:
        assert any(re.search(e["regex"], line) for line in sources), e["regex"]
