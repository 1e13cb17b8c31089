"""tools/harbor/check_tasks.py, i.e. Harbor's own task loader and `harbor lint`, on a minimal task
directory (accepted) and on broken copies of it (rejected). Needs `make harbor-env`."""
import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARBOR_PY = ROOT / ".venv-harbor" / "bin" / "python"
CHECK = ROOT / "tools" / "harbor" / "check_tasks.py"
FIXTURE = Path(__file__).parent / "fixtures" / "harbor_minimal"

pytestmark = pytest.mark.skipif(
    not HARBOR_PY.exists(), reason="no .venv-harbor (Harbor needs Python >= 3.12): run `make harbor-env`"
)


def check(*dirs: Path) -> tuple[int, list[dict]]:
    proc = subprocess.run([str(HARBOR_PY), str(CHECK), *map(str, dirs)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    return proc.returncode, [json.loads(line) for line in proc.stdout.splitlines()]


def test_minimal_fixture_is_valid():
    rc, [result] = check(FIXTURE)
    assert result["ok"], result
    assert rc == 0
    assert result["config_errors"] == [] and result["lint"]["returncode"] == 0


def test_broken_copies_are_rejected(tmp_path):
    # A timeout of the wrong type: TaskConfig (pydantic) and lint's invalid-task-config both reject it.
    wrong_type = shutil.copytree(FIXTURE, tmp_path / "wrong_type")
    toml = wrong_type / "task.toml"
    toml.write_text(toml.read_text().replace("timeout_sec = 120.0", 'timeout_sec = "two minutes"'))
    # No verifier entry point: Task's layout check and lint's invalid-task-files both reject it.
    no_test = shutil.copytree(FIXTURE, tmp_path / "no_test")
    (no_test / "tests" / "test.sh").unlink()

    rc, results = check(FIXTURE, wrong_type, no_test)
    assert rc == 1
    ok, bad_type, missing = results
    assert ok["ok"]
    assert not bad_type["ok"] and any("verifier.timeout_sec" in e for e in bad_type["config_errors"])
    assert "invalid-task-config" in bad_type["lint"]["output"]
    assert not missing["ok"] and any("test.sh" in e for e in missing["config_errors"])
    assert "invalid-task-files" in missing["lint"]["output"]
