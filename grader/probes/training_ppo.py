"""Run the PPO checks on a candidate (the twin of recorder/probes/training_ppo.py), inside the sandboxed child:
the candidate's jax_oracles.training.ppo through its public names, on the recorded inputs only. The L6 probe
decodes with grader code (catalog/ppo_eval.py) over the candidate's public forward.

A vision-language task's images are encoded by the candidate (its prompt_vision on the recorded prompt batch:
pixels, grids, M-RoPE positions); the step batch's per-token image features are laid out here as the rollout
batch carries them (jax_oracles/training/ppo.py's docstring): each query's columns from its prompt's tail, a
response column the image-pad token's text features. An Omni batch (Qwen2.5-Omni's thinker) also carries LF's fake
audio (input_features, feature_attention_mask): the candidate's prompt_vision runs it through its audio tower, its
rows sit at the audio tokens (a response column: the audio token's text features), and the L6 forward takes a
sampled video token as text (video_tokens_as_text), as the workflow's generate does.
"""
from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from catalog.ppo_eval import decode, eval_noise, rope_deltas
from catalog.workloads import GAE_OPTIONS, KL_COEFS, PPO_TIE_STATS, ROLLOUT_SAMPLING_OPTIONS, pad_rows, ppo_fixed_step_outputs, ppo_fixed_step_runs, ppo_stats_outputs, prompt_features
from grader.probes.training import _lora_from_inputs, n

LOSS_ARGS = ("old_logprobs", "values", "logits", "vpreds", "logprobs", "mask", "advantages", "returns")
# a recorded prompt batch: ids and mask, and a VL batch's M-RoPE positions, rope deltas, pixels and grids (an Omni
# batch's: LF's fake audio too, input_features and feature_attention_mask)
PROMPT_FIELDS = ("input_ids", "attention_mask", "position_ids", "rope_deltas", "pixel_values", "image_grid_thw",
                 "input_features", "feature_attention_mask", "token_type_ids", "image_sizes")
_TOKEN = "token_"  # prompt_vision's per-token tower features: token_<forward keyword> f32[B,P,...]
_TYPES = "token_type_ids"  # prompt_vision's token types (Gemma 3, PaliGemma): not a tower feature
_AUDIO = "audio_embeds"  # Omni's audio rows (the fake audio's), read at the audio tokens


def _prompts(ctx) -> list[dict]:
    return ctx.workflow.load_prompt_dataset(ctx.assets["tokenizer"], ctx.assets["data"], "train", ctx.args)


def _collator(ctx):
    return ctx.workflow.make_collator(ctx.args, ctx.assets["tokenizer"], data_dir=ctx.assets["data"],
                                      rope_index=ctx.rope_index)


def _prompt_batch(inp, prefix: str = "") -> dict:
    return {k: np.asarray(inp[prefix + k]) for k in PROMPT_FIELDS if prefix + k in inp}


def _prompt_features(ctx, policy, batch: dict) -> dict:
    """The candidate's per-token image features of a VL prompt batch {token_<keyword>: f32[B,P,...]} ({} for text)."""
    vision = ctx.workflow.prompt_vision(policy, batch)
    return {} if vision is None else {k: np.asarray(v) for k, v in vision.items()
                                      if k.startswith(_TOKEN) and k != _TYPES}


def _text_features(policy, prompt: dict) -> dict:
    """What a generated image-pad (or audio) token carries (the workflow's rule: it is text): the candidate's
    embedding of the token as its merged patch (its audio row), zero for an added feature (DeepStack's)."""
    def text(token_id):
        ids = jnp.full((1, 1), token_id, jnp.int32)
        return np.asarray(policy.module.apply({"params": policy.params}, ids, method="embed"))[0, 0]
    config = policy.module.config
    return {k: text(config.image_token_id) if k == _TOKEN + "image_embeds"
            else text(config.audio_token_id) if k == _TOKEN + _AUDIO else np.zeros(v.shape[2:], np.float32)
            for k, v in prompt.items()}


def _image_inputs(config, ids, features: dict) -> dict:
    """The forward's tower keywords from per-token features f32[B,T,...]: row k = the k-th image token's (Omni's
    audio rows: audio token's; reading order), padded to B*T rows (never read past the count); an Omni batch's
    forward also takes a sampled video token as text (video_tokens_as_text), as the workflow's generate does."""
    out = {}
    for k, v in features.items():
        keyword = k[len(_TOKEN):]
        flat = (ids == (config.audio_token_id if keyword == _AUDIO else config.image_token_id)).reshape(-1)
        (where,) = jnp.nonzero(flat, size=flat.shape[0], fill_value=0)
        out[keyword] = v.reshape(flat.shape[0], *v.shape[2:])[where]
    if _AUDIO in out:
        out["video_tokens_as_text"] = True
    return out


def _with_images(features: list[dict], names) -> list[dict]:
    """Prompt features with each row's recorded image names ("" padded; read from the task's data dir)."""
    if names is None:
        return features
    return [{**f, "images": [str(x) for x in row if str(x)]} for f, row in zip(features, np.asarray(names))]


def _gen_ids(ctx):
    return ctx.workflow.generation_ids(ctx.assets["tokenizer"], ctx.args)


def _v_head_from_inputs(inp) -> dict:
    return {k[len("v_head."):]: np.asarray(v) for k, v in inp.items() if k.startswith("v_head.")}


def _policy(ctx, inp):
    return ctx.workflow.load_policy(ctx.assets["checkpoint"], ctx.args, _lora_from_inputs(inp), _v_head_from_inputs(inp))


# ---- L1 ----------------------------------------------------------------------------------------

def probe_prompt_data(ctx, inp):
    ds, width = _prompts(ctx), ctx.args.cutoff_len + 1
    batch = _collator(ctx)(ds[:4])
    return {"input_ids": pad_rows([list(f["input_ids"])[:width] for f in ds], width, -1),
            "labels": pad_rows([list(f["labels"])[:width] for f in ds], width, -7), "n": np.array(len(ds)),
            **{f"collate.{k}": np.asarray(batch[k]).astype(np.int64)
               for k in ("input_ids", "attention_mask", "position_ids") if k in batch}}


def probe_value_head(ctx, inp):
    return {"values": n(ctx.workflow.value_head(jnp.asarray(inp["hidden"]), jnp.asarray(inp["weight"]),
                                                jnp.asarray(inp["bias"])))}


def _reward(ctx):
    if getattr(ctx, "reward_model", None) is None:
        ctx.reward_model = ctx.workflow.load_reward_model(ctx.assets["reward_model"])
    return ctx.reward_model


def probe_reward_score(ctx, inp):
    """The recorded rows split back into queries and responses, joined again by the candidate's own
    prepare_model_inputs, then scored."""
    reward, v_head = _reward(ctx)
    ids, q_len, r_len = (np.asarray(inp[k]) for k in ("input_ids", "query_len", "response_len"))
    queries = [row[:q] for row, q in zip(ids, q_len)]
    responses = [row[q:q + r] for row, q, r in zip(ids, q_len, r_len)]
    inputs = ctx.workflow.prepare_model_inputs(queries, responses, _gen_ids(ctx)[1])
    return {"scores": n(ctx.workflow.get_rewards(reward, v_head, inputs))}


def probe_rollout_rules(ctx, inp):
    out = {f"tokens.{name}": n(ctx.workflow.sample_next_tokens(jnp.asarray(inp["logits"]), jnp.asarray(inp["noise"]),
                                                               replace(ctx.args, **options))).astype(np.int64)
           for name, options in {"task": {}, **ROLLOUT_SAMPLING_OPTIONS}.items()}
    eos, pad = _gen_ids(ctx)
    q, r = ctx.workflow.trim_rollouts(inp["query_ids"], inp["response_ids"], pad, eos[0])
    return {**out, "queries": pad_rows([list(x) for x in q]), "responses": pad_rows([list(x) for x in r])}


def probe_kl_rewards(ctx, inp):
    out = {}
    for c in KL_COEFS:
        rewards, non_score, kls = ctx.workflow.compute_rewards(*(jnp.asarray(inp[k]) for k in (
            "scores", "logprobs", "ref_logprobs", "masks")), c)
        out.update({f"{c}.rewards": n(rewards), f"{c}.non_score_reward": n(non_score), f"{c}.kls": n(kls)})
    return out


def probe_gae_whiten(ctx, inp):
    values, rewards, masks = (jnp.asarray(inp[k]) for k in ("values", "rewards", "masks"))
    out = {}
    for name, o in GAE_OPTIONS.items():
        v, adv, ret = ctx.workflow.compute_advantages(values, rewards, masks, o.get("gamma", ctx.args.gamma),
                                                      o.get("lam", ctx.args.lam), o.get("ppo_whiten_rewards", False))
        out.update({f"{name}.values": n(v), f"{name}.advantages": n(adv), f"{name}.returns": n(ret)})
    out["whiten_no_shift"] = n(ctx.workflow.masked_whiten(rewards, masks, shift_mean=False))
    return out


def probe_ppo_loss(ctx, inp):
    out = {}
    for name in ("clipped", "past_threshold"):
        pg, vf, stats = ctx.workflow.ppo_loss(*(jnp.asarray(inp[f"{name}.{k}"]) for k in LOSS_ARGS), ctx.args)
        out.update({f"{name}.loss_p": n(pg), f"{name}.loss_v": n(vf),
                    **{f"{name}.{k.replace('/', '.')}": n(v) for k, v in stats.items()}})
    return out


def probe_kl_controller(ctx, inp):
    a = ctx.args
    ctls = {"adaptive": ctx.workflow.AdaptiveKLController(a.init_kl_coef, a.ppo_target, a.horizon),
            "fixed": ctx.workflow.FixedKLController(a.init_kl_coef)}
    values = {k: [] for k in ctls}
    for kl in np.asarray(inp["kls"]):
        for name, ctl in ctls.items():
            ctl.update(float(kl), a.batch_size * 1000)
            values[name].append(float(ctl.value))
    return {k: np.array(v, np.float32) for k, v in values.items()}


# ---- L3 / L4 -----------------------------------------------------------------------------------

def probe_rollout_generate(ctx, inp):
    policy, trainable = _policy(ctx, inp)
    eos, pad = _gen_ids(ctx)
    vision = ctx.workflow.prompt_vision(policy, _prompt_batch(inp))  # a VL batch's images and positions, else None
    responses = ctx.workflow.generate(policy, trainable["lora"], inp["input_ids"], inp["attention_mask"], inp["noise"],
                                      ctx.args, eos, pad, vision)
    _, r = ctx.workflow.trim_rollouts(inp["input_ids"], responses, pad, eos[0])
    return {"responses": n(responses).astype(np.int64), "response_len": np.array([len(x) for x in r], np.int64)}


def _row_features(ctx, policy, inp) -> dict:
    """A VL step batch's per-token image features f32[B,W,...]: row i's first query_len columns are its prompt's
    last ones (the query is the prompt without its left pad or LF's fake image), the rest the text features."""
    prompt = _prompt_features(ctx, policy, _prompt_batch(inp, "prompt."))
    text = _text_features(policy, prompt)
    query_len, width = np.asarray(inp["query_len"]), np.shape(inp["input_ids"])[1]
    out = {}
    for k, v in prompt.items():
        rows = np.broadcast_to(text[k], (len(query_len), width, *text[k].shape)).copy()
        for i, q in enumerate(query_len):
            rows[i, :q] = v[i, v.shape[1] - q:]
        out[k] = jnp.asarray(rows)
    return out


def _batch(ctx, policy, inp) -> dict:
    """The rollout batch of the step checks; a VL batch adds its recorded row_positions and the candidate's image
    features."""
    batch = {k: jnp.asarray(inp[k]) for k in ("input_ids", "attention_mask", "query_len", "response_len", "scores")}
    if "row_positions" in inp:
        batch["row_positions"] = jnp.asarray(inp["row_positions"])
    if _TYPES in inp:  # Gemma 3's and PaliGemma's recorded token types
        batch[_TYPES] = jnp.asarray(inp[_TYPES])
    if "prompt.pixel_values" in inp:  # a VL batch: the candidate's image features of its prompt batch
        batch.update(_row_features(ctx, policy, inp))
    return batch


def probe_rollout_logprobs_values(ctx, inp):
    policy, trainable = _policy(ctx, inp)
    b = _batch(ctx, policy, inp)
    logprobs, _, values, masks = ctx.workflow.batched_forward_pass(policy, trainable["lora"], trainable["v_head"], b,
                                                                   b["query_len"], b["response_len"])
    ref, _, _, _ = ctx.workflow.batched_forward_pass(policy, None, trainable["v_head"], b, b["query_len"],
                                                     b["response_len"])
    return {"logprobs": n(logprobs), "values": n(values), "masks": n(masks).astype(np.float32), "ref_logprobs": n(ref)}


def _step0(ctx, inp):
    if getattr(ctx, "ppo_step0", None) is None:
        policy, trainable = _policy(ctx, inp)
        ctx.ppo_step0 = ctx.workflow.ppo_step_loss_and_grads(policy, trainable, _batch(ctx, policy, inp), ctx.args)
    return ctx.ppo_step0


def probe_ppo_step0_losses(ctx, inp):
    return {k: np.float32(v) for k, v in _step0(ctx, inp)[0].items()}


def probe_ppo_step0_tensors(ctx, inp):
    return {k: np.asarray(v, np.float32) for k, v in _step0(ctx, inp)[1].items()}


def probe_ppo_step0_grads(ctx, inp):
    return {k: np.asarray(v, np.float32) for k, v in _step0(ctx, inp)[2].items()}


def _fixed(ctx, inp):
    if getattr(ctx, "ppo_fixed", None) is None:
        num = len([k for k in inp if k.endswith(".prompts") and k.startswith("s")])
        steps = [_with_images(prompt_features(inp[f"s{i}.prompts"]), inp.get(f"s{i}.images")) for i in range(num)]
        init, v_head = _lora_from_inputs(inp), _v_head_from_inputs(inp)
        eos, pad = _gen_ids(ctx)
        runs = ppo_fixed_step_runs(lambda args: ctx.workflow.train_steps(
            ctx.assets["checkpoint"], ctx.assets["reward_model"], init, v_head, steps, args, eos, pad,
            ctx.assets["tokenizer"], ctx.assets["data"]), ctx.args)
        # the moved steps are the reference's: every check of this run gets the same recorded inputs
        ctx.ppo_fixed = ppo_fixed_step_outputs(runs, {k: inp[k] for k in inp if k.endswith("moved_steps")})
    return ctx.ppo_fixed


def probe_ppo_fixed_steps_stats(ctx, inp):
    return _fixed(ctx, inp)[0]


def probe_ppo_fixed_steps_rollouts(ctx, inp):
    return _fixed(ctx, inp)[1]


def probe_ppo_fixed_steps_params(ctx, inp):
    return _fixed(ctx, inp)[2]


# ---- L5 / L6 -----------------------------------------------------------------------------------

def probe_ppo_e2e_stats(ctx, inp):
    return ppo_stats_outputs(ctx.run().step_stats, inp["moved_steps"], PPO_TIE_STATS)


def probe_ppo_e2e_rollouts(ctx, inp):
    return {"responses": np.stack(ctx.run().step_responses).astype(np.int64)}


def probe_ppo_e2e_value_head(ctx, inp):
    return {k: np.asarray(v, np.float32) for k, v in ctx.run().value_head.items()}


def probe_ppo_e2e_eval(ctx, inp):
    return {"before": np.float32(ctx.run().eval_before)}


def _heldout_forward(ctx, model, variables, inp, i: int, text_apply):
    """forward(ids, mask, positions) -> logits for ppo_eval.decode on held-out batch i: the candidate's public
    forward, jitted (text_apply for a text batch); a VL batch's image features at its prompt's image tokens (the
    candidate's prompt_vision; an Omni batch's audio rows at its audio tokens, through the candidate's audio
    tower), a generated image-pad (audio) token embedded as text, an Omni batch's sampled video token as text (as
    the workflow's generate does)."""
    if f"b{i}.pixel_values" not in inp:
        return lambda a, b, c: n(text_apply(a, b, c))
    batch = _prompt_batch(inp, f"b{i}.")
    if "position_ids" in batch:  # Qwen-VL: the prompt's M-RoPE positions and their deltas
        batch["rope_deltas"] = rope_deltas(batch["position_ids"], batch["attention_mask"])[:, None]
    prompt = _prompt_features(ctx, model, batch)
    text = _text_features(model, prompt)
    B, N = len(batch["input_ids"]), int(inp["gen.max_new_tokens"])
    features = {k: jnp.concatenate([v, jnp.broadcast_to(text[k], (B, N, *text[k].shape))], axis=1)
                for k, v in prompt.items()}
    config = model.module.config
    if _TYPES in batch:  # Gemma 3, PaliGemma: the prompt's types, its last type over the new tokens; no positions
        types = jnp.asarray(batch[_TYPES])
        types = jnp.concatenate([types, jnp.broadcast_to(types[:, -1:], (B, N))], axis=1)
        apply = jax.jit(lambda ids, mask, pos, f: model.module.apply(
            variables, ids, mask, token_type_ids=types, **_image_inputs(config, ids, f)))
    else:
        apply = jax.jit(lambda ids, mask, pos, f: model.module.apply(
            variables, ids, mask, position_ids=pos, **_image_inputs(config, ids, f)))
    return lambda a, b, c: n(apply(a, b, c, features))


def probe_heldout_reward(ctx, inp):
    """Held-out responses decoded by grader code over the candidate's public forward with the adapter its own
    L5 run produced (adapter.<PEFT name>), noise from grader/ppo_eval.eval_noise; the parent scores them."""

    model = ctx.workflow.load_model(ctx.assets["checkpoint"], ctx.workflow.lora_config(ctx.args))
    adapter = ctx.lora.lora_tree_from_state_dict({k[len("adapter."):]: np.asarray(v) for k, v in inp.items()
                                                  if k.startswith("adapter.")})
    variables = {"params": model.params, "lora": adapter}
    text_apply = jax.jit(lambda ids, mask, pos: model.module.apply(variables, ids, mask, pos))
    gen = {k[len("gen."):]: inp[k] for k in inp if k.startswith("gen.")}
    vocab = ctx.config.vocab_size
    num_batches = len([k for k in inp if k.startswith("b") and k.endswith(".input_ids")])
    out = {}
    for i in range(num_batches):
        forward = _heldout_forward(ctx, model, variables, inp, i, text_apply)
        ids, mask = np.asarray(inp[f"b{i}.input_ids"]), np.asarray(inp[f"b{i}.attention_mask"])
        positions = inp.get(f"b{i}.position_ids")  # a VL prompt's M-RoPE positions, continued by decode
        for k in range(int(gen["eval_samples"])):
            noise = eval_noise(k, i, (len(ids), int(gen["max_new_tokens"]), vocab))
            responses, logits = decode(forward, ids, mask, noise, gen, positions)
            out[f"b{i}.s{k}.responses"], out[f"b{i}.s{k}.logits"] = responses.astype(np.int64), logits
    return out


PROBES = {
    "prompt_data": probe_prompt_data, "value_head": probe_value_head, "reward_score": probe_reward_score,
    "rollout_rules": probe_rollout_rules, "kl_rewards": probe_kl_rewards, "gae_whiten": probe_gae_whiten,
    "ppo_loss": probe_ppo_loss, "kl_controller": probe_kl_controller, "rollout_generate": probe_rollout_generate,
    "rollout_logprobs_values": probe_rollout_logprobs_values, "ppo_step0_losses": probe_ppo_step0_losses,
    "ppo_step0_tensors": probe_ppo_step0_tensors, "ppo_step0_grads": probe_ppo_step0_grads,
    "ppo_fixed_steps_stats": probe_ppo_fixed_steps_stats, "ppo_fixed_steps_rollouts": probe_ppo_fixed_steps_rollouts,
    "ppo_fixed_steps_params": probe_ppo_fixed_steps_params, "ppo_e2e_stats": probe_ppo_e2e_stats,
    "ppo_e2e_rollouts": probe_ppo_e2e_rollouts, "ppo_e2e_value_head": probe_ppo_e2e_value_head,
    "ppo_e2e_eval": probe_ppo_e2e_eval, "heldout_reward": probe_heldout_reward,
}
