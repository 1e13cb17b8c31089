"""Which lines and branches of the graded code no graded check executes.

Two sides, one format ({path relative to the repo: {"lines": [...], "arcs": [[a, b], ...]}}):
- the oracle side: `grade(..., coverage=True)` (grade_all does it) asks every sandboxed child to run its
  probes under coverage.py's branch coverage of jax_oracles/, serving_engine/ and conversion/; the report of
  each task keeps the union over its children (grader/probes/common.py, grader/isolation/exchange.py);
- the torch side: `python -m recorder task=T coverage=true` records under branch coverage of torch_sources/
  and writes reports/coverage/torch/<task>.json.

`python -m grader.coverage` (run by `make grade-all`) merges them per task class, takes out the reasoned
exclusions of grader/coverage_exclusions.yaml, and writes reports/coverage/COVERAGE.md: per class and per
file, the statements and branches no check reaches. Files no task of a class imports count as wholly missed.
"""
from __future__ import annotations

import ast
import json
import sys
import tempfile
from pathlib import Path

import yaml

from catalog import pysource
from catalog.tasks import compose_task, task_class

ROOT = Path(__file__).resolve().parents[1]
EXCLUSIONS = ROOT / "grader" / "coverage_exclusions.yaml"
OUT = ROOT / "reports" / "coverage"
# What each task class grades (oracle side) or records from (torch side); "all" is the whole tree, which
# shows code no task of any class reaches. A file named after a family counts only for the families the
# class has tasks for.
SCOPES = {
    "training": {"oracle": ("jax_oracles/models", "jax_oracles/training", "conversion"),
                 "torch": ("torch_sources/models", "torch_sources/training")},
    "serving": {"oracle": ("jax_oracles/models", "serving_engine", "conversion"),
                "torch": ("torch_sources/models", "torch_sources/serving")},
    "all": {"oracle": ("jax_oracles", "serving_engine", "conversion"), "torch": ("torch_sources",)},
}
FAMILY_FILES = frozenset(p.stem for p in (ROOT / "configs" / "family").glob("*.yaml"))

__all__ = ["SCOPES", "analyze", "load_exclusions", "merge", "write_report"]


def merge(into: dict, part: dict | None) -> dict:
    """Union of executed lines and arcs, file by file (into is updated and returned)."""
    for rel, entry in (part or {}).items():
        cur = into.setdefault(rel, {"lines": set(), "arcs": set()})
        cur["lines"].update(int(x) for x in entry["lines"])
        cur["arcs"].update((int(a), int(b)) for a, b in entry["arcs"])
    return into


def load_exclusions(path: Path = EXCLUSIONS) -> dict[str, list[dict]]:
    """{"patterns": [{regex, reason[, which]}], "blocks": [{file, block, reason}]}. A pattern excludes every line
    it matches (coverage.py's exclude regex: a matched `def` or `if` takes its body along), or with
    `which: partial` only the branches a matched line does not take (coverage.py's partial regex); a block is the start
    of the first line of one statement in one file, excluded with its whole body. Each needs its reason."""
    raw = (yaml.safe_load(path.read_text()) if path.is_file() else None) or {}
    out = {"patterns": list(raw.get("patterns") or []), "blocks": list(raw.get("blocks") or [])}
    for kind, keys in (("patterns", ("regex", "reason")), ("blocks", ("file", "block", "reason"))):
        for e in out[kind]:
            if not (isinstance(e, dict) and all(e.get(k) for k in keys)):
                raise ValueError(f"{path}: each of {kind} needs {', '.join(keys)}, got {e!r}")
    return out


def _excluded_lines(source: str, blocks: list[str], rel: str) -> set[int]:
    lines, found = source.splitlines(), set()
    out: set[int] = set()
    for node in ast.walk(pysource.parse(source)):
        if not isinstance(node, ast.stmt):
            continue
        text = lines[node.lineno - 1].strip()
        for block in blocks:
            if text.startswith(block):
                first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                out.update(range(first, node.end_lineno + 1))
                found.add(block)
    missing = set(blocks) - found
    if missing:
        raise ValueError(f"coverage exclusion not found in {rel}: {sorted(missing)}")
    return out


def _files(roots, families=None) -> list[str]:
    paths = (p for r in roots for p in (ROOT / r).rglob("*.py") if "__pycache__" not in p.parts)
    return sorted(p.relative_to(ROOT).as_posix() for p in paths
                  if families is None or p.stem not in FAMILY_FILES or p.stem in families)


def analyze(executed: dict, roots, exclusions: dict | None = None, families=None) -> dict[str, dict]:
    """Per file under `roots` (family files only of `families`; None = all): statements, branches, and the
    missing ones (after the exclusions)."""
    import coverage

    exclusions = load_exclusions() if exclusions is None else exclusions
    files = _files(roots, families)
    with tempfile.TemporaryDirectory(prefix="t2j-cov-") as tmp:
        cov = coverage.Coverage(branch=True, data_file=None, config_file=False)
        for p in exclusions["patterns"]:
            cov.exclude(p["regex"], which=p.get("which", "exclude"))
        data = cov.get_data()
        data.add_arcs({str(ROOT / rel): sorted(e["arcs"]) for rel, e in executed.items() if rel in files})
        report = Path(tmp) / "r.json"
        cov.json_report(morfs=[str(ROOT / rel) for rel in files], outfile=str(report), ignore_errors=True)
        raw = json.loads(report.read_text())["files"]
    by_rel = {Path(k).resolve().relative_to(ROOT).as_posix() if Path(k).is_absolute() else k: v
              for k, v in raw.items()}
    out = {}
    for rel in files:
        entry = by_rel.get(rel)
        if entry is None:  # nothing to measure (an empty __init__.py)
            continue
        blocks = [e["block"] for e in exclusions["blocks"] if e["file"] == rel]
        skip = _excluded_lines((ROOT / rel).read_text(), blocks, rel) if blocks else set()
        missing_lines = [n for n in entry["missing_lines"] if n not in skip]
        # a jump into an excluded block is part of that block's exclusion
        missing_branches = [b for b in entry["missing_branches"] if b[0] not in skip and b[1] not in skip]
        s = entry["summary"]
        out[rel] = {"statements": s["num_statements"], "branches": s.get("num_branches", 0),
                    "missing_lines": missing_lines, "missing_branches": missing_branches,
                    "excluded_lines": len(skip) + s.get("excluded_lines", 0), "imported": rel in executed}
    return out


def _totals(files: dict) -> tuple[int, int, int, int]:
    st = sum(f["statements"] for f in files.values())
    br = sum(f["branches"] for f in files.values())
    return st, sum(len(f["missing_lines"]) for f in files.values()), br, sum(len(f["missing_branches"])
                                                                              for f in files.values())


def _ranges(nums: list[int]) -> str:
    out, nums = [], sorted(nums)
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ", ".join(out)


def summary_line(name: str, files: dict) -> str:
    st, ml, br, mb = _totals(files)
    return (f"{name}: statements {st - ml}/{st} reached, branches {br - mb}/{br} reached "
            f"({ml} statements, {mb} branches missed)")


def write_report(results: dict[str, dict[str, dict]], sources: dict[str, list[str]], out_dir: Path = OUT) -> Path:
    """results: "<class> oracle|torch" -> analyze() output; sources: the same key -> the task reports used."""
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# Coverage of the graded code", "",
             "Statements and branches that no graded check executes (oracle side: the clean oracle graded in "
             "the sandbox; torch side: the recorder). Exclusions, each with its reason: "
             "`grader/coverage_exclusions.yaml`.", ""]
    for key, files in results.items():
        lines += [f"## {key}", "", f"From: {', '.join(sources.get(key, [])) or 'no report'}.", "",
                  summary_line(key, files), "", "| file | statements | missed lines | branches | missed branches |",
                  "|---|---|---|---|---|"]
        for rel, f in files.items():
            if f["missing_lines"] or f["missing_branches"]:
                note = "" if f["imported"] else " (never imported)"
                lines.append(f"| `{rel}`{note} | {f['statements']} | {_ranges(f['missing_lines']) or '-'} | "
                             f"{f['branches']} | {', '.join(f'{a}->{b}' for a, b in f['missing_branches']) or '-'} |")
        lines.append("")
    path = out_dir / "COVERAGE.md"
    path.write_text("\n".join(lines))
    (out_dir / "coverage.json").write_text(json.dumps(results, indent=1))
    return path


def collect(reports_dir: Path = ROOT / "reports" / "all", torch_dir: Path = OUT / "torch") -> tuple[dict, dict]:
    """Executed lines per "<class> oracle|torch" from the grade reports and the recorder's coverage files."""

    executed: dict[str, dict] = {}
    sources: dict[str, list[str]] = {}

    def add(task, side, data):
        cls = task_class(compose_task(task))
        for key in (f"{cls} {side}", f"all {side}"):
            merge(executed.setdefault(key, {}), data)
            sources.setdefault(key, []).append(task)

    for path in sorted(reports_dir.glob("*.json")):
        report = json.loads(path.read_text())
        if "coverage" in report and isinstance(report.get("task"), str):
            add(report["task"], "oracle", report["coverage"])
    for path in sorted(torch_dir.glob("*.json")):
        add(path.stem, "torch", json.loads(path.read_text()))
    return executed, sources


def families_of(tasks) -> set[str]:
    return {compose_task(t).family.name for t in tasks}


def main(argv: list[str] | None = None) -> int:
    """python -m grader.coverage [REPORTS_DIR [OUT_DIR]]: the grade reports of REPORTS_DIR (reports/all)."""
    argv = sys.argv[1:] if argv is None else argv
    reports_dir = Path(argv[0]) if argv else ROOT / "reports" / "all"
    out_dir = Path(argv[1]) if len(argv) > 1 else OUT
    executed, sources = collect(reports_dir)
    if not executed:
        print("no coverage recorded: run `make grade-all` (oracle side) and "
              "`python -m recorder task=T coverage=true out_dir=/tmp/refs` (torch side)", file=sys.stderr)
        return 1
    results = {}
    for key in sorted(executed, key=lambda k: (k.startswith("all"), k)):
        cls, side = key.split()
        results[key] = analyze(executed[key], SCOPES[cls][side], families=None if cls == "all" else
                               families_of(sources[key]))
    path = write_report(results, sources, out_dir)
    for key, files in results.items():
        print(summary_line(key, files))
    print(f"coverage report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
