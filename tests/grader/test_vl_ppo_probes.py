"""The vision-language PPO probes' own pieces (qwen2_vl on the shipped VL prompts), against the workflows they stand in
for:
- catalog/ppo_eval.py: the rope deltas it derives from a prompt's M-RoPE positions are the collator's, the positions
  `decode` hands the forward continue them as torch_sources' mrope.decode_positions does, and a VL batch's queries
  start at the first attended token (LF's fake image stays out), as the torch workflow trims them;
- grader/probes/training_ppo.py: the step batch's per-token image features it lays out from the candidate's
  prompt_vision are the JAX rollout's own, and the L6 child's forward on the decode buffer gives the model's logits
  with the pixels at the prompt's positions.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from catalog import ppo_eval
from grader.probes import training_ppo as probes
from jax_oracles.training import ppo as jppo
from torch_sources.models import mrope
from torch_sources.training import ppo as tppo

jax.config.update("jax_default_matmul_precision", "highest")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROOT = Path(__file__).resolve().parents[2]
CKPT, TOKENIZER = ROOT / "assets/checkpoints/qwen2_vl", ROOT / "assets/tokenizer/qwen2_vl"
REWARD, DATA = ROOT / "assets/checkpoints/llama3-reward", ROOT / "assets/data/sft_vl"
ARGS = dict(template="qwen2_vl", cutoff_len=128, per_device_train_batch_size=2, gradient_accumulation_steps=1,
            max_new_tokens=3)
IMAGE_FREE = [2, 9]  # train rows without an image: their batch gets LF's fake image (row 0, masked)


def _torch_batch(rows):
    args = tppo.PPOArgs(**ARGS)
    model = tppo.load_policy(CKPT, args)
    collate = tppo.make_collator(args, TOKENIZER, DATA, model.pretrained_model.rope_index)
    features = tppo.load_prompt_dataset(TOKENIZER, DATA, "train", args)
    return collate([features[i] for i in rows])


@pytest.mark.parametrize("rows", [[0, 1, 3, 4], IMAGE_FREE], ids=["images", "fake_image"])
def test_rope_deltas_and_decode_positions(rows):
    batch = _torch_batch(rows)
    positions, mask = batch["position_ids"].numpy(), batch["attention_mask"].numpy()
    deltas = ppo_eval.rope_deltas(positions, mask)
    assert deltas.tolist() == batch["rope_deltas"][:, 0].tolist()
    seen = []

    def forward(ids, m, pos):
        seen.append((np.array(m), np.array(pos)))
        return np.zeros((*ids.shape, 512), np.float32)

    gen = dict(max_new_tokens=3, pad_token_id=0, eos_token_ids=[1], temperature=1.0, top_k=0, top_p=1.0)
    ppo_eval.decode(forward, batch["input_ids"].numpy(), mask, np.ones((len(mask), 3, 512), np.float32), gen, positions)
    P = mask.shape[1]
    for step, (m, pos) in enumerate(seen):
        np.testing.assert_array_equal(pos[:, :, :P], positions)  # the prompt keeps its own
        want = mrope.decode_positions(torch.tensor(m[:, :P + step]), batch["rope_deltas"])[..., P:].numpy()
        np.testing.assert_array_equal(pos[:, :, P:P + step], want)  # each new token as transformers' generate


def test_vl_queries_start_at_the_first_attended_token():
    batch = _torch_batch(IMAGE_FREE)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert (mask[0] == 0).sum() > (ids[0] == 0).sum()  # the fake image: masked tokens that are not pads
    responses = torch.tensor([[5, 6, 0], [7, 0, 0]])
    want, _ = tppo.trim_rollouts(ids, responses, 0, 0, mask)
    got, _ = ppo_eval.trim_rollouts(ids.numpy(), responses.numpy(), 0, 0, mask.numpy())
    assert [x.tolist() for x in got] == [x.tolist() for x in want]


@pytest.mark.slow  # CI time (9-13 s): the rope-delta and query tests stay in CI; qwen2-vl-sft grades there
def test_grader_step_features_are_the_rollouts():
    """The JAX rollout's batch (per-token image features of query + response) against the grader's layout from the
    same prompt batch through prompt_vision: the same arrays."""
    args = jppo.PPOArgs(**ARGS)
    policy, trainable = jppo.load_policy(CKPT, args)
    mm = jppo.make_collator(args, TOKENIZER, data_dir=DATA, rope_index=policy.module.rope_index).mm
    features = jppo.load_prompt_dataset(TOKENIZER, DATA, "train", args)
    prompts = [features[i] for i in (0, 1)]
    width = max(len(f["input_ids"]) for f in prompts) + 3
    reward, reward_v_head = jppo.load_reward_model(REWARD)
    eos, pad = jppo.generation_ids(TOKENIZER, args)
    batch, _ = jppo.rollout(policy, trainable["lora"], reward, reward_v_head, prompts, args, eos, pad, 0, width, mm=mm)
    prompt = jppo.PromptDataCollator(pad, pad_to_length=width, mm=mm)(prompts)
    inp = {**{f"prompt.{k}": np.asarray(v) for k, v in prompt.items()},
           **{k: np.asarray(batch[k]) for k in ("input_ids", "query_len")}}
    got = probes._row_features(SimpleNamespace(workflow=jppo), policy, inp)
    want = {k: np.asarray(v) for k, v in batch.items() if k.startswith("token_")}
    assert got.keys() == want.keys() and want
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), want[k])


@pytest.mark.slow  # CI time (9-13 s): the rope-delta and query tests stay in CI; qwen2-vl-sft grades there
def test_heldout_forward_sees_the_images():
    """The L6 child's forward on the decode buffer (prompt + new columns, masked): at the prompt's attended
    positions, the model's logits with the pixels (a pad position attends to nothing: its logits are noise)."""
    args = jppo.PPOArgs(**ARGS)
    model = jppo.load_model(CKPT, jppo.lora_config(args))
    collate = jppo.make_collator(args, TOKENIZER, data_dir=DATA, rope_index=model.module.rope_index)
    b = collate(jppo.load_prompt_dataset(TOKENIZER, DATA, "eval", args)[:2])
    inp = {f"b0.{k}": np.asarray(b[k]) for k in ("input_ids", "attention_mask", "position_ids", "pixel_values",
                                                 "image_grid_thw")}
    inp["gen.max_new_tokens"] = np.int64(3)
    variables = {"params": model.params}
    forward = probes._heldout_forward(SimpleNamespace(workflow=jppo), model, variables, inp, 0, None)
    ids, mask = inp["b0.input_ids"], inp["b0.attention_mask"]
    buffer = [np.concatenate([x, np.zeros((2, 3), x.dtype)], 1) for x in (ids, mask)]  # 3 new columns, masked
    prompt_positions = inp["b0.position_ids"]
    positions = ppo_eval._positions(buffer[1], prompt_positions, ppo_eval.rope_deltas(prompt_positions, mask))
    got = forward(*buffer, positions)[:, :ids.shape[1]]
    want = model.module.apply(variables, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(inp["b0.position_ids"]),
                              pixel_values=jnp.asarray(inp["b0.pixel_values"]), image_grid_thw=inp["b0.image_grid_thw"])
    attended = mask.astype(bool)
    np.testing.assert_allclose(got[attended], np.asarray(want)[attended], atol=2e-5)


OMNI_CKPT, OMNI_TOKENIZER = ROOT / "assets/checkpoints/qwen2_omni", ROOT / "assets/tokenizer/qwen2_omni"
OMNI_ARGS = {**ARGS, "template": "qwen2_omni", "cutoff_len": 160}


def test_omni_rope_deltas_are_prompt_visions():
    """Qwen2.5-Omni's thinker: the deltas ppo_eval derives are the ones the workflow's generation continues
    (prompt_vision's, against the text positions), not LF's Omni collator's (against the absolute column)."""
    args = tppo.PPOArgs(**OMNI_ARGS)
    model = tppo.load_policy(OMNI_CKPT, args)
    collate = tppo.make_collator(args, OMNI_TOKENIZER, DATA, model.pretrained_model.rope_index)
    features = tppo.load_prompt_dataset(OMNI_TOKENIZER, DATA, "train", args)
    batch = collate([features[i] for i in (0, 1, 3, 4)])
    assert "input_features" in batch
    vision = tppo.prompt_vision(model, batch)
    deltas = ppo_eval.rope_deltas(batch["position_ids"].numpy(), batch["attention_mask"].numpy())
    assert deltas.tolist() == vision["rope_deltas"][:, 0].tolist()
    assert "token_audio_embeds" in vision


@pytest.mark.slow  # CI time (9-13 s): the rope-delta and query tests stay in CI; qwen2-vl-sft grades there
def test_omni_heldout_forward_is_the_workflows():
    """The L6 child's forward on an Omni prompt batch (the candidate's audio tower on LF's fake audio, its rows at
    the audio tokens, a sampled audio / video / image-pad token as text) gives the logits of the JAX workflow's own
    generate inputs on the same buffer."""
    args = jppo.PPOArgs(**OMNI_ARGS)
    model = jppo.load_model(OMNI_CKPT, jppo.lora_config(args))
    collate = jppo.make_collator(args, OMNI_TOKENIZER, data_dir=DATA, rope_index=model.module.rope_index)
    b = collate(jppo.load_prompt_dataset(OMNI_TOKENIZER, DATA, "eval", args)[:2])
    inp = {f"b0.{k}": np.asarray(b[k]) for k in probes.PROMPT_FIELDS if k in b and k != "rope_deltas"}
    assert "b0.input_features" in inp
    inp["gen.max_new_tokens"] = np.int64(3)
    variables = {"params": model.params}
    forward = probes._heldout_forward(SimpleNamespace(workflow=jppo), model, variables, inp, 0, None)
    ids, mask = inp["b0.input_ids"], inp["b0.attention_mask"]
    c = model.module.config
    new = np.array([[c.audio_token_id, c.video_token_id, 5], [c.image_token_id, 7, c.audio_token_id]], ids.dtype)
    buffer = [np.concatenate([ids, new], 1), np.concatenate([mask, np.ones((2, 3), mask.dtype)], 1)]
    prompt_positions = inp["b0.position_ids"]
    positions = ppo_eval._positions(buffer[1], prompt_positions, ppo_eval.rope_deltas(prompt_positions, mask))
    got = forward(*buffer, positions)
    vision = jppo.prompt_vision(model, {**{k[3:]: v for k, v in inp.items() if k.startswith("b0.")},
                                        "rope_deltas": b["rope_deltas"]})
    prompt = {k: v for k, v in vision.items() if k.startswith("token_")}
    assert "token_audio_embeds" in prompt
    text = jppo._text_features(model.module, model.params, {k[6:]: v for k, v in prompt.items()})
    features = {k[6:]: jnp.concatenate([v, jnp.broadcast_to(text[k[6:]], (2, 3, *text[k[6:]].shape))], 1)
                for k, v in prompt.items()}
    want = model.module.apply(variables, jnp.asarray(buffer[0]), jnp.asarray(buffer[1]), jnp.asarray(positions),
                              **jppo._image_inputs(model.module, jnp.asarray(buffer[0]), features))
    attended = buffer[1].astype(bool)
    np.testing.assert_allclose(got[attended], np.asarray(want)[attended], atol=2e-5)
