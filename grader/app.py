"""Grade a candidate tree against a recorded reference: sandboxed runs, scores, lattice, reward."""
from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from grader import gate, sandbox
from grader.checks import checks_for
from grader.exchange import UntrustedOutput, read_outputs
from grader.h5schema import Reference, read_reference, write_arrays
from grader.lattice import Check, earned_levels
from grader.measures import score as measure_score
from grader.reward import reward as compute_reward
from grader.trace import reference_pressure

ROOT = Path(__file__).resolve().parents[1]
console = Console(width=150)
# One sandboxed child per group of levels: a crash or a hang costs that group, never the grader.
# Training L6 scores the adapter the L5 run trained, so they share a child; serving L6 inputs hold
# the greedy continuations, so they never share a child with the L5 check that must produce them.
LEVEL_GROUPS = {
    "training": (("L0",), ("L1",), ("L2",), ("L3",), ("L4",), ("L5", "L6")),
    "serving": (("L0",), ("L1",), ("L2",), ("L3",), ("L4",), ("L5",), ("L6",)),
}


def _asset_paths(cfg) -> dict[str, str]:
    """Inputs the candidate may read besides the inputs file: checkpoint, tokenizer, raw data."""
    paths = {"checkpoint": cfg.family.checkpoint}
    if "tokenizer" in cfg.family:
        paths["tokenizer"] = cfg.family.tokenizer
    if "data" in cfg:
        paths["data"] = cfg.data.dir
    return paths


def _task_meta(cfg) -> dict:
    from omegaconf import OmegaConf
    d = OmegaConf.to_container(cfg, resolve=True)
    return {k: d[k] for k in ("task_name", "family", "method", "mode", "data") if k in d}


def _score_check(spec, rec, produced: dict | None, error: str | None, band, seconds: float) -> Check:
    kw = dict(level=spec.level, name=spec.name, aspect=spec.aspect, measure=spec.measure, seconds=seconds)
    if error is not None:
        return Check(**kw, score=0.0, reason=error)
    if produced is None:
        return Check(**kw, score=0.0, reason="no output")
    if spec.measure == "pass":  # a spec check passes when every recorded output is reproduced exactly
        bad = [k for k, ref in rec.outputs.items()
               if k not in produced or np.shape(produced[k]) != np.shape(ref) or not np.array_equal(produced[k], ref)]
        return Check(**kw, score=0.0 if bad else 1.0, reason=f"differs: {', '.join(bad)}" if bad else None)
    scores = []
    for name, ref in rec.outputs.items():
        if name not in produced:
            return Check(**kw, score=0.0, reason=f"missing output {name!r}")
        out = produced[name]
        if np.asarray(out).dtype.kind == "f" and not np.all(np.isfinite(out)):
            return Check(**kw, score=0.0, reason=f"non-finite values in {name!r}")
        if spec.measure == "banded":
            scores.append(measure_score("banded", out, (float(band[0]), float(band[1]))))
        else:
            scores.append(measure_score(spec.measure, out, ref))
    s = float(np.mean(scores))
    return Check(**kw, score=s if math.isfinite(s) else 0.0, reason=None if math.isfinite(s) else "NaN score")


def grade(cfg, candidate: Path, references: Path, report_dir: Path, pass_bar: float = 0.99,
          budget_factor: float = 5.0, budget_min_s: float = 120.0, spec_timeout: float = 120.0,
          numeric_timeout: float = 300.0, quiet: bool = False, levels: tuple[str, ...] | None = None,
          check_timeout_s: float | None = None, only_checks: tuple[str, ...] | None = None, trusted: bool = False,
          compile_cache: Path | None = None) -> dict:
    """Grade `candidate` on the task whose composed config is `cfg` (recorder or grader config).

    `levels` restricts the run to some levels (L0's torch_free gate always runs); the reward then
    covers only the checks that ran; `only_checks` (names such as "rms_norm") restricts it further.
    `check_timeout_s` caps each L0-L4 check inside the child (grader/probes/common.py; default
    120 s there); L5/L6 checks are capped by the time budget.

    Every child runs sealed (grader/sandbox.py); where no sandbox can be made this raises
    SandboxUnavailable before anything runs, unless `trusted` (the oracles on such a machine: the
    Python-level fence alone). `compile_cache` is the sweep's shared JAX cache (trusted mutants only).
    """
    if not trusted:
        sandbox.ensure_sandbox()  # refuse up front, never fall back silently
    from recorder.app import task_class  # torch-free modules (config + hashes only)
    from recorder.provenance import stale_reasons

    task = cfg.task_name
    ref: Reference = read_reference(references / f"{task}.h5")
    stale = stale_reasons(references / f"{task}.h5", cfg)
    if stale and not quiet:
        console.print(f"[yellow]warning: reference is stale[/] ({'; '.join(stale)})")
    spec_checks, checks = checks_for(task_class(cfg))
    all_specs = spec_checks + checks
    results: list[Check] = []
    series: dict[str, dict] = {}  # small 1-D outputs (loss trajectories), candidate beside reference, for plots

    offences = gate.static_scan(candidate)
    lint_ok, lint_text = gate.run_import_linter(candidate)
    if offences or not lint_ok:
        why = "independence gate: " + "; ".join(offences or [lint_text.strip().splitlines()[-1] if lint_text
                                                              else "import-linter failed"])
        results = [Check(s.level, s.name, s.aspect, s.measure, 0.0, why) for s in all_specs]
        return _finish(task, candidate, results, ref, pass_bar, report_dir, stale, quiet, series, gated=why,
                       trusted=trusted)
    results.append(Check("L0", "torch_free", "spec", "pass", 1.0, None))

    budget = max(budget_min_s, budget_factor * float(ref.attrs["wall_clock_s"]))
    for group in LEVEL_GROUPS[task_class(cfg)]:
        specs = [s for s in all_specs if s.level in group and s.key in ref.checks
                 and (levels is None or s.level in levels) and (only_checks is None or s.name in only_checks)]
        if not specs:
            continue
        if group == ("L0",):
            timeout = spec_timeout
        elif group[0] in ("L5", "L6"):
            timeout = budget + 60
        else:  # the per-check limit fires first for Python-level hangs; this backstop catches C-level ones
            timeout = max(numeric_timeout, (check_timeout_s or 0) * len(specs) + 60)
        produced, errors, seconds = _run_group(candidate, cfg, ref, references, specs, group, budget, timeout,
                                               check_timeout_s, trusted, compile_cache)
        for s in specs:
            series.update(_series(s.key, ref.checks[s.key].outputs, produced.get(s.key) or {}))
            results.append(_score_check(s, ref.checks[s.key], produced.get(s.key), errors.get(s.key), ref.band,
                                        float(seconds.get(s.key, 0.0))))
    return _finish(task, candidate, results, ref, pass_bar, report_dir, stale, quiet, series, trusted=trusted)


def _series(key, reference: dict, produced: dict) -> dict:
    out = {}
    for name, ref in reference.items():
        if ref.ndim == 1 and ref.dtype.kind == "f" and ref.size <= 1024:
            cand = produced.get(name)
            out[f"{key}/{name}"] = {"reference": ref.tolist(),
                                    "candidate": None if cand is None else np.asarray(cand, np.float64).tolist()}
    return out


def _run_group(candidate, cfg, ref, ref_dir, specs, group, budget, timeout, check_timeout_s=None, trusted=False,
               compile_cache=None):
    with tempfile.TemporaryDirectory(prefix="t2j-grade-") as tmp:
        tmp = Path(tmp)
        inputs_dir, out_dir = tmp / "inputs", tmp / "out"
        out_dir.mkdir()
        assets = {}
        for key, rel in _asset_paths(cfg).items():  # copied: the child never sees the repo
            shutil.copytree(ROOT / rel, inputs_dir / key)
            assets[key] = key  # relative to the inputs directory, wherever the sandbox mounts it
        meta = {"task": _task_meta(cfg), "assets": assets, "checks": [s.key for s in specs],
                "time_budget_s": budget}
        if check_timeout_s is not None:
            meta["check_timeout_s"] = float(check_timeout_s)
        write_arrays(inputs_dir / "inputs.h5", {s.key: ref.checks[s.key].inputs for s in specs},
                     attrs={"meta": meta})
        started = time.perf_counter()
        res = gate.run_sandboxed(candidate, f"grader.probes.{cfg_class(cfg)}:main", inputs_dir, out_dir, timeout,
                                 deny_read=(ref_dir,), trusted=trusted, compile_cache=compile_cache)
        elapsed = time.perf_counter() - started
        if not res.ok or res.outputs is None:
            reason = res.reason or "no outputs written"
            return {}, {s.key: reason for s in specs}, {s.key: elapsed for s in specs}
        try:  # everything the child returns is untrusted data
            return read_outputs(res.outputs, [s.key for s in specs])
        except UntrustedOutput as e:
            return {}, {s.key: f"untrusted output: {e}" for s in specs}, {s.key: elapsed for s in specs}


def cfg_class(cfg) -> str:
    return cfg.method.task_class if "method" in cfg else cfg.mode.task_class


def _finish(task, candidate, results, ref, pass_bar, report_dir, stale, quiet, series, gated=None,
            trusted=False) -> dict:
    r = 0.0 if gated else compute_reward(results)
    levels = earned_levels(results, pass_bar=pass_bar)
    report = {"task": task, "candidate": str(candidate), "reward": r, "earned_levels": levels,
              "gated": gated, "stale_reference": stale, "pass_bar": pass_bar,
              "isolation": "trusted: Python-level fence only" if trusted else "bubblewrap sandbox",
              "reference_pressure": reference_pressure(ref),
              "checks": [asdict(c) for c in results], "series": series}
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / f"{task}.json").write_text(json.dumps(report, indent=2, default=float))
    if not quiet:
        _print_table(task, results, r, levels)
        if report["reference_pressure"]:
            p = report["reference_pressure"]
            console.print(f"pressure run of the reference: {p['num_preemptions']} preemptions, "
                          f"{p['num_evictions']} evictions")
    return report


def _print_table(task, results, r, levels):
    t = Table(title=f"{task}: earned up to {levels}")
    for col in ("level", "check", "aspect", "measure", "score", "seconds", "reason"):
        t.add_column(col)
    for c in results:
        colour = "green" if c.score >= 0.999 else "yellow" if c.score >= 0.99 else "red"
        t.add_row(c.level, c.name, c.aspect, c.measure, f"[{colour}]{c.score:.6f}[/]", f"{c.seconds:.1f}",
                  c.reason or "")
    console.print(t)
