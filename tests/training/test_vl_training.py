"""Vision-language LoRA training, torch source against the JAX oracle, end to end on the shipped VL data
(qwen2_vl and qwen3_vl, their templates' mm plugins, LF's collator with the fake image and M-RoPE positions; the
Qwen2.5-Omni thinker's PPO too, its SFT and DPO in test_omni_audio.py): the same step losses, eval losses and
adapter, and a held-out loss that training lowers. The torch source runs the tower in every forward; the JAX oracle
feeds the frozen tower's precomputed output (Qwen3-VL's DeepStack features too, Omni's audio rows) into its jitted
steps."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
import torch

jax.config.update("jax_default_matmul_precision", "highest")

from ppo_runs import assert_ppo_runs_match, max_diff  # noqa: E402 (tests/training/ppo_runs.py)
from catalog.workloads import rewarded_steps  # noqa: E402
from jax_oracles.training import dpo as jdpo  # noqa: E402
from jax_oracles.training import lora as jlora  # noqa: E402
from jax_oracles.training import ppo as jppo  # noqa: E402
from jax_oracles.training import sft as jsft  # noqa: E402
from torch_sources.training import dpo as tdpo  # noqa: E402
from torch_sources.training import lora as tlora  # noqa: E402
from torch_sources.training import loss as tloss  # noqa: E402
from torch_sources.training import ppo as tppo  # noqa: E402
from torch_sources.training import sft as tsft  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
# Per family (its template is its name): qwen2_vl's default system prompt is 25 tokens, so at 64 infer_seqlen would
# cut image tokens; qwen3_vl's images are 64-87 tokens, up to two a row: below 192 some row's image is cut, and at
# 232 no row is cut at all.
CUTOFF = {"qwen2_vl": 128, "qwen3_vl": 232, "qwen2_omni": 128}
# qwen2_vl's SFT runs in CI; qwen3_vl's (about as long) in make test-full, with a fast batch test in CI
SFT_FAMILIES = ["qwen2_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow)]


def _assets(family: str) -> tuple[Path, Path]:
    return ROOT / "assets/checkpoints" / family, ROOT / "assets/tokenizer" / family



@pytest.mark.parametrize("family", SFT_FAMILIES)
def test_sft_end_to_end_matches(family):
    ckpt, tokenizer = _assets(family)
    kw = dict(template=family, cutoff_len=CUTOFF[family], num_train_epochs=1)
    want = tsft.train_sft(ckpt, tokenizer, ROOT / "assets/data/sft_vl", tsft.TrainArgs(**kw))
    got = jsft.train_sft(ckpt, tokenizer, ROOT / "assets/data/sft_vl", jsft.TrainArgs(**kw))
    np.testing.assert_allclose(got.step_losses, want.step_losses, rtol=1e-5)
    np.testing.assert_allclose([got.eval_loss_before, got.eval_loss_after],
                               [want.eval_loss_before, want.eval_loss_after], rtol=1e-5)
    assert max_diff(got.lora_state_dict, want.lora_state_dict) < 1e-5
    assert want.eval_loss_after < want.eval_loss_before - 0.1  # the images' answers are learnable


def test_sft_eval_without_the_images_is_refused():
    """A vision-language row reaches the model only with its images: a collator without the mm context (a text
    template's) cannot collate it into a forward that sees pixels, so the processor refuses images it cannot
    place (LF's base plugin)."""
    with pytest.raises(ValueError, match="image"):
        tsft.load_processed_dataset(_assets("qwen2_vl")[1], ROOT / "assets/data/sft_vl", "train",
                                    tsft.TrainArgs(template="qwen", cutoff_len=CUTOFF["qwen2_vl"]))


def test_qwen3_vl_padded_batch_loss_matches():
    """Qwen3-VL's image input through the JAX trainer's static-shape batch (the merged patches and the DeepStack
    features precomputed, padded with zero rows as the rows are padded with filler) against the torch source's
    forward on the collated batch's pixels: the same loss at a random adapter. In CI; the end-to-end runs are
    make test-full's."""
    ckpt, tokenizer = _assets("qwen3_vl")
    data, args = ROOT / "assets/data/sft_vl", tsft.TrainArgs(template="qwen3_vl", cutoff_len=CUTOFF["qwen3_vl"])
    features = tsft.load_processed_dataset(tokenizer, data, "train", args)
    rows = [features[3], features[11]]  # one image each, of one grid (one tower compile)
    model = tsft.load_model(ckpt, tsft.lora_config(args))
    rng = np.random.default_rng(3)
    lora = {k: rng.normal(0, 0.05, v.shape).astype(np.float32) if "lora_B" in k else v
            for k, v in tlora.lora_state_dict(model).items()}
    tlora.load_lora_state_dict(model, lora)
    batch = tsft.make_collator(args, tokenizer, data_dir=data, rope_index=model.rope_index)(rows)
    with torch.no_grad():
        logits = model(torch.as_tensor(batch["input_ids"]), torch.as_tensor(batch["attention_mask"]),
                       **tsft.model_inputs(batch))
    want = tloss.causal_lm_loss(logits, torch.as_tensor(batch["labels"]), tloss.count_label_tokens(batch["labels"]))

    jargs = jsft.TrainArgs(template="qwen3_vl", cutoff_len=CUTOFF["qwen3_vl"])
    jmodel = jsft.load_model(ckpt, jsft.lora_config(jargs))
    jbatch = jsft.make_collator(jargs, tokenizer, data_dir=data, rope_index=jmodel.module.rope_index)(rows)
    embedded = jsft._embedded(jmodel, jbatch)  # what a jitted step reads instead of the pixels
    n = int((jbatch["input_ids"] == jmodel.module.config.image_token_id).sum())
    assert embedded["image_embeds"].shape == (n, 64) and embedded["deepstack_embeds"].shape == (n, 2, 64)
    padded = jsft._pad_batch(embedded, 4, 160, 0)  # two filler rows; 640 feature rows
    assert padded["deepstack_embeds"].shape == (640, 2, 64)
    got = jsft._eval_fn(jmodel.module)(jmodel.params, jlora.lora_tree_from_state_dict(lora), padded)
    assert abs(float(got) - want.item()) <= 1e-5 * want.item()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_dpo_end_to_end_matches(family):
    """Reward metrics are compared where the policy has left the reference (catalog.workloads.rewarded_steps: at
    the init every torch reward is exactly 0, and rounding noise decides the accuracies of those ties)."""
    ckpt, tokenizer = _assets(family)
    kw = dict(template=family, cutoff_len=CUTOFF[family], num_train_epochs=2)
    want = tdpo.train_dpo(ckpt, tokenizer, ROOT / "assets/data/dpo_vl", tdpo.DPOArgs(**kw))
    got = jdpo.train_dpo(ckpt, tokenizer, ROOT / "assets/data/dpo_vl", jdpo.DPOArgs(**kw))
    np.testing.assert_allclose(got.step_losses, want.step_losses, rtol=1e-5, atol=1e-6)
    rewarded = rewarded_steps(want.step_metrics)
    assert 0 < len(rewarded) < len(want.step_losses)
    for name in want.step_metrics:
        steps = rewarded if name.startswith("rewards/") else slice(None)
        np.testing.assert_allclose(np.asarray(got.step_metrics[name])[steps], np.asarray(want.step_metrics[name])[steps],
                                   rtol=1e-4, atol=1e-5, err_msg=name)
    for when in ("eval_before", "eval_after"):
        w, g = getattr(want, when), getattr(got, when)
        np.testing.assert_allclose([g[k] for k in w], [w[k] for k in w], rtol=1e-4, atol=1e-5, err_msg=when)
    assert max_diff(got.lora_state_dict, want.lora_state_dict) < 3e-5  # 4 Adam steps: normalised updates carry noise


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen2_omni"])
def test_ppo_end_to_end_matches(family):
    """LF's PPO with the multimodal collator's inputs (the torch docstring says why LF's own cannot run a VL policy):
    the prompts' images in generation and in TRL's forward passes, M-RoPE positions, a text reward model. The same
    sampled responses, step stats (the noise stat left out, the moved stats at the steps that moved: as the
    grader's PPO checks), held-out rewards (Omni's after training sits near 0: an absolute floor of 1e-6), adapter
    and value head; and the positions of query + response are the rope index of the concatenated rows (at the
    attended tokens: Omni's index puts pads at 1). Omni: every prompt batch carries LF's fake audio (its rows at the
    masked audio tokens in generation), and the policy samples audio tokens (text, as generate's decode steps embed
    them) and a video token (text, video_tokens_as_text)."""
    ckpt, tokenizer = _assets(family)
    reward, data = ROOT / "assets/checkpoints/llama3-reward", ROOT / "assets/data/sft_vl"
    kw = dict(template=family, cutoff_len=CUTOFF[family], num_train_epochs=1, eval_samples=1)
    want = tppo.train_ppo(ckpt, tokenizer, data, reward, tppo.PPOArgs(**kw))
    got = jppo.train_ppo(ckpt, tokenizer, data, reward, jppo.PPOArgs(**kw))
    assert_ppo_runs_match(want, got, tppo.STATS, adapter_atol=3e-5)

    args = tppo.PPOArgs(**kw)  # one rollout: its positions of query + response against the rope index
    prompts = tppo.load_prompt_dataset(tokenizer, data, "train", args)[:4]
    eos, pad = tppo.generation_ids(tokenizer, args)
    policy, rm = tppo.load_policy(ckpt, args), tppo.load_reward_model(reward)
    mm = tppo.make_collator(args, tokenizer, data, policy.pretrained_model.rope_index).mm
    queries, responses, _, vision = tppo.rollout(policy, rm, prompts, args, eos, pad, 0, mm=mm)
    inputs = tppo.prepare_model_inputs(queries, responses, pad, vision)
    grid = tppo.PromptDataCollator(pad, mm=mm)(prompts)["image_grid_thw"]
    positions, _ = policy.pretrained_model.rope_index(inputs["input_ids"], grid, inputs["attention_mask"])
    attended = inputs["attention_mask"].bool()[None].expand(3, -1, -1)
    np.testing.assert_array_equal(inputs["row_positions"].transpose(0, 1)[attended].numpy(),
                                  positions[attended].numpy())
    if family == "qwen2_omni":
        c = policy.pretrained_model.config
        assert "token_audio_embeds" in vision
        sampled = np.concatenate([r.ravel() for r in want.step_responses])
        assert (sampled == c.audio_token_id).any() and (sampled == c.video_token_id).any()
