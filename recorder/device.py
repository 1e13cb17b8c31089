"""True fp32 on the chosen device: TF32 off, highest matmul precision, deterministic algorithms."""
from __future__ import annotations

import os
import random

import numpy as np
import torch


def setup_device(name: str, seed: int = 0) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device=cuda asked for, but torch sees no CUDA device (use device=cpu)")
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    elif name != "cpu":
        raise ValueError(f"unknown device {name!r}: use cpu or cuda")
    if name == "cpu":
        # tiny models: intra-op threads only add contention (measured 10-100x slower steps with 2
        # threads on a loaded 2-core box), and one thread keeps the recorded wall-clock honest
        torch.set_num_threads(1)
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    seed_everything(seed)
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def device_description(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    import platform
    return f"cpu:{platform.processor() or platform.machine()}"
