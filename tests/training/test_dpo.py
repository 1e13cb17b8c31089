"""LLaMA-Factory-shaped DPO: the torch source and its JAX twin against TRL's and LF's formulas, written out by
hand here (never taken from the code under test), and against each other.

- TRL v0.24 `dpo_loss` (sigmoid, with label smoothing) and LF's rewards on fixed log-probs;
- LF `get_batch_logps` on literal logits: summed over labelled, shifted tokens;
- LF's pairwise processor (infer_seqlen over the prompt and the longer response) and collator (chosen rows
  first) on literals and the shipped data;
- LF's logged metrics of one batch recomputed from the logits by formula;
- the grader's numpy preference scorer on the same fixed log-probs;
- the shipped preference data: DPO measurably raises held-out accuracy and lowers held-out loss.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from catalog import heldout
from catalog.h5schema import read_reference
from jax_oracles.training import collator as j_collator, dpo as j_dpo, processor as j_processor
from torch_sources.training import collator as t_collator, dpo as t_dpo, lora as t_lora, processor as t_processor

jax.config.update("jax_default_matmul_precision", "highest")

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "assets" / "checkpoints" / "llama3"
TOKENIZER = ROOT / "assets" / "tokenizer" / "llama3"
DATA = ROOT / "assets" / "data" / "dpo"


def _softplus(x: float) -> float:  # -log sigmoid(-x)
    return math.log1p(math.exp(x))


# ---- TRL's sigmoid loss on fixed log-probs -------------------------------------------------

# (policy chosen, policy rejected, reference chosen, reference rejected) per pair
LOGPS = [(-10.0, -12.0, -11.0, -11.0), (-7.5, -6.0, -8.0, -5.0), (-3.0, -3.0, -3.0, -3.0)]
BETA, SMOOTHING = 0.1, 0.1


def _expected(beta: float, eps: float):
    """From the formulas: h = (pc - rc) - (pr - rr); loss = -(1-eps) log s(beta h) - eps log s(-beta h)."""
    losses, chosen, rejected = [], [], []
    for pc, pr, rc, rr in LOGPS:
        h = (pc - rc) - (pr - rr)
        losses.append((1 - eps) * _softplus(-beta * h) + eps * _softplus(beta * h))
        chosen.append(beta * (pc - rc))
        rejected.append(beta * (pr - rr))
    return np.array(losses), np.array(chosen), np.array(rejected)


@pytest.mark.parametrize("eps", [0.0, SMOOTHING])
def test_dpo_loss_and_rewards_match_trl_formulas(eps):
    want_loss, want_chosen, want_rejected = _expected(BETA, eps)
    # pair 0: h = 1 - (-1) = 2, so loss = log(1 + e^-0.2) without smoothing
    assert want_loss[0] == pytest.approx(math.log1p(math.exp(-0.2)) if eps == 0 else want_loss[0])
    cols = np.array(LOGPS, np.float32).T
    t_out = t_dpo.dpo_loss(*(torch.from_numpy(c) for c in cols), BETA, eps)
    j_out = j_dpo.dpo_loss(*(jnp.asarray(c) for c in cols), BETA, eps)
    for out in (t_out, j_out):
        for got, want in zip(out, (want_loss, want_chosen, want_rejected)):
            np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7)


def test_grader_preference_scorer_matches_the_formulas():
    """heldout.preference_batch on logits built so that each row's summed log-prob is the LOGPS entry."""
    V, T = 4, 3  # two labelled positions per row: log-probs a/2 each
    rows = [[pc, pr] for pc, pr, _, _ in LOGPS]
    ref_rows = [[rc, rr] for _, _, rc, rr in LOGPS]

    def logits_for(values):  # row r: token 1 gets log-prob values[r] / 2 at both labelled positions
        x = np.zeros((len(values), T, V))
        for r, lp in enumerate(values):
            p = math.exp(lp / 2)
            x[r, :, 1] = math.log(p)
            x[r, :, [0, 2, 3]] = math.log((1 - p) / 3)
        return x

    chosen_first = lambda pairs: [p[0] for p in pairs] + [p[1] for p in pairs]  # noqa: E731
    labels = np.array([[-100, 1, 1]] * (2 * len(LOGPS)))
    loss, accuracy = heldout.preference_batch(logits_for(chosen_first(rows)), logits_for(chosen_first(ref_rows)),
                                              labels, BETA, SMOOTHING)
    want_loss, want_chosen, want_rejected = _expected(BETA, SMOOTHING)
    assert loss == pytest.approx(want_loss.mean(), rel=1e-9)
    assert accuracy == pytest.approx(np.mean(want_chosen > want_rejected))  # pair 2 ties: not counted


def test_get_batch_logps_sums_shifted_labelled_tokens():
    V = 4
    logits = np.zeros((2, 4, V), np.float32)  # uniform: every labelled token costs log 4
    logits[1, 0, 3] = math.log(5.0)  # row 1, position 0 predicts label 1 (= 3): p = 5/8
    labels = np.array([[7, -100, 2, 1], [-100, 3, -100, -100]])  # label 0 is never predicted
    want = np.array([-2 * math.log(4), math.log(5 / 8)])
    for logps, valid in (t_dpo.get_batch_logps(torch.from_numpy(logits), torch.from_numpy(labels)),
                         j_dpo.get_batch_logps(jnp.asarray(logits), jnp.asarray(labels))):
        np.testing.assert_allclose(np.asarray(logps), want, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(valid), [2, 1])


# ---- LF's pairwise processor and collator --------------------------------------------------

@pytest.mark.parametrize("processor", [t_processor, j_processor])
def test_pairwise_example_cuts_prompt_and_both_responses_alike(processor):
    prompt, chosen, rejected = list(range(10)), [50, 51, 52], [60, 61, 62, 63, 64]
    # infer_seqlen(10, 5, 12): 2*5 < 12, so the target keeps 5 and the source gets 12 - 5 = 7
    out = processor.preprocess_pairwise_example(prompt, chosen, rejected, cutoff_len=12)
    assert out["chosen_input_ids"] == list(range(7)) + chosen
    assert out["rejected_input_ids"] == list(range(7)) + rejected
    assert out["chosen_labels"] == [-100] * 7 + chosen
    assert out["rejected_attention_mask"] == [1] * 12
    # both long: infer_seqlen(10, 8, 12) shares the budget, int(12 * 8 / 18) = 5; the shorter response is cut too
    out = processor.preprocess_pairwise_example(prompt, list(range(100, 108)), list(range(200, 206)), cutoff_len=12)
    assert out["chosen_input_ids"] == list(range(7)) + list(range(100, 105))
    assert out["rejected_input_ids"] == list(range(7)) + list(range(200, 205))


@pytest.mark.parametrize("collator", [t_collator, j_collator])
def test_pairwise_collator_puts_every_chosen_row_first(collator):
    features = [{"chosen_input_ids": [1, 2], "chosen_attention_mask": [1, 1], "chosen_labels": [-100, 2],
                 "rejected_input_ids": [1, 3, 4], "rejected_attention_mask": [1, 1, 1], "rejected_labels": [-100, 3, 4]},
                {"chosen_input_ids": [5], "chosen_attention_mask": [1], "chosen_labels": [5],
                 "rejected_input_ids": [6], "rejected_attention_mask": [1], "rejected_labels": [6]}]
    batch = {k: np.asarray(v) for k, v in collator.PairwiseDataCollator(pad_token_id=9)(features).items()}
    assert batch["input_ids"].shape == (4, 8)  # the longest row, 3, rounded up to a multiple of 8
    np.testing.assert_array_equal(batch["input_ids"][:, :3], [[1, 2, 9], [5, 9, 9], [1, 3, 4], [6, 9, 9]])
    np.testing.assert_array_equal(batch["labels"][:, :3], [[-100, 2, -100], [5, -100, -100], [-100, 3, 4],
                                                           [6, -100, -100]])
    np.testing.assert_array_equal(batch["attention_mask"].sum(1), [2, 1, 3, 1])


def test_shipped_pairs_process_alike_and_some_are_cut():
    args = t_dpo.DPOArgs()
    torch_rows = t_dpo.load_pairwise_dataset(TOKENIZER, DATA, "train", args)
    jax_rows = j_dpo.load_pairwise_dataset(TOKENIZER, DATA, "train", j_dpo.DPOArgs())
    raw = json.loads((DATA / "train.json").read_text())
    unpaired = [r for r in raw if not isinstance(r["rejected"], str)]
    assert len(unpaired) == 1, "the shipped data keeps one row without a rejected response (LF drops it)"
    assert torch_rows == jax_rows and len(torch_rows) == len(raw) - 1
    assert any(len(r["rejected_input_ids"]) == args.cutoff_len for r in torch_rows), "no row reaches cutoff_len"
    for r in torch_rows:  # the prompt is shared and unlabelled in both rows
        n_prompt = r["chosen_labels"].count(-100)
        assert r["rejected_labels"].count(-100) == n_prompt
        assert r["chosen_input_ids"][:n_prompt] == r["rejected_input_ids"][:n_prompt]


# ---- LF's metrics of one batch, from the logits by formula ---------------------------------

def test_batch_metrics_are_lf_formulas_of_the_logits():
    args = t_dpo.DPOArgs()
    rows = t_dpo.load_pairwise_dataset(TOKENIZER, DATA, "train", args)[:3]
    batch = {k: v for k, v in t_dpo.make_collator(args, TOKENIZER)(rows).items()}
    model = t_dpo.load_model(MODEL, t_dpo.lora_config(args), seed=0)
    r = np.random.default_rng(3)
    sd = {k: (v if ".lora_A." in k else r.standard_normal(v.shape).astype(np.float32) * 0.05)
          for k, v in t_lora.lora_state_dict(model).items()}
    t_lora.load_lora_state_dict(model, sd)
    with torch.no_grad():
        loss, metrics = t_dpo.batch_loss_metrics(model, batch, args)
        logits = model(batch["input_ids"], batch["attention_mask"]).numpy()
        with t_lora.disable_adapter(model):
            ref_logits = model(batch["input_ids"], batch["attention_mask"]).numpy()
    labels = batch["labels"].numpy()
    logps, _ = heldout.sequence_logps(logits, labels)  # the grader's numpy, not the code under test
    ref_logps, _ = heldout.sequence_logps(ref_logits, labels)
    n = 3
    chosen, rejected = args.pref_beta * (logps[:n] - ref_logps[:n]), args.pref_beta * (logps[n:] - ref_logps[n:])
    want = {"rewards/chosen": chosen.mean(), "rewards/rejected": rejected.mean(),
            "rewards/accuracies": (chosen > rejected).mean(), "rewards/margins": (chosen - rejected).mean(),
            "logps/chosen": logps[:n].mean(), "logps/rejected": logps[n:].mean(),
            "logits/chosen": logits[:n].mean(), "logits/rejected": logits[n:].mean()}
    assert list(metrics) == list(t_dpo.METRICS)
    for k, v in want.items():
        assert metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert float(loss) == pytest.approx(np.mean(np.log1p(np.exp(-(chosen - rejected)))), rel=1e-5)
    # the JAX twin on the same batch and adapter
    j_model = j_dpo.load_model(MODEL, j_dpo.lora_config(j_dpo.DPOArgs()))
    from jax_oracles.training import lora as j_lora
    variables = {"params": j_model.params, "lora": j_lora.lora_tree_from_state_dict(sd)}
    j_loss, j_metrics = j_dpo.batch_loss_metrics(j_model.module, variables,
                                                 {k: jnp.asarray(v.numpy()) for k, v in batch.items()},
                                                 j_dpo.DPOArgs())
    assert float(j_loss) == pytest.approx(float(loss), rel=1e-5)
    for k in t_dpo.METRICS:
        assert float(j_metrics[k]) == pytest.approx(metrics[k], rel=1e-4, abs=1e-6), k


def test_disable_adapter_restores_the_adapter_and_refuses_a_plain_model():
    model = t_dpo.load_model(MODEL, t_dpo.lora_config(t_dpo.DPOArgs()), seed=0)
    layers = [m for m in model.modules() if isinstance(m, t_lora.LoraLinear)]
    with t_lora.disable_adapter(model):
        assert all(m.disable_adapters for m in layers)
    assert not any(m.disable_adapters for m in layers)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        with t_lora.disable_adapter(t_dpo.load_model(MODEL)):
            pass
    from jax_oracles.training import lora as j_lora
    with pytest.raises(ValueError, match="no LoRA adapters"):
        j_lora.disable_adapter({"params": {}})
    with pytest.raises(NotImplementedError, match="sigmoid"):
        t_dpo.DPOArgs(pref_loss="ipo")
    with pytest.raises(NotImplementedError, match="sigmoid"):
        j_dpo.DPOArgs(pref_loss="ipo")


# ---- the shipped data trains ----------------------------------------------------------------

def test_dpo_raises_heldout_accuracy_and_lowers_heldout_loss():
    """From the committed reference: the torch run's held-out loss and accuracy before and after training."""
    rec = read_reference(ROOT / "references" / "llama3-dpo.h5").checks[heldout.PREFERENCE_KEY]
    loss, accuracy = float(rec.outputs["loss"]), float(rec.outputs["accuracy"])
    assert rec.attrs["loss_before"] == pytest.approx(math.log(2), rel=1e-6)  # the policy starts as the reference
    assert loss < rec.attrs["loss_before"] - 0.02, (loss, rec.attrs["loss_before"])
    assert accuracy >= rec.attrs["accuracy_before"] + 0.5, (accuracy, rec.attrs["accuracy_before"])
    lo, hi = rec.attrs["band_accuracy"]
    assert lo <= accuracy <= hi and lo > 0.5


def test_heldout_preference_refuses_missing_or_extra_logits():
    rec = read_reference(ROOT / "references" / "llama3-dpo.h5").checks[heldout.PREFERENCE_KEY]
    labels = {int(k[1:].split(".")[0]): v for k, v in rec.inputs.items() if k.endswith(".labels")}
    V = 512
    good = {f"b{i}.{f}": np.zeros((*y.shape, V), np.float32) for i, y in labels.items() for f in ("logits", "ref_logits")}
    values, shapes = heldout.heldout_preference(rec.inputs, good)  # all-equal logits: policy = reference
    assert values == {"loss": pytest.approx(math.log(2)), "accuracy": 0.0} and len(shapes) == 2 * len(labels)
    missing = {k: v for k, v in good.items() if k != "b0.ref_logits"}
    with pytest.raises(heldout.HeldoutError, match="b0.ref_logits"):
        heldout.heldout_preference(rec.inputs, missing)
    with pytest.raises(heldout.HeldoutError, match="unexpected"):
        heldout.heldout_preference(rec.inputs, {**good, "b0.chosen_logps": np.zeros(4, np.float32)})
    bad = {**good, "b1.logits": np.full_like(good["b1.logits"], np.nan)}
    with pytest.raises(heldout.HeldoutError, match="non-finite"):
        heldout.heldout_preference(rec.inputs, bad)


def test_l6_cheat_that_favours_the_chosen_rows_scores_below_the_bar():
    """A candidate that knows chosen rows come first and returns policy logits boosting each chosen row's own
    next tokens (reference logits honest-looking zeros) gets accuracy 1 and a loss far under the band: it scores below the strict bar."""
    from grader.scoring.lattice import strict_bar
    from grader.scoring.measures import score as measure_score

    rec = read_reference(ROOT / "references" / "llama3-dpo.h5").checks[heldout.PREFERENCE_KEY]
    produced = {}
    for key, ids in rec.inputs.items():
        if not key.endswith(".input_ids"):
            continue
        b = key.split(".")[0]
        ref_logits = np.zeros((*ids.shape, 512), np.float32)
        logits = ref_logits.copy()
        n = ids.shape[0] // 2
        rows, cols = np.meshgrid(np.arange(n), np.arange(ids.shape[1] - 1), indexing="ij")
        logits[rows, cols, ids[:n, 1:]] = 20.0  # the chosen continuation, made near-certain
        produced[f"{b}.logits"], produced[f"{b}.ref_logits"] = logits, ref_logits
    values, _ = heldout.heldout_preference(rec.inputs, produced)
    assert values["accuracy"] == 1.0 and values["loss"] < 0.5 * rec.attrs["band_loss"][0], values
    scores = [measure_score("banded", values[m], tuple(rec.attrs[f"band_{m}"])) for m in values]
    assert float(np.mean(scores)) < strict_bar("behavioral"), scores
