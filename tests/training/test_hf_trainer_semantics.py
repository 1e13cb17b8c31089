"""HF Trainer semantics of the SFT source and its JAX twin, checked against transformers itself.

- lr schedule by `lr_scheduler_type` (linear: HF's default; cosine: LLaMA-Factory's examples):
  every multiplier of torch and JAX against transformers' own scheduler functions;
- eval_loss as Trainer.evaluation_loop computes it (the mean of per-batch token means), against
  that loop written out over transformers' LlamaForCausalLM, and shown to differ from the
  token-global mean on the shipped eval data;
- the shipped data really is cut by cutoff_len (`infer_seqlen`), in every way LF cuts.
"""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from jax_oracles.training import optimizer as j_optimizer
from jax_oracles.training import sft as j_sft
from torch_sources.training import lora as t_lora
from torch_sources.training import optimizer as t_optimizer
from torch_sources.training import processor as t_processor
from torch_sources.training import sft as t_sft
from torch_sources.training import template as t_template
from torch_sources.training.collator import SFTDataCollator

jax.config.update("jax_default_matmul_precision", "highest")

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "assets" / "checkpoints" / "llama3"
TOKENIZER = ROOT / "assets" / "tokenizer" / "llama3"
DATA = ROOT / "assets" / "data" / "sft"
SCHEDULES = ["linear", "cosine"]
# (warmup W, total T): no warmup, a one-step run, the ceil(0.1 T) of the shipped config (T = 36),
# warmup over the whole run, and a warmup longer than the run
WARMUP_TOTAL = [(0, 1), (0, 12), (1, 7), (3, 23), (4, 36), (5, 5), (6, 4)]


# ---- learning-rate schedules ---------------------------------------------------------------

def _hf_lrs(name: str, num_warmup: int, num_total: int, steps: int) -> list[float]:
    """The lr transformers' scheduler gives each of `steps` optimizer steps (lr 1: the multiplier)."""
    transformers = pytest.importorskip("transformers")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = transformers.get_scheduler(name, opt, num_warmup_steps=num_warmup, num_training_steps=num_total)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


@pytest.mark.parametrize("warmup, total", WARMUP_TOTAL)
@pytest.mark.parametrize("name", SCHEDULES)
def test_schedule_multipliers_match_transformers(name, warmup, total):
    steps = total + 2  # past the end too: both must stay at 0 (or in warmup), as HF's do
    expected = _hf_lrs(name, warmup, total, steps)
    ours = [t_optimizer.LR_MULTIPLIERS[name](s, warmup, total) for s in range(steps)]
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-12)
    jx = [float(j_optimizer.LR_MULTIPLIERS[name](s, warmup, total)) for s in range(steps)]
    np.testing.assert_allclose(jx, ours, rtol=0, atol=1e-6)  # fp32 arithmetic
    # the LambdaLR / optax schedule wrappers, at a real learning rate
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=5e-3)
    sched, lrs = t_optimizer.get_scheduler(name, opt, warmup, total), []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    np.testing.assert_allclose(lrs, 5e-3 * np.asarray(expected), rtol=0, atol=1e-15)
    schedule = j_optimizer.get_scheduler(name, 5e-3, warmup, total)
    np.testing.assert_allclose([float(schedule(s)) for s in range(steps)], lrs, rtol=0, atol=5e-3 * 1e-6)


def test_named_schedule_builders_and_the_two_schedules_differ():
    W, T = 3, 23
    for name, t_fn, j_fn in (("linear", t_optimizer.get_linear_schedule_with_warmup,
                              j_optimizer.get_linear_schedule_with_warmup),
                             ("cosine", t_optimizer.get_cosine_schedule_with_warmup,
                              j_optimizer.get_cosine_schedule_with_warmup)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        assert t_fn(opt, W, T).lr_lambdas[0](10) == t_optimizer.LR_MULTIPLIERS[name](10, W, T)
        assert abs(float(j_fn(1.0, W, T)(10)) - t_optimizer.LR_MULTIPLIERS[name](10, W, T)) < 1e-6
    linear, cosine = (_hf_lrs(n, W, T, T) for n in SCHEDULES)
    assert linear[:W + 1] == cosine[:W + 1] == [0.0, 1 / 3, 2 / 3, 1.0]  # the same warmup
    assert abs(linear[13] - 0.5) < 1e-12 and cosine[13] == pytest.approx(0.5)  # both halve at mid-decay...
    assert cosine[8] - linear[8] > 0.1  # ...but cosine stays higher before it


@pytest.mark.parametrize("name", SCHEDULES)
def test_create_optimizer_follows_lr_scheduler_type(name):
    T = 36
    args = t_sft.TrainArgs(lr_scheduler_type=name)
    warmup = t_optimizer.get_warmup_steps(T, args.warmup_ratio)
    assert warmup == j_optimizer.get_warmup_steps(T, args.warmup_ratio) == 4
    opt, sched = t_optimizer.create_optimizer([("w", torch.nn.Parameter(torch.zeros(2)))], args, T)
    lrs = []
    for _ in range(T):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    np.testing.assert_allclose(lrs, args.learning_rate * np.asarray(_hf_lrs(name, warmup, T, T)), rtol=0, atol=1e-15)


@pytest.mark.parametrize("sft", [t_sft, j_sft], ids=["torch", "jax"])
def test_unknown_scheduler_is_refused(sft):
    with pytest.raises(ValueError, match="constant"):
        sft.TrainArgs(lr_scheduler_type="constant")


# ---- eval_loss -----------------------------------------------------------------------------

@pytest.mark.parametrize("sft", [t_sft, j_sft], ids=["torch", "jax"])
def test_mean_of_batch_losses(sft):
    assert sft.mean_of_batch_losses([1.0, 2.0, 6.0]) == 3.0
    assert sft.mean_of_batch_losses([1.0, float("nan"), 2.0, float("inf")]) == 1.5  # logging_nan_inf_filter
    assert np.isnan(sft.mean_of_batch_losses([float("nan")] * 2))


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaForCausalLM.from_pretrained(MODEL, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def held_out():
    return t_sft.load_processed_dataset(TOKENIZER, DATA, "eval", t_sft.TrainArgs())


@torch.no_grad()
def _hf_evaluation_loop(hf_model, features: list[dict], eval_batch_size: int) -> tuple[float, float]:
    """(eval_loss as transformers' Trainer.evaluation_loop computes it, the token-global mean).

    Written out from trainer.py (single process): a SequentialSampler in batches of
    eval_batch_size; prediction_step -> compute_loss with num_items_in_batch =
    _get_num_items_in_batch([inputs]) (labels != -100 of this batch, as transformers 5.6 counts them: LF 0.9.5's
    stack; prompt-masked rows never label position 0, so it equals the shifted count here), the model's own
    ForCausalLMLoss dividing by it; `losses.repeat(batch_size)` with the configured size;
    concatenated; non-finite dropped (logging_nan_inf_filter); `.mean()`.
    """
    collate = SFTDataCollator(pad_token_id=404)
    all_losses, summed, tokens = [], 0.0, 0
    for s in range(0, len(features), eval_batch_size):
        batch = collate(features[s:s + eval_batch_size])
        num_items = (batch["labels"] != -100).sum()
        out = hf_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                       num_items_in_batch=num_items)
        loss = out.loss.detach().mean()
        all_losses.append(loss.repeat(eval_batch_size).numpy())
        summed += out.loss.item() * int(num_items)
        tokens += int(num_items)
    losses = np.concatenate(all_losses)
    finite = np.isfinite(losses)
    return float((losses[finite] if finite.any() else losses).mean()), summed / tokens


@pytest.mark.parametrize("num_rows", [24, 22])  # 22: a short last batch of 2 weighs as much as a full one
def test_eval_loss_is_hf_evaluation_loop_not_token_global_mean(hf_model, held_out, num_rows):
    args_t, args_j = t_sft.TrainArgs(), j_sft.TrainArgs()
    features = held_out[:num_rows]
    hf_eval_loss, token_mean = _hf_evaluation_loop(hf_model, features, args_t.per_device_eval_batch_size)
    # the two reductions really differ on this data: batches hold 15..25 labelled tokens
    assert abs(hf_eval_loss - token_mean) / hf_eval_loss > 1e-4, (hf_eval_loss, token_mean)
    ours_t = t_sft.evaluate_loss(MODEL, None, features, args_t)
    ours_j = j_sft.evaluate_loss(MODEL, None, features, args_j)
    for ours in (ours_t, ours_j):
        assert abs(ours - hf_eval_loss) / hf_eval_loss < 1e-5
        assert abs(ours - hf_eval_loss) < 0.02 * abs(token_mean - hf_eval_loss)


def test_eval_loss_with_adapter_torch_vs_jax(held_out):
    """The LoRA path of both evaluators (B != 0, so the adapter changes the loss)."""
    args = t_sft.TrainArgs()
    sd = t_lora.lora_state_dict(t_sft.load_model(MODEL, t_sft.lora_config(args), seed=0))
    r = np.random.default_rng(3)
    sd = {k: (r.standard_normal(v.shape) * 0.05).astype(np.float32) if "lora_B" in k else v for k, v in sd.items()}
    base = t_sft.evaluate_loss(MODEL, None, held_out, args)
    ours_t = t_sft.evaluate_loss(MODEL, sd, held_out, args)
    ours_j = j_sft.evaluate_loss(MODEL, sd, held_out, j_sft.TrainArgs())
    assert abs(ours_t - base) > 1e-3
    assert abs(ours_j - ours_t) / ours_t < 1e-5


# ---- truncation in the shipped data --------------------------------------------------------

def _truncation_cases(split: str, cutoff_len: int) -> dict[str, int]:
    """Replay the supervised processor's turn loop on every row of a split; count what infer_seqlen did."""
    template = t_template.get_template("llama3")
    tok = template.fix_special_tokens(t_template.load_tokenizer(TOKENIZER))
    cases = {"rows_over_cutoff": 0, "source_cut": 0, "target_cut": 0, "turn_dropped": 0, "rows_losing_labels": 0}
    for row in json.loads((DATA / f"{split}.json").read_text()):
        pairs = template.encode_multiturn(tok, t_template.alpaca_to_messages(row), row.get("system"))
        cases["rows_over_cutoff"] += sum(len(s) + len(t) for s, t in pairs) > cutoff_len
        used, loses_labels = 0, False
        for source, target in pairs:
            if used >= cutoff_len:
                cases["turn_dropped"] += 1
                loses_labels = True
                break
            s, t = t_processor.infer_seqlen(len(source), len(target), cutoff_len - used)
            cases["source_cut"] += s < len(source)
            cases["target_cut"] += t < len(target)
            loses_labels |= t < len(target)
            used += s + t
        cases["rows_losing_labels"] += loses_labels
    return cases


def _num_labels(feature: dict) -> int:
    return sum(x != -100 for x in feature["labels"])


@pytest.mark.parametrize("split", ["train", "eval"])
def test_shipped_data_is_truncated_by_cutoff_len(split):
    args = t_sft.TrainArgs()
    cases = _truncation_cases(split, args.cutoff_len)
    # every way LF cuts: a prompt cut, an answer cut (labels lose their <|eot_id|>), a later turn dropped
    assert all(n > 0 for n in cases.values()), cases
    cut = t_sft.load_processed_dataset(TOKENIZER, DATA, split, args)
    uncut = t_sft.load_processed_dataset(TOKENIZER, DATA, split, t_sft.TrainArgs(cutoff_len=10_000))
    over = {i for i, f in enumerate(uncut) if len(f["input_ids"]) > args.cutoff_len}
    assert len(over) == cases["rows_over_cutoff"]
    assert all(len(cut[i]["input_ids"]) == args.cutoff_len for i in over)  # infer_seqlen spends the whole budget
    assert all(cut[i] == uncut[i] for i in range(len(cut)) if i not in over)
    assert sum(_num_labels(cut[i]) < _num_labels(uncut[i]) for i in over) == cases["rows_losing_labels"]
    assert sum(cut[i]["labels"][-1] != 404 for i in over) > 0  # an answer cut before its <|eot_id|>
