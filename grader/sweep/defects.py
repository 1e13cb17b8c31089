"""The defect catalog (grader/sweep/defects/*.yaml): each defect one exact text edit to a copy of the oracle trees."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import yaml

from catalog.tasks import task_class, task_features, task_method

ROOT = Path(__file__).resolve().parents[2]
FAMILY_CATALOGS = Path(__file__).with_name("defects")  # defects/<family>.yaml: each family's signature bugs
CATALOG = FAMILY_CATALOGS / "common.yaml"  # the defects every family of a class shares
SOLUTION_TREES = ("jax_oracles", "serving_engine", "conversion")
DEFAULT_NOISE = 1e-6
CLASSES = ("training", "serving")
LEVELS = ("L0", "L1", "L2", "L3", "L4", "L5", "L6")
GATE_CHECK = "L0/torch_free"


# ---- the catalog ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Defect:
    id: str
    task_class: str            # "training" | "serving" (`class` in the yaml)
    families: tuple[str, ...]  # () = all
    modes: tuple[str, ...]     # () = all (serving only)
    levels: tuple[str, ...]    # levels whose checks it is expected to trip
    file: str                  # relative to the candidate root
    old: str
    new: str
    description: str
    methods: tuple[str, ...] = ()  # training only: () = every method (the edited code serves them all)
    features: tuple[str, ...] = ()  # training only: family features the edited shared code serves (all needed)

    def applies_to(self, task_class: str, family: str, mode: str | None, method: str | None = None,
                   features=None) -> bool:
        return (self.task_class == task_class and (not self.families or family in self.families)
                and (not self.modes or mode is None or mode in self.modes)
                and (not self.methods or method is None or method in self.methods)
                and (features is None or set(self.features) <= set(features)))


@dataclass(frozen=True)
class Catalog:
    defects: tuple[Defect, ...]
    untripped_rationale: dict[str, str]


def _names(value, field: str, did: str) -> tuple[str, ...]:
    if value in (None, "all"):
        return ()
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"defect {did}: {field} must be `all` or a list of names, got {value!r}")
    return tuple(value)


def load_catalog(path: Path = CATALOG) -> Catalog:
    """The common catalog, plus (for the default path) every grader/sweep/defects/<family>.yaml beside it."""
    raw = yaml.safe_load(Path(path).read_text())
    entries, rationale = list(raw["defects"]), dict(raw.get("untripped_rationale") or {})
    if Path(path) == CATALOG:
        for extra in sorted(p for p in FAMILY_CATALOGS.glob("*.yaml") if p != CATALOG):
            more = yaml.safe_load(extra.read_text()) or {}
            entries += more.get("defects") or []
            rationale.update(more.get("untripped_rationale") or {})
    defects = []
    for d in entries:
        did = d["id"]
        if d["class"] not in CLASSES:
            raise ValueError(f"defect {did}: class {d['class']!r} not in {CLASSES}")
        if not str(d["file"]).startswith(tuple(f"{t}/" for t in SOLUTION_TREES)):
            raise ValueError(f"defect {did}: file {d['file']} is not under {SOLUTION_TREES}")
        levels = tuple(d.get("levels") or ())
        if not levels or set(levels) - set(LEVELS):
            raise ValueError(f"defect {did}: levels must be a non-empty list of {LEVELS}, got {levels}")
        defects.append(Defect(did, d["class"], _names(d.get("families"), "families", did),
                              _names(d.get("modes"), "modes", did), levels, d["file"], d["edit"]["old"],
                              d["edit"]["new"], " ".join(str(d["description"]).split()),
                              _names(d.get("methods"), "methods", did), _names(d.get("features"), "features", did)))
    ids = [d.id for d in defects]
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate defect ids: {sorted({i for i in ids if ids.count(i) > 1})}")
    return Catalog(tuple(defects), rationale)


def _task_key(cfg) -> tuple:
    return (task_class(cfg), cfg.family.name, cfg.mode.name if "mode" in cfg else None, task_method(cfg),
            task_features(cfg))


def applicable(defects, cfg) -> list[Defect]:
    """The defects that apply to the composed task config's class, family, mode and method."""
    key = _task_key(cfg)
    return [d for d in defects if d.applies_to(*key)]


def apply_defect(root: Path, defect: Defect) -> None:
    """Edit root/defect.file in place; the edit target must occur exactly once."""
    path = Path(root) / defect.file
    text = path.read_text()
    count = text.count(defect.old)
    if count != 1:
        raise ValueError(f"defect {defect.id}: edit target occurs {count} times in {defect.file}, not once")
    path.write_text(text.replace(defect.old, defect.new))


def make_mutant(defect: Defect, dst: Path, source: Path = ROOT) -> Path:
    """A copy of the solution trees of `source` under dst, with the defect applied."""
    dst = Path(dst)
    for tree in SOLUTION_TREES:
        shutil.copytree(source / tree, dst / tree, ignore=shutil.ignore_patterns("__pycache__"))
    apply_defect(dst, defect)
    return dst
