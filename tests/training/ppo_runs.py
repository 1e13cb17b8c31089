"""What two PPO runs of one task (the torch source's and the JAX twin's) must share, for the vision-language tests:
the sampled responses, every step stat (the noise stat left out, the moved stats at the steps that moved: as the
grader's PPO checks), the held-out rewards before and after, the adapter and the value head."""
from __future__ import annotations

import numpy as np

from catalog.workloads import PPO_MOVED_STATS, PPO_NOISE_STATS, moved_steps


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(np.asarray(a[k]) - np.asarray(b[k])).max()) for k in a)


def assert_ppo_runs_match(want, got, stats: tuple[str, ...], adapter_atol: float) -> None:
    """want, got: PPOResults of a 3-step run; stats: the source's STATS."""
    assert len(want.step_responses) == 3
    for w, g in zip(want.step_responses, got.step_responses):
        np.testing.assert_array_equal(g, w)
    moved = moved_steps(want.step_stats)
    assert 0 < len(moved) < 3  # warmup holds the first step still
    for name in stats:
        if name in PPO_NOISE_STATS:
            continue
        steps = moved if name in PPO_MOVED_STATS else slice(None)
        np.testing.assert_allclose(np.asarray(got.step_stats[name])[steps], np.asarray(want.step_stats[name])[steps],
                                   rtol=1e-4, atol=1e-5, err_msg=name)
    np.testing.assert_allclose([got.eval_before, got.eval_after], [want.eval_before, want.eval_after], rtol=1e-5,
                               atol=1e-6)
    assert max_diff(got.lora_state_dict, want.lora_state_dict) < adapter_atol
    assert max_diff(got.value_head, want.value_head) < 3e-5
