"""The repo's own solution trees, run through the twin: every property established, for one task of each class
and family shape (pre-norm, ALiBi, parallel residual, vision-language training; MoE, Gemma 4, vision-language
serving). llama3-sft and llama3-core run in the fast suite through tests/twin/test_boundary.py."""
from __future__ import annotations

import pytest

from grader.app import ROOT
from twin.harness import run_twin
from twin.properties import ESTABLISHED

TASKS = ("llama3-sft", "bloom-sft", "falcon-sft", "qwen2-vl-sft", "llama3-dpo", "llama3-ppo",
         "llama3-core", "llama3-chunked", "gemma4-core", "gpt-oss-ragged", "qwen2_5-vl-core")


@pytest.mark.slow
@pytest.mark.sandbox
@pytest.mark.parametrize("task", TASKS)
def test_every_property_is_established_on_the_oracle(task):
    report = run_twin(task, ROOT, seed=2)
    bad = [(r.prop.key, r.status, r.candidate_error or r.torch_error or r.first_divergent) for r in report.results
           if r.status != ESTABLISHED]
    assert not bad, bad
    assert len(report.results) >= 8  # the spec, operators, a layer, the forward, loss or decode, a step
