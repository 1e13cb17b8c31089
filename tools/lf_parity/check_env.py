"""make lf-env's last step, run by .venv-lf's python with -I: the parity environment is what the harness assumes.

torch is the 2.13.0 CPU build, llamafactory 0.9.5 and its pinned stack import (torchaudio met by the stand-in of
lf_child.py, torchvision absent), pip's consistency check names nothing but the two left out on purpose, and the
TRL overlay (argv[1]) gives TRL 0.9.6 and the Pillow overlay (argv[2]) Pillow 13.0.0 to a child that puts it first
on its path.
"""

from __future__ import annotations

import importlib.metadata as metadata
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXPECTED = {"torch": "2.13.0+cpu", "llamafactory": "0.9.5", "transformers": "5.6.0", "peft": "0.18.1",
            "trl": "0.24.0", "accelerate": "1.11.0", "datasets": "4.0.0"}
LEFT_OUT = ("torchvision", "torchaudio")


def main(overlay: str, pillow_overlay: str) -> int:
    problems = [f"{name} {metadata.version(name)} (expected {version})" for name, version in EXPECTED.items()
                if metadata.version(name) != version]
    for name in LEFT_OUT:
        try:
            problems.append(f"{name} {metadata.version(name)} is installed; it must stay out (README.md)")
        except metadata.PackageNotFoundError:
            pass
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    unexpected = [line for line in check.stdout.splitlines()
                  if line.strip() and not any(f"requires {name}, which is not installed" in line for name in LEFT_OUT)]
    problems += [f"pip check: {line}" for line in unexpected]
    sys.path.insert(0, str(HERE))
    from lf_child import install_torchaudio_standin

    install_torchaudio_standin()
    import llamafactory.train.sft.workflow  # noqa: F401  (the data and model stack behind it)
    import llamafactory.train.dpo.trainer  # noqa: F401
    probe = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); import trl, "
                            "importlib.metadata as m; print(trl.__version__, m.version('trl'))", overlay],
                           capture_output=True, text=True, env={**os.environ})
    if probe.stdout.split() != ["0.9.6", "0.9.6"]:
        problems.append(f"the TRL overlay {overlay} gives {probe.stdout.strip() or probe.stderr.strip()[-300:]}")
    probe = subprocess.run([sys.executable, "-I", "-c", "import sys; sys.path.insert(0, sys.argv[1]); import PIL, "
                            "PIL.Image, importlib.metadata as m; print(PIL.__version__, m.version('pillow'))",
                            pillow_overlay], capture_output=True, text=True, env={**os.environ})
    if probe.stdout.split() != ["13.0.0", "13.0.0"]:
        problems.append(f"the Pillow overlay {pillow_overlay} gives "
                        f"{probe.stdout.strip() or probe.stderr.strip()[-300:]}")
    for problem in problems:
        print("lf-env:", problem, file=sys.stderr)
    print("lf-env: ok" if not problems else f"lf-env: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
