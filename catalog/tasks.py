"""Task composition: which tasks exist, a task's resolved config (the recorder's and the grader's alike), and
what picks its checks (class, method, features). Torch-free: config and file names only."""
from __future__ import annotations

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from catalog.provenance import ROOT

CONFIG_DIR = ROOT / "configs"


def known_tasks() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "task").glob("*.yaml"))


def compose_task(task: str, overrides: list[str] | None = None) -> DictConfig:
    """The resolved recorder config of one task, as `python -m recorder task=...` would compose it."""
    if task not in known_tasks():
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(known_tasks())}")
    overrides = [f"task={task}", *(overrides or [])]
    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: its search path is ours already
        return compose("recorder", overrides=overrides)
    with initialize_config_dir(str(CONFIG_DIR), version_base=None):
        return compose("recorder", overrides=overrides)


def task_class(cfg: DictConfig) -> str:
    return cfg.method.task_class if "method" in cfg else cfg.mode.task_class


def task_features(cfg: DictConfig) -> frozenset[str] | None:
    """The family's features (family yaml `features`) that pick its feature checks."""
    return frozenset(cfg.family.get("features", ()))


def task_method(cfg: DictConfig) -> str | None:
    """The training method (sft, dpo, ...) that picks the task's checks; None for serving."""
    return cfg.method.name if "method" in cfg else None


def recorded_tasks() -> list[str]:
    """The tasks with a reference under references/."""
    return sorted(p.stem for p in (ROOT / "references").glob("*.h5"))

