"""Device side of the torch serving engine: paged attention, paged model forward, sampler, engine vs transformers."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from torch_sources.models import gemma4 as gemma4_model
from torch_sources.serving.config import EngineConfig, SamplingParams
from torch_sources.serving.engine import LLMEngine
from torch_sources.serving.model_runner import ModelRunner
from torch_sources.serving.paged_attention import (PagedKVCache, ragged_paged_attention,
                                                   write_to_kv_cache)
from torch_sources.serving.sampler import (SamplingMetadata, Sampler, apply_min_p, apply_penalties,
                                           apply_temperature, apply_top_k_top_p, exponential_noise, greedy_sample,
                                           random_sample)

CHECKPOINTS = Path(__file__).resolve().parents[2] / "assets" / "checkpoints"
FAMILIES = {family: str(CHECKPOINTS / family) for family in ("llama3", "gemma4", "qwen2", "qwen3")}
LLAMA_SHAPED = ("llama3", "qwen2", "qwen3")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tensor_measure(a, b) -> float:
    """sqrt(max(0, cos) * min(|a|,|b|) / max(|a|,|b|)) (DESIGN.md section 6)."""
    a, b = torch.as_tensor(a).double().flatten(), torch.as_tensor(b).double().flatten()
    na, nb = a.norm().item(), b.norm().item()
    cos = (a @ b).item() / max(na * nb, 1e-12)
    return float(np.sqrt(max(0.0, cos) * min(na, nb) / max(na, nb, 1e-12)))


# ---- (1) ragged paged attention vs dense causal attention ------------------------------------------------------

def _ragged_case(seed, seqs, *, block_size=4, num_pages=40, N=4, K=2, H=8, max_seqs=6, pad_tokens=3):
    """seqs: (kv_len, q_len) per sequence (the queries are the last q_len of kv_len tokens).
    Pages are shuffled across sequences; unwritten slots hold NaN so reading one shows up."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=g).tolist()
    full = [(torch.randn(L, N, H, generator=g), torch.randn(L, K, H, generator=g), torch.randn(L, K, H, generator=g))
            for L, _ in seqs]
    pages_per_seq = max(-(-L // block_size) for L, _ in seqs) + 1
    page_indices = torch.zeros(max_seqs, pages_per_seq, dtype=torch.int32)
    k_pages = torch.full((num_pages, block_size, K, H), float("nan"))
    v_pages = k_pages.clone()
    q, k_new, v_new, slots, cu = [], [], [], [], [0]
    for i, ((L, Tq), (qf, kf, vf)) in enumerate(zip(seqs, full)):
        table = [perm.pop() for _ in range(-(-L // block_size))]
        page_indices[i, :len(table)] = torch.tensor(table)
        seq_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(L)])
        write_to_kv_cache(k_pages, v_pages, kf[:L - Tq], vf[:L - Tq], seq_slots[:L - Tq])  # the context
        q.append(qf[L - Tq:]), k_new.append(kf[L - Tq:]), v_new.append(vf[L - Tq:]), slots.append(seq_slots[L - Tq:])
        cu.append(cu[-1] + Tq)
    T = cu[-1]
    q = torch.cat(q + [torch.randn(pad_tokens, N, H, generator=g)])
    k_new = torch.cat(k_new + [torch.randn(pad_tokens, K, H, generator=g)])
    v_new = torch.cat(v_new + [torch.randn(pad_tokens, K, H, generator=g)])
    slot_mapping = torch.cat(slots + [torch.full((pad_tokens,), -1)]).to(torch.int32)
    kv_lens = torch.tensor([L for L, _ in seqs] + [0] * (max_seqs - len(seqs)), dtype=torch.int32)
    cu_q_lens = torch.tensor(cu + [T] * (max_seqs - len(seqs)), dtype=torch.int32)
    return dict(q=q, k_new=k_new, v_new=v_new, k_pages=k_pages, v_pages=v_pages, slot_mapping=slot_mapping,
                kv_lens=kv_lens, page_indices=page_indices, cu_q_lens=cu_q_lens,
                num_seqs=torch.tensor([len(seqs)], dtype=torch.int32), full=full, seqs=seqs, T=T)


def _dense_reference(case, sm_scale, sliding_window, soft_cap):
    # Whole-sequence causal attention (training-side operators), keeping the rows of the last q_len queries.
    outs = []
    for (L, Tq), (qf, kf, vf) in zip(case["seqs"], case["full"]):
        mask = gemma4_model.causal_mask(torch.ones(1, L, dtype=torch.int32), sliding_window)
        out = gemma4_model.eager_attention(qf[None], kf[None], vf[None], mask, sm_scale, soft_cap)[0]
        outs.append(out[L - Tq:])
    return torch.cat(outs)


# decodes, whole prefills, chunks after a context, lengths ending mid-page and on a page boundary
RAGGED_SEQS = [(9, 1), (6, 6), (13, 5), (8, 1), (1, 1), (16, 3)]


@pytest.mark.parametrize("sliding_window,soft_cap", [(None, None), (3, None), (None, 2.0), (5, 30.0)])
@pytest.mark.parametrize("seed", [0, 1])
def test_ragged_paged_attention_matches_dense(seed, sliding_window, soft_cap):
    case = _ragged_case(seed, RAGGED_SEQS)
    write_to_kv_cache(case["k_pages"], case["v_pages"], case["k_new"], case["v_new"], case["slot_mapping"])
    out = ragged_paged_attention(case["q"], case["k_pages"], case["v_pages"], case["kv_lens"], case["page_indices"],
                                 case["cu_q_lens"], case["num_seqs"], sm_scale=0.3, sliding_window=sliding_window,
                                 soft_cap=soft_cap)
    ref = _dense_reference(case, 0.3, sliding_window, soft_cap)
    T = case["T"]
    torch.testing.assert_close(out[:T], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[T:], torch.zeros_like(out[T:]))  # bucket padding tokens


def test_window_changes_the_result():
    # Guards the parametrized test above: a window shorter than the sequences must matter.
    case = _ragged_case(3, RAGGED_SEQS)
    write_to_kv_cache(case["k_pages"], case["v_pages"], case["k_new"], case["v_new"], case["slot_mapping"])
    args = [case[k] for k in ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")]
    full = ragged_paged_attention(*args, sm_scale=0.3)
    windowed = ragged_paged_attention(*args, sm_scale=0.3, sliding_window=3)
    assert not torch.allclose(full[:case["T"]], windowed[:case["T"]])


def test_write_to_kv_cache_skips_padding_slots():
    k_pages, v_pages = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    k_new, v_new = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    write_to_kv_cache(k_pages, v_pages, k_new, v_new, torch.tensor([5, -1, 11, 0], dtype=torch.int32))
    assert torch.equal(k_pages[1, 1], k_new[0]) and torch.equal(v_pages[2, 3], v_new[2])
    assert torch.equal(k_pages[0, 0], k_new[3])
    written = torch.zeros(12, dtype=torch.bool)
    written[[5, 11, 0]] = True
    assert (k_pages.view(12, -1)[~written] == 0).all() and (v_pages.view(12, -1)[~written] == 0).all()


def test_allocate_kv_cache_gemma4_layers():
    runner = ModelRunner(FAMILIES["gemma4"], EngineConfig(block_size=4, num_blocks=8, max_model_len=32,
                                                          max_num_batched_tokens=32))
    cfg, cache = runner.model_config, runner.kv_cache
    assert isinstance(cache, PagedKVCache) and cache.block_size == 4
    for i in range(cfg.num_hidden_layers):
        if cfg.is_kv_shared(i):
            assert cache.k[i] is None and cache.v[i] is None
        else:
            assert cache.k[i].shape == (8, 4, cfg.layer_num_kv_heads(i), cfg.layer_head_dim(i))
    assert {cache.k[i].shape[-1] for i in range(cfg.num_hidden_layers) if cache.k[i] is not None} == {16, 32}


# ---- (2) paged prefill / teacher-forced decode vs the plain torch model ---------------------------------------

def _runner(family, num_blocks=32):
    return ModelRunner(FAMILIES[family], EngineConfig(block_size=4, num_blocks=num_blocks, max_model_len=64,
                                                      max_num_batched_tokens=64))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_logits_match_model(family):
    runner = _runner(family)
    rng = np.random.default_rng(7)
    for length in (1, 5, 8, 19):  # one token, mid-page, page boundary, past the gemma4 window of 8
        ids = rng.integers(3, 400, size=length).tolist()
        ref = runner.model(torch.tensor([ids]))[0]
        assert tensor_measure(runner.prefill_logits(ids), ref) >= 0.99999, (family, length)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_teacher_forced_decode_matches_model(family):
    runner = _runner(family)
    ids = np.random.default_rng(8).integers(3, 400, size=20).tolist()
    logits, snapshot = runner.teacher_forced_decode(ids[:9], ids[9:])
    ref = runner.model(torch.tensor([ids]))[0, 9:]
    assert logits.shape == ref.shape
    assert tensor_measure(logits, ref) >= 0.99999
    assert all(v.shape[0] == 20 for v in snapshot.values())
    # the cache after the steps holds K/V of every token: prefill them again into a fresh runner and compare
    fresh = _runner(family)
    fresh.prefill_logits(ids)
    again = fresh.cache_snapshot(20)
    assert again.keys() == snapshot.keys()
    for name in snapshot:
        assert tensor_measure(snapshot[name], again[name]) >= 0.99999, name


@pytest.mark.parametrize("family", list(FAMILIES))
def test_decoder_layer_paged_matches_training_layer(family):
    from torch_sources.serving import models
    from torch_sources.serving.model_runner import attention_metadata

    runner = _runner(family)
    serving = models.family(FAMILIES[family])
    ids = np.random.default_rng(9).integers(3, 400, size=11).tolist()
    meta = attention_metadata(runner._single_sequence_batch(ids, 0))
    positions = torch.arange(11, dtype=torch.int32)
    mask = gemma4_model.causal_mask(torch.ones(1, 11, dtype=torch.int32))
    m = runner.model.model
    if family in LLAMA_SHAPED:
        hidden = m.embed_tokens(torch.tensor([ids]))
        ref = m.layers[0](hidden, m.layer_inputs_fn(m.config, torch.ones(1, 11, dtype=torch.int32),
                                                    positions[None].long()))
        out, cache = serving.decoder_layer_paged(runner.model, 0, hidden[0], positions, runner.kv_cache, meta)
    else:
        hidden = m.embed(torch.tensor([ids]))
        ple = m.per_layer_inputs(torch.tensor([ids]), hidden)[:, :, 1]
        ref, _ = m.layers[1](hidden, ple, mask, *m.rope(positions[None].long())["full_attention"])
        out, cache = serving.decoder_layer_paged(runner.model, 1, hidden[0], ple[0], positions, runner.kv_cache, meta)
    assert tensor_measure(out, ref[0]) >= 0.99999
    layer = 0 if family in LLAMA_SHAPED else 1
    written = cache.k[layer].flatten(0, 1).abs().sum((-1, -2)) > 0  # slots 0..10 hold this prompt, no others
    assert written.tolist() == [True] * 11 + [False] * (written.numel() - 11)
    assert all(cache.k[i].abs().sum() == 0 for i in range(len(cache.k)) if i != layer and cache.k[i] is not None)


def test_load_model_dispatches_on_model_type():
    from torch_sources.models.gemma4 import Gemma4ForCausalLM
    from torch_sources.models.llama3 import LlamaForCausalLM
    from torch_sources.serving.models import load_model

    assert isinstance(load_model(FAMILIES["llama3"])[1], LlamaForCausalLM)
    config, model = load_model(FAMILIES["gemma4"])
    assert isinstance(model, Gemma4ForCausalLM) and config.num_kv_shared_layers == 2


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_logits_match_transformers(family):
    """The paged prefill of the torch engine against transformers' eager model on the same checkpoint:
    max abs diff <= 1e-5 (fp32 noise), prompts shorter and longer than any sliding window."""
    transformers = pytest.importorskip("transformers")
    runner = _runner(family)
    hf = transformers.AutoModelForCausalLM.from_pretrained(FAMILIES[family], attn_implementation="eager",
                                                           dtype=torch.float32)
    rng = np.random.default_rng(12)
    for length in (1, 5, 19, 40):
        ids = rng.integers(3, 400, size=length).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        diff = (runner.prefill_logits(ids) - ref).abs().max().item()
        assert diff <= 1e-5, (family, length, diff)


# ---- (3)-(5) the engine vs transformers greedy generate ----------------------------------------------------------

def _prompts():
    rng = np.random.default_rng(11)
    prefix = rng.integers(3, 400, size=13).tolist()  # shared by the first three: prefix-cache hits when chunked
    return [prefix + rng.integers(3, 400, size=6).tolist(), prefix + rng.integers(3, 400, size=3).tolist(),
            prefix[:10], rng.integers(3, 400, size=5).tolist()]


@pytest.fixture(scope="module")
def hf_greedy():
    """transformers greedy continuations (8 tokens, cut after the first EOS) per family."""
    transformers = pytest.importorskip("transformers")
    from torch_sources.serving.engine import eos_token_ids

    out = {}
    for family, path in FAMILIES.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                                  dtype=torch.float32)
        eos = set(eos_token_ids(path))
        conts = []
        for prompt in _prompts():
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
            cont = gen[0, len(prompt):].tolist()
            cut = next((i + 1 for i, t in enumerate(cont) if t in eos), len(cont))
            conts.append(cont[:cut])
        out[family] = conts
    return out


ENGINE_MODES = {
    "core": EngineConfig(block_size=4, num_blocks=32, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=64,
                         mode="core"),
    "ragged": EngineConfig(block_size=4, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                           mode="ragged"),
    "chunked": EngineConfig(block_size=4, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
                            mode="chunked", enable_prefix_caching=True),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0)


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_greedy_matches_transformers(hf_greedy, family, mode):
    config = ENGINE_MODES[mode]
    engine = LLMEngine(FAMILIES[family], config)
    outs = engine.generate(_prompts(), GREEDY)
    assert [o.output_token_ids for o in outs] == hf_greedy[family]
    assert all(o.finished and len(o.logprobs) == len(o.output_token_ids) for o in outs)
    stats = engine.stats()
    # (4) no block leak: every block but the null block (block 0, never handed out) is free again
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1 == config.num_blocks - 1
    if mode == "chunked":
        assert stats["num_prefix_hit_blocks"] > 0


@pytest.mark.parametrize("family", list(FAMILIES))
def test_preemption_keeps_tokens(hf_greedy, family):
    # 7 usable blocks of 4 slots (+ the null block): the longest request (19 + 8 tokens) needs all 7, so the
    # four cannot run together.
    config = EngineConfig(block_size=4, num_blocks=8, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                          mode="ragged")
    engine = LLMEngine(FAMILIES[family], config)
    outs = engine.generate(_prompts(), GREEDY)
    assert [o.output_token_ids for o in outs] == hf_greedy[family]
    stats = engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == config.num_blocks - 1


def test_engine_logprobs_are_raw_log_softmax():
    engine = LLMEngine(FAMILIES["llama3"], ENGINE_MODES["ragged"])
    prompt = _prompts()[3]
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, logprobs=0))[0]
    ids = prompt + out.output_token_ids
    logits = engine.runner.model(torch.tensor([ids]))[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(out.output_token_ids)[:, None])[:, 0]
    got = [d[t].logprob for d, t in zip(out.logprobs, out.output_token_ids)]
    assert all(list(d) == [t] for d, t in zip(out.logprobs, out.output_token_ids))  # logprobs=0: the token only
    torch.testing.assert_close(torch.tensor(got), ref, rtol=1e-5, atol=1e-5)


def test_engine_seeded_sampling_is_reproducible():
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=6) for s in (1, 1, 2)]
    prompt = _prompts()[0]
    a = LLMEngine(FAMILIES["llama3"], ENGINE_MODES["ragged"]).generate([prompt] * 3, params)
    b = LLMEngine(FAMILIES["llama3"], ENGINE_MODES["chunked"]).generate([prompt] * 3, params)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    assert a[0].output_token_ids == a[1].output_token_ids  # same seed, same noise
    assert a[0].output_token_ids != a[2].output_token_ids


# ---- (6) sampler transforms on literal logits ------------------------------------------------------------------

def _row(*values):
    return torch.tensor([values], dtype=torch.float32)


def test_top_p_keeps_the_crossing_token():
    logits = torch.log(_row(0.5, 0.3, 0.15, 0.05))
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.6]))
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]  # 0.5 < 0.6, 0.5 + 0.3 crosses
    torch.testing.assert_close(out[0, :2], logits[0, :2])
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.4]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]
    out = apply_top_k_top_p(logits, torch.tensor([0]), torch.tensor([0.9]))
    assert torch.isfinite(out).tolist() == [[True, True, True, False]]


def test_top_k_keeps_ties_and_per_row_settings():
    logits = torch.tensor([[1.0, 4.0, 2.0, 4.0, 0.0], [1.0, 4.0, 2.0, 3.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 0]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(out).tolist() == [[False, True, False, True, False], [True] * 5]
    out = apply_top_k_top_p(logits, torch.tensor([0, 3]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(out).tolist() == [[True] * 5, [False, True, True, True, False]]


def test_top_k_then_top_p_renormalises_over_the_kept():
    # top-k 2 leaves probs 0.5/0.8, 0.3/0.8; top-p 0.6 then keeps only the first (0.625 >= 0.6)
    logits = torch.log(_row(0.5, 0.3, 0.15, 0.05))
    out = apply_top_k_top_p(logits, torch.tensor([2]), torch.tensor([0.6]))
    assert torch.isfinite(out).tolist() == [[True, False, False, False]]


def test_min_p():
    logits = torch.log(_row(0.5, 0.3, 0.15, 0.05))
    out = apply_min_p(logits, torch.tensor([0.35]))  # threshold 0.175
    assert torch.isfinite(out).tolist() == [[True, True, False, False]]
    assert torch.equal(apply_min_p(logits, torch.tensor([0.0])), logits)


def test_temperature():
    logits = torch.tensor([[2.0, -1.0], [2.0, -1.0]])
    out = apply_temperature(logits, torch.tensor([0.5, 0.0]))
    assert out.tolist() == [[4.0, -2.0], [2.0, -1.0]]  # greedy rows are left alone


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 3.0], [2.0, -2.0, 1.0, 3.0]])
    prompt_mask = torch.tensor([[True, False, False, False], [False] * 4])
    counts = torch.tensor([[0, 1, 0, 2], [0, 0, 0, 3]], dtype=torch.int32)
    out = apply_penalties(logits, prompt_mask, counts, repetition_penalty=torch.tensor([2.0, 1.0]),
                          presence_penalty=torch.tensor([0.5, 0.0]), frequency_penalty=torch.tensor([0.25, 0.1]))
    # row 0: token 0 in prompt -> 2/2; token 1 in output -> -2*2 - 0.25 - 0.5; token 3 -> 3/2 - 0.5 - 0.5
    torch.testing.assert_close(out, torch.tensor([[1.0, -4.75, 1.0, 0.5], [2.0, -2.0, 1.0, 2.7]]))


def test_random_sample_and_greedy():
    probs = _row(0.1, 0.6, 0.3)
    assert random_sample(probs, _row(1.0, 1.0, 1.0)).tolist() == [1]
    assert random_sample(probs, _row(1.0, 10.0, 0.5)).tolist() == [2]  # 0.1, 0.06, 0.6
    assert greedy_sample(_row(0.0, 3.0, 3.0, 1.0)).tolist() == [1]  # first index on ties
    noise = exponential_noise(3, 5, 1000)
    assert noise.dtype == np.float32 and noise.shape == (1000,) and (noise >= 0).all()
    assert np.array_equal(noise, exponential_noise(3, 5, 1000))
    assert not np.array_equal(noise, exponential_noise(3, 6, 1000))
    assert abs(noise.mean() - 1.0) < 0.1


class _Req:  # the fields SamplingMetadata.from_requests reads
    def __init__(self, rid, params, prompt, output):
        self.request_id, self.sampling_params = rid, params
        self.prompt_token_ids, self.output_token_ids = prompt, output


def test_sampler_order():
    # Greedy sees penalties but not temperature / top-k; temperature comes before min_p.
    logits = torch.tensor([[3.0, 2.9, 0.0, -1.0]] * 3)
    reqs = [_Req("a", SamplingParams(temperature=0.0, repetition_penalty=2.0), [0], []),
            _Req("b", SamplingParams(temperature=0.0, top_k=1), [2], []),
            _Req("c", SamplingParams(temperature=10.0, min_p=0.9, seed=0), [], [])]
    meta = SamplingMetadata.from_requests(reqs, 4)
    ids, logprobs = Sampler()(logits, meta)
    assert ids[0].item() == 1  # the penalty halved token 0's logit
    assert ids[1].item() == 0
    # row c: at T=10 probs are nearly flat, so min_p 0.9 keeps tokens 0 and 1 (it would keep only 0 at T=1)
    picks = set()
    for seed in range(40):
        meta = SamplingMetadata.from_requests([_Req("c", SamplingParams(temperature=10.0, min_p=0.9, seed=seed),
                                                    [], [])], 4)
        picks.add(Sampler()(logits[:1], meta)[0].item())
    assert picks == {0, 1}
    # logprobs are of the raw logits, whatever the transforms
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1))
