"""Grade a candidate tree against a recorded reference: sandboxed runs, scores, lattice, reward."""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from catalog import heldout, scorers
from catalog.checks import checks_for
from catalog.h5schema import Reference, ReferenceError, read_reference, write_arrays
from catalog.provenance import checkpoint_dir, checkpoint_mismatch, sealed, stale_reasons
from catalog.tasks import task_class, task_features, task_method
from catalog.trace import reference_pressure
from grader.coverage import merge as merge_coverage
from grader.isolation import answers, contents, gate, sandbox
from grader.isolation.exchange import UntrustedOutput, read_compile_seconds, read_coverage, read_outputs
from grader.scoring.lattice import Check, earned_levels, strict_bar
from grader.scoring.measures import error_figures, score as measure_score
from grader.scoring.reward import reward as compute_reward
from grader.timing.budget import BudgetPolicy, Calibration, TIMED_LEVELS, level_budget, load_calibration
from grader.timing.speed import machine_speed

ROOT = Path(__file__).resolve().parents[1]
console = Console(width=150)
# One sandboxed child per group of levels: a crash or a hang costs that group, never the grader.
# L6 never shares a child with L5: training L6 runs the candidate's forward with the adapter its L5
# child produced (catalog/heldout.py), serving L6 inputs hold the greedy continuations L5 must produce.
LEVEL_GROUPS = {
    "training": (("L0",), ("L1",), ("L2",), ("L3",), ("L4",), ("L5",), ("L6",)),
    "serving": (("L0",), ("L1",), ("L2",), ("L3",), ("L4",), ("L5",), ("L6",)),
}


def _asset_paths(cfg) -> dict[str, str]:
    """Inputs the candidate may read besides the inputs file: checkpoint (`checkpoint=PATH`, else the family's
    tiny one), tokenizer, raw data; relative to the repo, or absolute."""
    paths = {"checkpoint": str(checkpoint_dir(cfg))}
    if "tokenizer" in cfg.family:
        paths["tokenizer"] = cfg.family.tokenizer
    if "data" in cfg:
        paths["data"] = cfg.data.dir
    if "reward_model" in cfg.get("method", {}):
        paths["reward_model"] = cfg.method.reward_model
    return paths


# what a reference records of its recording environment that the verifier also runs (catalog/h5schema.py attrs)
SHARED_PACKAGES = ("numpy", "h5py", "safetensors", "tokenizers")


def version_drift(ref: Reference) -> list[str]:
    """Where this verifier's packages differ from those the reference was recorded with (the packages both
    environments hold) and, in an exported runtime, from the verifier lock it was exported with: a warning,
    since a numeric library's release can move a last digit, never a refusal."""
    from importlib import metadata

    def installed(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    drift = []
    recorded = ref.attrs.get("package_versions") or {}
    for name in SHARED_PACKAGES:
        if name in recorded and installed(name) not in (None, recorded[name]):
            drift.append(f"{name} {installed(name)} (the reference was recorded with {recorded[name]})")
    seal = sealed()
    for name, version in sorted(((seal or {}).get("verifier_versions") or {}).items()):
        if installed(name) != version:
            drift.append(f"{name} {installed(name) or 'missing'} (verifier.lock of "
                         f"{seal.get('verifier_lock_date')}: {version})")
    return drift


def child_caps(cfg) -> "gate.clock.Limits":
    """What each child may take (grader/isolation/gate.py DEFAULT_CAPS), its memory raised with the checkpoint it
    loads: 4 GiB + 6 x its bytes on disk (a bf16 release upcast to fp32, converted, and its activations)."""
    ckpt = ROOT / _asset_paths(cfg)["checkpoint"]
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) if ckpt.is_dir() else 0
    return replace(gate.DEFAULT_CAPS, memory_bytes=max(gate.DEFAULT_CAPS.memory_bytes, 4 * 2**30 + 6 * size))


def _task_meta(cfg) -> dict:
    from omegaconf import OmegaConf
    d = OmegaConf.to_container(cfg, resolve=True)
    return {k: d[k] for k in ("task_name", "family", "method", "mode", "data") if k in d}


def _score_check(spec, rec, produced: dict | None, error: str | None, band, seconds: float) -> Check:
    kw = dict(level=spec.level, name=spec.name, aspect=spec.aspect, measure=spec.measure, seconds=seconds,
              bar=strict_bar(spec.aspect, rec.attrs.get("noise")))
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
    figures = None if spec.measure == "banded" else error_figures((produced[k], ref) for k, ref in rec.outputs.items())
    return Check(**kw, **(figures or {}), score=s if math.isfinite(s) else 0.0,
                 reason=None if math.isfinite(s) else "NaN score")


def _score_heldout(spec, rec, produced: dict | None, error: str | None, band, seconds: float) -> tuple[Check, dict]:
    """Training L6: the banded score of what the grader itself computes from the candidate's logits
    (scorers.SCORERS: never a number the candidate reports), the mean over its metrics, each banded by the
    check's `band_<metric>` attribute (the loss falls back to /L6/band); -> (check, what the report shows)."""
    kw = dict(level=spec.level, name=spec.name, aspect=spec.aspect, measure=spec.measure, seconds=seconds,
              bar=strict_bar(spec.aspect, rec.attrs.get("noise")))
    if error is not None or produced is None:
        return Check(**kw, score=0.0, reason=error or "no output"), {}
    try:
        values, shapes = scorers.SCORERS[spec.key](rec.inputs, produced)
    except heldout.HeldoutError as e:
        return Check(**kw, score=0.0, reason=str(e)), {}
    detail, scores = {"logits_shapes": [list(x) for x in shapes]}, []
    for metric, value in values.items():
        lo, hi = (float(x) for x in rec.attrs.get(f"band_{metric}", band))
        detail.update({f"grader_{metric}": value, f"reference_{metric}": float(rec.outputs[metric]),
                       f"band_{metric}": [lo, hi]})
        scores.append(measure_score("banded", value, (lo, hi)))
    detail["band"] = detail[f"band_{next(iter(values))}"]
    return Check(**kw, score=float(np.mean(scores))), detail


@dataclass(frozen=True)
class GradeOptions:
    """How one grading runs (grade()'s docstring says what each does); the sweep, the calibration, the stability
    runs and the CLI each build one."""
    budget: BudgetPolicy | None = None
    spec_timeout: float = 120.0
    numeric_timeout: float = 300.0
    quiet: bool = False
    levels: tuple[str, ...] | None = None
    check_timeout_s: float | None = None
    only_checks: tuple[str, ...] | None = None
    trusted: bool = False
    compile_cache: Path | None = None
    coverage: bool = False
    measure_compile: bool = False
    groups: tuple[tuple[str, ...], ...] | None = None
    forkserver: object = None
    calibration: Calibration | None = None
    caps: object = None
    jax_platforms: str = "cpu"  # the children's JAX backend: "cuda" runs the Pallas kernels compiled (make gpu-check)


def grade(cfg, candidate: Path, references: Path, report_dir: Path, options: GradeOptions | None = None,
          **overrides) -> dict:
    """Grade `candidate` on the task whose composed config is `cfg` (recorder or grader config).

    `levels` restricts the run to some levels (L0's torch_free gate always runs); the reward then
    covers only the checks that ran; `only_checks` (names such as "rms_norm") restricts it further.
    `check_timeout_s` caps each L0-L4 check inside the child (grader/probes/common.py; default
    120 s there); each of L5 and L6 runs under one CPU-time budget (grader/timing/budget.py, policy `budget`,
    `calibration` or grader/timing/budgets.yaml, scaled by this machine's speed probe), kept on the grader's own
    clock (grader/isolation/clock.py): the child's process tree is killed past it.

    Every child runs sealed (grader/isolation/sandbox.py); where no sandbox can be made this raises
    SandboxUnavailable before anything runs, unless `trusted` (the oracles on such a machine: the
    Python-level fence alone). `compile_cache` is the sweep's shared JAX cache (trusted mutants only).
    `coverage`: every child runs under branch coverage of the candidate's packages; the report's "coverage"
    holds the executed lines and arcs over all children (grader/coverage.py reads it), its "coverage_by_group"
    those of each level group's child ("L1": ...; the sweep's impact analysis, grader/sweep/impact.py). `measure_compile`
    (calibration of the repo's own oracle only): the report's "compile_seconds" per timed level.
    `groups` (the sweep's trusted mutants only) runs other groups of levels per child than LEVEL_GROUPS;
    a timed level (L5, L6) always has a child of its own. `forkserver` (grader/isolation/forkserver.py; with trusted
    only, the sweep's own mutants) forks each child from an interpreter that has imported jax already.
    `overrides`: GradeOptions fields replacing those of `options` (an unknown one is a TypeError).
    """
    o = replace(options or GradeOptions(), **overrides)
    budget, spec_timeout, numeric_timeout, quiet, levels = o.budget, o.spec_timeout, o.numeric_timeout, o.quiet, o.levels
    check_timeout_s, only_checks, trusted, compile_cache = o.check_timeout_s, o.only_checks, o.trusted, o.compile_cache
    coverage, measure_compile, groups, forkserver = o.coverage, o.measure_compile, o.groups, o.forkserver
    calibration, caps = o.calibration, o.caps
    if not trusted:
        sandbox.ensure_sandbox()  # refuse up front, never fall back silently

    task = cfg.task_name
    ref: Reference = read_reference(references / f"{task}.h5")
    mismatch = checkpoint_mismatch(references / f"{task}.h5", cfg)
    if mismatch:  # outputs of checkpoint A graded against a candidate run on checkpoint B: meaningless
        raise ReferenceError(mismatch)
    stale = stale_reasons(references / f"{task}.h5", cfg)
    if stale and sealed() is not None:  # an exported runtime: its inputs are what was sealed, or nothing is graded
        raise ReferenceError(f"{task}: the exported verifier's inputs are not as sealed: {'; '.join(stale)}")
    if stale and not quiet:
        console.print(f"[yellow]warning: reference is stale[/] ({'; '.join(stale)})")
    drift = version_drift(ref)
    if drift and not quiet:
        console.print(f"[yellow]warning: this verifier's versions differ[/] ({'; '.join(drift)})")
    spec_checks, checks = checks_for(task_class(cfg), task_method(cfg), task_features(cfg))
    all_specs = spec_checks + checks
    results: list[Check] = []
    series: dict[str, dict] = {}  # small 1-D outputs (loss trajectories), candidate beside reference, for plots

    offences = gate.static_scan(candidate) + contents.inspect_tree(candidate)  # what it imports, what it carries
    lint_ok, lint_text = gate.run_import_linter(candidate)
    if offences or not lint_ok:
        why = "independence gate: " + "; ".join(offences or [lint_text.strip().splitlines()[-1] if lint_text
                                                              else "import-linter failed"])
        results = [Check(s.level, s.name, s.aspect, s.measure, 0.0, why) for s in all_specs]
        return _finish(task, candidate, results, ref, report_dir, stale, quiet, series, drift, gated=why,
                       trusted=trusted)
    results.append(Check("L0", "torch_free", "spec", "pass", 1.0, None))

    policy = budget or BudgetPolicy()
    compile_seconds = {} if measure_compile else None
    selected = [s for s in all_specs if s.key in ref.checks and (levels is None or s.level in levels)
                and (only_checks is None or s.name in only_checks)]
    budgets = _timed_budgets(ref, task, policy, calibration, {s.level for s in selected} & set(TIMED_LEVELS))
    caps = caps or child_caps(cfg)  # what each child may take from the machine (grader/isolation/gate.py DEFAULT_CAPS)
    children: dict[str, dict] = {}  # per level group: what its child used on the grader's clock
    # training L6 runs on the adapter the candidate's L5 child produced: that check runs whenever L6 does
    # (scored only when selected), and its outputs become L6 inputs, read as untrusted as any output
    wants_adapter = any(s.key in scorers.SCORERS for s in selected) and heldout.ADAPTER_KEY in ref.checks
    adapter, adapter_error = None, f"{heldout.ADAPTER_KEY} did not run"
    details = {}
    executed = {} if coverage else None
    executed_by_group = {} if coverage else None  # group name ("L1") -> that child's executed lines
    if groups is not None and any(len(g) > 1 and set(g) & set(TIMED_LEVELS) for g in groups):
        raise ValueError(f"a timed level runs in a child of its own: {groups}")
    for group in groups if groups is not None else LEVEL_GROUPS[task_class(cfg)]:
        specs = [s for s in selected if s.level in group]
        run = specs + [s for s in all_specs if wants_adapter and s.key == heldout.ADAPTER_KEY
                       and s.level in group and s not in specs]
        inputs = {s.key: ref.checks[s.key].inputs for s in run}
        early = {}  # check key -> reason it scores 0 without running
        for key in sorted(scorers.SCORERS.keys() & inputs.keys()):
            try:
                if adapter is None:
                    raise heldout.HeldoutError(f"no adapter from {heldout.ADAPTER_KEY}: {adapter_error}")
                inputs[key] = heldout.child_inputs(
                    ref.checks[key].inputs, heldout.adapter_inputs(ref.checks[heldout.ADAPTER_KEY].outputs, adapter))
            except heldout.HeldoutError as e:
                early[key] = str(e)
                run = [s for s in run if s.key != key]
        if not run and not early:
            continue
        cpu_limit = math.inf
        if group == ("L0",):
            timeout = spec_timeout
        elif group[0] in TIMED_LEVELS:
            b = budgets[group[0]][0]
            cpu_limit, timeout = policy.kill_at(b), policy.wall_limit(b)
            budgets[group[0]][1].update(wall_limit_s=timeout)
        else:  # the per-check limit fires first for Python-level hangs; this backstop catches C-level ones
            timeout = max(numeric_timeout, (check_timeout_s or 0) * len(run) + 60)
        produced, errors, seconds = {}, {}, {}
        if run:
            group_budget = budgets[group[0]][0] if group[0] in TIMED_LEVELS else None
            group_executed = {} if coverage else None
            parts = _separate(run, ref, group)
            for i, part in enumerate(parts):  # usually one: checks whose answers others' inputs carry go apart
                got, failed, took, usage = _run_group(
                    candidate, cfg, references, part, {s.key: inputs[s.key] for s in part}, group_budget, timeout,
                    check_timeout_s, trusted, compile_cache, group_executed, compile_seconds, forkserver, cpu_limit,
                    caps, o.jax_platforms)
                produced.update(got)
                errors.update(failed)
                seconds.update(took)
                if usage is not None:
                    children["+".join(group) + (f"#{i + 1}" if len(parts) > 1 else "")] = {
                        "checks": [s.key for s in part], "cpu_s": round(usage.cpu_s, 3),
                        "wall_s": round(usage.wall_s, 3), "peak_memory_gib": round(usage.peak_memory_bytes / 2**30, 3),
                        "peak_tasks": usage.peak_tasks, "meter": usage.meter, "exceeded": usage.exceeded}
                if group[0] in TIMED_LEVELS and usage is not None:
                    budgets[group[0]][1].update(used_cpu_s=round(usage.cpu_s, 3),
                                                used_wall_s=round(usage.wall_s, 3), meter=usage.meter)
            if coverage:
                merge_coverage(executed, group_executed)
                executed_by_group["+".join(group)] = group_executed
        errors = {**early, **errors}
        if any(s.key == heldout.ADAPTER_KEY for s in run):
            adapter, adapter_error = produced.get(heldout.ADAPTER_KEY), errors.get(heldout.ADAPTER_KEY, "no output")
        for s in specs:
            args = (s, ref.checks[s.key], produced.get(s.key), errors.get(s.key), ref.band,
                    float(seconds.get(s.key, 0.0)))
            if s.key in scorers.SCORERS:
                check, details[s.key] = _score_heldout(*args)
            else:
                series.update(_series(s.key, ref.checks[s.key].outputs, produced.get(s.key) or {}))
                check = _score_check(*args)
            results.append(check)
    return _finish(task, candidate, results, ref, report_dir, stale, quiet, series, drift, trusted=trusted,
                   details=details, executed=executed, budgets={lv: b[1] for lv, b in budgets.items()},
                   compile_seconds=compile_seconds, executed_by_group=executed_by_group, children=children,
                   caps=caps)


def _timed_budgets(ref, task, policy: BudgetPolicy, calibration, timed: set[str]) -> dict:
    """{level: (CPU-s here, how derived)} for the timed levels; the speed probe runs only when one will run."""
    cal = load_calibration() if calibration is None else calibration
    if timed and policy.scale:
        speed = machine_speed(cal.probe_cpu_s)
    else:
        speed = (1.0, {"speed": 1.0, "note": "unscaled" if timed else "no timed level ran"})
    return {lv: level_budget(ref, task, lv, policy, cal, speed) for lv in TIMED_LEVELS}


def _separate(run, ref, group) -> list[list]:
    """`run` split into children none of which gets a check's recorded answer among another's inputs
    (grader/isolation/answers.py), scanned on the recorded inputs (a training L6 scorer's adapter is the candidate's)."""
    recorded = {s.key: heldout.child_inputs(ref.checks[s.key].inputs, {}) if s.key in scorers.SCORERS
                else ref.checks[s.key].inputs for s in run}
    parts, found = answers.separate(run, recorded, {s.key: ref.checks[s.key].outputs for s in run}, "+".join(group))
    if len(parts) > 1 and set(group) & set(TIMED_LEVELS):  # one budget per timed level: one child
        raise ReferenceError(f"{'+'.join(group)}: recorded answers among the timed level's own inputs: "
                             + "; ".join(f"{f.answering} in {f.carrying}" for f in found))
    return parts


def _series(key, reference: dict, produced: dict) -> dict:
    out = {}
    for name, ref in reference.items():
        if ref.ndim == 1 and ref.dtype.kind == "f" and ref.size <= 1024:
            cand = produced.get(name)
            out[f"{key}/{name}"] = {"reference": ref.tolist(),
                                    "candidate": None if cand is None else np.asarray(cand, np.float64).tolist()}
    return out


def _run_group(candidate, cfg, ref_dir, specs, inputs, budget, timeout, check_timeout_s=None, trusted=False,
               compile_cache=None, executed: dict | None = None, compile_seconds: dict | None = None,
               forkserver=None, cpu_limit: float = math.inf, caps=None, jax_platforms: str = "cpu"):
    """One sealed child on `inputs` (check key -> {name: array}); -> (outputs, errors, seconds, clock usage)
    per check. `budget`: the timed level's CPU seconds (None below L5), which the child keeps itself to;
    the grader kills its tree past `cpu_limit` CPU seconds or `timeout` wall seconds (its own clock). With
    `executed` (a dict), the child runs under coverage and its executed lines are merged into it; with
    `compile_seconds`, its JAX compile seconds are added up per level there."""
    with tempfile.TemporaryDirectory(prefix="t2j-grade-") as tmp:
        tmp = Path(tmp)
        inputs_dir, out_dir = tmp / "inputs", tmp / "out"
        out_dir.mkdir()
        assets = {}
        for key, rel in _asset_paths(cfg).items():  # copied: the child never sees the repo
            shutil.copytree(ROOT / rel, inputs_dir / key, copy_function=_link_or_copy)
            assets[key] = key  # relative to the inputs directory, wherever the sandbox mounts it
        meta = {"task": _task_meta(cfg), "assets": assets, "checks": [s.key for s in specs]}
        if budget is not None:
            meta["time_budget_s"] = float(budget)
        if compile_seconds is not None:
            meta["measure_compile"] = True
        if check_timeout_s is not None:
            meta["check_timeout_s"] = float(check_timeout_s)
        if executed is not None:
            meta["coverage"] = True
        write_arrays(inputs_dir / "inputs.h5", inputs, attrs={"meta": meta})
        started = time.perf_counter()
        res = gate.run_sandboxed(candidate, f"grader.probes.{cfg_class(cfg)}:main", inputs_dir, out_dir, timeout,
                                 deny_read=(ref_dir,), trusted=trusted, compile_cache=compile_cache,
                                 forkserver=forkserver, cpu_limit_s=cpu_limit, caps=caps, jax_platforms=jax_platforms)
        elapsed = time.perf_counter() - started
        usage = res.usage
        over = None  # the grader's clock, never the child's: a child may end between two readings past a limit
        if usage is not None and res.reason != "timeout":
            if usage.cpu_s > cpu_limit:
                over = (f"timeout: the child's process tree used {usage.cpu_s:.1f} CPU-s > {cpu_limit:.1f} CPU-s "
                        f"(grader's clock, {usage.meter})")
            elif usage.wall_s > timeout:
                over = f"timeout: the child ran {usage.wall_s:.1f} s > {timeout:.1f} s (grader's wall clock)"
        if over or not res.ok or res.outputs is None:
            reason = over or res.timeout_detail or res.reason or "no outputs written"
            return {}, {s.key: reason for s in specs}, {s.key: elapsed for s in specs}, usage
        try:  # everything the child returns is untrusted data
            outputs = read_outputs(res.outputs, [s.key for s in specs])
            if executed is not None:
                merge_coverage(executed, read_coverage(res.outputs))
            if compile_seconds is not None:
                for key, sec in read_compile_seconds(res.outputs, [s.key for s in specs]).items():
                    level = key.split("/", 1)[0]
                    compile_seconds[level] = compile_seconds.get(level, 0.0) + sec
        except UntrustedOutput as e:
            return {}, {s.key: f"untrusted output: {e}" for s in specs}, {s.key: elapsed for s in specs}, usage
        return (*outputs, usage)


def _link_or_copy(src, dst) -> None:
    """A hard link where the filesystem allows (a release's gigabytes, once per level group: the child sees its
    inputs read-only), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def cfg_class(cfg) -> str:
    return cfg.method.task_class if "method" in cfg else cfg.mode.task_class


def _finish(task, candidate, results, ref, report_dir, stale, quiet, series, drift, gated=None,
            trusted=False, details=None, executed=None, budgets=None, compile_seconds=None,
            executed_by_group=None, children=None, caps=None) -> dict:
    r = 0.0 if gated else compute_reward(results)
    levels = -1 if gated else earned_levels(results)
    digits = [c.digits for c in results if c.digits is not None]
    report = {"task": task, "candidate": str(candidate), "reward": r, "earned_levels": levels,
              "mean_digits": float(np.mean(digits)) if digits else None,
              "gated": gated, "stale_reference": stale, "version_drift": drift,
              "isolation": "trusted: Python-level fence only" if trusted else "bubblewrap sandbox",
              "reference_pressure": reference_pressure(ref),
              "checks": [_with_budget(asdict(c), budgets) for c in results], "series": series,
              "details": details or {},  # per check, what the grader computed itself (training L6: the loss)
              "budgets": budgets or {},  # per timed level: the budget and what it was derived from
              "children": children or {},  # per level group: CPU, wall, peak memory and tasks of its child
              "caps": None if caps is None else {"memory_gib": caps.memory_bytes / 2**30, "tasks": caps.tasks,
                                                 "file_mib": caps.file_bytes / 2**20,
                                                 "disk_mib": caps.disk_bytes / 2**20}}
    if compile_seconds is not None:
        report["compile_seconds"] = compile_seconds
    if executed is not None:
        report["coverage"] = _coverage_json(executed)
    if executed_by_group is not None:  # each level group's child on its own (the sweep's impact analysis)
        report["coverage_by_group"] = {g: _coverage_json(e) for g, e in executed_by_group.items()}
    save_report(report, report_dir)
    if not quiet:
        print_checks(f"{task}: strict lattice L{levels}" if levels >= 0 else f"{task}: no level earned",
                     report["checks"])
        for lv, b in (budgets or {}).items():
            if b.get("used_cpu_s") is not None:
                console.print(f"{lv} budget: {b['rule']} (speed {b.get('speed', 1.0):.3f} against "
                              f"{b.get('calibrated_on') or 'no calibration'}); used {b['used_cpu_s']:.1f} CPU-s, "
                              f"{b['used_wall_s']:.1f} s wall (grader's clock, {b['meter']}); killed past "
                              f"{b['kill_at_cpu_s']:.1f} CPU-s or {b.get('wall_limit_s', 0):.0f} s")
        if report["reference_pressure"]:
            p = report["reference_pressure"]
            console.print(f"pressure run of the reference: {p['num_preemptions']} preemptions, "
                          f"{p['num_evictions']} evictions")
        for key, d in report["details"].items():
            metrics = [k[len("grader_"):] for k in d if k.startswith("grader_")]
            if metrics:
                figures = "; ".join(f"{m} {d['grader_' + m]:.6f} (band [{d['band_' + m][0]:.6f}, "
                                    f"{d['band_' + m][1]:.6f}], torch seed run {d['reference_' + m]:.6f})"
                                    for m in metrics)
                console.print(f"{key}: grader-computed {figures}; logits {len(d['logits_shapes'])} arrays, "
                              f"first {d['logits_shapes'][0]}")
    return report


def _with_budget(check: dict, budgets: dict | None) -> dict:
    """A timed check's entry names its level's budget and what the level's child used on the grader's clock
    (its own `seconds` are the child's word, shown for reading only)."""
    b = (budgets or {}).get(check["level"])
    if b is not None:
        check["budget"] = {k: b.get(k) for k in ("budget_cpu_s", "kill_at_cpu_s", "wall_limit_s", "used_cpu_s",
                                                 "used_wall_s", "meter", "rule")}
    return check


def _coverage_json(executed: dict) -> dict:
    return {rel: {"lines": sorted(e["lines"]), "arcs": sorted(e["arcs"])} for rel, e in sorted(executed.items())}


def _fig(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def save_report(report: dict, report_dir: Path) -> None:
    """reports/<task>.json (the fresh pass adds its section and saves again)."""
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / f"{report['task']}.json").write_text(json.dumps(report, indent=2, default=float))


def print_checks(title: str, checks: list[dict]) -> None:
    """The per-check table of a report's checks (dicts as the report holds them)."""
    t = Table(title=title)
    for col in ("level", "check", "measure", "score", "bar", "max|diff|", "rel L2", "digits", "s", "reason"):
        t.add_column(col)
    for c in checks:
        colour = "green" if c["score"] >= c["bar"] else "red"
        t.add_row(c["level"], c["name"], c["measure"], f"[{colour}]{c['score']:.6f}[/]", f"{c['bar']:.4f}",
                  _fig(c.get("max_abs_diff"), ".2e"), _fig(c.get("rel_l2"), ".2e"), _fig(c.get("digits"), ".1f"),
                  f"{c['seconds']:.1f}", c.get("reason") or "")
    console.print(t)
