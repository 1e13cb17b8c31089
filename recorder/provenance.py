"""Provenance of a reference: what it was recorded from, and whether that has changed since.

A reference is stale when the sha256 of any of its task's source files, of its checkpoint, or of its
resolved config no longer matches the tree, or when the schema version moved.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import h5py
from omegaconf import DictConfig, OmegaConf

from grader.h5schema import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[1]
# The keys that say what a task records (not where or on which device): their change stales it.
TASK_KEYS = ("task_name", "family", "method", "mode", "data")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_dir(path: Path) -> str:
    """One hash over every file's relative name and bytes, in sorted order."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory")
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(p.relative_to(path).as_posix().encode() + b"\0" + sha256_file(p).encode())
    return h.hexdigest()


def model_files(family_file: Path) -> list[Path]:
    """The family file and every torch_sources/models module it imports, transitively (the shared layers, the
    model registry, the Llama blocks a Llama-shaped family composes), read statically."""
    import ast

    models, seen, todo = ROOT / "torch_sources/models", [], [Path(family_file)]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.append(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch_sources.models"):
                rest = node.module.split(".")[2:]
                names = rest[:1] if rest else [a.name for a in node.names]
                todo += [models / f"{name}.py" for name in names]
    return sorted(seen)


def task_source_files(cfg: DictConfig) -> list[Path]:
    """Every file whose change can change the recorded numbers."""
    task_class = cfg.method.task_class if "method" in cfg else cfg.mode.task_class
    files = [*model_files(ROOT / "torch_sources/models" / Path(cfg.family.model_module).name),
             ROOT / "torch_sources/models/auto.py",
             ROOT / "torch_sources/models/loading.py",
             ROOT / f"recorder/probes/{task_class}.py",
             *sorted((ROOT / "recorder/probes").glob(f"{task_class}_*.py")),  # per-method probes
             ROOT / "recorder/probes/__init__.py",
             ROOT / "grader/checks.py",
             ROOT / "grader/layout.py",  # the recorder imports these grader modules to build its arrays
             ROOT / "grader/heldout.py",
             ROOT / "grader/workloads.py"]  # workloads and check inputs both sides drive the same way
    if task_class == "training":
        files += sorted((ROOT / "torch_sources/training").glob("*.py"))
        files += sorted((ROOT / cfg.data.dir).glob("*"))
        files += sorted((ROOT / cfg.family.tokenizer).glob("*"))
        files += [ROOT / "grader/ppo_eval.py"]  # the recorder checks the grader's PPO L6 scoring on the source
        if "reward_model" in cfg.method:  # PPO: the reward checkpoint's bytes change every score
            files += sorted(p for p in (ROOT / cfg.method.reward_model).glob("*") if p.is_file())
    else:
        files += sorted((ROOT / "torch_sources/serving").glob("*.py"))
        files += sorted((ROOT / "torch_sources/serving/models").glob("*.py"))
        files += [ROOT / "grader/trace.py"]
    return list(dict.fromkeys(f for f in files if (f.name != "__init__.py" or f.parent.name == "probes") and f.is_file()))


def hashed_config(cfg: DictConfig) -> dict:
    d = OmegaConf.to_container(cfg, resolve=True)
    return {k: d[k] for k in TASK_KEYS if k in d}


def provenance(cfg: DictConfig) -> dict:
    return {
        "source_sha256": {p.relative_to(ROOT).as_posix(): sha256_file(p) for p in task_source_files(cfg)},
        "checkpoint_sha256": sha256_dir(ROOT / cfg.family.checkpoint),
        "config_sha256": hashlib.sha256(json.dumps(hashed_config(cfg), sort_keys=True).encode()).hexdigest(),
    }


def stale_reasons(h5_path: Path, cfg: DictConfig) -> list[str]:
    """Why the reference at h5_path no longer matches the tree (empty when fresh)."""
    try:
        with h5py.File(h5_path, "r") as f:
            attrs = {k: f.attrs[k] for k in ("schema_version", "source_sha256", "checkpoint_sha256", "config_sha256")
                     if k in f.attrs}
    except OSError as e:
        return [f"unreadable ({e})"]
    if len(attrs) < 4:
        return ["provenance attributes missing"]
    reasons = []
    if int(attrs["schema_version"]) != SCHEMA_VERSION:
        reasons.append(f"schema_version {attrs['schema_version']} != {SCHEMA_VERSION}")
    now = provenance(cfg)
    old_src = json.loads(attrs["source_sha256"])
    for path in sorted(set(old_src) | set(now["source_sha256"])):
        if path not in now["source_sha256"]:
            reasons.append(f"source removed: {path}")
        elif path not in old_src:
            reasons.append(f"source added: {path}")
        elif old_src[path] != now["source_sha256"][path]:
            reasons.append(f"source changed: {path}")
    if attrs["checkpoint_sha256"] != now["checkpoint_sha256"]:
        reasons.append(f"checkpoint changed: {cfg.family.checkpoint}")
    if attrs["config_sha256"] != now["config_sha256"]:
        reasons.append("resolved config changed")
    return reasons
