"""Provenance of a reference: what it was recorded from, and whether that has changed since.

A reference is stale when the sha256 of any of its task's source files, of its checkpoint, or of its
resolved config no longer matches the tree, or when the schema version moved.

The checkpoint is the family's tiny one, or any release directory given as `checkpoint=PATH`; the
reference names it (`checkpoint_path`), so the staleness check and the grader hash the same directory.
Hashing a multi-gigabyte release on every check would cost minutes: a file of HASH_CACHE_MIN_BYTES or more
is hashed once and its sha256 cached, keyed by its resolved path and stat stamp (size, mtime, ctime,
inode, device), in HASH_CACHE (env T2J_HASH_CACHE overrides). The hash itself is unchanged.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import h5py
from omegaconf import DictConfig, OmegaConf

from catalog import pysource
from catalog.h5schema import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[1]
# The keys that say what a task records (not where or on which device): their change stales it.
TASK_KEYS = ("task_name", "family", "method", "mode", "data", "scale", "vision")  # scale: only where not tiny (configs/scale/)
HASH_CACHE_MIN_BYTES = 16 << 20  # smaller files hash faster than a cache lookup is worth trusting
HASH_CACHE = Path(os.environ.get("T2J_HASH_CACHE", Path.home() / ".cache" / "t2j-refs" / "sha256.json"))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def sha256_file_cached(path: Path, cache: Path | None = None) -> str:
    """sha256_file, remembered for a large file until its stat stamp changes (the module docstring)."""
    cache = cache or HASH_CACHE
    st = path.stat()
    if st.st_size < HASH_CACHE_MIN_BYTES:
        return sha256_file(path)
    key = str(path.resolve())
    stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]
    hit = _read_cache(cache).get(key)
    if hit and hit.get("stamp") == stamp:
        return hit["sha256"]
    digest = sha256_file(path)
    try:  # merge into what is there now (parallel recordings share the file), then replace atomically
        cache.parent.mkdir(parents=True, exist_ok=True)
        entries = {k: v for k, v in _read_cache(cache).items() if os.path.exists(k)}  # gone files drop out
        entries[key] = {"stamp": stamp, "sha256": digest}
        with tempfile.NamedTemporaryFile("w", dir=cache.parent, delete=False, suffix=".tmp") as f:
            json.dump(entries, f)
        os.replace(f.name, cache)
    except OSError:
        pass  # an unwritable cache costs time, never correctness
    return digest


def sha256_dir(path: Path) -> str:
    """One hash over every file's relative name and bytes, in sorted order (large files via the cache)."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory")
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(p.relative_to(path).as_posix().encode() + b"\0" + sha256_file_cached(p).encode())
    return h.hexdigest()


def checkpoint_dir(cfg: DictConfig) -> Path:
    """The checkpoint a task records from and is graded with: `checkpoint=PATH` (absolute, or relative to the
    repo), else the family's tiny one."""
    given = cfg.get("checkpoint") or cfg.family.checkpoint
    return (ROOT / Path(given).expanduser()).resolve()


def checkpoint_label(path: Path) -> str:
    """How a reference names its checkpoint: relative to the repo when inside it, else absolute."""
    path = Path(path).resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def recorded_checkpoint(h5_path: Path) -> str | None:
    """The `checkpoint_path` a reference was recorded from (None: recorded before it was written down)."""
    try:
        with h5py.File(h5_path, "r") as f:
            v = f.attrs.get("checkpoint_path")
    except OSError:
        return None
    return None if v is None else (v.decode() if isinstance(v, bytes) else str(v))


def checkpoint_mismatch(h5_path: Path, cfg: DictConfig) -> str | None:
    """Why grading the reference at h5_path with cfg's checkpoint would compare different models (None: same
    bytes). Outputs recorded from checkpoint A say nothing about a candidate run on checkpoint B."""
    try:
        with h5py.File(h5_path, "r") as f:
            old = f.attrs.get("checkpoint_sha256")
    except OSError:
        return None  # read_reference reports the unreadable file
    ckpt = checkpoint_dir(cfg)
    new = sha256_dir(ckpt) if ckpt.is_dir() else "(no such directory)"
    if old is None or (old.decode() if isinstance(old, bytes) else str(old)) == new:
        return None
    was = recorded_checkpoint(h5_path) or cfg.family.checkpoint
    return (f"{h5_path} was recorded from checkpoint {was} (sha256 {str(old)[:12]}...), not from "
            f"{checkpoint_label(ckpt)} (sha256 {new[:12]}...): grade with checkpoint={was}, or re-record "
            f"with checkpoint={checkpoint_label(ckpt)}")


def model_files(family_file: Path, *importers: Path) -> list[Path]:
    """The family file and every torch_sources/models module it (or one of `importers`: the training workflow's
    files, whose data path reads the image and audio processors) imports, transitively (the shared layers, the
    model registry, the Llama blocks a Llama-shaped family composes), read statically; importers themselves are
    not listed."""
    import ast

    models, seen, todo = ROOT / "torch_sources/models", [], [Path(family_file), *map(Path, importers)]
    while todo:
        path = todo.pop()
        if path in seen or not path.is_file():
            continue
        seen.append(path)
        for node in ast.walk(pysource.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("torch_sources.models"):
                rest = node.module.split(".")[2:]
                names = rest[:1] if rest else [a.name for a in node.names]
                todo += [models / f"{name}.py" for name in names]
    return sorted(p for p in seen if p not in importers)


def task_source_files(cfg: DictConfig) -> list[Path]:
    """Every file whose change can change the recorded numbers."""
    task_class = cfg.method.task_class if "method" in cfg else cfg.mode.task_class
    workflow = sorted((ROOT / "torch_sources/training").glob("*.py")) if task_class == "training" else []
    files = [*model_files(ROOT / "torch_sources/models" / Path(cfg.family.model_module).name, *workflow),
             ROOT / "torch_sources/models/auto.py",
             ROOT / "torch_sources/models/loading.py",
             ROOT / f"recorder/probes/{task_class}.py",
             *sorted((ROOT / "recorder/probes").glob(f"{task_class}_*.py")),  # per-method probes
             ROOT / "recorder/probes/__init__.py",
             ROOT / "catalog/checks.py",
             ROOT / "catalog/layout.py",  # the recorder imports these grader modules to build its arrays
             ROOT / "catalog/heldout.py",
             ROOT / "catalog/workloads.py"]  # workloads and check inputs both sides drive the same way
    if task_class == "training":
        files += workflow
        files += sorted((ROOT / cfg.data.dir).glob("*"))
        files += sorted((ROOT / cfg.family.tokenizer).glob("*"))
        files += [ROOT / "catalog/ppo_eval.py"]  # the recorder checks the grader's PPO L6 scoring on the source
        if "reward_model" in cfg.method:  # PPO: the reward checkpoint's bytes change every score
            files += sorted(p for p in (ROOT / cfg.method.reward_model).glob("*") if p.is_file())
    else:
        files += sorted((ROOT / "torch_sources/serving").glob("*.py"))
        files += sorted((ROOT / "torch_sources/serving/models").glob("*.py"))
        files += [ROOT / "catalog/trace.py"]
    return list(dict.fromkeys(f for f in files if (f.name != "__init__.py" or f.parent.name == "probes") and f.is_file()))


def hashed_config(cfg: DictConfig) -> dict:
    d = OmegaConf.to_container(cfg, resolve=True)
    return {k: d[k] for k in TASK_KEYS if k in d}


def provenance(cfg: DictConfig) -> dict:
    ckpt = checkpoint_dir(cfg)
    return {
        "source_sha256": {p.relative_to(ROOT).as_posix(): sha256_file(p) for p in task_source_files(cfg)},
        "checkpoint_sha256": sha256_dir(ckpt) if ckpt.is_dir() else None,
        "config_sha256": hashlib.sha256(json.dumps(hashed_config(cfg), sort_keys=True).encode()).hexdigest(),
    }


# An exported verifier's runtime (recorder/export.py) carries no torch sources to hash: its sealed.json holds the
# sha256 of the reference and of the assets as exported, and those are what a reference is checked against there
SEALED = ROOT / "sealed.json"


def sealed() -> dict | None:
    """The export's seal when this tree is an exported verifier runtime, else None."""
    return json.loads(SEALED.read_text()) if SEALED.exists() else None


def sealed_reasons(h5_path: Path, cfg: DictConfig, seal: dict) -> list[str]:
    """Why the reference or the assets of an exported runtime differ from what was exported (empty: intact)."""
    reasons = []
    if seal.get("task") != cfg.task_name:
        reasons.append(f"sealed for task {seal.get('task')!r}, graded as {cfg.task_name!r}")
    if not h5_path.exists():
        return reasons + [f"reference missing: {h5_path.name}"]
    if sha256_file(h5_path) != seal.get("reference_sha256"):
        reasons.append(f"reference changed since the export: {h5_path.name}")
    for rel, digest in sorted(seal.get("assets_sha256", {}).items()):
        path = ROOT / rel
        if not path.is_dir():
            reasons.append(f"asset missing: {rel}")
        elif sha256_dir(path) != digest:
            reasons.append(f"asset changed since the export: {rel}")
    return reasons


def stale_reasons(h5_path: Path, cfg: DictConfig) -> list[str]:
    """Why the reference at h5_path no longer matches the tree (empty when fresh); in an exported runtime, why it
    or its assets no longer match the seal."""
    seal = sealed()
    if seal is not None:
        return sealed_reasons(h5_path, cfg, seal)
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
    if now["checkpoint_sha256"] is None:
        reasons.append(f"checkpoint missing: {checkpoint_label(checkpoint_dir(cfg))}")
    elif attrs["checkpoint_sha256"] != now["checkpoint_sha256"]:
        reasons.append(f"checkpoint changed: {checkpoint_label(checkpoint_dir(cfg))}")
    if attrs["config_sha256"] != now["config_sha256"]:
        reasons.append("resolved config changed")
    return reasons
