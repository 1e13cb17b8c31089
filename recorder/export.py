"""`python -m recorder.export task=T|a,b|all out=DIR [lock_dir=locks]`: Harbor task bundles (DESIGN section 13).

One directory per task, in the Harbor task format (tools/harbor/FACTS.md: harbor 0.26.0, schema 1.4), in two halves:

    DIR/<task>/task.toml            Harbor's config; [metadata] says the task, its lock dates and the reference's hash
    DIR/<task>/instruction.md       the agent's instruction, from recorder/export_templates/<class>.md
    DIR/<task>/environment/         the agent's half: Dockerfile, agent.lock, and workspace/ (-> /workspace):
        torch_orig/torch_sources/   exactly the torch sources the task imports (recorder/export_graph.py)
        assets/...                  the checkpoint, tokenizer, data (and PPO's reward model), at the repo's paths
        jax_repo/                   where the agent writes its JAX tree (the graded artifact)
    DIR/<task>/tests/               the verifier's half, never shown to the agent, torch-free: Dockerfile,
        test.sh, verifier.lock, runtime/ (grader, catalog, configs, the task's reference and assets, sealed.json)
    DIR/<task>/solution/            the oracle's jax_repo (the mirrored modules the task needs) and solve.sh

The verifier runs in a container of its own (environment_mode "separate"); the agent's work reaches it as the
artifact /workspace/jax_repo. test.sh grades it with the sealed grader and writes /logs/verifier/reward.json and the
per-level report beside it. A reference that is missing or stale is refused: an export is of what was recorded.
"""
from __future__ import annotations

import ast
import json
import re
import shutil
import sys
from pathlib import Path
from string import Template

from catalog.provenance import ROOT, checkpoint_dir, sha256_dir, sha256_file, stale_reasons
from catalog.pysource import parse
from catalog.tasks import compose_task, known_tasks, task_class, task_method
from recorder.export_graph import mirror_path, oracle_files, reward_family_modules, start_modules, torch_files
from recorder.probes.serving import ENGINE_API
from recorder.probes.training import public_names
from tools.make_locks import lock_date, locked_versions

__all__ = ["ExportError", "export_task", "instruction_fields", "render_instruction", "instruction_matches",
           "TEMPLATES", "main"]

TEMPLATES = Path(__file__).with_name("export_templates")
FILES = Path(__file__).with_name("export_files")
WORKSPACE = "/workspace"  # the agent's working directory (task.toml [environment].workdir)
CANDIDATE = f"{WORKSPACE}/jax_repo"
# the verifier's runtime: what the grader process and its sandboxed children import, and what they read
RUNTIME_PACKAGES = ("grader", "catalog")
BYTECODE = shutil.ignore_patterns("__pycache__", "*.pyc")
# the runtime's packages leave out the seeded-defect sweep too: the maintainers' tool, not a verdict's
RUNTIME_SKIP = shutil.ignore_patterns("__pycache__", "*.pyc", "sweep")
# task.toml's numbers: the agent gets a GPU machine for a working day; the verifier grades on CPUs
AGENT_TIMEOUT_S = 8 * 3600.0
VERIFIER_TIMEOUT_S = 3600.0


class ExportError(ValueError):
    """A task that cannot be exported as it is (no reference, a stale one, a checkpoint outside the repo)."""


def _asset_dirs(cfg) -> dict[str, Path]:
    """The task's inputs, by role: what both halves carry at the repo's relative paths."""
    dirs = {"checkpoint": checkpoint_dir(cfg)}
    if "tokenizer" in cfg.family:
        dirs["tokenizer"] = ROOT / cfg.family.tokenizer
    if "data" in cfg:
        dirs["data"] = ROOT / cfg.data.dir
    if "reward_model" in cfg.get("method", {}):
        dirs["reward_model"] = ROOT / cfg.method.reward_model
    for role, path in dirs.items():
        if not path.resolve().is_relative_to(ROOT):
            raise ExportError(f"{cfg.task_name}: its {role} {path} lies outside the repo; an export ships the "
                              f"repo's tiny assets (record with the default checkpoint)")
        if not path.is_dir():
            raise ExportError(f"{cfg.task_name}: its {role} {path} is missing (make assets)")
    return dirs


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.copytree(src, dst, ignore=BYTECODE, dirs_exist_ok=True)
    else:
        shutil.copy2(src, dst)


def _copy_rel(paths, dst_root: Path, src_root: Path = ROOT) -> None:
    for path in paths:
        _copy(path, dst_root / path.relative_to(src_root))


def _module_list(cfg) -> str:
    """The graded modules (L0/layout) with their public names, as the instruction lists them."""
    lines = []
    for module in start_modules(cfg):
        src = ROOT / "torch_sources" / module
        lines.append(f"- `{mirror_path('torch_sources/' + module)}` (twin of `torch_orig/torch_sources/{module}`): "
                     + ", ".join(f"`{n}`" for n in public_names(src)))
    return "\n".join(lines)


def _parameters(path: Path, function: str) -> list[str]:
    """The parameter names of a module-level function, read statically (the entry point's signature)."""
    for node in parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef) and node.name == function:
            return [a.arg for a in node.args.args]
    raise ExportError(f"{path.relative_to(ROOT)} defines no {function}()")


def instruction_fields(cfg) -> dict[str, str]:
    """The values the task class's template is filled with: all of them from the task's config and sources."""
    assets = _asset_dirs(cfg)
    fields = {
        "task": cfg.task_name, "family": cfg.family.name, "candidate": CANDIDATE, "workspace": WORKSPACE,
        "family_module": f"jax_oracles/{cfg.family.model_module}",
        "converters": " and ".join(f"`conversion/{name}`" for name in dict.fromkeys(
            [Path(cfg.family.model_module).name, *(Path(m).name for m in reward_family_modules(cfg))])),
        "modules": _module_list(cfg),
        "assets": "\n".join(f"- {role}: `{WORKSPACE}/{p.relative_to(ROOT).as_posix()}`" for role, p in assets.items()),
    }
    if task_class(cfg) == "training":
        fields.update(method=task_method(cfg), workflow=f"jax_oracles/{cfg.method.workflow.replace('.', '/')}.py",
                      args=cfg.method.args, entry=cfg.method.entry, entry_module=cfg.method.workflow,
                      entry_params=", ".join(_parameters(ROOT / "torch_sources" / f"{cfg.method.workflow.replace('.', '/')}.py",
                                                         cfg.method.entry)))
    else:
        fields.update(mode=cfg.mode.name,
                      engine_api=", ".join(f"`{n}`" for n in ENGINE_API))
    return fields


def render_instruction(cfg) -> str:
    template = (TEMPLATES / f"{task_class(cfg)}.md").read_text()
    return Template(template).substitute(instruction_fields(cfg))


def instruction_matches(template: str, text: str) -> bool:
    """Whether text is the template with each $field replaced by some text (the mirror check's template half)."""
    parts = re.split(r"\$\{?([a-z_]+)\}?", template)
    pattern = "".join(re.escape(p) if i % 2 == 0 else r"(.+?)" for i, p in enumerate(parts))
    return re.fullmatch(pattern, text, flags=re.S) is not None


def _task_toml(cfg, ref: Path, dates: dict[str, str], cls: str) -> str:
    meta = {"task": cfg.task_name, "task_class": cls, "family": cfg.family.name,
            ("method" if cls == "training" else "mode"): (task_method(cfg) if cls == "training"
                                                          else cfg.mode.name),
            "reference_sha256": sha256_file(ref), "agent_lock_date": dates["agent"],
            "verifier_lock_date": dates["verifier"], "author_name": "t2j-refs", "category": "pytorch-to-jax",
            "tags": ["pytorch-to-jax", cls, cfg.family.name]}
    meta_lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in meta.items())
    return f"""# {cfg.task_name}: written by `python -m recorder.export` (Harbor task format, schema 1.4)
schema_version = "1.4"
# the agent's JAX tree, restored at the same path in the verifier's own container
artifacts = ["{CANDIDATE}"]

[metadata]
{meta_lines}

[verifier]
timeout_sec = {VERIFIER_TIMEOUT_S}
# a fresh container built from tests/ (torch-free, offline); it sees the agent's work only as the artifact above
environment_mode = "separate"

[agent]
timeout_sec = {AGENT_TIMEOUT_S}

[environment]
build_timeout_sec = 1800.0
cpus = 8
memory_mb = 65536
storage_mb = 65536
gpus = 1
network_mode = "public"
workdir = "{WORKSPACE}"
"""


def _sealed(cfg, ref: Path, assets: dict[str, Path], verifier_lock: Path) -> dict:
    """What the exported grader checks its inputs against in place of the torch sources it does not carry."""
    return {"task": cfg.task_name, "reference": f"references/{ref.name}", "reference_sha256": sha256_file(ref),
            "assets_sha256": {p.relative_to(ROOT).as_posix(): sha256_dir(p) for p in assets.values()},
            "verifier_lock_date": lock_date(verifier_lock), "verifier_versions": locked_versions(verifier_lock)}


def export_task(task: str, out: Path, lock_dir: Path = ROOT / "locks") -> Path:
    """One task's bundle under out/<task> (replaced if it is an earlier export); -> that directory."""
    cfg = compose_task(task)
    ref = ROOT / "references" / f"{task}.h5"
    if not ref.exists():
        raise ExportError(f"{task}: no reference at {ref.relative_to(ROOT)}: `python -m recorder task={task}` first")
    stale = stale_reasons(ref, cfg)
    if stale:
        raise ExportError(f"{task}: the reference is stale ({'; '.join(stale[:3])}): record it again first")
    locks = {half: lock_dir / f"{half}.lock" for half in ("agent", "verifier")}
    for path in locks.values():
        if not path.exists():
            raise ExportError(f"{path} is missing: `python -m tools.make_locks` first")
    dates = {half: lock_date(path) for half, path in locks.items()}
    dest = out / task
    if dest.exists():
        if not (dest / "task.toml").exists():
            raise ExportError(f"{dest} exists and is not an export: not overwriting it")
        shutil.rmtree(dest)
    cls = task_class(cfg)
    assets = _asset_dirs(cfg)

    env = dest / "environment"
    workspace = env / "workspace"
    _copy_rel(torch_files(cfg), workspace / "torch_orig")
    _copy_rel(assets.values(), workspace)
    (workspace / "jax_repo").mkdir(parents=True)
    (workspace / "jax_repo" / ".keep").write_text("")  # the agent's tree goes here (instruction.md)
    shutil.copy2(locks["agent"], env / "agent.lock")
    shutil.copy2(FILES / "agent.Dockerfile", env / "Dockerfile")

    tests = dest / "tests"
    runtime = tests / "runtime"
    for package in RUNTIME_PACKAGES:
        shutil.copytree(ROOT / package, runtime / package, ignore=RUNTIME_SKIP)
    shutil.copytree(ROOT / "configs", runtime / "configs", ignore=RUNTIME_SKIP)
    _copy(ref, runtime / "references" / ref.name)
    _copy_rel(assets.values(), runtime)
    (runtime / "sealed.json").write_text(json.dumps(_sealed(cfg, ref, assets, locks["verifier"]), indent=1))
    shutil.copy2(locks["verifier"], tests / "verifier.lock")
    shutil.copy2(FILES / "verifier.Dockerfile", tests / "Dockerfile")
    (tests / "test.sh").write_text(Template((FILES / "test.sh").read_text()).substitute(task=task,
                                                                                        candidate=CANDIDATE))
    (tests / "test.sh").chmod(0o755)

    solution = dest / "solution"
    _copy_rel(oracle_files(cfg), solution / "jax_repo")
    shutil.copy2(FILES / "solve.sh", solution / "solve.sh")
    (solution / "solve.sh").chmod(0o755)

    (dest / "instruction.md").write_text(render_instruction(cfg))
    (dest / "task.toml").write_text(_task_toml(cfg, ref, dates, cls))
    return dest


def main(argv: list[str]) -> int:
    options = {"task": None, "out": "exports", "lock_dir": "locks"}
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep or key not in options:
            raise SystemExit(f"unknown argument {item!r}; usage: {__doc__.splitlines()[0]}")
        options[key] = value
    if not options["task"]:
        raise SystemExit(f"task= is required; usage: {__doc__.splitlines()[0]}")
    tasks = known_tasks() if options["task"] == "all" else options["task"].split(",")
    unknown = [t for t in tasks if t not in known_tasks()]
    if unknown:
        raise SystemExit(f"unknown task(s): {', '.join(unknown)}; known: {', '.join(known_tasks())}")
    out = (ROOT / options["out"]).resolve()
    failed = []
    for task in tasks:
        try:
            dest = export_task(task, out, ROOT / options["lock_dir"])
            size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
            print(f"{task}: {dest} ({size / 2**20:.1f} MiB)", flush=True)
        except ExportError as error:
            failed.append(task)
            print(f"{task}: not exported: {error}", file=sys.stderr, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
