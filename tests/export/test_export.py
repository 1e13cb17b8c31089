"""recorder.export: two tasks (one per class) exported, then checked as the benchmark's users would be served.

- the mirror check: each instruction matches its class's template, and the solution's modules are exactly the twins
  of the task's torch_orig/ modules (plus the documented JAX-only ones), each with the torch module's public names;
- the leak checks: the agent's half carries no reference, no oracle, no grader, no defect catalog, no hidden input;
  the verifier's half carries no torch;
- Harbor's own task loader and lint accept the bundles (tools/harbor/check_tasks.py; skipped without .venv-harbor);
- the exported verifier, copied alone to a fresh directory, grades an empty tree at 0 with the reason, and (slow) the
  exported solution at reward >= 0.999.
"""
from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from catalog.tasks import compose_task
from recorder.export import TEMPLATES, export_task, instruction_matches
from recorder.export_graph import MIRROR_EXTRAS, TORCH_ONLY, unmirror_path
from recorder.probes.training import public_names

ROOT = Path(__file__).resolve().parents[2]
TASKS = {"training": "llama3-sft", "serving": "qwen3-core"}
FORBIDDEN = ("torch", "transformers", "torch_sources", "recorder", "peft", "trl", "vllm")
HARBOR_PY = ROOT / ".venv-harbor" / "bin" / "python"
VERIFIER = ROOT / ".venv-verifier"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    out = tmp_path_factory.mktemp("exports")
    return {cls: export_task(task, out) for cls, task in TASKS.items()}


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def _modules(root: Path, top: tuple[str, ...]) -> set[str]:
    return {p.relative_to(root).as_posix() for p in _files(root) if p.suffix == ".py"
            and p.relative_to(root).parts[0] in top}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("cls", sorted(TASKS))
def test_instruction_matches_its_template(bundles, cls):
    template = (TEMPLATES / f"{cls}.md").read_text()
    text = (bundles[cls] / "instruction.md").read_text()
    assert instruction_matches(template, text)
    assert "$" not in text.replace("$$", "")  # every field filled
    other = (TEMPLATES / f"{'serving' if cls == 'training' else 'training'}.md").read_text()
    assert not instruction_matches(other, text)  # the check can fail
    assert not instruction_matches(template, text.replace("## Rules", "## Hints"))


@pytest.mark.parametrize("cls", sorted(TASKS))
def test_solution_mirrors_torch_orig(bundles, cls):
    """The oracle and torch_orig/ expose the same set of modules, each twin at least its torch module's public names."""
    torch_root = bundles[cls] / "environment" / "workspace" / "torch_orig"
    solution = bundles[cls] / "solution" / "jax_repo"
    torch_mods = {m for m in _modules(torch_root, ("torch_sources",))
                  if m != "torch_sources/__init__.py" and m not in TORCH_ONLY}
    twins, extras = set(), set()
    for m in _modules(solution, ("jax_oracles", "serving_engine", "conversion")):
        if m == "jax_oracles/__init__.py":  # the twin of torch_sources/__init__.py, left out above
            continue
        if any(m.startswith(prefix) for prefix in MIRROR_EXTRAS):
            extras.add(m)
        elif cls == "serving" and m in ("jax_oracles/training/lora.py", "jax_oracles/training/__init__.py"):
            extras.add(m)  # the flax models declare their LoRA factors (LoraLinear); see export_graph
        else:
            twins.add(unmirror_path(m))
    assert twins == torch_mods, (sorted(twins - torch_mods), sorted(torch_mods - twins))
    assert any(m.startswith("conversion/") for m in extras)  # the family's converter
    for m in sorted(torch_mods):
        if m.endswith("__init__.py"):
            continue
        twin = solution / next(t for t in _modules(solution, ("jax_oracles", "serving_engine"))
                               if unmirror_path(t) == m)
        missing = set(public_names(torch_root / m)) - set(public_names(twin))  # L0/layout's rule: a superset
        assert not missing, (m, sorted(missing))
    for rel in TORCH_ONLY:  # their counterparts ship where the torch module is shipped
        if (torch_root / rel).exists():
            assert (solution / TORCH_ONLY[rel]).exists()


@pytest.mark.parametrize("cls", sorted(TASKS))
def test_agent_half_leaks_nothing(bundles, cls):
    dest = bundles[cls]
    agent = [dest / "instruction.md", *_files(dest / "environment")]
    rels = [p.relative_to(dest).as_posix() for p in agent]
    assert not [r for r in rels if r.endswith((".h5", ".hdf5"))], "a reference in the agent's half"
    for part in ("jax_oracles", "serving_engine", "conversion", "grader", "catalog", "references", "recorder",
                 "defects", "sealed.json"):
        assert not [r for r in rels if f"/{part}/" in f"/{r}" or r.endswith(f"/{part}")], part
    # no byte of the verifier's or the solution's own files (the shared inputs aside)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    shared = {digest(p) for p in _files(dest / "tests" / "runtime" / "assets")}
    hidden = {digest(p): p for root in (dest / "tests", dest / "solution") for p in _files(root)
              if digest(p) not in shared and p.stat().st_size > 64}
    leaked = [p.relative_to(dest).as_posix() for p in agent if digest(p) in hidden]
    assert not leaked, leaked
    workspace = dest / "environment" / "workspace"
    assert sorted(p.name for p in workspace.iterdir()) == ["assets", "jax_repo", "torch_orig"]
    assert [p.name for p in (workspace / "jax_repo").iterdir()] == [".keep"]


@pytest.mark.parametrize("cls", sorted(TASKS))
def test_verifier_half_has_no_torch(bundles, cls):
    tests = bundles[cls] / "tests"
    assert not [p for p in tests.rglob("torch_sources")]
    offenders = {p.relative_to(tests).as_posix(): sorted(_imports(p) & set(FORBIDDEN))
                 for p in _files(tests) if p.suffix == ".py"}
    assert not {k: v for k, v in offenders.items() if v}
    locked = {line.split("==")[0].lower() for line in (tests / "verifier.lock").read_text().splitlines()
              if "==" in line and not line.startswith(("#", " "))}
    assert not locked & {"torch", "transformers", "torchvision", "torchaudio", "peft", "trl", "vllm"}
    assert "torch==2.13.0" in (bundles[cls] / "environment" / "agent.lock").read_text()
    toml = (bundles[cls] / "task.toml").read_text()
    date = (tests / "verifier.lock").read_text().splitlines()[0].split(": ")[1]
    assert f'verifier_lock_date = "{date}"' in toml and 'environment_mode = "separate"' in toml


@pytest.mark.skipif(not HARBOR_PY.exists(), reason="no .venv-harbor (Harbor needs Python >= 3.12): make harbor-env")
def test_harbor_accepts_the_bundles(bundles):
    proc = subprocess.run([str(HARBOR_PY), str(ROOT / "tools" / "harbor" / "check_tasks.py"),
                           *map(str, bundles.values())], capture_output=True, text=True, timeout=300)
    results = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(results) == 2 and all(r["ok"] for r in results), results
    assert proc.returncode == 0


def _grade_alone(bundle: Path, tmp: Path, candidate: Path | None) -> dict:
    """The bundle's tests/ (and solution/) copied alone to tmp, its test.sh run there with the verifier's venv;
    -> the report it wrote."""
    if not (VERIFIER / "bin" / "python").exists():
        pytest.skip("no .venv-verifier: make verifier")
    shutil.copytree(bundle / "tests", tmp / "tests")
    shutil.copytree(bundle / "solution", tmp / "solution")
    target = candidate or (tmp / "solution" / "jax_repo")
    logs = tmp / "logs"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp), "T2J_PYTHON": str(VERIFIER / "bin" / "python"),
           "T2J_VERIFIER": str(VERIFIER), "T2J_CANDIDATE": str(target), "T2J_LOGS": str(logs)}
    subprocess.run(["bash", str(tmp / "tests" / "test.sh")], cwd=tmp, env=env, check=True, timeout=1500)
    reward = json.loads((logs / "reward.json").read_text())
    assert set(reward) == {"reward"} and isinstance(reward["reward"], float)
    return json.loads((logs / "report.json").read_text())


@pytest.mark.sandbox
def test_exported_verifier_grades_an_empty_tree_zero(bundles, tmp_path):
    (tmp_path / "empty").mkdir()
    report = _grade_alone(bundles["training"], tmp_path, tmp_path / "empty")
    assert report["reward"] == 0.0
    assert "no candidate packages" in report["gated"]


@pytest.mark.slow
@pytest.mark.sandbox
def test_exported_verifier_grades_the_exported_solution(bundles, tmp_path):
    report = _grade_alone(bundles["serving"], tmp_path, None)
    assert report["reward"] >= 0.999, report.get("gated")
    assert report["candidate"].startswith(str(tmp_path))
    assert report["stale_reference"] == [] and report["isolation"] == "bubblewrap sandbox"


def test_a_stale_or_missing_reference_is_not_exported(tmp_path, monkeypatch):
    from recorder import export

    cfg = compose_task("llama3-sft")
    assert cfg.task_name == "llama3-sft"
    monkeypatch.setattr(export, "stale_reasons", lambda ref, cfg: ["source changed: torch_sources/x.py"])
    with pytest.raises(export.ExportError, match="stale"):
        export.export_task("llama3-sft", tmp_path)
    monkeypatch.setattr(export, "ROOT", tmp_path)
    with pytest.raises(export.ExportError, match="no reference"):
        export.export_task("llama3-sft", tmp_path)


@pytest.mark.sandbox
def test_exported_verifier_refuses_a_changed_reference(bundles, tmp_path):
    """The runtime's reference is checked against sealed.json before anything is graded."""
    copy = tmp_path / "bundle"
    shutil.copytree(bundles["training"], copy)
    ref = next((copy / "tests" / "runtime" / "references").glob("*.h5"))
    with open(ref, "ab") as f:
        f.write(b"\0")
    report = _grade_alone(copy, tmp_path / "run", tmp_path / "run" / "solution" / "jax_repo")
    assert report["reward"] == 0.0
    assert "not as sealed" in report["reason"] and "reference changed since the export" in report["reason"]


def test_version_drift_names_what_differs():
    import numpy as np

    from catalog.h5schema import Reference
    from grader.app import version_drift

    ref = Reference(attrs={"package_versions": {"numpy": "0.0.1", "torch": "2.13.0"}}, checks={}, band=None)
    drift = version_drift(ref)
    assert drift == [f"numpy {np.__version__} (the reference was recorded with 0.0.1)"]
    assert version_drift(Reference(attrs={"package_versions": {"numpy": np.__version__}}, checks={}, band=None)) == []


def test_every_task_solution_mirrors_its_sources():
    """Over all tasks, without exporting: the solution's modules are the twins of torch_orig's (plus the documented
    JAX-only ones), and a PPO task carries its reward model's family and converter (models/auto.py loads it by
    model_type, so no static import reaches it)."""
    from catalog.tasks import known_tasks
    from recorder.export_graph import oracle_files, reward_family_modules, torch_files

    for task in known_tasks():
        cfg = compose_task(task)
        torch_mods = {p.relative_to(ROOT).as_posix() for p in torch_files(cfg)} - {"torch_sources/__init__.py"}
        torch_mods -= set(TORCH_ONLY)
        twins = set()
        for p in oracle_files(cfg):
            m = p.relative_to(ROOT).as_posix()
            if m == "jax_oracles/__init__.py" or any(m.startswith(e) for e in MIRROR_EXTRAS):
                continue
            if "method" not in cfg and m in ("jax_oracles/training/lora.py", "jax_oracles/training/__init__.py"):
                continue
            twins.add(unmirror_path(m))
        assert twins == torch_mods, (task, sorted(twins ^ torch_mods))
        solution = {p.relative_to(ROOT).as_posix() for p in oracle_files(cfg)}
        for module in reward_family_modules(cfg):
            name = Path(module).name
            assert {f"torch_sources/{module}"} <= torch_mods and f"conversion/{name}" in solution, task
        assert f"conversion/{Path(cfg.family.model_module).name}" in solution, task
    assert reward_family_modules(compose_task("paligemma-ppo")) == ["models/llama3.py"]
