"""vLLM-shaped serving outputs of both twin engines (serving_engine/ and torch_sources/serving/).

(1) prompt_logprobs equal the log_softmax of the runner's prefill logits, chunk by chunk and in ragged mode, with
top-N ids and ranks; (2) a request asking for prompt logprobs takes no prefix-cache hit; (3) logprobs=-1 covers the
vocabulary, logprobs=0 is the chosen token only, ranks; (4) finish_reason / stop_reason for eos, extra eos ids of
override_generation_config, stop_token_ids, ignore_eos, max_tokens and max_model_len; (5) abort_request;
(6) the engine-wide noise stream of unseeded requests; (7) validation of the new parameters.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from serving_engine import config as jconfig
from serving_engine import engine as jengine
from serving_engine import sampler as jsampler
from torch_sources.serving import config as tconfig
from torch_sources.serving import engine as tengine
from torch_sources.serving import sampler as tsampler

LLAMA = "assets/checkpoints/llama3"
VOCAB = 512  # assets/checkpoints/llama3/config.json
CHECKPOINT_EOS = (401, 404)  # its generation_config.json: 401 is the request eos, 404 a stop token
PKGS = {"jax": (jengine, jconfig, jsampler), "torch": (tengine, tconfig, tsampler)}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompts(seed, lengths, vocab=400):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _engine(pkg, override=None, **cfg):
    eng, conf, _ = PKGS[pkg]
    return eng.LLMEngine(LLAMA, conf.EngineConfig(**cfg), override_generation_config=override)


def _sp(pkg, **kw):
    return PKGS[pkg][1].SamplingParams(**kw)


def _log_softmax(logits) -> np.ndarray:
    x = np.asarray(logits.detach().numpy() if isinstance(logits, torch.Tensor) else logits, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _summary(outs):
    return [(o.request_id, o.output_token_ids, o.finish_reason, o.stop_reason) for o in outs]


RAGGED = dict(mode="ragged", block_size=4, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
CHUNKED = dict(RAGGED, mode="chunked", max_num_batched_tokens=8)  # a budget well under the longest prompt


# ---- (1) prompt logprobs -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["chunked", "ragged"])
@pytest.mark.parametrize("pkg", PKGS)
def test_prompt_logprobs_equal_prefill_log_softmax(pkg, mode):
    cfg = CHUNKED if mode == "chunked" else RAGGED
    prompts = _prompts(1, [21, 6, 9])
    engine = _engine(pkg, **cfg)
    params = [_sp(pkg, temperature=0.0, max_tokens=2, prompt_logprobs=0),
              _sp(pkg, temperature=0.0, max_tokens=2, prompt_logprobs=3),
              _sp(pkg, temperature=0.0, max_tokens=2)]  # asks for none: gets None
    outs = engine.generate(prompts, params)
    if mode == "chunked":  # 36 prompt tokens through an 8-token budget: the long prompt spans several chunks
        assert engine.stats()["num_steps"] >= -(-sum(map(len, prompts)) // cfg["max_num_batched_tokens"])
    assert outs[2].prompt_logprobs is None and all(o.logprobs is None for o in outs)
    for out, prompt, num in zip(outs[:2], prompts[:2], (0, 3)):
        plp = out.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        ref = _log_softmax(engine.runner.prefill_logits(prompt))  # after generate: the engine is idle
        got = np.array([plp[j][prompt[j]].logprob for j in range(1, len(prompt))])
        want = ref[np.arange(len(prompt) - 1), prompt[1:]]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        for j in range(1, len(prompt)):
            entry, row = plp[j], ref[j - 1]
            top = np.argsort(-row, kind="stable")[:num].tolist()
            assert list(entry) == list(dict.fromkeys([prompt[j], *top])), (j, entry)  # prompt token first
            for rank, t in enumerate(top, start=1):  # top-N in order, ranks 1..N
                assert entry[t].rank == rank and abs(entry[t].logprob - row[t]) < 1e-5
            # rank of the prompt token = 1 + tokens strictly above it (a 1e-6 slack for fp32 near-ties)
            lp = entry[prompt[j]].logprob
            assert 1 + np.sum(row > lp + 1e-6) <= entry[prompt[j]].rank <= 1 + np.sum(row > lp - 1e-6)


# ---- (2) prompt logprobs skip the prefix cache ---------------------------------------------------------------

@pytest.mark.parametrize("pkg", PKGS)
def test_prompt_logprobs_skip_prefix_cache(pkg):
    engine = _engine(pkg, **dict(CHUNKED, enable_prefix_caching=True))
    prompt = _prompts(2, [14])[0]  # 3 full blocks of 4 can hit (never the last token)
    first = engine.generate([prompt], _sp(pkg, temperature=0.0, max_tokens=2))[0]
    hits = engine.stats()["num_prefix_hit_blocks"]
    assert hits == 0
    with_plp = engine.generate([prompt], _sp(pkg, temperature=0.0, max_tokens=2, prompt_logprobs=1))[0]
    assert engine.stats()["num_prefix_hit_blocks"] == hits  # no new hit: every prompt position ran
    assert with_plp.output_token_ids == first.output_token_ids
    assert with_plp.prompt_logprobs[0] is None and all(e is not None for e in with_plp.prompt_logprobs[1:])
    fresh = _engine(pkg, **CHUNKED).generate([prompt], _sp(pkg, temperature=0.0, max_tokens=2, prompt_logprobs=1))
    for a, b in zip(with_plp.prompt_logprobs[1:], fresh[0].prompt_logprobs[1:]):
        assert list(a) == list(b) and [x.rank for x in a.values()] == [x.rank for x in b.values()]
        np.testing.assert_allclose([x.logprob for x in a.values()], [x.logprob for x in b.values()], atol=1e-5)
    again = engine.generate([prompt], _sp(pkg, temperature=0.0, max_tokens=2))[0]
    assert engine.stats()["num_prefix_hit_blocks"] == hits + 3  # without prompt logprobs it hits
    assert again.output_token_ids == first.output_token_ids


# ---- (3) sample logprobs -------------------------------------------------------------------------------------

def _assert_whole_vocab(entry, token):
    assert len(entry) == VOCAB and set(entry) == set(range(VOCAB)) and next(iter(entry)) == token
    values = np.array([entry[t].logprob for t in range(VOCAB)])
    assert abs(np.exp(values.astype(np.float64)).sum() - 1.0) < 1e-4
    for t in range(VOCAB):  # rank = 1 + tokens with a strictly larger logprob
        assert entry[t].rank == 1 + int(np.sum(values > entry[t].logprob))
    order = sorted(range(VOCAB), key=lambda t: (-entry[t].logprob, t))  # ties: lower id first
    assert list(entry)[1:] == [t for t in order if t != token]  # then the vocabulary, most likely first


@pytest.mark.parametrize("pkg", PKGS)
def test_sample_logprobs(pkg):
    prompt, other = _prompts(3, [7, 10])
    engine = _engine(pkg, **RAGGED)
    params = [_sp(pkg, temperature=0.0, max_tokens=4, logprobs=-1, prompt_logprobs=-1, ignore_eos=True),
              _sp(pkg, temperature=0.0, max_tokens=4, logprobs=0, ignore_eos=True),
              _sp(pkg, temperature=1.0, seed=7, max_tokens=4, logprobs=-1, ignore_eos=True)]
    whole, chosen, sampled = engine.generate([prompt, prompt, other], params)
    assert whole.output_token_ids == chosen.output_token_ids
    assert len(whole.logprobs) == len(chosen.logprobs) == len(sampled.logprobs) == 4
    for entry, token in zip(whole.logprobs, whole.output_token_ids):
        _assert_whole_vocab(entry, token)
        assert entry[token].rank == 1  # greedy picks the top token
    for entry, token in zip(chosen.logprobs, chosen.output_token_ids):
        assert list(entry) == [token] and entry[token].rank == 1
    for a, b, token in zip(whole.logprobs, chosen.logprobs, whole.output_token_ids):
        assert abs(a[token].logprob - b[token].logprob) < 1e-5
    for entry, token in zip(sampled.logprobs, sampled.output_token_ids):
        _assert_whole_vocab(entry, token)  # the sampled token first, whatever its rank
    for j, entry in enumerate(whole.prompt_logprobs[1:], start=1):
        _assert_whole_vocab(entry, prompt[j])


# ---- (4) finish and stop reasons -----------------------------------------------------------------------------

REASONS = dict(RAGGED, num_blocks=40)


def _expect(full, *, eos=None, stops=(), max_tokens=8, ignore_eos=False):
    """vLLM check_stop on a greedy continuation: eos, then stop tokens, then the length cap."""
    for i, t in enumerate(full[:max_tokens]):
        if not ignore_eos and t == eos:
            return full[: i + 1], "stop", None
        if t in stops:
            return full[: i + 1], "stop", t
    return full[:max_tokens], "length", None


def _first_new(seq, start=1):
    """(index, token) of the first token at index >= start that does not occur earlier in seq."""
    return next((i, t) for i, t in enumerate(seq) if i >= start and t not in seq[:i])


def _reasons_runs(pkg, prompts, long_prompt, picks=None):
    plain = _engine(pkg, **REASONS)  # checkpoint eos ids (401, 404)
    full = [o.output_token_ids for o in plain.generate(prompts, _sp(pkg, temperature=0.0, max_tokens=8,
                                                                     ignore_eos=True))]
    if picks is None:
        (ix, x), (iy, y), (iz, z) = _first_new(full[0]), _first_new(full[1], 2), _first_new(full[2])
        picks = dict(ix=ix, x=x, iy=iy, y=y, iz=iz, z=z)
    p = picks
    n = len(prompts)
    runs = {"full": full, "picks": p}
    runs["stop_ids"] = plain.generate(prompts, _sp(pkg, temperature=0.0, max_tokens=8, stop_token_ids=[p["z"]]))
    runs["stop_last"] = plain.generate(
        [prompts[2]], _sp(pkg, temperature=0.0, max_tokens=p["iz"] + 1, stop_token_ids=[p["z"]], ignore_eos=True))
    runs["model_len"] = plain.generate([long_prompt], _sp(pkg, temperature=0.0, max_tokens=8, ignore_eos=True))
    override = _engine(pkg, override={"eos_token_id": [p["x"], p["y"]]}, **REASONS)
    runs["eos"] = override.generate(prompts, _sp(pkg, temperature=0.0, max_tokens=8))
    runs["eos_ignored"] = override.generate(prompts, _sp(pkg, temperature=0.0, max_tokens=8, ignore_eos=True))
    runs["eos_last"] = override.generate([prompts[0]], _sp(pkg, temperature=0.0, max_tokens=p["ix"] + 1))
    runs["eos_and_stop_ids"] = override.generate(
        prompts, _sp(pkg, temperature=0.0, max_tokens=8, stop_token_ids=[p["z"]]))
    runs["stop_ids_ignore_eos"] = override.generate(
        prompts, _sp(pkg, temperature=0.0, max_tokens=8, stop_token_ids=[p["z"]], ignore_eos=True))
    assert all(len(runs[k]) == n for k in ("stop_ids", "eos", "eos_ignored", "eos_and_stop_ids",
                                           "stop_ids_ignore_eos"))
    return runs


def test_finish_and_stop_reasons():
    prompts = _prompts(4, [5, 9, 7, 11])
    long_prompt = _prompts(5, [REASONS["max_model_len"] - 2])[0]
    j = _reasons_runs("jax", prompts, long_prompt)
    t = _reasons_runs("torch", prompts, long_prompt, picks=j["picks"])
    assert j["full"] == t["full"]
    full, p = j["full"], j["picks"]
    x, y, z = p["x"], p["y"], p["z"]
    assert len({x, y, z}) == 3 and x not in full[0][: p["ix"]] and y not in full[1][: p["iy"]]
    for name in ("stop_ids", "stop_last", "model_len", "eos", "eos_ignored", "eos_last", "eos_and_stop_ids",
                 "stop_ids_ignore_eos"):
        assert _summary(j[name]) == _summary(t[name]), name  # both engines: same tokens and reasons
        assert all(o.finished for o in j[name]), name

    def check(outs, **kw):
        for out, cont in zip(outs, full):
            assert (out.output_token_ids, out.finish_reason, out.stop_reason) == _expect(cont, **kw), out.request_id

    # override eos [x, y]: x is the request's eos (stop_reason None), y a stop token (stop_reason y)
    eos = j["eos"]
    check(eos, eos=x, stops=(y,))
    cut_x = _expect(full[0], eos=x, stops=(y,))
    cut_y = _expect(full[1], eos=x, stops=(y,))
    assert eos[0].output_token_ids[-1] == x and (eos[0].finish_reason, eos[0].stop_reason) == ("stop", None), cut_x
    assert eos[1].output_token_ids[-1] == y and (eos[1].finish_reason, eos[1].stop_reason) == ("stop", y), cut_y
    # ignore_eos: the override's ids (eos and the extra one) stop nothing, every request runs to max_tokens
    check(j["eos_ignored"], ignore_eos=True)
    assert all(o.finish_reason == "length" and o.stop_reason is None and len(o.output_token_ids) == 8
               for o in j["eos_ignored"])
    # eos sampled as the last allowed token: "stop", not "length"
    (last,) = j["eos_last"]
    assert (last.output_token_ids, last.finish_reason, last.stop_reason) == (full[0][: p["ix"] + 1], "stop", None)
    # stop_token_ids on the checkpoint's eos ids (401 eos, 404 an extra stop token)
    check(j["stop_ids"], eos=CHECKPOINT_EOS[0], stops=(z, CHECKPOINT_EOS[1]))
    assert j["stop_ids"][2].output_token_ids[-1] == z and j["stop_ids"][2].stop_reason == z
    # with the override's eos ids: the user's stop token joins them; ignore_eos drops x and y, keeps z
    both = j["eos_and_stop_ids"]
    check(both, eos=x, stops=(z, y))
    assert [(o.finish_reason, o.stop_reason) for o in both[:3]] == [("stop", None), ("stop", y), ("stop", z)]
    kept = j["stop_ids_ignore_eos"]
    check(kept, stops=(z,), ignore_eos=True)
    assert len(kept[0].output_token_ids) > p["ix"] + 1 and len(kept[1].output_token_ids) > p["iy"] + 1
    assert (kept[2].output_token_ids[-1], kept[2].finish_reason, kept[2].stop_reason) == (z, "stop", z)
    (last,) = j["stop_last"]
    assert (last.output_token_ids, last.finish_reason, last.stop_reason) == (full[2][: p["iz"] + 1], "stop", z)
    # a prompt of max_model_len - 2 tokens: 2 tokens, then "length", whatever max_tokens says
    (capped,) = j["model_len"]
    assert len(capped.output_token_ids) == 2 and (capped.finish_reason, capped.stop_reason) == ("length", None)


# ---- (5) abort_request ---------------------------------------------------------------------------------------

def _abort_run(pkg):
    engine = _engine(pkg, **CHUNKED)  # 8-token budget: a, b, c prefill over the first steps
    kv = engine.scheduler.kv_cache_manager
    a, b, c, d = _prompts(6, [5, 7, 11, 6])
    params = _sp(pkg, temperature=0.0, max_tokens=6, ignore_eos=True)
    for rid, prompt in zip("abc", (a, b, c)):
        engine.add_request(rid, prompt, params)
    early = [engine.step(), engine.step()]
    assert "b" in {o.request_id for o in early[1]}  # b got its first token: aborted mid-generation
    held, free = len(kv.req_to_blocks["b"]), engine.stats()["num_free_blocks"]
    assert held > 0
    engine.abort_request("b")
    assert "b" not in kv.req_to_blocks and engine.stats()["num_free_blocks"] == free + held  # freed at once
    engine.add_request("d", d, params)
    engine.abort_request(["d", "no-such-request"])  # a waiting request, and an unknown id
    engine.abort_request("no-such-request")
    later = []
    while engine.has_unfinished_requests():
        later.append(engine.step())
    assert not {o.request_id for step in later for o in step} & {"b", "d"}
    done = {o.request_id: o for step in early + later for o in step if o.finished}
    assert set(done) == {"a", "c"} and all(o.finish_reason == "length" for o in done.values())
    engine.abort_request("a")  # finished: ignored
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] - 1 and not kv.req_to_blocks
    # the survivors' continuations are those of a run without the aborted requests
    ref = engine.generate([a, c], params)
    assert [done["a"].output_token_ids, done["c"].output_token_ids] == [o.output_token_ids for o in ref]
    return {rid: o.output_token_ids for rid, o in done.items()}


def test_abort_request():
    assert _abort_run("jax") == _abort_run("torch")


# ---- (6) unseeded sampling -----------------------------------------------------------------------------------

def test_engine_noise_rows():
    for _, _, sampler in PKGS.values():
        rows = [sampler.engine_noise(0, 3, r, VOCAB) for r in (0, 1)]
        assert not np.array_equal(rows[0], rows[1])
        assert not np.array_equal(rows[0], sampler.engine_noise(1, 3, 0, VOCAB))  # engine seed
        assert not np.array_equal(rows[0], sampler.engine_noise(0, 4, 0, VOCAB))  # step
        assert not np.array_equal(rows[0], sampler.exponential_noise(0, 3, VOCAB))  # apart from seeded streams
    np.testing.assert_array_equal(jsampler.engine_noise(5, 2, 1, VOCAB), tsampler.engine_noise(5, 2, 1, VOCAB))


def test_unseeded_sampling_engine_seed():
    prompt, other = _prompts(7, [6, 9])
    prompts = [prompt, prompt, other]

    def run(pkg, seed):
        engine = _engine(pkg, **dict(RAGGED, seed=seed))
        return [o.output_token_ids for o in
                engine.generate(prompts, _sp(pkg, temperature=1.5, max_tokens=8, ignore_eos=True))]

    base = run("jax", 0)
    assert base == run("torch", 0)  # the same engine-wide stream in both engines
    assert base[0] != base[1]  # identical prompts, different batch rows: different noise
    assert run("jax", 0) == base  # a fresh engine with the same seed repeats itself
    reseeded = run("jax", 1)
    assert reseeded != base and all(a != b for a, b in zip(reseeded, base))
    assert run("torch", 1) == reseeded


# ---- (7) validation ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pkg", PKGS)
def test_validation(pkg):
    conf = PKGS[pkg][1]
    for bad in (dict(logprobs=-2), dict(prompt_logprobs=True), dict(logprobs=True), dict(prompt_logprobs=-2),
                dict(logprobs=1.5)):
        with pytest.raises(ValueError):
            conf.SamplingParams(**bad)
    for ok in (dict(logprobs=-1, prompt_logprobs=-1), dict(logprobs=0, prompt_logprobs=0), dict(logprobs=5)):
        conf.SamplingParams(**ok)
    for bad_seed in (-1, True, 1.0):
        with pytest.raises(ValueError):
            conf.EngineConfig(seed=bad_seed)
    assert conf.EngineConfig().seed == 0 and conf.EngineConfig(seed=3).seed == 3


@pytest.mark.parametrize("engine_module", [jengine, tengine], ids=["jax", "torch"])
def test_eos_ids_fall_back_from_the_override_to_generation_config_to_config(engine_module, tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 7}))
    assert engine_module.eos_token_ids(tmp_path) == (7,)  # no generation_config.json: config.json's
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 4]}))
    assert engine_module.eos_token_ids(tmp_path) == (3, 4)
    assert engine_module.eos_token_ids(tmp_path, {"eos_token_id": 9}) == (9,)
    (tmp_path / "generation_config.json").write_text(json.dumps({}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert engine_module.eos_token_ids(tmp_path) == ()  # none anywhere: nothing stops at eos
