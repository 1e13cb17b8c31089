"""Which files a task is: the torch sources it imports (its `torch_orig/`), and the oracle modules that mirror them
(its `solution/`), both found from the import graph, read statically (no module is imported to find it).

A training task starts from its family's mirrored modules (the family file, a vision-language family's decoder, tower,
processor and plugin), the graded training modules and its method's workflow; a serving task from its family file,
its paged model and the graded engine modules (recorder/probes: the modules L0/layout names). Each start's
`torch_sources` imports are followed transitively; `models/auto.py` loads a family by name (importlib), so the
family file is a start of its own, and so is PPO's reward model's family file (one reward model, Llama-shaped, scores
every family). The oracle side mirrors every torch module (CONTRACTS.md's mirror rule) and adds
the family's converter (`conversion/<family>.py`) and the JAX-only modules those import (MIRROR_EXTRAS says which
may exist and why).
"""
from __future__ import annotations

import ast
from pathlib import Path

from catalog.family import language_model, mirrored_modules
from catalog.provenance import ROOT
from catalog.pysource import parse
from recorder.probes.serving import SERVING_MODULES
from recorder.probes.training import TRAINING_MODULES
from torch_sources.models.auto import family_of

__all__ = ["MIRROR_EXTRAS", "TORCH_ONLY", "mirror_path", "oracle_files", "reward_family_modules", "start_modules",
           "torch_files", "unmirror_path"]

TORCH_ROOT = "torch_sources"
# torch_sources/<sub>/... <-> its twin's package (CONTRACTS.md, mirror rule)
MIRROR = {"models": "jax_oracles/models", "training": "jax_oracles/training", "serving": "serving_engine"}
ORACLE_PACKAGES = ("jax_oracles", "serving_engine", "conversion")
# Oracle modules with no torch twin (path prefixes), and why a solution may carry them; nothing else may appear
MIRROR_EXTRAS = {
    "conversion/": "checkpoint readers and converters to JAX trees (numpy + safetensors only): the torch side's "
                   "loading.py and mxfp4.py have their counterparts here (TORCH_ONLY)",
    "serving_engine/kernels/": "the Pallas paged-attention kernels and their dispatch: the torch engine's "
                               "paged_attention.py is eager gathers, the JAX engine's a kernel (DESIGN, serving)",
    "serving_engine/models/common.py": "the model value the JAX family files hand forward_paged (a pytree: params "
                                       "beside static config); the torch models are nn.Modules",
}
# torch modules with no twin at the mirrored path, and where their work lives on the JAX side
TORCH_ONLY = {"torch_sources/models/loading.py": "conversion/safetensors_io.py",
              "torch_sources/models/mxfp4.py": "conversion/mxfp4.py"}


def start_modules(cfg) -> list[str]:
    """The task's graded modules, as paths under torch_sources/ (recorder/probes: probe_layout's modules)."""
    family = cfg.family
    if "method" in cfg:
        mods = [*mirrored_modules(family), language_model(family)[0], *TRAINING_MODULES,
                f"{cfg.method.workflow.replace('.', '/')}.py", *reward_family_modules(cfg)]
    else:
        mods = [family.model_module, language_model(family)[0], f"serving/models/{family.name}.py", *SERVING_MODULES]
    return list(dict.fromkeys(mods))


def reward_family_modules(cfg) -> list[str]:
    """PPO's reward checkpoint's family file (models/auto.py loads it by its model_type): one reward model scores
    every family, so a PPO task runs a second family's model."""
    if "reward_model" not in cfg.get("method", {}):
        return []
    return [f"models/{family_of(ROOT / cfg.method.reward_model)}.py"]


def _imports(path: Path, root: Path, packages: tuple[str, ...]) -> list[Path]:
    """The files under root that path imports from `packages` (modules or `from pkg.sub import module`)."""
    out = []
    for node in ast.walk(parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: against the importing file's package, one level up per extra dot
                package = path.relative_to(root).parents[node.level - 1].parts
                module = ".".join([*package, *([module] if module else [])])
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            if name.split(".")[0] not in packages:
                continue
            base = root / name.replace(".", "/")
            if base.with_suffix(".py").is_file():
                out.append(base.with_suffix(".py"))
            elif (base / "__init__.py").is_file():  # a package: its __init__ and what that imports
                out.append(base / "__init__.py")
    return out


def _closure(starts: list[Path], root: Path, packages: tuple[str, ...]) -> list[Path]:
    seen, todo = [], list(starts)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        if not path.is_file():
            raise FileNotFoundError(f"{path.relative_to(root)}: a graded module that does not exist")
        seen.append(path)
        todo += _imports(path, root, packages)
    return sorted(seen)


def _with_packages(files: list[Path], root: Path, top: str) -> list[Path]:
    """files and every __init__.py of the packages they sit in (below root, from `top` down)."""
    out = set(files)
    for f in files:
        for parent in f.relative_to(root).parents:
            if parent.parts and parent.parts[0] == top and (root / parent / "__init__.py").is_file():
                out.add(root / parent / "__init__.py")
    return sorted(out)


def torch_files(cfg, root: Path = ROOT) -> list[Path]:
    """The torch_sources files the task runs (its torch_orig/), package __init__ files included."""
    starts = [root / TORCH_ROOT / m for m in start_modules(cfg)]
    return _with_packages(_closure(starts, root, (TORCH_ROOT,)), root, TORCH_ROOT)


def mirror_path(rel: str) -> str:
    """torch_sources/models/x.py -> jax_oracles/models/x.py (serving -> serving_engine)."""
    parts = Path(rel).parts
    if parts[0] != TORCH_ROOT or len(parts) < 3 or parts[1] not in MIRROR:
        raise ValueError(f"{rel}: not a mirrored torch source (torch_sources/{{{','.join(MIRROR)}}}/...)")
    return f"{MIRROR[parts[1]]}/{Path(*parts[2:]).as_posix()}"


def unmirror_path(rel: str) -> str | None:
    """The inverse of mirror_path; None for a module with no torch twin (conversion/)."""
    for sub, twin in MIRROR.items():
        if rel.startswith(twin + "/"):
            return f"{TORCH_ROOT}/{sub}/{rel[len(twin) + 1:]}"
    return None


def oracle_files(cfg, root: Path = ROOT) -> list[Path]:
    """The oracle modules the task's solution carries: each torch file's twin, the family's converter, and what
    they import of the oracle packages, package __init__ files included."""
    rels = [p.relative_to(root).as_posix() for p in torch_files(cfg, root)]
    twins = [root / (TORCH_ONLY[rel] if rel in TORCH_ONLY else mirror_path(rel)) for rel in rels
             if rel != f"{TORCH_ROOT}/__init__.py"]
    families = [Path(cfg.family.model_module).name, *(Path(m).name for m in reward_family_modules(cfg))]
    converters = [root / "conversion" / name for name in dict.fromkeys(families)]
    files = _closure([*twins, *converters], root, ORACLE_PACKAGES)
    out = []
    for top in ORACLE_PACKAGES:
        out += _with_packages([f for f in files if f.relative_to(root).parts[0] == top], root, top)
    return sorted(set(out))
