"""LLaMA-Factory-shaped SFT: torch_sources/training against its JAX twin (and HF where it is the spec).

Data pipeline (template ids, truncation, labels, collation) on literals and on the whole
dataset; LoRA init bits; AdamW + warmup schedule against optax; loss, grads and a few optimizer
steps on the tiny Llama 3 checkpoint; the full SFT run (slow). HF Trainer semantics (schedules vs
transformers, eval_loss, truncation in the shipped data) are in tests/training/test_hf_trainer_semantics.py.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
import torch

from grader.scoring.measures import tensor_score
from jax_oracles.training import collator as j_collator, lora as j_lora, loss as j_loss, optimizer as j_optimizer, processor as j_processor, sft as j_sft, template as j_template
from torch_sources.training import collator as t_collator, lora as t_lora, loss as t_loss, optimizer as t_optimizer, processor as t_processor, sft as t_sft, template as t_template

jax.config.update("jax_default_matmul_precision", "highest")

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "assets" / "checkpoints" / "llama3"
TOKENIZER = ROOT / "assets" / "tokenizer" / "llama3"
DATA = ROOT / "assets" / "data" / "sft"
TEMPLATES = [t_template, j_template]
PROCESSORS = [t_processor, j_processor]

# Tokenized with assets/tokenizer/llama3 (tools/make_tokenizer.py).
COUNT_PROMPT = [400, 402, 267, 403, 256, 287, 358, 220, 18, 13, 404, 402, 269, 403, 256]  # 256 = "\n\n"
COUNT_ANSWER = [16, 220, 17, 220, 18, 404]  # "1 2 3<|eot_id|>": the eot closes the turn and is labelled


def _tokenizer(template_module):
    template = template_module.get_template("llama3")
    return template, template.fix_special_tokens(template_module.load_tokenizer(TOKENIZER))


# ---- assets --------------------------------------------------------------------------------

def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dataset_and_tokenizer_assets_are_reproducible():
    datasets, tokenizers = _tool("make_datasets"), _tool("make_tokenizer")
    train, held_out = datasets.make_sft()
    for name, rows in (("train", train), ("eval", held_out)):
        assert (DATA / f"{name}.json").read_text() == json.dumps(rows, indent=2, ensure_ascii=False) + "\n"
    tok = tokenizers.build_tokenizer(tokenizers.corpus(DATA))
    assert tok.to_str(pretty=True) == (TOKENIZER / "tokenizer.json").read_text()  # what Tokenizer.save writes
    config = (TOKENIZER / "tokenizer_config.json").read_text()
    assert config == json.dumps(tokenizers.tokenizer_config(), indent=2, sort_keys=True) + "\n"
    specials = {t: tok.token_to_id(t) for t in tokenizers.SPECIAL_TOKENS[:5]}
    assert specials == {"<|begin_of_text|>": 400, "<|end_of_text|>": 401, "<|start_header_id|>": 402,
                        "<|end_header_id|>": 403, "<|eot_id|>": 404}
    assert tok.get_vocab_size() <= 512  # the checkpoint's vocab


# ---- template ------------------------------------------------------------------------------

@pytest.mark.parametrize("mod", TEMPLATES, ids=["torch", "jax"])
def test_llama3_template_literal_ids(mod):
    template, tok = _tokenizer(mod)
    raw = mod.load_tokenizer(TOKENIZER)
    assert (raw.eos_token_id, raw.pad_token_id) == (401, None)  # the base checkpoint's <|end_of_text|>, no pad
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (400, 404, 404)  # replace_eos; pad := eos
    messages = [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1 2 3"}]
    assert template.encode_oneturn(tok, messages) == (COUNT_PROMPT, COUNT_ANSWER)
    assert tok.decode(COUNT_PROMPT) == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nCount to 3."
                                        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    # LF's test_encode_multiturn shape: bos only on turn 0, each pair = (user slot, answer + eot)
    two = messages + [{"role": "user", "content": "Sort the letters.\ncab"}, {"role": "assistant", "content": "abc"}]
    pairs = template.encode_multiturn(tok, two)
    assert pairs[0] == (COUNT_PROMPT, COUNT_ANSWER)
    assert tok.decode(pairs[1][0]) == ("<|start_header_id|>user<|end_header_id|>\n\nSort the letters.\ncab<|eot_id|>"
                                       "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert tok.decode(pairs[1][1]) == "abc<|eot_id|>"
    system = template.encode_oneturn(tok, messages, system="Be brief.")[0]
    assert tok.decode(system).startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
                                         "<|eot_id|><|start_header_id|>user")


def test_template_matches_hf_chat_template_on_dataset():
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(TOKENIZER))
    template, tok = _tokenizer(t_template)
    rows = json.loads((DATA / "train.json").read_text())
    multi = [r for r in rows if r.get("history")]
    system = [r for r in rows if r.get("system") and not r.get("history")]
    assert multi and system, "the dataset must exercise the multi-turn and system-prompt paths"
    for row in rows[:8] + multi + system[:8]:
        messages = t_template.alpaca_to_messages(row)
        prompt, answer = template.encode_oneturn(tok, messages, row.get("system"))
        pairs = template.encode_multiturn(tok, messages, row.get("system"))
        assert [t for p in pairs for part in p for t in part] == prompt + answer
        hf_messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + messages
        assert prompt + answer == hf.apply_chat_template(hf_messages, tokenize=True)["input_ids"]


@pytest.mark.parametrize("mod", TEMPLATES, ids=["torch", "jax"])
def test_alpaca_to_messages(mod):
    row = {"instruction": "Reverse the words.", "input": "red cat", "output": "cat red",
           "history": [["Count to 2.", "1 2"]]}
    assert mod.alpaca_to_messages(row) == [
        {"role": "user", "content": "Count to 2."}, {"role": "assistant", "content": "1 2"},
        {"role": "user", "content": "Reverse the words.\nred cat"}, {"role": "assistant", "content": "cat red"}]
    assert mod.alpaca_to_messages({"instruction": "Count to 2.", "input": "", "output": "1 2"})[0]["content"] == "Count to 2."


# ---- processor -----------------------------------------------------------------------------

@pytest.mark.parametrize("mod", PROCESSORS, ids=["torch", "jax"])
@pytest.mark.parametrize("case, expected", [  # LF tests/data/processor/test_processor_utils.py
    ((3000, 2000, 1000), (600, 400)), ((2000, 3000, 1000), (400, 600)), ((1000, 100, 1000), (900, 100)),
    ((100, 1000, 1000), (100, 900)), ((100, 500, 1000), (100, 500)), ((500, 100, 1000), (500, 100)),
    ((10, 10, 1000), (10, 10))])
def test_infer_seqlen_lf_cases(mod, case, expected):
    assert mod.infer_seqlen(*case) == expected


@pytest.mark.parametrize("mod", PROCESSORS, ids=["torch", "jax"])
def test_supervised_labels_multiturn_and_truncation(mod):
    pairs = [([1] * 10, [2] * 6), ([3] * 8, [4] * 5)]
    ids, labels = mod.preprocess_supervised_example(pairs, cutoff_len=64)
    assert ids == [1] * 10 + [2] * 6 + [3] * 8 + [4] * 5
    assert labels == [-100] * 10 + [2] * 6 + [-100] * 8 + [4] * 5  # every assistant turn is trained
    # cutoff 20: turn 0 fits (16); turn 1 gets budget 4 -> infer_seqlen(8, 5, 4) = (3, 1)
    ids, labels = mod.preprocess_supervised_example(pairs, cutoff_len=20)
    assert ids == [1] * 10 + [2] * 6 + [3] * 3 + [4]
    assert labels == [-100] * 10 + [2] * 6 + [-100] * 3 + [4]
    # mask_history: last turn first (8+5=13), then turn 0 in budget 7 -> (5, 2); only the last turn labelled
    ids, labels = mod.preprocess_supervised_example(pairs, cutoff_len=20, mask_history=True)
    assert ids == [1] * 5 + [2] * 2 + [3] * 8 + [4] * 5
    assert labels == [-100] * 15 + [4] * 5
    ids, labels = mod.preprocess_supervised_example(pairs, cutoff_len=64, train_on_prompt=True)
    assert labels == ids


@pytest.mark.parametrize("tmod, pmod", zip(TEMPLATES, PROCESSORS), ids=["torch", "jax"])
def test_processed_multiturn_row(tmod, pmod):
    template, tok = _tokenizer(tmod)
    row = {"instruction": "Reverse the words.", "input": "red cat", "output": "cat red",
           "history": [["Count to 3.", "1 2 3"]]}
    (feature,) = pmod.preprocess_supervised_dataset([row], tok, template, cutoff_len=64)
    (p1, a1), (p2, a2) = template.encode_multiturn(tok, tmod.alpaca_to_messages(row))
    assert (p1, a1) == (COUNT_PROMPT, COUNT_ANSWER)
    assert feature["input_ids"] == p1 + a1 + p2 + a2
    assert feature["labels"] == [-100] * len(p1) + a1 + [-100] * len(p2) + a2
    assert feature["attention_mask"] == [1] * len(feature["input_ids"])


# ---- collator ------------------------------------------------------------------------------

def test_collator_right_pads_to_multiple_of_8():
    feats = [{"input_ids": [5, 6, 7, 8, 9], "attention_mask": [1] * 5, "labels": [-100, -100, 7, 8, 9]},
             {"input_ids": list(range(1, 12)), "attention_mask": [1] * 11, "labels": [-100] * 6 + list(range(7, 12))}]
    tb = t_collator.SFTDataCollator(pad_token_id=404)(feats)
    jb = j_collator.SFTDataCollator(pad_token_id=404)(feats)
    assert tb["input_ids"].dtype == torch.int64 and isinstance(tb["input_ids"], torch.Tensor)
    assert jb["input_ids"].dtype == np.int32 and isinstance(jb["input_ids"], np.ndarray)
    assert tb["input_ids"].shape == (2, 16)
    np.testing.assert_array_equal(tb["input_ids"][0].numpy(), [5, 6, 7, 8, 9] + [404] * 11)
    np.testing.assert_array_equal(tb["attention_mask"][1].numpy(), [1] * 11 + [0] * 5)
    np.testing.assert_array_equal(tb["labels"][0].numpy(), [-100, -100, 7, 8, 9] + [-100] * 11)
    for k in tb:
        np.testing.assert_array_equal(tb[k].numpy(), jb[k])
    fixed = j_collator.SFTDataCollator(pad_token_id=404, pad_to_length=24)(feats)
    assert fixed["labels"].shape == (2, 24)


def test_data_pipelines_agree_on_whole_dataset():
    args_t, args_j = t_sft.TrainArgs(), j_sft.TrainArgs()
    for split, n in (("train", 96), ("eval", 24)):
        ft = t_sft.load_processed_dataset(TOKENIZER, DATA, split, args_t)
        fj = j_sft.load_processed_dataset(TOKENIZER, DATA, split, args_j)
        assert len(ft) == n and ft == fj
        assert all(len(f["input_ids"]) <= args_t.cutoff_len for f in ft)
        # every row ends with a labelled <|eot_id|>, unless cutoff_len cut its last answer
        assert all(f["labels"][-1] == 404 or len(f["input_ids"]) == args_t.cutoff_len for f in ft)
        assert any(sum(a != -100 and b == -100 for a, b in zip(f["labels"][1:], f["labels"])) == 2 for f in ft)
    ft = t_sft.load_processed_dataset(TOKENIZER, DATA, "train", args_t)
    fj = j_sft.load_processed_dataset(TOKENIZER, DATA, "train", args_j)
    ct, cj = t_sft.make_collator(args_t, TOKENIZER), j_sft.make_collator(args_j, TOKENIZER)
    assert ct.pad_token_id == cj.pad_token_id == 404
    for step_t, step_j in zip(t_sft.step_example_indices(96, args_t, 1), j_sft.step_example_indices(96, args_j, 1)):
        for it, ij in zip(step_t, step_j):
            bt, bj = ct([ft[i] for i in it]), cj([fj[i] for i in ij])
            for k in bt:
                np.testing.assert_array_equal(bt[k].numpy(), bj[k])


def test_data_order_is_seeded_permutation():
    args = t_sft.TrainArgs()
    steps = t_sft.step_example_indices(96, args, 2)
    assert len(steps) == 12 and all(len(s) == 2 and all(len(m) == 4 for m in s) for s in steps)
    np.testing.assert_array_equal(np.concatenate([m for s in steps for m in s]),
                                  np.random.default_rng(args.seed + 2).permutation(96))
    assert t_sft.num_training_steps(96, args) == args.num_train_epochs * 12
    assert t_sft.num_training_steps(97, args) == args.num_train_epochs * 13  # a short last step, as in HF


# ---- loss, schedule, optimizer -------------------------------------------------------------

def test_causal_lm_loss_matches_hf_and_jax():
    ForCausalLMLoss = pytest.importorskip("transformers.loss.loss_utils").ForCausalLMLoss

    r = np.random.default_rng(1)
    logits = r.standard_normal((2, 7, 11)).astype(np.float32) * 3
    labels = r.integers(0, 11, (2, 7))
    labels[0, :3] = -100
    labels[1, 5:] = -100
    n_items = t_loss.count_label_tokens(labels)
    # LF 0.9.5's transformers (5.6) counts every labelled position, the first one too (issue 31): row 1 labels its
    # first position, so the shifted count (transformers 5.2x) is one less
    assert n_items == j_loss.count_label_tokens(labels) == int((labels != -100).sum())
    assert n_items == int((labels[:, 1:] != -100).sum()) + 1
    tl, tlab = torch.from_numpy(logits), torch.from_numpy(labels)
    for num_items in (None, n_items, 3 * n_items):  # 3x: the micro-batch of a larger accumulation step
        hf = ForCausalLMLoss(tl, tlab, 11, num_items_in_batch=None if num_items is None else torch.tensor(num_items))
        ours = t_loss.causal_lm_loss(tl, tlab, num_items)
        jx = j_loss.causal_lm_loss(logits, labels.astype(np.int32), num_items)
        np.testing.assert_allclose(ours.item(), hf.item(), rtol=1e-6)
        np.testing.assert_allclose(float(jx), hf.item(), rtol=1e-6)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("flatten", [False, True], ids=["tree", "flat"])
def test_adamw_schedule_clip_torch_vs_optax_5_steps(flatten, schedule):
    r = np.random.default_rng(7)
    # the tree optimizer must keep "bias" out of weight decay, as torch's param groups do;
    # the flat one (used on LoRA trees) decays every element, so it gets no bias
    shapes = {"w": (6, 5), "v": (4,), ("u" if flatten else "bias"): (5,)}
    init = {k: r.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    # grad norms straddle max_grad_norm=1, so some steps clip and some do not
    grads = [{k: (r.standard_normal(s) * scale).astype(np.float32) for k, s in shapes.items()}
             for scale in (0.05, 2.0, 0.1, 5.0, 0.2)]
    kw = dict(learning_rate=1e-2, weight_decay=0.1, warmup_ratio=0.4, max_grad_norm=1.0, lr_scheduler_type=schedule)
    T = len(grads)

    params_t = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in init.items()}
    opt, sched = t_optimizer.create_optimizer(params_t.items(), t_sft.TrainArgs(**kw), T)
    for g in grads:
        for k, p in params_t.items():
            p.grad = torch.from_numpy(g[k].copy())
        t_optimizer.clip_grad_norm(params_t.values(), 1.0)
        opt.step()
        sched.step()

    tx = j_optimizer.create_optimizer(j_sft.TrainArgs(**kw), T, flatten=flatten)
    params_j = {k: jax.numpy.asarray(v) for k, v in init.items()}
    state = tx.init(params_j)
    for g in grads:
        updates, state = tx.update({k: jax.numpy.asarray(v) for k, v in g.items()}, state, params_j)
        params_j = jax.tree.map(lambda p, u: p + u, params_j, updates)

    for k in shapes:
        pt, pj = params_t[k].detach().numpy(), np.asarray(params_j[k])
        assert np.abs(pt - init[k]).max() > 1e-2, "the optimizer must have moved the params"
        assert np.abs(pt - pj).max() < 1e-6, k


# ---- LoRA ----------------------------------------------------------------------------------

def test_lora_linear_ops_agree():
    r = np.random.default_rng(3)
    x = r.standard_normal((2, 5, 16)).astype(np.float32)
    w, b = r.standard_normal((12, 16)).astype(np.float32), r.standard_normal(12).astype(np.float32)
    a, bb = r.standard_normal((4, 16)).astype(np.float32), r.standard_normal((12, 4)).astype(np.float32)
    yt = t_lora.lora_linear(*(torch.from_numpy(v) for v in (x, w, b, a, bb)), 2.0).numpy()
    yj = np.asarray(j_lora.lora_linear(x, w, b, a, bb, 2.0))
    base = torch.nn.Linear(16, 12)
    with torch.no_grad():
        base.weight.copy_(torch.from_numpy(w))
        base.bias.copy_(torch.from_numpy(b))
    module = t_lora.LoraLinear(base, r=4, lora_alpha=8)
    with torch.no_grad():
        module.lora_A.weight.copy_(torch.from_numpy(a))
        module.lora_B.weight.copy_(torch.from_numpy(bb))
    np.testing.assert_allclose(module(torch.from_numpy(x)).detach().numpy(), yt, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(yj, yt, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(yt, x @ w.T + b + 2.0 * (x @ a.T) @ bb.T, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def torch_model():
    return t_sft.load_model(MODEL, t_sft.lora_config(t_sft.TrainArgs()), seed=0)


@pytest.fixture(scope="module")
def jax_model():
    return j_sft.load_model(MODEL, j_sft.lora_config(j_sft.TrainArgs()))


def test_lora_init_bit_identical_and_trainable_set(jax_model):
    torch_model = t_sft.load_model(MODEL, t_lora.LoraConfig(), seed=0)  # fresh: other tests reload adapters
    sd_t = t_lora.lora_state_dict(torch_model)
    tree, names_j = j_lora.inject_lora(jax_model.params, j_lora.LoraConfig(), seed=0)
    sd_j = j_lora.lora_state_dict(j_lora.init_lora_tree(jax_model.params, j_lora.LoraConfig(), seed=0))
    assert list(sd_t) == list(sd_j) == names_j == list(j_lora.lora_state_dict(tree)) and len(sd_t) == 2 * 7 * 2
    assert names_j == t_lora.inject_lora(t_sft.load_model(MODEL), t_lora.LoraConfig(), seed=0)
    assert next(iter(sd_t)) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    for k in sd_t:
        assert sd_t[k].dtype == sd_j[k].dtype == np.float32
        np.testing.assert_array_equal(sd_t[k], sd_j[k])
    a = sd_t["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"]
    assert a.shape == (8, 128) and 0.9 / math.sqrt(128) < np.abs(a).max() <= 1 / math.sqrt(128)
    assert not np.any(sd_t["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"])
    trainable = {"base_model.model." + n for n, p in torch_model.named_parameters() if p.requires_grad}
    assert trainable == set(sd_t)
    roundtrip = j_lora.lora_state_dict(j_lora.load_lora_state_dict(tree, sd_t))
    with pytest.raises(KeyError):
        j_lora.load_lora_state_dict(tree, dict(list(sd_t.items())[1:]))
    with pytest.raises(KeyError):
        t_lora.load_lora_state_dict(torch_model, dict(list(sd_t.items())[1:]))
    assert list(roundtrip) == list(sd_t) and all(np.array_equal(roundtrip[k], sd_t[k]) for k in sd_t)
    other = t_lora.init_lora_weights([("m", 64, 32)], seed=1)
    assert not np.array_equal(other["m.lora_A.weight"], t_lora.init_lora_weights([("m", 64, 32)], seed=0)["m.lora_A.weight"])


# ---- loss, grads and optimizer steps on the model ------------------------------------------

def _fixed_steps(num_steps: int) -> list[list[dict]]:
    """The first optimizer steps of epoch 0, collated by the torch collator (numpy copies)."""
    args = t_sft.TrainArgs()
    feats = t_sft.load_processed_dataset(TOKENIZER, DATA, "train", args)
    collate = t_sft.make_collator(args, TOKENIZER)
    steps = t_sft.step_example_indices(len(feats), args, 0)[:num_steps]
    return [[{k: v.numpy() for k, v in collate([feats[i] for i in idx]).items()} for idx in step] for step in steps]


def _random_b(sd: dict, seed: int) -> dict:
    r = np.random.default_rng(seed)
    return {k: (r.standard_normal(v.shape) * 0.05).astype(np.float32) if k.endswith("lora_B.weight") else v
            for k, v in sd.items()}


def test_step0_loss_and_lora_grads(torch_model, jax_model):
    (micro,) = _fixed_steps(1)
    sd0 = t_lora.init_lora_weights(t_lora.lora_target_specs(torch_model, t_lora.LoraConfig()), seed=0)
    loss_t, grads_t = t_sft.sft_step_loss_and_grads(torch_model, sd0, micro)
    loss_j, grads_j = j_sft.sft_step_loss_and_grads(jax_model, sd0, micro)
    # GA normalisation: the step loss is the token mean over both micro-batches
    summed = sum(t_loss.causal_lm_loss(torch_model(torch.from_numpy(b["input_ids"]), torch.from_numpy(b["attention_mask"])),
                                       torch.from_numpy(b["labels"]), 1).item() for b in micro)
    np.testing.assert_allclose(loss_t, summed / sum(t_loss.count_label_tokens(b["labels"]) for b in micro), rtol=1e-6)
    assert abs(loss_t - loss_j) / loss_t < 1e-6
    assert list(grads_t) == list(grads_j) == list(sd0)
    for k in grads_t:
        if k.endswith("lora_A.weight"):  # B = 0 -> dL/dA = 0 exactly, on both sides
            assert not np.any(grads_t[k]) and not np.any(grads_j[k]), k
        else:
            assert tensor_score(grads_t[k], grads_j[k]) >= 0.9999, k
    # with a non-zero B every adapter gets a gradient
    sd1 = _random_b(sd0, seed=5)
    loss_t, grads_t = t_sft.sft_step_loss_and_grads(torch_model, sd1, micro)
    loss_j, grads_j = j_sft.sft_step_loss_and_grads(jax_model, sd1, micro)
    assert abs(loss_t - loss_j) / loss_t < 1e-6
    for k in grads_t:
        assert np.abs(grads_t[k]).max() > 0, k
        assert tensor_score(grads_t[k], grads_j[k]) >= 0.9999, k


def test_three_fixed_steps_torch_vs_jax():
    steps = _fixed_steps(3)
    args_t, args_j = t_sft.TrainArgs(), j_sft.TrainArgs()
    model = t_sft.load_model(MODEL, t_sft.lora_config(args_t), seed=0)
    sd0 = _random_b(t_lora.lora_state_dict(model), seed=11)
    losses_t, final_t = t_sft.train_steps(MODEL, sd0, steps, args_t)
    losses_j, final_j = j_sft.train_steps(MODEL, sd0, steps, args_j)
    np.testing.assert_allclose(losses_j, losses_t, rtol=1e-5)
    assert list(final_t) == list(final_j)
    moved = max(np.abs(final_t[k] - sd0[k]).max() for k in sd0)
    assert moved > 1e-3, "three steps must move the adapters"
    for k in final_t:
        assert tensor_score(final_t[k], final_j[k]) >= 0.99999, k
        assert np.abs(final_t[k] - final_j[k]).max() < 1e-5, k


# ---- end to end ----------------------------------------------------------------------------

@pytest.mark.slow
def test_full_sft_run_lowers_heldout_loss_and_jax_matches():
    args_t, args_j = t_sft.TrainArgs(), j_sft.TrainArgs()
    rt = t_sft.train_sft(MODEL, TOKENIZER, DATA, args_t)
    rj = j_sft.train_sft(MODEL, TOKENIZER, DATA, args_j)
    assert len(rt.step_losses) == len(rj.step_losses) == t_sft.num_training_steps(96, args_t)
    np.testing.assert_allclose(rj.eval_loss_before, rt.eval_loss_before, rtol=1e-5)
    assert rt.eval_loss_after <= 0.8 * rt.eval_loss_before, (
        f"held-out loss {rt.eval_loss_before:.3f} -> {rt.eval_loss_after:.3f} is not 20% lower. With the lm_head "
        f"and final norm frozen, the reachable CE floor is set by the lm_head scale: at std 0.02 on a 64-wide "
        f"hidden state no adapter gets below ~5.0 (ln 512 = 6.24); std ~0.1 lets this run reach ~37%.")
    assert abs(rj.eval_loss_after - rt.eval_loss_after) / rt.eval_loss_after < 1e-3
    np.testing.assert_allclose(rj.step_losses, rt.step_losses, rtol=1e-3)
    held_out = t_sft.load_processed_dataset(TOKENIZER, DATA, "eval", args_t)
    np.testing.assert_allclose(t_sft.evaluate_loss(MODEL, rt.lora_state_dict, held_out, args_t),
                               rt.eval_loss_after, rtol=1e-6)
    np.testing.assert_allclose(j_sft.evaluate_loss(MODEL, None, held_out, args_j), rt.eval_loss_before, rtol=1e-5)
