"""Record the PPO checks of the training class (catalog/checks.py, methods ("ppo",)) from
torch_sources/training/ppo.py. The shared checks come from recorder/probes/training.py; the JAX twin of
this file is grader/probes/training_ppo.py.

A vision-language task (its template's collator has an mm context) records what the torch workflow hands its
model besides the ids: the prompt batch's M-RoPE positions, rope deltas, pixels and grids (generation, the held-out
batches), the step batch's row_positions with its prompt batch (the candidate encodes the images itself), and
each fixed-steps prompt's image names (read from the task's data dir). An Omni batch adds LF's fake audio
(input_features, feature_attention_mask), and its L6 decode continues prompt_vision's rope deltas (taken against
the text positions, not the collator's). A text task records as before.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from catalog.ppo_eval import RewardModel, decode, eval_noise, heldout_reward, rope_deltas
from catalog.provenance import ROOT
from catalog.workloads import GAE_OPTIONS, KL_COEFS, KL_CONTROLLER_KLS, PPO_TIE_STATS, ROLLOUT_SAMPLING_OPTIONS, moved_steps, pad_rows, ppo_fixed_step_outputs, ppo_fixed_step_runs, ppo_stats_outputs, prompt_rows
from recorder.probes.training import _lora_init, batch_arrays, n, rng_for, t

ADAPTER_SCALE = 0.05  # lora_B of the L3/L4 step checks: a policy that differs from the reference


def _prompts(ctx, split: str = "train") -> list[dict]:
    return ctx.workflow.load_prompt_dataset(ROOT / ctx.cfg.family.tokenizer, ROOT / ctx.cfg.data.dir, split, ctx.args)


def _collator(ctx):
    """The task's prompt collator: a vision-language template's reads the rows' images from the data dir and takes
    the model's rope index (its mm context; None for text)."""
    return ctx.workflow.make_collator(ctx.args, ROOT / ctx.cfg.family.tokenizer, data_dir=ROOT / ctx.cfg.data.dir,
                                      rope_index=ctx.rope_index)


def _prompt_arrays(batch: dict, prefix: str = "") -> dict[str, np.ndarray]:
    """A collated prompt batch as recorded inputs: ids and mask (i32), and a VL batch's positions, pixels, grids and
    rope deltas (what the candidate's prompt_vision takes)."""
    out = batch_arrays(batch)
    if "rope_deltas" in batch:
        out["rope_deltas"] = n(batch["rope_deltas"]).astype(np.int64)
    return {prefix + k: v for k, v in out.items()}


def _image_names(features: list[dict]) -> np.ndarray:
    """Each prompt's image names (relative to the data dir) as rows padded with "" (an HDF5 input)."""
    width = max(1, max(len(f.get("images") or []) for f in features))
    return np.array([list(f.get("images") or []) + [""] * (width - len(f.get("images") or [])) for f in features])


def _gen_ids(ctx):
    return ctx.workflow.generation_ids(ROOT / ctx.cfg.family.tokenizer, ctx.args)


def _reward_model(ctx):
    if getattr(ctx, "reward_model", None) is None:
        ctx.reward_model = ctx.workflow.load_reward_model(ROOT / ctx.cfg.method.reward_model)
    return ctx.reward_model


def _adapter(ctx) -> dict[str, np.ndarray]:
    r = rng_for("ppo_adapter")
    return {k: (v if ".lora_A." in k else (r.standard_normal(v.shape) * ADAPTER_SCALE).astype(np.float32))
            for k, v in _lora_init(ctx).items()}


def _value_head(ctx) -> dict[str, np.ndarray]:
    return ctx.workflow.init_value_head(ctx.config.hidden_size, ctx.args.seed)


def _policy(ctx, adapter=None, v_head=None):
    return ctx.workflow.load_policy(ctx.ckpt, ctx.args, adapter, v_head)


def _masks(r, rows: int, width: int, lo: int, hi: int) -> np.ndarray:
    """Rows of ones over one random contiguous span (at least two positions) each."""
    m = np.zeros((rows, width), np.float32)
    for i in range(rows):
        a = int(r.integers(lo, width - 2))
        m[i, a:int(r.integers(a + 2, min(width, a + hi) + 1))] = 1
    return m


# ---- L1 ----------------------------------------------------------------------------------------

def probe_prompt_data(ctx):
    ds = _prompts(ctx)
    width = ctx.args.cutoff_len + 1
    batch = _collator(ctx)(ds[:4])
    return {}, {"input_ids": pad_rows([f["input_ids"][:width] for f in ds], width, -1),
                "labels": pad_rows([f["labels"][:width] for f in ds], width, -7), "n": np.array(len(ds)),
                **{f"collate.{k}": n(batch[k]).astype(np.int64) for k in ("input_ids", "attention_mask", "position_ids")
                   if k in batch}}


def probe_value_head(ctx):
    r, d = rng_for("value_head"), ctx.config.hidden_size
    x = r.standard_normal((2, 5, d), np.float32) * 2
    w, b = r.standard_normal((1, d), np.float32) * 0.3, r.standard_normal((1,), np.float32)
    return {"hidden": x, "weight": w, "bias": b}, {"values": n(ctx.workflow.value_head(t(x), t(w), t(b)))}


def _fixed_rollouts(ctx, r, num: int, lengths) -> tuple[list, list]:
    """The first `num` train prompts and random responses of the given lengths (ids below the specials)."""
    queries = [torch.tensor(f["input_ids"]) for f in _prompts(ctx)[:num]]
    responses = [torch.from_numpy(r.integers(0, 400, k)) for k in lengths]
    return queries, responses


def _rollout_inputs(ctx, queries, responses, vision=None) -> dict[str, np.ndarray]:
    """Right-padded query + response rows (a VL batch: and their M-RoPE row_positions; its per-token image features
    stay out, the candidate computes them) and the lengths."""
    inputs = ctx.workflow.prepare_model_inputs(queries, responses, _gen_ids(ctx)[1], vision)
    return {**{k: n(inputs[k]).astype(np.int32) for k in ("input_ids", "attention_mask", "row_positions",
                                                          "token_type_ids") if k in inputs},
            "query_len": np.array([len(q) for q in queries], np.int32),
            "response_len": np.array([len(x) for x in responses], np.int32)}


def probe_reward_score(ctx):
    queries, responses = _fixed_rollouts(ctx, rng_for("reward_score"), 4, (16, 3, 1, 9))
    scores = ctx.workflow.get_rewards(_reward_model(ctx), queries, responses, _gen_ids(ctx)[1])
    return _rollout_inputs(ctx, queries, responses), {"scores": n(scores)}


def probe_rollout_rules(ctx):
    r, V = rng_for("rollout_rules"), ctx.config.vocab_size
    logits = r.standard_normal((6, V), np.float32) * 3
    noise = r.exponential(size=(6, V)).astype(np.float32)
    out = {}
    for name, options in {"task": {}, **ROLLOUT_SAMPLING_OPTIONS}.items():
        out[f"tokens.{name}"] = n(ctx.workflow.sample_next_tokens(t(logits), t(noise), replace(ctx.args, **options)))
    eos, pad = _gen_ids(ctx)
    # a second stop word ends a response mid-row (llama3's <|eom_id|>); a template with one stop word gets a
    # plain token there instead
    other = next((e for e in eos if e != pad), 8)
    queries = np.array([[pad, pad, 400, 5, 6, 7, 8, 9], [400, 1, 2, 3, pad, 4, 5, 6],
                        [pad, 400, 9, 8, 7, 6, 5, 4], [pad, pad, pad, 400, 1, 2, 3, 4]], np.int64)
    responses = np.array([[5, 6, pad, pad, pad, pad], [7, other, pad, pad, pad, pad],
                          [pad] * 6, [1, 2, 3, pad, 5, 6]], np.int64)
    q, resp = ctx.workflow.trim_rollouts(t(queries), t(responses), pad, eos[0])
    out.update({"queries": pad_rows([n(x) for x in q]), "responses": pad_rows([n(x) for x in resp])})
    return {"logits": logits, "noise": noise, "query_ids": queries, "response_ids": responses}, out


def probe_kl_rewards(ctx):
    r = rng_for("kl_rewards")
    logprobs, ref = -r.exponential(size=(3, 10)).astype(np.float32), -r.exponential(size=(3, 10)).astype(np.float32)
    masks, scores = _masks(r, 3, 10, 0, 8), r.standard_normal(3).astype(np.float32)
    out = {}
    for c in KL_COEFS:
        rewards, non_score, kls = ctx.workflow.compute_rewards(t(scores), t(logprobs), t(ref), t(masks), c)
        out.update({f"{c}.rewards": n(rewards), f"{c}.non_score_reward": n(non_score), f"{c}.kls": n(kls)})
    return {"scores": scores, "logprobs": logprobs, "ref_logprobs": ref, "masks": masks}, out


def probe_gae_whiten(ctx):
    r = rng_for("gae_whiten")
    values, rewards = r.standard_normal((3, 12)).astype(np.float32), r.standard_normal((3, 12)).astype(np.float32)
    masks = _masks(r, 3, 12, 1, 9)
    out = {}
    for name, o in GAE_OPTIONS.items():
        v, adv, ret = ctx.workflow.compute_advantages(t(values), t(rewards), t(masks), o.get("gamma", ctx.args.gamma),
                                                      o.get("lam", ctx.args.lam), o.get("ppo_whiten_rewards", False))
        out.update({f"{name}.values": n(v), f"{name}.advantages": n(adv), f"{name}.returns": n(ret)})
    out["whiten_no_shift"] = n(ctx.workflow.masked_whiten(t(rewards), t(masks), shift_mean=False))
    return {"values": values, "rewards": rewards, "masks": masks}, out


def _loss_case(r, V: int, ratio_shift: float):
    old = -r.exponential(size=(2, 9)).astype(np.float32)
    logprobs = (old + r.standard_normal((2, 9)) * 0.4 + ratio_shift).astype(np.float32)
    values = r.standard_normal((2, 9)).astype(np.float32)
    vpreds = (values + r.standard_normal((2, 9)) * 0.5).astype(np.float32)
    return {"old_logprobs": old, "values": values, "logits": r.standard_normal((2, 9, V)).astype(np.float32),
            "vpreds": vpreds, "logprobs": logprobs, "mask": _masks(r, 2, 9, 0, 8),
            "advantages": r.standard_normal((2, 9)).astype(np.float32),
            "returns": r.standard_normal((2, 9)).astype(np.float32)}


LOSS_ARGS = ("old_logprobs", "values", "logits", "vpreds", "logprobs", "mask", "advantages", "returns")


def probe_ppo_loss(ctx):
    r, V = rng_for("ppo_loss"), ctx.config.vocab_size
    cases = {"clipped": _loss_case(r, V, 0.0), "past_threshold": _loss_case(r, V, 3.0)}
    inputs, out = {}, {}
    for name, case in cases.items():
        inputs.update({f"{name}.{k}": v for k, v in case.items()})
        pg, vf, stats = ctx.workflow.ppo_loss(*(t(case[k]) for k in LOSS_ARGS), ctx.args)
        out.update({f"{name}.loss_p": n(pg), f"{name}.loss_v": n(vf),
                    **{f"{name}.{k.replace('/', '.')}": n(v) for k, v in stats.items()}})
    return inputs, out


def probe_kl_controller(ctx):
    a = ctx.args
    adaptive, fixed = (ctx.workflow.AdaptiveKLController(a.init_kl_coef, a.ppo_target, a.horizon),
                       ctx.workflow.FixedKLController(a.init_kl_coef))
    values = {"adaptive": [], "fixed": []}
    for kl in KL_CONTROLLER_KLS:
        for name, ctl in (("adaptive", adaptive), ("fixed", fixed)):
            ctl.update(kl, a.batch_size * 1000)  # n_steps large enough that each update moves the coefficient
            values[name].append(float(ctl.value))
    return {"kls": np.array(KL_CONTROLLER_KLS)}, {k: np.array(v, np.float32) for k, v in values.items()}


# ---- L3 / L4 -----------------------------------------------------------------------------------

def _generation(ctx):
    """Responses of the nonzero adapter for the first batch_size prompts, each mini-batch with its step-0 noise
    (a VL batch: its images and M-RoPE positions through the workflow's prompt_vision; queries start at the first
    attended token, as its rollout trims them)."""
    if getattr(ctx, "ppo_generation", None) is None:
        batch, adapter = _collator(ctx)(_prompts(ctx)[:ctx.args.batch_size]), _adapter(ctx)
        eos, pad = _gen_ids(ctx)
        model, mb, V = _policy(ctx, adapter), ctx.args.mini_batch_size, ctx.config.vocab_size
        noise = np.concatenate([ctx.workflow.rollout_noise(ctx.args.seed, 0, m, (mb, ctx.args.max_new_tokens, V))
                                for m in range(ctx.args.gradient_accumulation_steps)])
        vision = ctx.workflow.prompt_vision(model, batch)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        responses = ctx.workflow.generate(model, ids, mask, noise, ctx.args, eos, pad, vision)
        q, r = ctx.workflow.trim_rollouts(ids, responses, pad, eos[0], None if vision is None else mask)
        ctx.ppo_generation = batch, adapter, noise, responses, q, r
    return ctx.ppo_generation


def probe_rollout_generate(ctx):
    batch, adapter, noise, responses, _, r = _generation(ctx)
    inputs = {**_prompt_arrays(batch), "noise": noise, **{f"lora.{k}": v for k, v in adapter.items()}}
    return inputs, {"responses": n(responses).astype(np.int64),
                    "response_len": np.array([len(x) for x in r], np.int64)}


def _step_rollouts(ctx):
    """Fixed rollouts for the step checks: the L3 generation's queries and responses, scored by the reward model,
    and (a VL batch) the rows' vision inputs. A VL batch's come from the workflow's rollout on the same prompts,
    adapter and noise (its mini-batches): the per-row positions and image features ppo_step takes are its output."""
    if getattr(ctx, "ppo_rollouts", None) is None:
        batch, adapter, noise, _, q, r = _generation(ctx)
        eos, pad = _gen_ids(ctx)
        mm = _collator(ctx).mm
        if mm is None:
            scores, vision = ctx.workflow.get_rewards(_reward_model(ctx), q, r, pad), None
        else:
            q, r, scores, vision = ctx.workflow.rollout(_policy(ctx, adapter), _reward_model(ctx),
                                                        _prompts(ctx)[:ctx.args.batch_size], ctx.args, eos, pad, 0,
                                                        noise, mm)
        ctx.ppo_rollouts = q, r, scores, adapter, vision, batch
    return ctx.ppo_rollouts


def _step_inputs(ctx, q, r, scores, adapter, v_head, vision=None, batch=None) -> dict[str, np.ndarray]:
    """The step batch as recorded: right-padded query + response rows, their lengths, the scores, the inits; a VL
    batch adds its row_positions and the prompt batch whose images the candidate encodes (prompt.*)."""
    rows = _rollout_inputs(ctx, q, r, vision)
    if vision is not None:
        rows.update(_prompt_arrays(batch, "prompt."))
    return {**rows, "scores": n(scores), **{f"lora.{k}": v for k, v in adapter.items()},
            **{f"v_head.{k}": v for k, v in v_head.items()}}


def probe_rollout_logprobs_values(ctx):
    q, r, scores, adapter, vision, batch = _step_rollouts(ctx)
    v_head, pad = _value_head(ctx), _gen_ids(ctx)[1]
    model = _policy(ctx, adapter, v_head)
    inputs = ctx.workflow.prepare_model_inputs(q, r, pad, vision)
    with torch.no_grad():
        logprobs, _, values, masks = ctx.workflow.batched_forward_pass(model, q, r, inputs, ctx.args.mini_batch_size)
        with ctx.lora.disable_adapter(model):
            ref, _, _, _ = ctx.workflow.batched_forward_pass(model, q, r, inputs, ctx.args.mini_batch_size)
    return (_step_inputs(ctx, q, r, scores, adapter, v_head, vision, batch),
            {"logprobs": n(logprobs), "values": n(values), "masks": n(masks).astype(np.float32),
             "ref_logprobs": n(ref)})


def _step0(ctx):
    if getattr(ctx, "ppo_step0", None) is None:
        q, r, scores, adapter, vision, batch = _step_rollouts(ctx)
        v_head = _value_head(ctx)
        terms, tensors, grads = ctx.workflow.ppo_step_loss_and_grads(_policy(ctx, adapter, v_head), q, r, scores,
                                                                     ctx.args, _gen_ids(ctx)[1], vision=vision)
        ctx.ppo_step0 = _step_inputs(ctx, q, r, scores, adapter, v_head, vision, batch), terms, tensors, grads
    return ctx.ppo_step0


def probe_ppo_step0_losses(ctx):
    inputs, terms, _, _ = _step0(ctx)
    return inputs, {k: np.float32(v) for k, v in terms.items()}


def probe_ppo_step0_tensors(ctx):
    inputs, _, tensors, _ = _step0(ctx)
    return inputs, {k: np.asarray(v, np.float32) for k, v in tensors.items()}


def probe_ppo_step0_grads(ctx):
    inputs, _, _, grads = _step0(ctx)
    return inputs, {k: np.asarray(v, np.float32) for k, v in grads.items()}


def _fixed(ctx):
    """k PPO steps from the inits on the first k prompt batches of epoch 0, under the task's args and the variant."""
    if getattr(ctx, "ppo_fixed", None) is None:
        ds, k = _prompts(ctx), int(ctx.cfg.method.fixed_steps)
        steps = [[ds[i] for i in idx] for idx in ctx.workflow.prompt_batch_indices(len(ds), ctx.args, 0)[:k]]
        init, v_head = _lora_init(ctx), _value_head(ctx)
        eos, pad = _gen_ids(ctx)
        runs = ppo_fixed_step_runs(lambda args: ctx.workflow.train_steps(
            ctx.ckpt, ROOT / ctx.cfg.method.reward_model, init, v_head, steps, args, eos, pad,
            ROOT / ctx.cfg.family.tokenizer, ROOT / ctx.cfg.data.dir), ctx.args)
        moved = {f"{name}moved_steps": moved_steps(stats) for name, (stats, *_) in runs.items()}
        images = {f"s{i}.images": _image_names(s) for i, s in enumerate(steps)} if _collator(ctx).mm else {}
        inputs = {**{f"s{i}.prompts": prompt_rows(s) for i, s in enumerate(steps)}, **images,
                  **{f"lora.{k}": v for k, v in init.items()}, **{f"v_head.{k}": v for k, v in v_head.items()},
                  **moved}  # every check of these runs carries them: the twin's cache may be built by any
        ctx.ppo_fixed = inputs, ppo_fixed_step_outputs(runs, moved)
    return ctx.ppo_fixed


def probe_ppo_fixed_steps_stats(ctx):
    inputs, (stats, _, _) = _fixed(ctx)
    return inputs, stats


def probe_ppo_fixed_steps_rollouts(ctx):
    inputs, (_, rollouts, _) = _fixed(ctx)
    return inputs, rollouts


def probe_ppo_fixed_steps_params(ctx):
    inputs, (_, _, params) = _fixed(ctx)
    return inputs, params


# ---- L5 / L6 -----------------------------------------------------------------------------------

def probe_ppo_e2e_stats(ctx):
    moved = moved_steps(ctx.run().step_stats)
    return ({"seed": np.int64(ctx.args.seed), "moved_steps": moved},
            ppo_stats_outputs(ctx.run().step_stats, moved, PPO_TIE_STATS))


def probe_ppo_e2e_rollouts(ctx):
    return {"seed": np.int64(ctx.args.seed)}, {"responses": np.stack(ctx.run().step_responses).astype(np.int64)}


def probe_ppo_e2e_value_head(ctx):
    return {"seed": np.int64(ctx.args.seed)}, {k: np.asarray(v, np.float32) for k, v in ctx.run().value_head.items()}


def probe_ppo_e2e_eval(ctx):
    return {"seed": np.int64(ctx.args.seed)}, {"before": np.float32(ctx.run().eval_before)}


def _heldout_batches(ctx) -> list[dict]:
    """The eval prompts in batches of per_device_eval_batch_size, collated as evaluate_reward's rollout collates
    them (a VL batch: its images, M-RoPE positions and rope deltas)."""
    held_out, size = _prompts(ctx, "eval"), ctx.args.per_device_eval_batch_size
    collate = _collator(ctx)
    return [collate(held_out[s:s + size]) for s in range(0, len(held_out), size)]


_TOKEN = "token_"  # prompt_vision's per-token tower features: token_<forward keyword> f32[B,P,...]
_TYPES = "token_type_ids"  # prompt_vision's token types (Gemma 3, PaliGemma): not a tower feature
_AUDIO = "audio_embeds"  # Omni's audio rows (the fake audio's), read at the audio tokens


def _feature_token(config, keyword: str) -> int:
    """The token a keyword's rows sit at: the image-pad token's, Omni's audio rows the audio token's."""
    return config.audio_token_id if keyword == _AUDIO else getattr(config, "image_token_id", -1)


def _text_features(lm, prompt: dict) -> dict:
    """What a generated image-pad (or audio) token carries (the workflow's rule: it is text): the token's own
    embedding as its merged patch (its audio row), zero for an added feature (DeepStack's)."""
    def text(token_id):
        return lm.embed(torch.tensor([[token_id]]))[0, 0].detach()
    return {k: text(lm.config.image_token_id) if k == _TOKEN + "image_embeds"
            else text(lm.config.audio_token_id) if k == _TOKEN + _AUDIO else torch.zeros(v.shape[2:])
            for k, v in prompt.items()}


def _forward(ctx, model, batch: dict):
    """(The policy's forward(ids, mask, positions) -> logits for ppo_eval.decode on one prompt batch, as the
    workflow's generate runs it; prompt_vision's output, None for text): a VL batch's image features at its
    prompt's image tokens (an Omni batch's audio rows at its audio tokens), a generated image-pad (audio) token
    embedded as text, and for Omni a sampled video token as text (video_tokens_as_text)."""
    lm = model.pretrained_model
    vision = ctx.workflow.prompt_vision(model, batch)
    prompt = {} if vision is None else {k: v for k, v in vision.items() if k.startswith(_TOKEN) and k != _TYPES}
    # Gemma 3's and PaliGemma's token types: the prompt's, then its last type over the new tokens (their forwards
    # take no positions); the other families take decode's positions
    types = None if vision is None else vision.get(_TYPES)
    text = _text_features(lm, prompt) if prompt else {}
    omni = {"video_tokens_as_text": True} if _TOKEN + _AUDIO in prompt else {}

    def forward(ids, mask, pos):
        ids = t(ids).long()
        new = ids.shape[1] - batch["input_ids"].shape[1]
        features = {k[len(_TOKEN):]: torch.cat([v, text[k].expand(len(ids), new, *text[k].shape)], dim=1)[
            ids == _feature_token(lm.config, k[len(_TOKEN):])] for k, v in prompt.items()}
        if types is None:
            extra = {"position_ids": t(pos).long()}
        else:
            extra = {_TYPES: torch.cat([types, types[:, -1:].expand(-1, new)], dim=1)}
        with torch.no_grad():
            return n(lm(ids, t(mask).long(), **extra, **features, **omni))
    return forward, vision


def _decode_positions(batch: dict, vision):
    """A VL batch's prompt positions for ppo_eval.decode (None for text), after checking that ppo_eval's rope
    deltas, derived from them, are the ones the workflow's generation continues (prompt_vision's: the collator's
    for Qwen2-VL / Qwen3-VL, an Omni prompt's taken against its text positions)."""
    if vision is None or "position_ids" not in vision:  # text, or a fixed-size tower: decode's text positions
        return None
    positions, mask = n(batch["position_ids"]), n(batch["attention_mask"])
    if not np.array_equal(rope_deltas(positions, mask), n(vision["rope_deltas"]).reshape(-1)):
        raise RuntimeError("catalog/ppo_eval.rope_deltas differs from the rope deltas of the workflow's prompt_vision")
    return positions


def probe_heldout_reward(ctx):
    """Inputs: the held-out prompt batches and the generation settings (the grader decodes with the
    candidate's logits and scores with its own reward model, catalog/ppo_eval.py). Output: the source's held-out
    reward of the seed run; the band is the spread of the seed-varied runs."""

    runs = [ctx.run() if s == ctx.args.seed else ctx.train(s) for s in ctx.cfg.method.band_seeds]
    rewards = [float(r.eval_after) for r in runs]
    a, (eos, pad) = ctx.args, _gen_ids(ctx)
    batches = _heldout_batches(ctx)
    gen = {"gen.temperature": np.float64(a.temperature), "gen.top_k": np.int64(a.top_k),
           "gen.top_p": np.float64(a.top_p), "gen.max_new_tokens": np.int64(a.max_new_tokens),
           "gen.eos_token_ids": np.array(eos, np.int64), "gen.pad_token_id": np.int64(pad),
           "gen.eval_samples": np.int64(a.eval_samples), "gen.reward_model": np.array(str(ctx.cfg.method.reward_model))}
    inputs = {**{f"b{i}.{k}": v for i, b in enumerate(batches) for k, v in batch_arrays(b).items()}, **gen}
    # the grader's decoding and reward model on the source's own forward must give the source's evaluate_reward
    model = _policy(ctx, ctx.run().lora_state_dict, ctx.run().value_head).eval()
    settings = {k[len("gen."):]: v for k, v in gen.items()}
    produced = {}
    for i, b in enumerate(batches):
        forward, vision = _forward(ctx, model, b)
        positions = _decode_positions(b, vision)
        for k in range(a.eval_samples):
            noise = eval_noise(k, i, (len(b["input_ids"]), a.max_new_tokens, ctx.config.vocab_size))
            responses, logits = decode(forward, n(b["input_ids"]), n(b["attention_mask"]), noise, settings, positions)
            produced.update({f"b{i}.s{k}.responses": responses, f"b{i}.s{k}.logits": logits})
    ours = heldout_reward(inputs, produced, RewardModel(ROOT / ctx.cfg.method.reward_model))[0]["reward"]
    if abs(ours - ctx.run().eval_after) > 1e-4 * max(1.0, abs(ctx.run().eval_after)):
        raise RuntimeError(f"catalog/ppo_eval.py gives {ours} on the source's forward, its evaluate_reward "
                           f"{ctx.run().eval_after}")
    ctx.band = (min(rewards), max(rewards))
    ctx.l6_attrs["heldout_reward"] = {"band_reward": [min(rewards), max(rewards)],
                                      "reward_before": float(ctx.run().eval_before)}
    return inputs, {"reward": np.float32(ctx.run().eval_after)}


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
