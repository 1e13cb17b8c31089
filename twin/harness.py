"""One twin run: the task's properties drawn fresh from a seed, the torch source run on them here (the trusted
process), the candidate on the same inputs in a sealed child (twin/seal.py), each property compared tensor by
tensor (twin/compare.py) and reported established, violated or not established.

Besides the matched probes, the candidate-side diagnostics: independence here (the grader's static scan and
import-linter over the candidate), importability, parameter-tree shapes, gradient liveness, jit with static
shapes and an integrated one-step run in the child (each a property of the task's probe module)."""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from grader.isolation import gate
from twin.compare import TensorDiff, compare_outputs
from twin.properties import ESTABLISHED, NOT_ESTABLISHED, VIOLATED, Property
from twin.seal import run_candidate
from twin.spec import TaskSpec, task_spec

__all__ = ["PropertyResult", "TwinReport", "run_twin"]

INDEPENDENCE = Property("L0/independent", "no torch, transformers or torch source import, direct or indirect "
                        "(static scan + import-linter)", ("jax_oracles", "serving_engine", "conversion"))


@dataclass
class PropertyResult:
    prop: Property
    status: str
    first_divergent: TensorDiff | None = None
    tensors: list[TensorDiff] = field(default_factory=list)
    torch_error: str | None = None
    candidate_error: str | None = None
    seconds: float = 0.0

    def row(self) -> dict:
        return {"key": self.prop.key, "what": self.prop.what, "modules": list(self.prop.modules),
                "status": self.status, "rtol": self.prop.rtol,
                "first_divergent": None if self.first_divergent is None else self.first_divergent.row(),
                "tensors": [t.row() for t in self.tensors], "torch_error": self.torch_error,
                "candidate_error": self.candidate_error, "candidate_seconds": round(self.seconds, 3)}


@dataclass
class TwinReport:
    task: str
    candidate: str
    seed: int
    isolation: str
    results: list[PropertyResult]
    child_failure: str | None
    seconds: float

    @property
    def first_failing(self) -> PropertyResult | None:
        """The first property, in level order, that is not established."""
        return next((r for r in self.results if r.status != ESTABLISHED), None)

    def counts(self) -> dict[str, int]:
        return {s: sum(r.status == s for r in self.results) for s in (ESTABLISHED, VIOLATED, NOT_ESTABLISHED)}

    def to_json(self) -> dict:
        first = self.first_failing
        return {"task": self.task, "candidate": self.candidate, "seed": self.seed, "isolation": self.isolation,
                "summary": {**self.counts(), "first_failing": first and first.prop.key,
                            "first_failing_modules": first and list(first.prop.modules)},
                "child_failure": self.child_failure, "seconds": round(self.seconds, 1),
                "properties": [r.row() for r in self.results]}


def _independence(candidate: Path) -> PropertyResult:
    offences = gate.static_scan(candidate)
    lint_ok, lint_text = gate.run_import_linter(candidate)
    if not offences and lint_ok:
        return PropertyResult(INDEPENDENCE, ESTABLISHED)
    why = "; ".join(offences) or (lint_text.strip().splitlines() or ["import-linter failed"])[-1]
    return PropertyResult(INDEPENDENCE, VIOLATED, candidate_error=why[:1500])


def _judge(prop: Property, want: dict | None, torch_error: str | None, got: dict | None,
           candidate_error: str | None, seconds: float) -> PropertyResult:
    if torch_error is not None or candidate_error is not None:
        return PropertyResult(prop, NOT_ESTABLISHED, torch_error=torch_error, candidate_error=candidate_error,
                              seconds=seconds)
    tensors, first = compare_outputs(prop, got or {}, want or {})
    return PropertyResult(prop, ESTABLISHED if first is None else VIOLATED, first, tensors, seconds=seconds)


def run_twin(task: str, candidate: str | Path, seed: int = 0, *, trusted: bool = False,
             only: tuple[str, ...] | None = None, timeout_s: float = 900.0, checkpoint: str | None = None
             ) -> TwinReport:
    """The twin of `task` on `candidate` (a tree mirroring jax_oracles/, serving_engine/, conversion/) with
    inputs drawn from `seed`. `only`: property names (or keys) to run; `trusted`: the child behind the guard alone
    (no namespaces here), as the grader's trusted=true."""
    started = time.perf_counter()
    candidate = Path(candidate).resolve()
    spec: TaskSpec = task_spec(task, checkpoint)
    side = importlib.import_module(f"twin.torch_side.{spec.task_class}")
    props = [p for p in side.properties(spec) if only is None or p.name in only or p.key in only]
    results = [_independence(candidate)] if only is None or "independent" in only else []

    ctx = side.make_ctx(spec)
    inputs = side.draw(ctx, seed)
    want, torch_errors = {}, {}
    for p in props:
        try:
            want[p.key] = {k: np.asarray(v) for k, v in side.run(ctx, p.key, inputs[p.key]).items()}
        except Exception as e:  # the source itself failed on this input: nothing to establish against
            torch_errors[p.key] = f"{type(e).__name__}: {e}"[:1500]
    meta = {**spec.child_meta(), "properties": [p.key for p in props]}
    got, errors, seconds, child_failure = run_candidate(candidate, spec.task_class, meta, spec.assets,
                                                        {p.key: inputs.get(p.key, {}) for p in props}, timeout_s,
                                                        trusted)
    for p in props:
        results.append(_judge(p, want.get(p.key), torch_errors.get(p.key), got.get(p.key), errors.get(p.key),
                              seconds.get(p.key, 0.0)))
    return TwinReport(task, str(candidate), seed, "trusted: Python-level fence only" if trusted else
                      "bubblewrap sandbox", results, child_failure, time.perf_counter() - started)

