"""Validate exported Harbor task directories with Harbor's own code (tools/harbor/FACTS.md).

Run with the harbor venv (make harbor-env):

    .venv-harbor/bin/python tools/harbor/check_tasks.py DIR [DIR ...]

Per directory, two checks, both Harbor's and both offline:
  1. config: harbor.models.task.task.Task(dir), the object `harbor run` builds for a task. It loads
     task.toml through TaskConfig.model_validate_toml (pydantic) and checks the layout it needs at run
     time (instruction.md, tests/test.sh or a verifier image, input trees inside the task); then
     Task.is_valid_dir, which adds the environment/ (or [environment].docker_image) check.
  2. lint: the `harbor lint --json DIR` CLI with its default rules (plus any [metadata.harbor.lint]
     in task.toml). Static only; it shells out to `docker compose config` for docker-compose.yaml
     files alone, so Dockerfile-only tasks need no Docker.
Prints one JSON object per directory and exits 1 if any directory fails.
"""

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from pydantic import ValidationError

from harbor.models.task.task import Task


def config_errors(task_dir: Path) -> tuple[list[str], list[str]]:
    """Errors and warnings (deprecated keys such as allow_internet, memory) from loading the task."""
    errors: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            Task(task_dir)
        except ValidationError as exc:
            errors += [
                f"{'.'.join(map(str, e['loc'])) or 'task'}: {e['msg']}"
                for e in exc.errors(include_url=False)
            ]
        except Exception as exc:  # Task raises FileNotFoundError, ValueError, TOMLDecodeError...
            errors.append(f"{type(exc).__name__}: {exc}")
        if not errors and not Task.is_valid_dir(task_dir):
            errors.append("Task.is_valid_dir is False: add environment/ or set [environment].docker_image")
    notes = sorted({str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)})
    return errors, notes


def harbor_cli() -> list[str]:
    # The console script beside this interpreter (.venv-harbor/bin/harbor), else harbor's own entry point.
    script = Path(sys.executable).parent / "harbor"
    if script.exists():
        return [str(script)]
    found = shutil.which("harbor")
    return [found] if found else [sys.executable, "-c", "from harbor.cli.main import app; app()"]


def lint(task_dir: Path) -> dict:
    proc = subprocess.run(
        [*harbor_cli(), "lint", "--json", str(task_dir)],
        capture_output=True, text=True, timeout=120,
    )
    result = {"returncode": proc.returncode, "output": (proc.stdout + proc.stderr).strip()}
    try:  # exit 1 prints a JSON array of findings; exit 2 (bad input, no docker compose) prints text
        result["findings"] = [f"{f['rule']}: {f['message']} ({f['path']})" for f in json.loads(proc.stdout)]
    except ValueError:
        pass
    return result


def check(task_dir: Path) -> dict:
    if not task_dir.is_dir():
        return {"dir": str(task_dir), "ok": False, "config_errors": ["not a directory"],
                "config_warnings": [], "lint": {"returncode": None, "output": "not run"}}
    errors, notes = config_errors(task_dir)
    lint_result = lint(task_dir)
    return {"dir": str(task_dir), "ok": not errors and lint_result["returncode"] == 0,
            "config_errors": errors, "config_warnings": notes, "lint": lint_result}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    results = [check(Path(d)) for d in argv]
    for result in results:
        print(json.dumps(result))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
