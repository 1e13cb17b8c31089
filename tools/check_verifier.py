"""Fail unless this interpreter is a torch-free verifier: none of the forbidden packages importable.

Run with the verifier's own interpreter (`make verifier` does): `.venv-verifier/bin/python -I
tools/check_verifier.py`. Standard library only; the list is grader.isolation.gate.FORBIDDEN, repeated here
because the verifier cannot import the grader package (a test keeps the two equal).
"""
import importlib.util
import sys

FORBIDDEN = ("torch", "torchvision", "torchaudio", "transformers", "vllm", "peft", "trl",
             "torch_sources", "recorder")
REQUIRED = ("jax", "flax", "optax", "numpy", "h5py", "safetensors", "tokenizers")


def main() -> int:
    present = [m for m in FORBIDDEN if importlib.util.find_spec(m) is not None]
    missing = [m for m in REQUIRED if importlib.util.find_spec(m) is None]
    if present:
        print(f"verifier {sys.prefix} is not torch-free: {', '.join(present)} importable", file=sys.stderr)
    if missing:
        print(f"verifier {sys.prefix} lacks {', '.join(missing)}", file=sys.stderr)
    if present or missing:
        return 1
    print(f"verifier {sys.prefix}: torch-free, has {', '.join(REQUIRED)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
