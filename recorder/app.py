"""The recorder's real entry point (Hydra's `main` is a shim around `run`)."""
from __future__ import annotations

import importlib
import json
import os
import platform
import resource
import time
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import numpy as np
from omegaconf import DictConfig
from rich.console import Console
from rich.markup import escape

from catalog.h5schema import SCHEMA_VERSION, write_reference
from catalog.provenance import ROOT, checkpoint_dir, checkpoint_label, provenance, recorded_checkpoint, stale_reasons
from catalog.scale import ensure_scale_checkpoints, scale_name
from catalog.tasks import compose_task, known_tasks, task_class
from recorder.device import check_device, device_description, record_on, setup_device
from recorder.probes.training import set_fresh_seed
from torch_sources.models.loading import tensor_index

console = Console(stderr=True)


def _package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for pkg in ("torch", "numpy", "safetensors", "tokenizers", "h5py", "hydra-core"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def record(cfg: DictConfig) -> Path:
    """Run the task's torch source in fp32 on cfg.device and write references/<task>.h5; return its path."""

    check_device(cfg.device.name)  # an unknown device, or cuda without a GPU, before anything else
    name = cfg.task_name
    out_dir = (ROOT / cfg.out_dir) if not os.path.isabs(cfg.out_dir) else Path(cfg.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeError(f"cannot create output directory {out_dir}: {e}") from e
    if not os.access(out_dir, os.W_OK):
        raise RuntimeError(f"output directory {out_dir} is not writable")
    fresh = cfg.get("fresh")
    if fresh is not None and out_dir.resolve() == (ROOT / "references").resolve():
        raise ValueError("fresh=SEED records inputs no frozen reference holds: give another out_dir (the grader's "
                         "fresh pass writes to a temporary one); references/ keeps the frozen draws")
    ensure_scale_checkpoints(cfg, log=console.print)  # scale=small: its checkpoints, written on first use
    ckpt = checkpoint_dir(cfg)
    if not (ckpt / "config.json").is_file():
        raise FileNotFoundError(f"checkpoint {ckpt} has no config.json (run `make assets` to build the tiny ones)")

    dev = setup_device(cfg.device.name, seed=0)
    import torch
    stored = tensor_index(ckpt)  # a missing shard or a corrupt header fails here, before any probe runs
    rss_at_start = _reset_peak_rss()
    probes = importlib.import_module(f"recorder.probes.{task_class(cfg)}")
    set_fresh_seed(fresh)  # every recording sets it: a multirun worker records several tasks in one process
    started = time.perf_counter()
    cov = _start_coverage() if cfg.get("coverage") else None
    # off the CPU: an audited pass (every aten op on dev), then the recorded one, which must reproduce it
    try:
        checks, band, wall = record_on(dev, lambda: probes.record_task(cfg, dev, console), console.print)
    finally:
        if cov is not None:
            _save_coverage(cov, name)
    attrs = {
        "schema_version": SCHEMA_VERSION,
        "task": name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": device_description(dev),
        "dtype": "float32",
        "seed": 0,
        "torch_version": torch.__version__,
        "package_versions": _package_versions(),
        "wall_clock_s": float(wall or 0.0),
        **provenance(cfg),
        **checkpoint_attrs(ckpt, stored),
        "peak_rss_bytes": _peak_rss_bytes(),
        "rss_at_start_bytes": rss_at_start,
    }
    if cfg.get("levels"):
        attrs["recorded_levels"] = list(cfg.levels)
    if fresh is not None:
        attrs["fresh_seed"] = int(fresh)
    if scale_name(cfg) != "tiny":  # configs/scale/; absent: tiny (references from before scales say nothing)
        attrs["scale"] = scale_name(cfg)
    path = out_dir / f"{name}.h5"
    write_reference(path, attrs, checks, band)
    console.print(f"[green]wrote[/] {path} ({len(checks)} checks, recorded in "
                  f"{time.perf_counter() - started:.1f} s; end-to-end torch run {wall or 0.0:.2f} s; peak RSS "
                  f"{attrs['peak_rss_bytes'] / 2**20:.0f} MiB for {attrs['fp32_param_bytes'] / 2**20:.0f} MiB of "
                  f"fp32 parameters)")
    return path


DTYPE_POLICY = "upcast to float32"  # what load_pretrained does to every stored tensor as it is read


def checkpoint_attrs(ckpt: Path, stored: dict) -> dict:
    """What the reference says about its checkpoint: where it is, what dtypes it stores (name -> tensor count),
    what the recorder did with them, and the fp32 bytes of its tensors (the memory bound's unit)."""
    dtypes: dict[str, int] = {}
    numel = 0
    for _, entry in stored.values():
        dtype = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(entry["dtype"], entry["dtype"])
        dtypes[dtype] = dtypes.get(dtype, 0) + 1
        numel += int(np.prod(entry["shape"], dtype=np.int64))
    return {"checkpoint_path": checkpoint_label(ckpt), "checkpoint_dtypes": dict(sorted(dtypes.items())),
            "dtype_policy": DTYPE_POLICY, "fp32_param_bytes": 4 * numel}


def _reset_peak_rss() -> int:
    """Restart the kernel's peak-RSS counter (VmHWM) so the peak is this recording's, not the process's
    (a multirun worker records several tasks); -> the RSS now, in bytes."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # then the peak is the process's
    return _proc_status_bytes("VmRSS") or 0


def _peak_rss_bytes() -> int:
    return _proc_status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _proc_status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _start_coverage():
    import coverage
    cov = coverage.Coverage(branch=True, data_file=None, config_file=False, source_pkgs=["torch_sources"])
    cov.set_option("run:disable_warnings", ["module-not-imported", "no-data-collected"])
    cov.start()
    return cov


def _save_coverage(cov, task: str) -> None:
    """reports/coverage/torch/<task>.json: the torch source's executed lines and arcs (grader/coverage.py)."""
    import json
    cov.stop()
    data, out = cov.get_data(), {}
    for path in data.measured_files():
        rel = Path(path).resolve().relative_to(ROOT).as_posix()
        out[rel] = {"lines": sorted(data.lines(path) or []), "arcs": sorted([a, b] for a, b in data.arcs(path) or [])}
    dest = ROOT / "reports" / "coverage" / "torch" / f"{task}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out))
    console.print(f"coverage of torch_sources: {dest}")


def recorded_scale(h5_path: Path) -> str:
    """The scale a reference was recorded at (its `scale` attr; absent: tiny)."""
    import h5py
    try:
        with h5py.File(h5_path, "r") as f:
            v = f.attrs.get("scale")
    except OSError:
        return "tiny"
    return "tiny" if v is None else (v.decode() if isinstance(v, bytes) else str(v))


def list_stale(out_dir: Path) -> int:
    n = 0
    for h5 in sorted(out_dir.glob("*.h5")):
        task = h5.stem
        if task not in known_tasks():
            print(f"{task}: stale (no task config named {task!r})")
            n += 1
            continue
        scale = recorded_scale(h5)
        cfg = compose_task(task, [f"scale={scale}"] if scale != "tiny" else [])
        recorded = recorded_checkpoint(h5)
        if recorded is not None:  # a release given as checkpoint=PATH: check it against that directory
            cfg.checkpoint = recorded
        reasons = stale_reasons(h5, cfg)
        if reasons:
            n += 1
            print(f"{task}: stale ({'; '.join(reasons)})")
    print(f"stale={n}")
    return n


def run(cfg: DictConfig) -> int:
    if cfg.stale:
        list_stale(ROOT / cfg.out_dir)
        return 0
    if "task_name" not in cfg:
        console.print(f"[red]no task given[/]: pass task=NAME; valid tasks: {', '.join(known_tasks())}")
        return 2
    try:
        record(cfg)
    except (OSError, RuntimeError, ValueError) as e:  # OSError: CheckpointError, a missing file
        console.print(f"[red]recording {cfg.task_name} failed:[/] {escape(str(e))}")
        return 1
    return 0
