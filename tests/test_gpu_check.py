"""make gpu-check (tools/gpu_check.py): on a machine without a GPU it says so and exits 0; with one it records,
grades with the kernel compiled and measures the decode kernel (the `gpu` test, run where a GPU is)."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_and_exits_0(monkeypatch, capsys):
    tool = _tool()
    monkeypatch.setattr(tool.shutil, "which", lambda name: None)
    assert tool.main() == 0
    assert "no GPU here" in capsys.readouterr().out


def test_a_gpu_the_environments_cannot_use_is_a_failure_that_names_them(monkeypatch, capsys):
    tool = _tool()
    monkeypatch.setattr(tool, "_gpu_name", lambda: "NVIDIA H100")
    monkeypatch.setattr(tool, "_probe", lambda python, code: "False" if "torch" in code else "cpu")
    assert tool.main() == 1
    out = capsys.readouterr().out
    assert "torch in .venv sees no CUDA" in out and ".venv-verifier runs on cpu" in out


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no GPU here (no nvidia-smi)")
def test_gpu_check_passes_on_a_gpu():
    out = subprocess.run([sys.executable, str(ROOT / "tools/gpu_check.py")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and "gpu-check: ok" in out.stdout, out.stdout + out.stderr
