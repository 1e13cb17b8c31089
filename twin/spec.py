"""The task as the twin sees it: the composed config (configs/task/<task>.yaml, the same composition the recorder
and the grader use) and the paths of its assets. Only the task's composition is read here (catalog.tasks,
catalog.family, catalog.provenance): never the check catalog, the workloads, references/ or reports/."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from catalog.provenance import ROOT, checkpoint_dir
from catalog.tasks import compose_task, task_class

__all__ = ["TaskSpec", "task_spec"]


@dataclass(frozen=True)
class TaskSpec:
    task: str
    task_class: str          # "training" | "serving"
    cfg: dict                # the composed config as plain data: task_name, family, method | mode, data
    assets: dict[str, Path]  # checkpoint, tokenizer, data, reward_model (those the task has), absolute

    @property
    def family(self) -> dict:
        return self.cfg["family"]

    @property
    def features(self) -> frozenset[str]:
        return frozenset(self.family.get("features") or ())

    @property
    def method(self) -> str | None:
        return self.cfg["method"]["name"] if "method" in self.cfg else None

    @property
    def mode(self) -> str | None:
        return self.cfg["mode"]["name"] if "mode" in self.cfg else None

    def child_meta(self) -> dict:
        """What the sealed child is told: the config (plain data) and the asset names (the grader's layout: each
        asset a directory beside the inputs file)."""
        return {"task": self.cfg, "assets": {k: k for k in self.assets}}


def task_spec(task: str, checkpoint: str | None = None) -> TaskSpec:
    """The task's spec; an unknown task is a ValueError that lists the valid ones."""
    cfg = compose_task(task, [f"checkpoint={checkpoint}"] if checkpoint else [])
    plain = OmegaConf.to_container(cfg, resolve=True)
    assets = {"checkpoint": Path(checkpoint_dir(cfg))}
    if "tokenizer" in cfg.family:
        assets["tokenizer"] = ROOT / cfg.family.tokenizer
    if "data" in cfg:
        assets["data"] = ROOT / cfg.data.dir
    if "method" in cfg and cfg.method.get("reward_model"):
        assets["reward_model"] = ROOT / cfg.method.reward_model
    keep = {k: plain[k] for k in ("task_name", "family", "method", "mode", "data") if k in plain}
    return TaskSpec(task, task_class(cfg), keep, {k: Path(v).resolve() for k, v in assets.items()})
