"""The fixed-size towers' data pipeline (gemma3, paligemma, llava_next, intern_vl) against LLaMA-Factory's own
(tools/lf_parity/plugins.py): every row's ids, masks and labels, and the SFT, DPO and PPO collators' batches (token
types, pixels, image sizes; a batch with images and one with LF's fake image). Slow, and only where `make lf-env`
has built .venv-lf. A pixel difference that vanishes with the source run under .venv-lf's Pillow is the two
environments' Pillows (13.0 here, 11.3 there), not the source: it is reported, not failed."""

from __future__ import annotations

import pytest

from tools.lf_parity.plugins import FAMILIES, LF_PYTHON, failures, family_parity, render


@pytest.mark.slow
@pytest.mark.skipif(not LF_PYTHON.exists(), reason=f"{LF_PYTHON} is missing: run `make lf-env` first")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tower_plugin_pipeline_matches_llamafactory(family, tmp_path):
    result = family_parity(family, tmp_path)
    assert {stage for stage, _ in result["cells"]} == {"sft", "dpo", "ppo"}
    assert all("first" in cells for cells in result["cells"].values())
    assert not failures(result, environment=False), render(family, result)
