"""LLaMA-Factory-shaped PPO on TRL v0.9.6: the torch source and its JAX twin against TRL's formulas written out
by hand here (float64 loops, never the code under test), and against each other.

- compute_rewards: -kl_coef (logp - ref logp), the score at each row's last masked position;
- GAE (gamma, lam) backwards over every position, returns = A + V, whitening over the whole batch with the
  unbiased variance; TRL's loss on literal tensors (both clip ranges crossed) and its ratio_threshold;
- the adaptive KL controller; LF's trimming rule; HF's top-k / top-p warpers on literal logits;
- the PPO step on fixed rollouts: its first mini-batch's loss terms from the step's own inputs by formula;
- the grader's numpy reward model (catalog/ppo_eval.py) against the torch source's on the same rows;
- the shipped reference: PPO measurably raised the held-out reward (every seed's run above the init's).
"""
from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from catalog import ppo_eval
from catalog.h5schema import read_reference
from jax_oracles.training import ppo as j_ppo
from torch_sources.training import ppo as t_ppo

jax.config.update("jax_default_matmul_precision", "highest")

ROOT = Path(__file__).resolve().parents[2]
MODEL, REWARD = ROOT / "assets/checkpoints/llama3", ROOT / "assets/checkpoints/llama3-reward"
TOKENIZER = ROOT / "assets/tokenizer/llama3"
R = np.random.default_rng(7)
LOGP, REF = -R.exponential(size=(2, 6)), -R.exponential(size=(2, 6))
VALUES, SCORES = R.standard_normal((2, 6)), np.array([1.5, -0.5])
MASK = np.array([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]], np.float64)


def _sides():
    return [("torch", t_ppo, lambda x: torch.tensor(np.asarray(x), dtype=torch.float32), lambda x: x.numpy()),
            ("jax", j_ppo, lambda x: jnp.asarray(np.asarray(x), jnp.float32), np.asarray)]


def _rewards_by_hand(kl_coef):
    rewards = -kl_coef * (LOGP - REF)
    for i in range(2):
        rewards[i, np.flatnonzero(MASK[i])[-1]] += SCORES[i]
    return rewards


def _whiten(x, m):
    mean = (x * m).sum() / m.sum()
    var = (((x - mean) ** 2) * m).sum() / m.sum() * m.sum() / (m.sum() - 1)
    return (x - mean) / math.sqrt(var + 1e-8)


def _gae_by_hand(values, rewards, gamma, lam):
    values, rewards = values * MASK, rewards * MASK
    adv = np.zeros_like(values)
    for i in range(values.shape[0]):
        last = 0.0
        for t in reversed(range(values.shape[1])):
            nxt = values[i, t + 1] if t + 1 < values.shape[1] else 0.0
            last = rewards[i, t] + gamma * nxt - values[i, t] + gamma * lam * last
            adv[i, t] = last
    return _whiten(adv, MASK), adv + values


@pytest.mark.parametrize("side", _sides(), ids=lambda s: s[0])
def test_rewards_and_gae_match_trl_formulas(side):
    _, mod, T, N = side
    rewards, non_score, kls = mod.compute_rewards(T(SCORES), T(LOGP), T(REF), T(MASK), 0.2)
    np.testing.assert_allclose(N(rewards), _rewards_by_hand(0.2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(N(kls), LOGP - REF, rtol=1e-5, atol=1e-6)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.8)):
        adv_ref, ret_ref = _gae_by_hand(VALUES, _rewards_by_hand(0.2), gamma, lam)
        _, adv, ret = mod.compute_advantages(T(VALUES), rewards, T(MASK), gamma, lam)
        np.testing.assert_allclose(N(adv), adv_ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(N(ret), ret_ref, rtol=1e-4, atol=1e-5)


def _loss_by_hand(old, new, values, vpreds, adv, ret, m, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1):
    mean = lambda x: (x * m).sum() / m.sum()  # noqa: E731
    ratio = np.exp(new - old)
    pg = mean(np.maximum(-adv * ratio, -adv * np.clip(ratio, 1 - cliprange, 1 + cliprange)))
    vclip = np.clip(vpreds, values - cliprange_value, values + cliprange_value)
    vf = 0.5 * mean(np.maximum((vpreds - ret) ** 2, (vclip - ret) ** 2))
    if mean(ratio) > 10:
        pg, vf = 0.0, 0.0
    return pg, vf_coef * vf


@pytest.mark.parametrize("side", _sides(), ids=lambda s: s[0])
@pytest.mark.parametrize("shift", [0.0, 3.0], ids=["clipped", "past_threshold"])
def test_ppo_loss_matches_trl_formula(side, shift):
    _, mod, T, N = side
    r = np.random.default_rng(3)
    old = -r.exponential(size=(2, 6))
    new = old + r.standard_normal((2, 6)) * 0.4 + shift  # ratios past 1 +- 0.2 both ways
    vpreds = VALUES + r.standard_normal((2, 6)) * 0.5  # past values +- 0.2
    adv, ret, logits = r.standard_normal((2, 6)), r.standard_normal((2, 6)), r.standard_normal((2, 6, 11))
    pg, vf, stats = mod.ppo_loss(*(T(x) for x in (old, VALUES, logits, vpreds, new, MASK, adv, ret)), mod.PPOArgs())
    want_pg, want_vf = _loss_by_hand(old, new, VALUES, vpreds, adv, ret, MASK)
    np.testing.assert_allclose([float(N(pg)), float(N(vf))], [want_pg, want_vf], rtol=1e-5, atol=1e-7)
    if shift == 0.0:
        assert 0 < float(N(stats["policy/clipfrac"])) < 1 and 0 < float(N(stats["val/clipfrac"])) < 1


@pytest.mark.parametrize("mod", [t_ppo, j_ppo], ids=["torch", "jax"])
def test_adaptive_kl_controller(mod):
    ctl = mod.AdaptiveKLController(0.2, 6.0, 10000)
    value = 0.2
    for kl in (0.5, 6.0, 7.0, 30.0):
        ctl.update(kl, 800)
        value *= 1 + min(max(kl / 6.0 - 1, -0.2), 0.2) * 800 / 10000
        assert float(ctl.value) == pytest.approx(value, rel=1e-6)
    fixed = mod.FixedKLController(0.3)
    fixed.update(100.0, 800)
    assert fixed.value == 0.3


def test_trim_rule_keeps_eos_when_pad_is_eos():
    pad, eom = 404, 405
    q = np.array([[pad, pad, 400, 5], [400, 1, 2, 3], [pad, 400, 9, 8]])
    r = np.array([[5, 6, pad, pad], [7, eom, pad, pad], [pad, pad, pad, pad]])
    want = [[5, 6, pad], [7, eom, pad], [pad]]  # + 1 past the last non-pad (the eos itself); one token if empty
    for trimmed in (t_ppo.trim_rollouts(torch.tensor(q), torch.tensor(r), pad, pad),
                    j_ppo.trim_rollouts(q, r, pad, pad), ppo_eval.trim_rollouts(q, r, pad, pad)):
        assert [list(map(int, x)) for x in trimmed[1]] == want
        assert [list(map(int, x)) for x in trimmed[0]] == [[400, 5], [400, 1, 2, 3], [400, 9, 8]]


def test_warpers_on_literal_logits():
    logits = np.log(np.array([[0.4, 0.3, 0.2, 0.06, 0.04]], np.float32))
    args = t_ppo.PPOArgs(temperature=1.0, top_k=4, top_p=0.7)
    # top-k 4 drops 0.04; top-p 0.7 keeps the smallest set whose mass passes 0.7: {0.4, 0.3}
    for warped in (t_ppo.warp_logits(torch.tensor(logits), args).numpy(), np.asarray(j_ppo.warp_logits(logits, args))):
        assert np.isfinite(warped[0]).tolist() == [True, True, False, False, False]
    probs = ppo_eval.warp_probs(logits, 1.0, 4, 0.7)
    np.testing.assert_allclose(probs[0], [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0], rtol=1e-6)


def test_ppo_step_first_minibatch_matches_trl_math():
    """On fixed rollouts, the step's first mini-batch loss (ratio 1: logp equals old logp before any update)
    is the formula applied to the step's own inputs: logp, ref logp, values, masks and the scores."""
    args = t_ppo.PPOArgs()
    policy = t_ppo.load_policy(MODEL, args)
    r = np.random.default_rng(0)
    queries = [torch.tensor([400, *r.integers(0, 400, k)]) for k in (5, 9, 3, 7, 4, 6, 8, 2)]
    responses = [torch.tensor(r.integers(0, 400, k)) for k in (4, 1, 6, 3, 5, 2, 6, 4)]
    scores = torch.tensor(r.standard_normal(8), dtype=torch.float32)
    terms, x, _ = t_ppo.ppo_step_loss_and_grads(policy, queries, responses, scores, args, 404)
    m = x["masks"].astype(np.float64)
    rewards = -args.init_kl_coef * (x["logprobs"] - x["ref_logprobs"]).astype(np.float64)
    for i in range(len(m)):
        rewards[i, np.flatnonzero(m[i])[-1]] += float(scores[i])
    values, rewards = x["values"] * m, rewards * m
    adv = np.zeros_like(values)
    for i in range(len(m)):
        last = 0.0
        for t in reversed(range(m.shape[1])):
            nxt = values[i, t + 1] if t + 1 < m.shape[1] else 0.0
            last = rewards[i, t] + args.gamma * nxt - values[i, t] + args.gamma * args.lam * last
            adv[i, t] = last
    returns = adv + values
    adv = _whiten(adv, m)
    np.testing.assert_allclose(x["advantages"], adv, rtol=1e-4, atol=1e-5)
    mb, mm = slice(0, args.mini_batch_size), m[:args.mini_batch_size]
    pg = (-adv[mb] * mm).sum() / mm.sum()
    vf = 0.5 * (((x["values"][mb] - returns[mb]) ** 2) * mm).sum() / mm.sum()
    assert terms["policy"] == pytest.approx(pg, rel=1e-4, abs=1e-6)
    assert terms["value"] == pytest.approx(vf, rel=1e-4)  # TRL logs loss/value before vf_coef
    assert terms["total"] == pytest.approx(pg + args.vf_coef * vf, rel=1e-4, abs=1e-6)


def test_grader_reward_model_matches_the_torch_source():
    rm = t_ppo.load_reward_model(REWARD)
    r = np.random.default_rng(1)
    queries = [torch.tensor([400, *r.integers(0, 400, k)]) for k in (6, 2, 11)]
    responses = [torch.tensor(r.integers(0, 400, k)) for k in (5, 9, 1)]
    want = t_ppo.get_rewards(rm, queries, responses, 404).numpy()
    got = ppo_eval.RewardModel(REWARD).scores([q.numpy() for q in queries], [x.numpy() for x in responses], 404)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_heldout_reward_rejects_malformed_responses():
    ref = read_reference(ROOT / "references/llama3-ppo.h5")
    rec = ref.checks["L6/heldout_reward"].inputs
    rm = ppo_eval.RewardModel(REWARD)
    n, gen = int(rec["gen.max_new_tokens"]), {k[4:]: v for k, v in rec.items() if k.startswith("gen.")}
    good = {}
    for i in range(6):
        for k in range(int(rec["gen.eval_samples"])):
            logits = np.random.default_rng([i, k]).standard_normal((len(rec[f"b{i}.input_ids"]), n, 512)).astype(np.float32)
            good[f"b{i}.s{k}.logits"] = logits
            good[f"b{i}.s{k}.responses"] = ppo_eval.redraw(logits, ppo_eval.eval_noise(k, i, logits.shape), gen)
    assert np.isfinite(ppo_eval.heldout_reward(rec, good, rm)[0]["reward"])
    from catalog.heldout import HeldoutError
    # a child whose decoding was patched to return the tokens the reward model likes best (here: one repeated id)
    # rather than the draws of its logits
    patched = {**good, "b0.s0.responses": np.full((4, n), int(good["b0.s0.responses"][0, 0]) ^ 1, np.int64)}
    for bad in ({**good, "b0.s0.responses": np.full((4, n), 10_000)}, {k: v for k, v in good.items() if k != "b0.s0.responses"},
                {**good, "b0.s0.responses": np.zeros((4, n + 1), np.int64)}, patched,
                {**good, "b0.s0.logits": np.full((4, n, 512), np.nan, np.float32)}):
        with pytest.raises(HeldoutError):
            ppo_eval.heldout_reward(rec, bad, rm)


def test_ppo_raised_the_heldout_reward():
    """The shipped task trains: every seed-varied torch run ends above the policy's held-out reward at its init."""
    rec = read_reference(ROOT / "references/llama3-ppo.h5").checks["L6/heldout_reward"]
    lo, hi = rec.attrs["band_reward"]
    assert rec.attrs["reward_before"] < lo <= float(rec.outputs["reward"]) <= hi


@pytest.mark.parametrize("mod", [t_ppo, j_ppo], ids=["torch", "jax"])
@pytest.mark.parametrize("option", [{"kl_penalty": "abs"}, {"ppo_score_norm": True}, {"value_head_dropout": 0.1}])
def test_unimplemented_options_are_refused(mod, option):
    with pytest.raises(NotImplementedError):
        mod.PPOArgs(**option)


def test_masked_var_refuses_an_empty_mask():
    with pytest.raises(ValueError, match="empty"):
        t_ppo.masked_var(torch.ones(3), torch.zeros(3))


@pytest.mark.sandbox
@pytest.mark.slow  # CI time (~37 s): make test-full
def test_a_candidate_that_patches_the_grader_decoder_scores_zero_at_l6(tmp_path):
    """Code in the child can reach the grader's decoder: this candidate replaces it, on import, with one that
    returns the tokens it likes (one repeated id) beside its honest logits. The parent redraws the tokens from
    those logits under its own noise, sees they differ, and gives L6 nothing."""
    import shutil

    from grader.app import grade
    from catalog.tasks import compose_task

    cand = tmp_path / "cand"
    for tree in ("jax_oracles", "serving_engine", "conversion"):
        shutil.copytree(ROOT / tree, cand / tree, ignore=shutil.ignore_patterns("__pycache__"))
    model = cand / "jax_oracles/models/llama3.py"  # imported when the child starts, before any probe runs
    model.write_text(model.read_text() + '''

def _patch_grader_decoder():
    try:
        import catalog.ppo_eval as pe
    except ImportError:
        return
    import sys
    honest = pe.decode

    def decode(*a, **k):
        responses, logits = honest(*a, **k)
        return responses * 0 + 7, logits

    # wherever the grader's probes hold the decoder (a from-import keeps its own name)
    for module in [pe, *(m for m in list(sys.modules.values()) if getattr(m, "decode", None) is honest)]:
        module.decode = decode


_patch_grader_decoder()
''')
    report = grade(compose_task("llama3-ppo"), cand, ROOT / "references", tmp_path / "reports", quiet=True,
                   levels=("L5", "L6"))
    (l6,) = [c for c in report["checks"] if c["name"] == "heldout_reward"]
    assert l6["score"] == 0.0 and "not the draws" in (l6["reason"] or ""), l6
