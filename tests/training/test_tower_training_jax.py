"""The fixed-size towers' families (issue 34: gemma3, paligemma, llava_next, internvl) through the JAX trainers
against the torch sources, end to end on the shipped VL data: SFT (step losses, evals, adapter), DPO (losses, metrics,
evals, adapter) and PPO (sampled responses identical, step stats, held-out rewards, adapter, value head). The torch
source runs the tower in every forward; the JAX oracle feeds the frozen tower's rows (each family's encode_images,
outside the jit) into its jitted steps, with Gemma 3's and PaliGemma's token types. PaliGemma (the smallest) runs in
CI, the other three in make test-full."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

jax.config.update("jax_default_matmul_precision", "highest")

from ppo_runs import assert_ppo_runs_match, max_diff  # noqa: E402 (tests/training/ppo_runs.py)
from catalog.workloads import rewarded_steps, width_dependent_metrics  # noqa: E402
from jax_oracles.training import dpo as jdpo  # noqa: E402
from jax_oracles.training import ppo as jppo  # noqa: E402
from jax_oracles.training import sft as jsft  # noqa: E402
from torch_sources.training import dpo as tdpo  # noqa: E402
from torch_sources.training import ppo as tppo  # noqa: E402
from torch_sources.training import sft as tsft  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
# family: (template, cutoff_len), as configs/task/<family>-*.yaml
TASKS = {"paligemma": ("paligemma", 128), "gemma3": ("gemma3", 160), "llava_next": ("llava_next", 320),
         "internvl": ("intern_vl", 320)}
FAMILIES = ["paligemma", *(pytest.param(f, marks=pytest.mark.slow) for f in ("gemma3", "internvl", "llava_next"))]
# Adam's normalised updates carry the gradients' rounding noise (InternVL's first SFT step: LoRA grads within 4.5e-8
# of 0.13): the adapters part by up to 3.7e-5 after SFT's 3 steps (InternVL), 3.6e-5 after DPO's 4 (Gemma 3) and
# 4.2e-5 after PPO's 3 x 4 epochs (Gemma 3)
ADAPTER_ATOL = 6e-5


def _assets(family: str) -> tuple[Path, Path]:
    return ROOT / "assets/checkpoints" / family, ROOT / "assets/tokenizer" / family



def _features(family: str) -> list[str]:
    return yaml.safe_load((ROOT / "configs/family" / f"{family}.yaml").read_text())["features"]


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_end_to_end_matches(family):
    (template, cutoff), (ckpt, tokenizer) = TASKS[family], _assets(family)
    kw = dict(template=template, cutoff_len=cutoff, num_train_epochs=1)
    want = tsft.train_sft(ckpt, tokenizer, ROOT / "assets/data/sft_vl", tsft.TrainArgs(**kw))
    got = jsft.train_sft(ckpt, tokenizer, ROOT / "assets/data/sft_vl", jsft.TrainArgs(**kw))
    np.testing.assert_allclose(got.step_losses, want.step_losses, rtol=1e-5)
    np.testing.assert_allclose([got.eval_loss_before, got.eval_loss_after],
                               [want.eval_loss_before, want.eval_loss_after], rtol=1e-5)
    assert max_diff(got.lora_state_dict, want.lora_state_dict) < ADAPTER_ATOL
    assert want.eval_loss_after < want.eval_loss_before - 0.1  # the images' answers are learnable


@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_end_to_end_matches(family):
    """Reward metrics where the policy has left the reference (rewarded_steps); Gemma 3's sliding window leaves the
    logits means out (catalog.workloads.WIDTH_METRICS: a padded query past the window spreads over every key of the
    padded width)."""
    (template, cutoff), (ckpt, tokenizer) = TASKS[family], _assets(family)
    kw = dict(template=template, cutoff_len=cutoff, num_train_epochs=2)
    want = tdpo.train_dpo(ckpt, tokenizer, ROOT / "assets/data/dpo_vl", tdpo.DPOArgs(**kw))
    got = jdpo.train_dpo(ckpt, tokenizer, ROOT / "assets/data/dpo_vl", jdpo.DPOArgs(**kw))
    np.testing.assert_allclose(got.step_losses, want.step_losses, rtol=1e-5, atol=1e-6)
    rewarded, skip = rewarded_steps(want.step_metrics), width_dependent_metrics(_features(family))
    assert 0 < len(rewarded) < len(want.step_losses)
    for name in set(want.step_metrics) - set(skip):
        steps = rewarded if name.startswith("rewards/") else slice(None)
        np.testing.assert_allclose(np.asarray(got.step_metrics[name])[steps],
                                   np.asarray(want.step_metrics[name])[steps], rtol=1e-4, atol=1e-5, err_msg=name)
    for when in ("eval_before", "eval_after"):
        w, g = getattr(want, when), getattr(got, when)
        names = [k for k in w if k not in skip]
        np.testing.assert_allclose([g[k] for k in names], [w[k] for k in names], rtol=1e-4, atol=1e-5, err_msg=when)
    assert max_diff(got.lora_state_dict, want.lora_state_dict) < ADAPTER_ATOL


@pytest.mark.parametrize("family", FAMILIES)
def test_ppo_end_to_end_matches(family):
    """LF's PPO with the towers' inputs (torch_sources/training/ppo.py's docstring): the prompts' image rows in
    generation and TRL's forward passes, text positions, Gemma 3's and PaliGemma's token types; a text reward model.
    The same sampled responses, step stats (the noise stat left out, the moved stats at the steps that moved),
    held-out rewards, adapter and value head; and one rollout's token types of query + response on both sides: the
    query's, then the prompt's last type (PaliGemma's 1, Gemma 3's 0) over the response, pads 0."""
    (template, cutoff), (ckpt, tokenizer) = TASKS[family], _assets(family)
    reward, data = ROOT / "assets/checkpoints/llama3-reward", ROOT / "assets/data/sft_vl"
    kw = dict(template=template, cutoff_len=cutoff, num_train_epochs=1, eval_samples=1)
    want = tppo.train_ppo(ckpt, tokenizer, data, reward, tppo.PPOArgs(**kw))
    got = jppo.train_ppo(ckpt, tokenizer, data, reward, jppo.PPOArgs(**kw))
    assert_ppo_runs_match(want, got, tppo.STATS, adapter_atol=ADAPTER_ATOL)

    args = tppo.PPOArgs(**kw)  # one rollout (step 0's noise) on both sides: its model inputs
    prompts = tppo.load_prompt_dataset(tokenizer, data, "train", args)[:4]
    eos, pad = tppo.generation_ids(tokenizer, args)
    policy, rm = tppo.load_policy(ckpt, args), tppo.load_reward_model(reward)
    mm = tppo.make_collator(args, tokenizer, data).mm
    queries, responses, _, vision = tppo.rollout(policy, rm, prompts, args, eos, pad, 0, mm=mm)
    inputs = tppo.prepare_model_inputs(queries, responses, pad, vision)
    assert "row_positions" not in inputs and "token_image_embeds" in inputs
    jargs = jppo.PPOArgs(**kw)
    jpolicy, trainable = jppo.load_policy(ckpt, jargs)
    jreward, jreward_head = jppo.load_reward_model(reward)
    jmm = jppo.make_collator(jargs, tokenizer, data_dir=data).mm
    width = jppo._prompt_width(prompts) + jsft._fake_media_length(jmm)
    batch, _ = jppo.rollout(jpolicy, trainable["lora"], jreward, jreward_head, prompts, jargs, eos, pad, 0, width,
                            mm=jmm)
    L = inputs["input_ids"].shape[1]
    np.testing.assert_array_equal(np.asarray(batch["input_ids"])[:, :L], inputs["input_ids"].numpy())
    if "token_type_ids" not in inputs:  # LLaVA-NeXT, InternVL
        assert "token_type_ids" not in batch
        return
    types = inputs["token_type_ids"].numpy()
    np.testing.assert_array_equal(np.asarray(batch["token_type_ids"])[:, :L], types)
    text_type = {"paligemma": 1, "gemma3": 0}[family]
    for i, (q, r) in enumerate(zip(queries, responses)):
        assert (types[i, len(q):len(q) + len(r)] == text_type).all() and (types[i, len(q) + len(r):] == 0).all()
