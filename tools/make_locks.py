"""`python -m tools.make_locks [DATE]`: the two halves' lock files, pinned by date (DESIGN section 13).

    locks/verifier.lock   the verifier's torch-free environment (requirements-verifier.txt's packages)
    locks/agent.lock      the agent's environment: torch 2.13.0 and the project's runtime packages

Each is `uv pip compile --generate-hashes --exclude-newer DATE` (exact versions and hashes, nothing released after
DATE), for CPython 3.11 on x86_64 manylinux, constrained to the versions the project is tested with: the live
environment's `pip freeze` (.venv-verifier, .venv) is written beside the lock as <half>.pins and given as
constraints, so a lock never moves a version the references were recorded or graded with; DATE defaults to today
(UTC). The first line of each lock says its date (`# lock-date: ...`); the export puts it in task.toml.
torch is left out of the agent's pins: the live .venv has the CPU build (2.13.0+cpu, a local version PyPI does not
serve); the agent's machine has a GPU, and PyPI's torch==2.13.0 for Linux is the CUDA build.
"""
from __future__ import annotations

import datetime as dt
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCKS = ROOT / "locks"
UV = ROOT / ".venv" / "bin" / "uv"
PLATFORM = ("--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28")
# half -> (its top-level requirements, the environment whose versions pin it, packages left out of the pins)
HALVES = {
    "verifier": (ROOT / "requirements-verifier.txt", ROOT / ".venv-verifier", ()),
    "agent": (LOCKS / "agent.in", ROOT / ".venv", ("torch", "t2j-refs", "uv")),
}
DATE_LINE = re.compile(r"^# lock-date: (\d{4}-\d{2}-\d{2})$")


def lock_date(lock: Path) -> str:
    """The date a lock was compiled against (its first line)."""
    first = lock.read_text().splitlines()[0] if lock.exists() else ""
    match = DATE_LINE.match(first)
    if not match:
        raise ValueError(f"{lock}: no '# lock-date: YYYY-MM-DD' first line (python -m tools.make_locks)")
    return match.group(1)


def locked_versions(lock: Path) -> dict[str, str]:
    """{normalized name: version} of a lock's pins."""
    out = {}
    for line in lock.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s;\\]+)", line)
        if match:
            out[normalize(match.group(1))] = match.group(2)
    return out


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(venv: Path, leave_out) -> str:
    freeze = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze", "--exclude-editable"],
                            capture_output=True, text=True, check=True).stdout
    keep = [line for line in freeze.splitlines()
            if "==" in line and normalize(line.split("==")[0]) not in {normalize(n) for n in leave_out}]
    return "\n".join(keep) + "\n"


def compile_lock(half: str, date: str) -> Path:
    requirements, venv, leave_out = HALVES[half]
    if not venv.exists():
        raise SystemExit(f"{venv} is missing: `make venv verifier` first")
    pin_file = LOCKS / f"{half}.pins"
    pin_file.write_text(pins(venv, leave_out))
    out = LOCKS / f"{half}.lock"
    # --exclude-newer is exclusive of its instant: the day after DATE's midnight admits everything of DATE
    until = (dt.date.fromisoformat(date) + dt.timedelta(days=1)).isoformat()
    cmd = [str(UV), "pip", "compile", "--quiet", "--generate-hashes", "--no-header", "--exclude-newer", until,
           *PLATFORM, "-c", str(pin_file.relative_to(ROOT)), str(requirements.relative_to(ROOT))]
    body = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    out.write_text(f"# lock-date: {date}\n# {half}: `python -m tools.make_locks {date}` "
                   f"(uv pip compile --generate-hashes --exclude-newer {until}, CPython 3.11, x86_64 manylinux;\n"
                   f"# constrained to {pin_file.name}, the versions tested in {venv.name})\n{body}")
    return out


def main(argv: list[str]) -> int:
    date = argv[0] if argv else dt.datetime.now(dt.timezone.utc).date().isoformat()
    dt.date.fromisoformat(date)
    for half in HALVES:
        lock = compile_lock(half, date)
        print(f"{lock.relative_to(ROOT)}: {len(locked_versions(lock))} packages, lock-date {lock_date(lock)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
