"""Scales (configs/scale/): `tiny`, the default (the committed checkpoints), and `small` (~100M parameters, a 32k
vocabulary, 512-token sequences), whose checkpoints are written on first use (tools/checkpoints_small.py).

configs/scale/small.yaml points `checkpoint` (and PPO's reward model) at the small directories; this module only
writes a missing one before the recorder or the grader reads it. Torch-free (numpy and safetensors).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from omegaconf import DictConfig

from catalog.provenance import ROOT, checkpoint_dir

__all__ = ["scale_name", "small_tools", "ensure_scale_checkpoints"]


def scale_name(cfg: DictConfig) -> str:
    """The composed config's scale: "tiny" unless configs/scale/<name>.yaml set `scale.name`."""
    scale = cfg.get("scale")
    return str(scale.get("name", "tiny")) if scale else "tiny"


def small_tools():
    """tools/checkpoints_small.py (tools/ is not a package: loaded by path, on use)."""
    spec = importlib.util.spec_from_file_location("checkpoints_small", ROOT / "tools" / "checkpoints_small.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def ensure_scale_checkpoints(cfg: DictConfig, log=print) -> list[Path]:
    """At scale=small, write the task's small checkpoint (and PPO's small reward model) where cfg points if it is
    absent and is a small checkpoint's default directory; -> the directories written. A path given as
    `checkpoint=PATH` is never written to."""
    if scale_name(cfg) != "small":
        return []
    tools = small_tools()
    wanted = [checkpoint_dir(cfg)]
    if "reward_model" in cfg.get("method", {}):
        wanted.append((ROOT / Path(cfg.method.reward_model).expanduser()).resolve())
    small_dir = (ROOT / Path(str(cfg.scale.dir)).expanduser() / "checkpoints" / "small").resolve()
    written = []
    for path in wanted:
        if path.parent == small_dir and path.name in tools.SMALL_FAMILIES and not (path / "config.json").exists():
            written.append(tools.ensure_small(path.name, path, log=log))
    return written
