"""The timing loop bench_sft.py and bench_dpo.py share: rounds of the two frameworks alternate, so that a change
in machine load hits both, and the best round of each is reported (the least disturbed one)."""
from __future__ import annotations

import statistics


def report_step_times(runners: dict, rounds: int, steps: int, warmup: int, label: str) -> dict[str, float]:
    """runners: {name: run(num_steps) -> seconds}; prints best and median ms per step, then the ratio line."""
    for run in runners.values():
        run(warmup)  # JAX: compile
    times = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            times[name].append(run(steps) / steps * 1e3)
    best = {name: min(ms) for name, ms in times.items()}
    for name, ms in times.items():
        print(f"{name:5s} {label} step ms: best {best[name]:7.2f}  median {statistics.median(ms):7.2f}")
    print(f"torch {label} step ms {best['torch']:.2f}  jax {label} step ms {best['jax']:.2f}  "
          f"ratio jax/torch {best['jax'] / best['torch']:.3f}")
    return best
