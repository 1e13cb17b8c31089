"""True fp32 on the chosen device, and proof that the probes ran there.

`setup_device` checks the name before anything runs, then sets true fp32: TF32 off, highest
matmul precision, deterministic algorithms. `on_device` runs the probes with every tensor that they
and the torch sources make on that device, under a `DeviceAudit` that sees every aten op.

The torch sources are device-unaware on purpose (a reader holds them beside their JAX twins), so
the device is applied where tensors enter them, not inside them (ENTRY_POINTS):
  factories    the default device (torch's own DeviceContext): `torch.tensor`, `zeros`, `arange`,
               `as_tensor`, parameters of modules built there; a source's own
               `with torch.device("meta")` still wins inside it;
  from_numpy   `torch.from_numpy` copies to the device (the probes' `t()`, the collator, the
               sampler's noise);
  checkpoints  `torch_sources.models.loading.load_file` copies each tensor to the device as it is
               read, so the fp32 cast and the parameters live there;
  numpy        the way back: `Tensor.numpy()` and `np.asarray(tensor)` copy a device tensor to the
               host first, as `.cpu().numpy()` does.
On the CPU all four are no-ops (the same tensors and bits), so CPU references do not move.
"""
from __future__ import annotations

import os
import random
import traceback
from collections import Counter
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torch_sources.models import loading

DEVICES = ("cpu", "cuda")  # configs/device/<name>.yaml


def check_device(name: str) -> None:
    """Refuse an unknown device, or device=cuda where torch sees no GPU, before anything runs."""
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; valid devices: {', '.join(DEVICES)}")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device=cuda asked for, but torch {torch.__version__} sees no CUDA device "
                           f"(built for CUDA {torch.version.cuda or 'none'}); record on the CPU with device=cpu")


def setup_device(name: str, seed: int = 0) -> torch.device:
    check_device(name)
    if name == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # deterministic cuBLAS; before its first use
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        # tiny models: intra-op threads only add contention (measured 10-100x slower steps with 2
        # threads on a loaded 2-core box), and one thread keeps the recorded wall-clock honest
        torch.set_num_threads(1)
        dev = torch.device("cpu")
    torch.set_float32_matmul_precision("highest")
    torch.use_deterministic_algorithms(True)
    torch.set_default_dtype(torch.float32)
    seed_everything(seed)
    return dev


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def device_description(dev: torch.device) -> str:
    if dev.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(dev)}"
    import platform
    return f"cpu:{platform.processor() or platform.machine()}"


def same_device(a, b) -> bool:
    """`cuda` matches `cuda:0` (a tensor always carries its index, a configured device may not)."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


# ---- placement -------------------------------------------------------------------------------------------

_STAGING = [0]  # > 0 while host data (a checkpoint's bytes, an array) becomes a tensor bound for the device


@contextmanager
def host_staging():
    _STAGING[0] += 1
    try:
        yield
    finally:
        _STAGING[0] -= 1


@contextmanager
def _patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


class _HostBoundary(TorchFunctionMode):
    """`.numpy()` and `np.asarray` of a device tensor copy it to the host first."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and args[0].device.type != "cpu":
            args = (args[0].detach().cpu(), *args[1:])
        return func(*args, **(kwargs or {}))


def _entry_points(dev: torch.device) -> dict:
    host_from_numpy, host_load_file = torch.from_numpy, loading.load_file

    def from_numpy(a):
        with host_staging():
            host = host_from_numpy(a)
        return host.to(dev)

    def load_file(path, *args, **kwargs):
        with host_staging():  # safetensors builds each tensor on the host from the file's bytes
            tensors = host_load_file(path, *args, **kwargs)
        return {k: v.to(dev) for k, v in tensors.items()}

    return {"factories": torch.device(dev), "from_numpy": _patched(torch, "from_numpy", from_numpy),
            "checkpoints": _patched(loading, "load_file", load_file), "numpy": _HostBoundary()}


ENTRY_POINTS = ("factories", "from_numpy", "checkpoints", "numpy")


@contextmanager
def placed_on(dev: torch.device, skip: tuple[str, ...] = ()):
    """Every tensor the probes and the torch sources make is made on `dev` (module docstring).
    `skip` leaves entry points out: the tests show that each one is needed."""
    with ExitStack() as stack:
        for name, cm in _entry_points(torch.device(dev)).items():
            if name not in skip:
                stack.enter_context(cm)
        yield


# ---- audit -----------------------------------------------------------------------------------------------

aten = torch.ops.aten
TRANSFERS = {aten._to_copy.default, aten.copy_.default}  # `.to`, `.cpu()`, `copy_`: the way in and out
# no computation: a host result passes through these on its way out (`.numpy()`)
ALIASES = {aten.detach.default, aten.alias.default}
# advanced indexing may take its index list from the host: `x[[3, 5]]` (CUDA copies it over itself)
INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_ROOT = str(Path(__file__).resolve().parents[1])


def _where() -> str:
    """The innermost project frames (probe, torch source) of the op being audited."""
    frames = [f for f in traceback.extract_stack()[:-3] if f.filename.startswith(_ROOT)
              and "/.venv" not in f.filename and not f.filename.endswith("recorder/device.py")]
    return " <- ".join(f"{Path(f.filename).relative_to(_ROOT)}:{f.lineno} {f.name}" for f in reversed(frames[-3:]))


def _host_scalar(x: torch.Tensor) -> bool:
    return x.dim() == 0 and x.device.type == "cpu"


def _meta_factory(kwargs) -> bool:
    return kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta"


class DeviceAudit(TorchDispatchMode):
    """Counts the device of every aten op's outputs and records each op that computes off `dev`.

    An op computes off the device when an output is not on `dev`, or a tensor input is neither on
    `dev` nor a 0-dim CPU scalar (which CUDA kernels take as a number); arithmetic among 0-dim CPU
    scalars alone is host bookkeeping (torch's AdamW keeps its step count there). Not computation,
    so not checked: ops on meta tensors only (shapes), aliases (`detach`: a result on its way out)
    and the host side of `from_numpy` and of a checkpoint read (`host_staging`). Transfers (`.to`,
    `.cpu()`, `copy_`) may read the host on the way in, and write it only from the device (results
    going back); a host -> host transfer is host computation.
    """

    def __init__(self, dev: torch.device, keep: int = 20):
        super().__init__()
        self.dev, self.keep = torch.device(dev), keep
        self.outputs: Counter[str] = Counter()  # device of every output tensor of every checked op
        self.ops = 0  # checked ops
        self.to_host = 0  # device -> host copies: results brought back
        self.host_scalars = 0  # ops on 0-dim CPU tensors only
        self.unchecked = 0  # meta, alias and staging ops
        self.violations: list[str] = []
        self.num_violations = 0

    def _on(self, x) -> bool:
        return same_device(x.device, self.dev)

    def _flag(self, func, why: str) -> None:
        self.num_violations += 1
        if len(self.violations) < self.keep:
            self.violations.append(f"{func.__name__}: {why} (at {_where()})")

    def _count(self, out) -> list[torch.Tensor]:
        self.ops += 1
        outs = [x for x in tree_leaves(out) if isinstance(x, torch.Tensor)]
        self.outputs.update(str(x.device) for x in outs)
        return outs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if _STAGING[0] or func in ALIASES or _meta_factory(kwargs) or (ins and all(x.is_meta for x in ins)):
            self.unchecked += 1
            return func(*args, **kwargs)
        if func in TRANSFERS:
            out = func(*args, **kwargs)
            dst, src = (args[0], args[1]) if func is aten.copy_.default else (out, args[0])
            self._count(out)
            if not self._on(dst):
                if self._on(src):
                    self.to_host += 1
                else:
                    self._flag(func, f"host computation ({src.device} -> {dst.device})")
            return out
        if func in INDEX_OPS:
            skip = {id(i) for i in tree_leaves(args[1]) if isinstance(i, torch.Tensor)}
            ins = [x for x in ins if id(x) not in skip]
        bad = [x for x in ins if not self._on(x) and not _host_scalar(x)]
        if bad:  # before the call: on a real device the op would fail on the mixed inputs
            self._flag(func, f"inputs on {sorted({str(x.device) for x in ins})}")
        out = func(*args, **kwargs)
        outs = self._count(out)
        if not bad and any(not self._on(x) for x in outs):
            if all(_host_scalar(x) for x in ins + outs):
                self.host_scalars += 1
            else:
                self._flag(func, f"outputs on {sorted({str(x.device) for x in outs})}")
        return out

    def verify(self) -> str:
        """Raise if anything computed off the device, or nothing on it; else a one-line summary."""
        if self.num_violations:
            raise RuntimeError(f"{self.num_violations} op(s) computed off {self.dev}; the first:\n  "
                               + "\n  ".join(self.violations))
        on = sum(c for d, c in self.outputs.items() if same_device(d, self.dev))
        if on == 0:
            raise RuntimeError(f"no op produced a tensor on {self.dev}")
        return (f"{self.ops} aten ops checked, {on} output tensors on {self.dev}, none elsewhere but "
                f"{self.to_host} copies back to the host and {self.host_scalars} host-scalar ops")


@contextmanager
def on_device(dev: torch.device, audit: bool | None = None):
    """placed_on(dev) and, off the CPU unless told otherwise, a DeviceAudit: yields it (or None).
    The caller calls `audit.verify()` after the block."""
    dev = torch.device(dev)
    with placed_on(dev):
        if not (dev.type != "cpu" if audit is None else audit):
            yield None
            return
        with DeviceAudit(dev) as a:
            yield a


def record_on(dev: torch.device, run, say=print, seed: int = 0):
    """`run()` -> (records, band, wall-clock): the task's probes, on `dev`.

    On the CPU one pass. Off it, two: an audited pass proves that every op runs on `dev`; the
    reference and its wall-clock come from a second, unaudited pass (a dispatch mode costs tens of
    microseconds per op, several times these tiny models' own time), which must reproduce the
    audited one. The second pass runs warm, as the candidate's timed run does.
    """
    if dev.type == "cpu":
        with on_device(dev):
            return run()
    with on_device(dev) as audit:
        checked = run()
    say(f"device check: {audit.verify()}")
    seed_everything(seed)
    with on_device(dev, audit=False):
        result = run()
    say(f"device check: the unaudited pass {reproduces(checked, result)}")
    if dev.type == "cuda":
        say(f"device check: {cuda_evidence(dev)}")
    return result


def _arrays(records, band) -> dict[str, np.ndarray]:
    out = {f"{r.key}/{side}/{k}": np.asarray(v) for r in records
           for side, d in (("inputs", r.inputs), ("outputs", r.outputs)) for k, v in d.items()}
    if band is not None:
        out["band"] = np.asarray(band)
    return out


def reproduces(checked, result, rtol: float = 1e-5, atol: float = 1e-6) -> str:
    """Raise unless `result` (records, band, wall) has the arrays of `checked`: exact, floats within tolerance."""
    a, b = _arrays(*checked[:2]), _arrays(*result[:2])
    bad = sorted(a.keys() ^ b.keys())
    worst = 0.0
    for k in a.keys() & b.keys():
        x, y = a[k], b[k]
        if x.shape != y.shape or x.dtype != y.dtype:
            bad.append(k)
        elif x.dtype.kind == "f":
            worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)))
            if not np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True):
                bad.append(k)
        elif not np.array_equal(x, y):
            bad.append(k)
    if bad:
        raise RuntimeError(f"the unaudited pass does not reproduce the audited one: {bad[:10]}")
    return f"reproduces the audited one ({len(a)} arrays, max |diff| {worst:.2g})"


def cuda_evidence(dev: torch.device) -> str:
    """What the CUDA allocator saw: the run must have allocated memory on the device."""
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    if peak <= 0:
        raise RuntimeError(f"torch.cuda reports no memory allocated on {dev}: the probes did not run there")
    return f"peak {peak / 2**20:.1f} MiB allocated on {torch.cuda.get_device_name(dev)}"
