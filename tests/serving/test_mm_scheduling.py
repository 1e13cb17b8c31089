"""Multimodal encoder scheduling of the serving engine's host bookkeeping (vLLM v1's semantics).

Re-expresses vLLM's tests/v1/core/test_encoder_cache_manager.py and the multimodal tests of
tests/v1/core/test_scheduler.py (test_schedule_multimodal_requests, test_schedule_partial_requests), then covers
what they leave implicit: a chunk boundary inside a placeholder, images shared by hash, an encoder budget that
defers an image, preemption and eviction, freeing once a placeholder is computed, per-request refusals, and
text-only requests left exactly as they were. The code is ours; each re-expressed test names vLLM's.

Every test runs against both copies (torch_sources/serving and serving_engine), like
tests/serving/test_vllm_v1_scenarios.py; one test runs both copies side by side on a scripted scenario.
"""
import dataclasses
import importlib
import types

import pytest

MODULES = ["config", "request", "block_pool", "kv_cache_manager", "encoder_cache_manager", "scheduler", "input_batch"]
PACKAGES = ["torch_sources.serving", "serving_engine"]
IMAGE_PAD = 151655  # Qwen2.5-VL's <|image_pad|>: one per image-embedding row


def _namespace(package):
    ns = types.SimpleNamespace(package=package)
    for name in MODULES:
        mod = importlib.import_module(f"{package}.{name}")
        for attr in mod.__all__:
            setattr(ns, attr, getattr(mod, attr))
    return ns


@pytest.fixture(params=PACKAGES)
def s(request):
    """One copy's modules, flattened: s.Scheduler, s.EncoderCacheManager, ...; s.package is the package name."""
    return _namespace(request.param)


# -- helpers -----------------------------------------------------------------------------------------------------
def _scheduler(s, **overrides):
    """Chunked prefill, block 16, a large KV cache; max_model_len 2048 unless given."""
    kw = dict(mode="chunked", block_size=16, num_blocks=1000, max_num_seqs=16, max_num_batched_tokens=8192,
              max_model_len=2048)
    kw.update(overrides)
    return s.Scheduler(s.EngineConfig(**kw))


def _req(s, rid, num_tokens, images=(), max_tokens=4, text_token=7):
    """A prompt of num_tokens text tokens with image pads under each (offset, length, hash) placeholder."""
    tokens = [text_token] * num_tokens
    for offset, length, _ in images:
        tokens[offset:offset + length] = [IMAGE_PAD] * length
    return s.Request(rid, tokens, s.SamplingParams(max_tokens=max_tokens), mm_placeholders=images)


def _image_request(s, rid, *images):
    """A request showing the (hash, length) images back to back after one text token (for the cache alone)."""
    placeholders, offset = [], 1
    for mm_hash, length in images:
        placeholders.append((offset, length, mm_hash))
        offset += length
    return _req(s, rid, offset + 1, placeholders)


def _step(sched, token=1000):
    out = sched.schedule()
    sched.update_from_output(out, {rid: token for rid in out.scheduled_req_ids})
    return out


def _tokens(out):
    return dict(zip(out.scheduled_req_ids, out.num_scheduled_tokens))


def _drain(sched, max_steps=200):
    outs = []
    while sched.has_unfinished_requests():
        outs.append(_step(sched))
        assert len(outs) < max_steps, "requests did not finish"
    return outs


def _assert_no_references(sched):
    """Every entry left in the encoder cache is unreferenced and freeable; the slot counts agree."""
    cache = sched.encoder_cache_manager
    assert all(not refs for refs in cache.cached.values())
    assert set(cache.freeable) == set(cache.cached)
    assert cache.num_freeable_slots == cache.cache_size
    assert cache.num_free_slots == cache.cache_size - sum(cache.freeable.values())


# ================================================================================================================
# test_encoder_cache_manager.py
# ================================================================================================================
def test_basic_allocate_and_reuse(s):
    cache = s.EncoderCacheManager(cache_size=10)
    req = _image_request(s, "r1", ("imgA", 4))
    assert not cache.check_and_update_cache(req, 0)
    assert cache.can_allocate(req, 0, encoder_compute_budget=10**9, num_embeds_to_schedule=0)
    cache.allocate(req, 0)
    assert cache.check_and_update_cache(req, 0)
    assert cache.cached["imgA"] == {"r1"} and cache.num_free_slots == 6 and cache.num_freeable_slots == 6
    # Freeing twice is freeing once: the second call finds no reference.
    cache.free_encoder_input(req, 0)
    cache.free_encoder_input(req, 0)
    assert cache.cached["imgA"] == set() and dict(cache.freeable) == {"imgA": 4}
    assert cache.num_freeable_slots == 10 and cache.num_free_slots == 6  # kept, not evicted


def test_free_request_frees_all_inputs(s):
    cache = s.EncoderCacheManager(cache_size=10)
    req = _image_request(s, "req3", ("a", 2), ("b", 3))
    for i in (0, 1):
        assert cache.can_allocate(req, i, 10**9, 0)
        cache.allocate(req, i)
    assert cache.cached == {"a": {"req3"}, "b": {"req3"}}
    cache.free(req)
    assert cache.cached == {"a": set(), "b": set()}
    assert list(cache.freeable) == ["a", "b"] and cache.num_freeable_slots == 10


def test_eviction_when_cache_is_full_reports_the_hash_once(s):
    # vLLM test_eviction_when_cache_is_full / test_get_freed_mm_hashes_clears_freed_list.
    cache = s.EncoderCacheManager(cache_size=10)
    req1, req2 = _image_request(s, "req1", ("x", 6)), _image_request(s, "req2", ("y", 5))
    assert cache.can_allocate(req1, 0, 10**9, 0)
    cache.allocate(req1, 0)
    cache.free_encoder_input(req1, 0)
    assert cache.can_allocate(req2, 0, 10**9, 0)  # 4 free slots: "x" must go
    cache.allocate(req2, 0)
    assert "x" not in cache.cached and not cache.freeable
    assert cache.get_freed_mm_hashes() == ["x"]
    assert cache.get_freed_mm_hashes() == []


def test_get_cached_input_ids(s):
    cache = s.EncoderCacheManager(cache_size=10)
    req = _image_request(s, "reqX", ("m", 2), ("n", 4), ("o", 3))
    for i in (0, 2):
        assert cache.can_allocate(req, i, 10**9, 0)
        cache.allocate(req, i)
    assert cache.get_cached_input_ids(req) == {0, 2}


def test_cache_hit_restores_an_entry_from_freeable(s):
    # vLLM test_has_cache_restores_from_freeable.
    cache = s.EncoderCacheManager(cache_size=10)
    req = _image_request(s, "reqY", ("imgZ", 4))
    assert cache.can_allocate(req, 0, 10**9, 0)
    cache.allocate(req, 0)
    cache.free_encoder_input(req, 0)
    other = _image_request(s, "reqW", ("imgZ", 4))
    assert cache.check_and_update_cache(other, 0)
    assert cache.cached["imgZ"] == {"reqW"} and "imgZ" not in cache.freeable and cache.num_freeable_slots == 6


def test_eviction_takes_the_oldest_freeable_entries_only_as_far_as_needed(s):
    cache = s.EncoderCacheManager(cache_size=12)
    req = _image_request(s, "old", ("a", 4), ("b", 4), ("c", 4))
    for i in range(3):
        cache.allocate(req, i)
    for i in (1, 0, 2):  # freeable order: b, a, c
        cache.free_encoder_input(req, i)
    new = _image_request(s, "new", ("d", 6))
    assert cache.can_allocate(new, 0, 10**9, 0)
    assert cache.freed == ["b", "a"] and list(cache.freeable) == ["c"]
    assert (cache.num_free_slots, cache.num_freeable_slots) == (8, 12)


def test_can_allocate_counts_the_compute_budget_and_the_rows_already_planned(s):
    cache = s.EncoderCacheManager(cache_size=10)
    req = _image_request(s, "r", ("a", 4), ("b", 4))
    cache.allocate(req, 0)
    cache.free_encoder_input(req, 0)  # "a": freeable, 4 rows
    assert not cache.can_allocate(req, 1, encoder_compute_budget=3, num_embeds_to_schedule=0)  # budget first
    assert cache.can_allocate(req, 1, encoder_compute_budget=4, num_embeds_to_schedule=2)  # 6 <= 6 free slots
    assert not cache.freed
    assert not cache.can_allocate(req, 1, encoder_compute_budget=4, num_embeds_to_schedule=7)  # 11 > 10 reclaimable
    assert not cache.freed and "a" in cache.cached  # a refusal evicts nothing
    assert cache.can_allocate(req, 1, encoder_compute_budget=4, num_embeds_to_schedule=5)  # 9: "a" must go
    assert cache.freed == ["a"]


def test_allocate_without_room_raises(s):
    cache = s.EncoderCacheManager(cache_size=4)
    req = _image_request(s, "r", ("a", 3), ("b", 3))
    cache.allocate(req, 0)
    with pytest.raises(ValueError, match="needs 3 encoder cache rows, only 1 are free"):
        cache.allocate(req, 1)
    assert cache.cached == {"a": {"r"}} and cache.num_free_slots == 1


# ================================================================================================================
# Request and config
# ================================================================================================================
def test_request_validates_placeholders_and_inputs(s):
    req = _req(s, "ok", 12, ((1, 4, "a"), (5, 3, "b")))  # adjacent placeholders are fine
    assert req.has_encoder_inputs and req.get_num_encoder_tokens(0) == 4 and req.get_num_encoder_tokens(1) == 3
    assert req.mm_inputs == ()
    assert not _req(s, "text", 5).has_encoder_inputs
    payloads = [{"pixel_values": "opaque"}, ("grid", 1)]
    with_inputs = s.Request("in", [7] * 12, mm_placeholders=((1, 4, "a"), (5, 3, "b")), mm_inputs=payloads)
    assert with_inputs.mm_inputs == tuple(payloads)
    bad = {
        "length 0, it must be >= 1": ((2, 0, "a"),),
        r"covers \[10, 14\), outside the prompt of 12": ((10, 4, "a"),),
        r"covers \[-1, 2\)": ((-1, 3, "a"),),
        "starts at 3, before the previous one ends at 5": ((1, 4, "a"), (3, 2, "b")),
        "starts at 1, before the previous one ends at 10": ((6, 4, "a"), (1, 2, "b")),  # unsorted
    }
    for message, placeholders in bad.items():
        with pytest.raises(ValueError, match=message):
            s.Request("bad", [7] * 12, mm_placeholders=placeholders)
    with pytest.raises(ValueError, match="1 mm_inputs for 2 placeholders"):
        s.Request("bad", [7] * 12, mm_placeholders=((1, 4, "a"), (5, 3, "b")), mm_inputs=["only one"])


def test_request_fields_keep_their_order(s):
    names = [f.name for f in dataclasses.fields(s.Request)]
    assert names[:5] == ["request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "mm_placeholders"]
    assert names[-1] == "mm_inputs"


def test_encoder_config_defaults_and_validation(s):
    cfg = s.EngineConfig(max_num_batched_tokens=512, max_model_len=512)
    assert (cfg.max_num_encoder_input_tokens, cfg.encoder_cache_size) == (0, 0)
    assert (cfg.encoder_compute_budget, cfg.encoder_cache_slots) == (512, 512)  # vLLM's defaults
    cfg = s.EngineConfig(max_num_batched_tokens=512, max_model_len=512, max_num_encoder_input_tokens=100)
    assert (cfg.encoder_compute_budget, cfg.encoder_cache_slots) == (100, 100)
    cfg = s.EngineConfig(max_num_encoder_input_tokens=100, encoder_cache_size=300)
    assert (cfg.encoder_compute_budget, cfg.encoder_cache_slots) == (100, 300)
    for name in ("max_num_encoder_input_tokens", "encoder_cache_size"):
        for value in (-1, True, 1.5):
            with pytest.raises(ValueError, match=f"{name} must be an int >= 0"):
                s.EngineConfig(**{name: value})
    assert [f.name for f in dataclasses.fields(s.EngineConfig)][-2:] == [
        "max_num_encoder_input_tokens", "encoder_cache_size"]


def test_new_output_fields_come_last_with_defaults(s):
    assert [f.name for f in dataclasses.fields(s.SchedulerOutput)][-2:] == [
        "scheduled_encoder_inputs", "free_encoder_mm_hashes"]
    assert [f.name for f in dataclasses.fields(s.StepTrace)][-2:] == ["scheduled_encoder_inputs", "freed_mm_hashes"]
    out = s.SchedulerOutput([], [], [], [], [], [], [], [], [])
    assert out.scheduled_encoder_inputs == {} and out.free_encoder_mm_hashes == []
    trace = s.StepTrace([], [], [], [], [], [])
    assert trace.scheduled_encoder_inputs == [] and trace.freed_mm_hashes == []


def test_add_request_refuses_an_image_the_encoder_can_never_take(s):
    sched = _scheduler(s, max_num_encoder_input_tokens=8, encoder_cache_size=16)
    with pytest.raises(ValueError, match=r"image 1 has 9 placeholder tokens.*compute budget \(8.*cache \(16"):
        sched.add_request(_req(s, "big", 20, ((0, 2, "a"), (5, 9, "b"))))
    sched = _scheduler(s, max_num_encoder_input_tokens=16, encoder_cache_size=8)
    with pytest.raises(ValueError, match=r"9 placeholder tokens.*compute budget \(16.*cache \(8"):
        sched.add_request(_req(s, "big", 20, ((5, 9, "b"),)))
    sched.add_request(_req(s, "fits", 20, ((5, 8, "b"),)))  # exactly the limit is fine
    assert not sched.requests.get("big") and sched.get_num_unfinished_requests() == 1


# ================================================================================================================
# test_scheduler.py (multimodal)
# ================================================================================================================
def test_schedule_multimodal_requests(s):
    # vLLM test_schedule_multimodal_requests: ten 200-token prompts, each with its own 100-token image; all fit.
    sched = _scheduler(s)
    reqs = [_req(s, str(i), 200, ((i, 100, f"hash{i}"),)) for i in range(10)]
    for req in reqs:
        sched.add_request(req)
    out = sched.schedule()
    assert out.scheduled_req_ids == [r.request_id for r in reqs] and out.num_scheduled_tokens == [200] * 10
    assert out.scheduled_encoder_inputs == {r.request_id: [0] for r in reqs}
    assert out.free_encoder_mm_hashes == [] and not sched.waiting
    # Every placeholder was computed in this step, so every reference is dropped already.
    _assert_no_references(sched)
    assert sched.encoder_cache_manager.num_free_slots == 8192 - 1000


def test_schedule_partial_requests(s):
    # vLLM test_schedule_partial_requests: 3 prompts of 800 tokens, a 600-token image at 100, 1024 tokens of token
    # and encoder budget. The first runs whole; the others stop before their images (the encoder budget is spent).
    sched = _scheduler(s, max_num_batched_tokens=1024)
    assert sched.config.encoder_compute_budget == 1024 and sched.config.encoder_cache_slots == 1024
    reqs = [_req(s, str(i), 800, ((100, 600, f"img{i}"),)) for i in range(3)]
    for req in reqs:
        sched.add_request(req)
    out = _step(sched)
    assert _tokens(out) == {"0": 800, "1": 100, "2": 100}
    assert out.scheduled_encoder_inputs == {"0": [0]}
    # Next step: "0" decodes, "1" runs its image (evicting "0"'s, computed and unreferenced now), and "2", running
    # but short of encoder budget at the start of its image, is skipped.
    out = _step(sched)
    assert len(sched.running) == 3
    assert _tokens(out) == {"0": 1, "1": 700}
    assert out.scheduled_encoder_inputs == {"1": [0]} and out.free_encoder_mm_hashes == ["img0"]
    out = _step(sched)
    assert _tokens(out) == {"0": 1, "1": 1, "2": 700}
    assert out.scheduled_encoder_inputs == {"2": [0]} and out.free_encoder_mm_hashes == ["img1"]


def test_chunk_boundary_inside_a_placeholder_runs_the_encoder_once(s):
    # A 16-token chunk reaches the image at [10, 22): the encoder runs in that step, whole; the next chunk reads
    # the cached output. The reference is dropped once the placeholder is fully computed, but the entry is kept.
    sched = _scheduler(s, max_num_batched_tokens=16, max_num_seqs=4)
    sched.add_request(_req(s, "r", 40, ((10, 12, "h"),)))
    cache = sched.encoder_cache_manager
    out = _step(sched)
    assert _tokens(out) == {"r": 16} and out.scheduled_encoder_inputs == {"r": [0]}
    assert cache.cached == {"h": {"r"}} and cache.num_free_slots == 4 and cache.num_freeable_slots == 4
    out = _step(sched)
    assert _tokens(out) == {"r": 16} and out.scheduled_encoder_inputs == {}
    assert cache.cached == {"h": set()} and dict(cache.freeable) == {"h": 12}  # 32 >= 22: freed, kept
    assert (cache.num_free_slots, cache.num_freeable_slots) == (4, 16)
    outs = _drain(sched)
    assert all(o.scheduled_encoder_inputs == {} and o.free_encoder_mm_hashes == [] for o in outs)
    _assert_no_references(sched)


def test_placeholder_freed_when_the_chunk_ends_exactly_at_its_end(s):
    sched = _scheduler(s, max_num_batched_tokens=16, max_num_seqs=4)
    sched.add_request(_req(s, "r", 40, ((4, 12, "h"),)))  # [4, 16): the first chunk computes all of it
    out = _step(sched)
    assert out.scheduled_encoder_inputs == {"r": [0]}
    assert sched.encoder_cache_manager.cached == {"h": set()}
    assert dict(sched.encoder_cache_manager.freeable) == {"h": 12}


def test_image_computed_by_the_previous_chunk_is_not_needed_again(s):
    # r's first chunk ends exactly where its image ends, so the next chunk neither needs nor references it: the
    # unreferenced entry is evicted for q's image in the same step.
    sched = _scheduler(s, max_num_batched_tokens=16, max_num_seqs=4, encoder_cache_size=8)
    sched.add_request(_req(s, "r", 30, ((8, 8, "x"),)))
    out = _step(sched)
    assert _tokens(out) == {"r": 16} and out.scheduled_encoder_inputs == {"r": [0]}
    sched.add_request(_req(s, "q", 10, ((0, 8, "y"),)))
    out = _step(sched)
    assert _tokens(out) == {"r": 14, "q": 2} and out.scheduled_encoder_inputs == {"q": [0]}
    assert out.free_encoder_mm_hashes == ["x"]


def test_requests_sharing_an_image_hash_run_the_encoder_once(s):
    sched = _scheduler(s, max_num_batched_tokens=64, max_num_seqs=4)
    cache = sched.encoder_cache_manager
    sched.add_request(_req(s, "a", 30, ((5, 10, "cat"),), text_token=1))
    sched.add_request(_req(s, "b", 30, ((12, 10, "cat"),), text_token=2))  # same image elsewhere, other text
    out = sched.schedule()
    assert out.scheduled_encoder_inputs == {"a": [0]}  # "b" hits the entry "a" allocated moments before
    assert _tokens(out) == {"a": 30, "b": 30}
    assert cache.num_free_slots == 64 - 10
    sched.update_from_output(out, {"a": 1000, "b": 1000})
    _assert_no_references(sched)
    # A later request showing it again hits the unreferenced entry: no encoder run, nothing evicted.
    sched.add_request(_req(s, "c", 20, ((0, 10, "cat"),), text_token=3))
    out = _step(sched)
    assert out.scheduled_encoder_inputs == {} and _tokens(out)["c"] == 20 and out.free_encoder_mm_hashes == []


def test_a_repeated_image_in_one_request_runs_once(s):
    sched = _scheduler(s, max_num_batched_tokens=64, max_num_seqs=4)
    sched.add_request(_req(s, "r", 30, ((2, 6, "dup"), (10, 6, "dup"), (20, 6, "other"))))
    out = _step(sched)
    assert out.scheduled_encoder_inputs == {"r": [0, 2]}
    assert sched.encoder_cache_manager.num_free_slots == 64 - 12


def test_encoder_budget_smaller_than_two_images_defers_the_second(s):
    # Two requests, an 8-row image each, an encoder budget of 10: the second stops just before its image and runs
    # it in the next step.
    sched = _scheduler(s, max_num_batched_tokens=64, max_num_seqs=4, max_num_encoder_input_tokens=10,
                       encoder_cache_size=20)
    sched.add_request(_req(s, "a", 16, ((2, 8, "x"),)))
    sched.add_request(_req(s, "b", 16, ((3, 8, "y"),)))
    out = _step(sched)
    assert _tokens(out) == {"a": 16, "b": 3} and out.scheduled_encoder_inputs == {"a": [0]}
    out = _step(sched)
    assert _tokens(out) == {"a": 1, "b": 13} and out.scheduled_encoder_inputs == {"b": [0]}
    assert out.free_encoder_mm_hashes == []  # 20 slots hold both images


def test_encoder_budget_splits_one_request_between_its_images(s):
    sched = _scheduler(s, max_num_batched_tokens=64, max_num_seqs=4, max_num_encoder_input_tokens=10)
    sched.add_request(_req(s, "r", 40, ((4, 8, "x"), (20, 8, "y"))))
    out = _step(sched)
    assert _tokens(out) == {"r": 20} and out.scheduled_encoder_inputs == {"r": [0]}
    out = _step(sched)
    assert _tokens(out) == {"r": 20} and out.scheduled_encoder_inputs == {"r": [1]}


def test_try_schedule_encoder_inputs_returns_inputs_tokens_and_budget_left(s):
    sched = _scheduler(s, max_num_batched_tokens=64, max_num_seqs=4)
    req = _req(s, "r", 40, ((0, 4, "a"), (6, 4, "b"), (20, 8, "c")))
    # The chunk [0, 12) needs "a" and "b"; "c" lies past it. Nothing is allocated by the call itself.
    assert sched._try_schedule_encoder_inputs(req, 0, 12, 30) == ([0, 1], 12, 22)
    assert sched.encoder_cache_manager.cached == {}
    # Budget for "a" only: the chunk stops where "b" starts.
    assert sched._try_schedule_encoder_inputs(req, 0, 40, 5) == ([0], 6, 1)
    # From 4 on, "a" is in the KV cache; no budget for "b", whose placeholder the chunk starts inside -> 0 tokens.
    assert sched._try_schedule_encoder_inputs(req, 7, 10, 3) == ([], 0, 3)


def test_running_request_short_of_encoder_budget_is_skipped_not_blocking(s):
    # vLLM skips such a running request (continue, not break): the decode behind it is still scheduled.
    sched = _scheduler(s, max_num_batched_tokens=64, max_num_seqs=4, max_num_encoder_input_tokens=8)
    sched.add_request(_req(s, "x", 30, ((5, 8, "x0"), (20, 8, "x1"))))
    sched.add_request(_req(s, "a", 20, ((10, 8, "a0"),)))
    sched.add_request(_req(s, "t", 5))
    out = _step(sched)
    assert _tokens(out) == {"x": 20, "a": 10, "t": 5} and out.scheduled_encoder_inputs == {"x": [0]}
    out = _step(sched)  # "x" spends the whole encoder budget on x1; "a" sits at the start of a0
    assert _tokens(out) == {"x": 10, "t": 1} and out.scheduled_encoder_inputs == {"x": [1]}
    out = _step(sched)
    assert _tokens(out) == {"x": 1, "a": 10, "t": 1} and out.scheduled_encoder_inputs == {"a": [0]}


def test_waiting_request_short_of_encoder_budget_stops_admission(s):
    # A waiting request whose image starts its prompt gets 0 tokens: admission stops there (FCFS), so the text
    # request behind it waits too.
    sched = _scheduler(s, max_num_batched_tokens=64, max_num_seqs=4, max_num_encoder_input_tokens=8)
    sched.add_request(_req(s, "x", 12, ((0, 8, "x0"),)))
    sched.add_request(_req(s, "w", 12, ((0, 8, "w0"),)))
    sched.add_request(_req(s, "t", 5))
    out = _step(sched)
    assert _tokens(out) == {"x": 12} and out.scheduled_encoder_inputs == {"x": [0]}
    assert [r.request_id for r in sched.waiting] == ["w", "t"]
    out = _step(sched)
    assert _tokens(out) == {"x": 1, "w": 12, "t": 5} and out.scheduled_encoder_inputs == {"w": [0]}


def test_waiting_request_without_kv_blocks_drops_its_cache_references(s):
    # The image hit takes a reference (check_and_update_cache); when the KV cache then refuses the request, the
    # reference goes back, or the entry could never be evicted while the request waits.
    sched = _scheduler(s, block_size=4, num_blocks=5, max_num_batched_tokens=64, max_num_seqs=4)  # 4 usable blocks
    sched.add_request(_req(s, "a", 8, ((0, 4, "img"),), max_tokens=1))
    _step(sched)  # "a" runs and finishes: "img" stays cached, unreferenced
    _assert_no_references(sched)
    sched.add_request(_req(s, "b", 12, max_tokens=4))  # 3 blocks now, 4 at most
    sched.add_request(_req(s, "w", 8, ((0, 4, "img"),), max_tokens=1))  # 2 blocks; 1 is left
    out = sched.schedule()
    assert out.scheduled_req_ids == ["b"] and [r.request_id for r in sched.waiting] == ["w"]
    assert sched.encoder_cache_manager.cached == {"img": set()} and "img" in sched.encoder_cache_manager.freeable
    _assert_no_references(sched)


@pytest.mark.parametrize("encoder_cache_size, reruns", [(12, False), (6, True)])
def test_preempted_image_request_reruns_its_encoder_only_if_evicted(s, encoder_cache_size, reruns):
    # "p" is admitted first, "r" second (so "r" is the preemption victim). r's image is computed in step 1 and
    # left unreferenced. In step 3 p's chunk reaches its own image and its blocks preempt "r". With room for both
    # images r's entry survives and its resumption hits it; with room for one, p's image evicts it (reported in
    # that step's free_encoder_mm_hashes) and the resumed "r" runs its encoder again.
    sched = _scheduler(s, block_size=4, num_blocks=8, max_num_batched_tokens=20, max_num_seqs=2,
                       long_prefill_token_threshold=8, encoder_cache_size=encoder_cache_size)  # 7 usable blocks
    sched.add_request(_req(s, "p", 24, ((16, 6, "p-img"),), max_tokens=2))
    sched.add_request(_req(s, "r", 12, ((2, 6, "r-img"),), max_tokens=2))
    outs = _drain(sched)
    steps = [(_tokens(o), o.scheduled_encoder_inputs, o.free_encoder_mm_hashes, o.preempted_req_ids) for o in outs]
    assert steps[:3] == [
        ({"p": 8, "r": 8}, {"r": [0]}, [], []),
        ({"p": 8, "r": 4}, {}, [], []),
        ({"p": 8}, {"p": [0]}, ["r-img"] if reruns else [], ["r"]),
    ]
    resumed = next(i for i, o in enumerate(outs) if i > 2 and "r" in o.scheduled_req_ids)
    assert outs[resumed].scheduled_encoder_inputs == ({"r": [0]} if reruns else {})
    assert [rid for o in outs for rid in o.scheduled_encoder_inputs] == (["r", "p", "r"] if reruns else ["r", "p"])
    assert sched.requests == {} and sched.kv_cache_manager.num_free_blocks == 7
    _assert_no_references(sched)


def test_request_preempted_mid_image_drops_its_reference(s):
    # "r" is preempted between the two chunks of its image: its reference goes with it (the entry turns freeable,
    # so another image could evict it while "r" waits), and back in the cache it resumes without an encoder run.
    sched = _scheduler(s, block_size=4, num_blocks=6, max_num_batched_tokens=16, max_num_seqs=2)  # 5 usable blocks
    cache = sched.encoder_cache_manager
    sched.add_request(_req(s, "p", 8, max_tokens=10))
    sched.add_request(_req(s, "r", 16, ((4, 8, "r-img"),), max_tokens=1))
    out = _step(sched)
    assert _tokens(out) == {"p": 8, "r": 8} and out.scheduled_encoder_inputs == {"r": [0]}
    assert cache.cached == {"r-img": {"r"}}
    out = _step(sched)  # p's decode takes the last free block; r's next chunk finds none and preempts r itself
    assert _tokens(out) == {"p": 1} and out.preempted_req_ids == ["r"]
    assert cache.cached == {"r-img": set()} and dict(cache.freeable) == {"r-img": 8}
    outs = _drain(sched)
    assert any("r" in o.scheduled_req_ids for o in outs)
    assert all(o.scheduled_encoder_inputs == {} for o in outs)  # resumed on the cached output
    _assert_no_references(sched)


def test_preempt_gives_back_the_tokens_and_encoder_rows_scheduled_this_step(s):
    # Under FCFS the victim (the last running request) is never one already scheduled in the step, but _preempt
    # hands both budgets back should it be, as vLLM's priority policy does.
    sched = _scheduler(s, max_num_batched_tokens=64)
    sched.add_request(_req(s, "r", 20, ((2, 8, "img"),)))
    sched.schedule()
    victim = sched.running.pop()
    scheduled, new_blocks, encoder_inputs = {"r": 20}, {"r": [1, 2]}, {"r": [0]}
    assert sched._preempt(victim, scheduled, new_blocks, encoder_inputs) == (20, 8)
    assert scheduled == new_blocks == encoder_inputs == {}
    assert victim.status == s.RequestStatus.PREEMPTED and list(sched.waiting) == [victim]


def test_cache_size_forces_eviction_reported_once(s):
    sched = _scheduler(s, max_num_batched_tokens=64, max_num_seqs=4, encoder_cache_size=10, record_trace=True)
    sched.add_request(_req(s, "a", 12, ((2, 8, "a-img"),), max_tokens=1))
    out = _step(sched)
    assert out.scheduled_encoder_inputs == {"a": [0]} and out.finished_req_ids == []
    sched.add_request(_req(s, "b", 12, ((2, 8, "b-img"),), max_tokens=1))
    out = _step(sched)
    assert out.scheduled_encoder_inputs == {"b": [0]} and out.free_encoder_mm_hashes == ["a-img"]
    assert "a-img" not in sched.encoder_cache_manager.cached
    assert sched.encoder_cache_manager.get_freed_mm_hashes() == []  # handed over with the output
    assert not sched.has_unfinished_requests()
    assert sched.schedule().free_encoder_mm_hashes == []  # reported once
    assert [t.freed_mm_hashes for t in sched.trace] == [[], ["a-img"]]
    assert [t.scheduled_encoder_inputs for t in sched.trace] == [[("a", 0)], [("b", 0)]]


def test_finish_and_abort_drop_references(s):
    sched = _scheduler(s, max_num_batched_tokens=16, max_num_seqs=4)
    sched.add_request(_req(s, "r", 40, ((10, 12, "h"),)))
    _step(sched)  # mid-image: "r" holds its reference
    assert sched.encoder_cache_manager.cached == {"h": {"r"}}
    sched.abort_request("r")
    _assert_no_references(sched)
    assert dict(sched.encoder_cache_manager.freeable) == {"h": 12}


def test_step_trace_records_encoder_inputs_in_schedule_order(s):
    sched = _scheduler(s, max_num_batched_tokens=64, max_num_seqs=4, record_trace=True)
    sched.add_request(_req(s, "a", 30, ((2, 4, "a0"), (10, 4, "a1"))))
    sched.add_request(_req(s, "b", 10, ((1, 4, "a0"), (5, 4, "b1"))))  # shares a0 with "a"
    _drain(sched)
    assert sched.trace[0].scheduled_encoder_inputs == [("a", 0), ("a", 1), ("b", 1)]
    assert all(t.scheduled_encoder_inputs == [] and t.freed_mm_hashes == [] for t in sched.trace[1:])


def _text_workload(s):
    return [s.Request(f"t{i}", [i + 1] * (9 + 7 * i), s.SamplingParams(max_tokens=5 + i)) for i in range(4)]


def test_text_only_requests_are_unaffected(s):
    # No placeholders, no encoder: the same schedules whatever the encoder budget and cache (even 1 row).
    base = _scheduler(s, block_size=4, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=3)
    tiny = _scheduler(s, block_size=4, num_blocks=12, max_num_batched_tokens=16, max_num_seqs=3,
                      max_num_encoder_input_tokens=1, encoder_cache_size=1)
    for sched in (base, tiny):
        for req in _text_workload(s):
            sched.add_request(req)
    base_outs, tiny_outs = _drain(base), _drain(tiny)
    assert any(o.preempted_req_ids for o in base_outs), "the workload should preempt"
    assert [dataclasses.asdict(o) for o in base_outs] == [dataclasses.asdict(o) for o in tiny_outs]
    assert all(o.scheduled_encoder_inputs == {} and o.free_encoder_mm_hashes == [] for o in base_outs)
    assert tiny.encoder_cache_manager.cached == {} and tiny.encoder_cache_manager.num_free_slots == 1


# ================================================================================================================
# The two copies, side by side
# ================================================================================================================
def _scripted_run(s):
    """Images shared by hash, an encoder budget that defers images, a cache that evicts, chunk boundaries inside
    placeholders, preemption under a small KV cache and an abort: every SchedulerOutput and the trace."""
    sched = _scheduler(s, block_size=4, num_blocks=14, max_num_batched_tokens=24, max_num_seqs=3,
                       max_model_len=64, max_num_encoder_input_tokens=12, encoder_cache_size=16, record_trace=True)
    arrivals = {
        0: [_req(s, "a", 30, ((3, 8, "cat"), (14, 6, "dog")), max_tokens=6, text_token=1),
            _req(s, "b", 18, ((0, 8, "cat"),), max_tokens=8, text_token=2)],
        2: [_req(s, "c", 21, ((5, 10, "owl"),), max_tokens=5, text_token=3), _req(s, "t", 7, max_tokens=9)],
        4: [_req(s, "d", 16, ((2, 6, "dog"), (9, 6, "eel")), max_tokens=4, text_token=4)],
    }
    outs = []
    for step in range(200):
        for req in arrivals.get(step, []):
            sched.add_request(req)
        if step == 6 and "c" in sched.requests:
            sched.abort_request("c")
        if step > max(arrivals) and not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        sched.update_from_output(out, {rid: 100 + step for rid in out.scheduled_req_ids})
        outs.append(dataclasses.asdict(out))
    return outs, [dataclasses.asdict(t) for t in sched.trace], sched


def test_copies_produce_identical_scheduler_outputs():
    (torch_outs, torch_trace, torch_sched), (jax_outs, jax_trace, _) = (
        _scripted_run(_namespace(p)) for p in PACKAGES)
    assert torch_outs == jax_outs and torch_trace == jax_trace
    # The scenario exercises what it claims to: "b" hits a's "cat", is preempted, loses "cat" to c's "owl" (which
    # evicts it, then finds no KV blocks) and runs it again on resumption; "d" hits a's "dog", is preempted and
    # resumes on its cached images.
    runs = [(rid, i) for o in torch_outs for rid, inputs in o["scheduled_encoder_inputs"].items() for i in inputs]
    assert runs == [("a", 0), ("a", 1), ("b", 0), ("d", 1)]
    assert [o["free_encoder_mm_hashes"] for o in torch_outs if o["free_encoder_mm_hashes"]] == [["cat"], ["cat"]]
    assert [o["preempted_req_ids"] for o in torch_outs if o["preempted_req_ids"]] == [["b"], ["d"]]
    assert torch_sched.requests == {}
    _assert_no_references(torch_sched)
