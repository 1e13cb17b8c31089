"""The fixed-size towers' families (issue 34, staged) through the torch trainers: LF's SFT and DPO run on their data
with images (finite losses, the first step at log(V)-ish for SFT and log 2 for DPO, adapters only outside the tower
and projector), and PPO runs on their prompts' images (PaliGemma's here; every family against the JAX twin in
test_tower_training_jax.py)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from torch_sources.training import dpo, ppo, sft

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {"paligemma": ("paligemma", 128), "gemma3": ("gemma3", 160), "llava_next": ("llava_next", 320),
            "internvl": ("intern_vl", 320)}


def _dirs(family):
    return ROOT / "assets/checkpoints" / family, ROOT / "assets/tokenizer" / family


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sft_and_dpo_train_on_images(family):
    template, cutoff = FAMILIES[family]
    ckpt, tok = _dirs(family)
    args = sft.TrainArgs(template=template, cutoff_len=cutoff, num_train_epochs=1, per_device_train_batch_size=4,
                         gradient_accumulation_steps=2, learning_rate=5e-3)
    result = sft.train_sft(ckpt, tok, ROOT / "assets/data/sft_vl", args)
    assert all(math.isfinite(x) for x in result.step_losses) and abs(result.step_losses[0] - math.log(512)) < 1.0
    names = list(result.lora_state_dict)
    assert names and not any("vision_tower" in k or "multi_modal_projector" in k for k in names)
    assert all(".language_model." in k for k in names)
    dargs = dpo.DPOArgs(template=template, cutoff_len=cutoff, num_train_epochs=1, per_device_train_batch_size=2,
                        gradient_accumulation_steps=2)
    losses = dpo.train_dpo(ckpt, tok, ROOT / "assets/data/dpo_vl", dargs).step_losses
    assert abs(losses[0] - math.log(2)) < 1e-6 and all(math.isfinite(x) for x in losses)


def test_ppo_runs_on_a_towers_images():
    """PaliGemma's PPO: the prompts' image rows at the image tokens (no M-RoPE positions), its token types in
    generation and in TRL's forward (the query's, then the prompt's last type, LF's 1, over the response; pads 0);
    finite stats, responses cut after eos, adapters only in the language model (the JAX twin's equality:
    test_tower_training_jax.py)."""
    ckpt, tok = _dirs("paligemma")
    reward, data = ROOT / "assets/checkpoints/llama3-reward", ROOT / "assets/data/sft_vl"
    args = ppo.PPOArgs(template="paligemma", cutoff_len=128, num_train_epochs=1, eval_samples=1)
    result = ppo.train_ppo(ckpt, tok, data, reward, args)
    assert all(math.isfinite(v) for k in ppo.STATS for v in result.step_stats[k])
    assert len(result.step_responses) == 3 and all(r.shape == (args.batch_size, args.max_new_tokens)
                                                   for r in result.step_responses)
    assert all(".language_model." in k for k in result.lora_state_dict)

    prompts = ppo.load_prompt_dataset(tok, data, "train", args)[:4]
    eos, pad = ppo.generation_ids(tok, args)
    policy = ppo.load_policy(ckpt, args)
    mm = ppo.make_collator(args, tok, data).mm
    queries, responses, _, vision = ppo.rollout(policy, ppo.load_reward_model(reward), prompts, args, eos, pad, 0,
                                                mm=mm)
    inputs = ppo.prepare_model_inputs(queries, responses, pad, vision)
    assert "row_positions" not in inputs
    image = inputs["input_ids"] == policy.pretrained_model.config.image_token_id
    assert image.any() and (inputs["token_image_embeds"][image].abs().sum(-1) > 0).all()
    for i, (q, r) in enumerate(zip(queries, responses)):
        types = inputs["token_type_ids"][i]
        assert (types[len(q):len(q) + len(r)] == 1).all() and (types[len(q) + len(r):] == 0).all()
        assert (types[:len(q)][image[i, :len(q)]] == 0).all()  # the image tokens: PaliGemma's type-0 prefix
