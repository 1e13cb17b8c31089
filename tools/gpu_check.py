"""make gpu-check: what this project does on a GPU, in one short run (under 5 minutes).

Where CUDA is present: records llama3-sft and llama3-core with device=cuda (TF32 off, deterministic: recorder/
device.py) into a temporary directory, grades llama3-core against that reference with the candidate children on
the GPU (jax_platforms=cuda: the Pallas ragged paged-attention kernel compiled, not interpreted), and prints the
decode attention kernel's achieved K/V read bandwidth against the device's (bench/bench_kernel.py --decode).
Where no GPU is present it says so and exits 0; where one is but torch, the recorder's JAX or the verifier's JAX
cannot use it, it says which and exits 1.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = str(ROOT / ".venv/bin/python")
VPY = str(ROOT / ".venv-verifier/bin/python")
TASKS = ("llama3-sft", "llama3-core")


def _gpu_name() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def _probe(python: str, code: str) -> str:
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    return out.stdout.strip() if out.returncode == 0 else f"error: {out.stderr.strip().splitlines()[-1:]}"


def _run(cmd: list[str], timeout: float) -> tuple[int, str]:
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    print(f"  $ {' '.join(cmd)}  ({time.perf_counter() - started:.0f} s, exit {out.returncode})")
    return out.returncode, out.stdout + out.stderr


def main() -> int:
    gpu = _gpu_name()
    if gpu is None:
        print("gpu-check: no GPU here (no nvidia-smi, or it lists none): nothing to check")
        return 0
    print(f"gpu-check on {gpu}")
    torch_cuda = _probe(PY, "import torch; print(torch.cuda.is_available())")
    jax_gpu = _probe(PY, "import jax; print(jax.default_backend())")
    verifier_gpu = _probe(VPY, "import jax; print(jax.default_backend())")
    missing = [what for what, ok in ((f"torch in .venv sees no CUDA ({torch_cuda})", torch_cuda == "True"),
                                     (f"JAX in .venv runs on {jax_gpu}", jax_gpu == "gpu"),
                                     (f"JAX in .venv-verifier runs on {verifier_gpu}", verifier_gpu == "gpu"))
               if not ok]
    if missing:
        print("gpu-check: a GPU is here but " + "; ".join(missing) + ": install CUDA builds (torch==2.13.0 from "
              "PyTorch's CUDA index, jax[cuda12]) in both environments")
        return 1
    failures = []
    with tempfile.TemporaryDirectory(prefix="t2j-gpu-") as tmp:
        for task in TASKS:
            rc, text = _run([PY, "-m", "recorder", f"task={task}", "device=cuda", f"out_dir={tmp}"], 240)
            if rc != 0:
                failures.append(f"recording {task} on cuda: {text.strip().splitlines()[-3:]}")
        if not failures:
            rc, text = _run([PY, "-m", "grader", "task=llama3-core", "jax_platforms=cuda", f"references={tmp}",
                             f"report_dir={tmp}/reports"], 300)
            lines = [ln for ln in text.splitlines() if ln.startswith(("strict_level=", "reward="))]
            print("  " + "  ".join(lines))
            if rc != 0 or not lines or float(lines[-1].split("=")[1]) < 0.999:
                failures.append(f"grading llama3-core with the kernel compiled: {text.strip().splitlines()[-3:]}")
    rc, text = _run([PY, "bench/bench_kernel.py", "--decode", "--iters", "10"], 120)
    print("\n".join("  " + ln for ln in text.splitlines() if ln.startswith(("backend", "kernel", "decode"))))
    if rc != 0:
        failures.append(f"decode kernel bench: {text.strip().splitlines()[-3:]}")
    for f in failures:
        print(f"gpu-check: FAILED {f}")
    print(f"gpu-check: {'ok' if not failures else f'{len(failures)} failed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
