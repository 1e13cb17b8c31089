"""Host bookkeeping of the serving engine (config, request, block pool, KV-cache manager, scheduler, input batch).

Every test runs against both copies: torch_sources/serving (the original) and serving_engine (the JAX engine's
own copy). The scheduler is driven by a fake model that keeps token ids (not K/V) in a paged "cache" addressed by
slot_mapping and predicts from what it reads back through the block tables, so a wrong slot, block table, prefix
hit or preemption changes the generated tokens.
"""
import ast
import importlib
import pathlib
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = ["config", "request", "block_pool", "kv_cache_manager", "encoder_cache_manager", "scheduler", "input_batch",
           "multimodal"]
PACKAGES = ["torch_sources.serving", "serving_engine"]


@pytest.fixture(params=PACKAGES)
def s(request):
    """One copy's modules, flattened: s.Scheduler, s.BlockPool, ..."""
    ns = types.SimpleNamespace()
    for name in MODULES:
        mod = importlib.import_module(f"{request.param}.{name}")
        for attr in mod.__all__:
            setattr(ns, attr, getattr(mod, attr))
    return ns


# -- the two copies ---------------------------------------------------------------------------------------------
def _strip_docstring(path):
    text = path.read_text()
    first = ast.parse(text).body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant), f"{path} has no module docstring"
    lines = text.splitlines(keepends=True)
    return "".join(lines[:first.lineno - 1] + lines[first.end_lineno:])


@pytest.mark.parametrize("name", MODULES)
def test_copies_identical_apart_from_docstring(name):
    original = ROOT / "torch_sources" / "serving" / f"{name}.py"
    copy = ROOT / "serving_engine" / f"{name}.py"
    assert _strip_docstring(original) == _strip_docstring(copy), f"{copy} drifted from {original}"


@pytest.mark.parametrize("package", ["torch_sources/serving", "serving_engine"])
@pytest.mark.parametrize("name", MODULES)
def test_bookkeeping_imports_stdlib_only(package, name):
    allowed = {"__future__", "bisect", "collections", "dataclasses", "enum", "hashlib", "struct"}
    for node in ast.walk(ast.parse((ROOT / package / f"{name}.py").read_text())):
        if isinstance(node, ast.Import):
            roots = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            roots = [] if node.level else [node.module.split(".")[0]]
        else:
            continue
        assert set(roots) <= allowed, f"{package}/{name}.py imports {roots}"


# -- config --------------------------------------------------------------------------------------------------------
def test_config_validation(s):
    cfg = s.EngineConfig(block_size=4, max_model_len=10, max_num_batched_tokens=10)
    assert cfg.max_blocks_per_seq == 3
    with pytest.raises(ValueError, match="mode"):
        s.EngineConfig(mode="paged")
    with pytest.raises(ValueError, match="block_size"):
        s.EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens .* max_model_len"):
        s.EngineConfig(mode="ragged", max_num_batched_tokens=64, max_model_len=128)
    with pytest.raises(ValueError, match="max_num_seqs"):
        s.EngineConfig(mode="chunked", max_num_batched_tokens=4, max_num_seqs=8)
    with pytest.raises(ValueError, match="chunked"):
        s.EngineConfig(mode="core", long_prefill_token_threshold=8)
    assert s.EngineConfig(mode="chunked", max_num_batched_tokens=8, max_model_len=128).max_running == 8
    assert s.EngineConfig(mode="core").max_running == 1


def test_sampling_params_validation(s):
    p = s.SamplingParams(temperature=0.0, stop_token_ids=[5, 6])
    assert p.temperature == 0.0 and p.stop_token_ids == (5, 6)
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-1), dict(min_p=1.5), dict(max_tokens=0),
                dict(repetition_penalty=0.0), dict(presence_penalty=3.0)):
        with pytest.raises(ValueError):
            s.SamplingParams(**bad)


# -- block pool ----------------------------------------------------------------------------------------------------
def test_block_pool_ref_counts_and_lru_order(s):
    pool = s.BlockPool(5)  # block 0 is the null block: 4 usable blocks
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4 and pool.usage == 0.0
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [1, 2] and [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_free_blocks == 2 and pool.usage == 0.5
    pool.touch([a[0]])  # a second holder
    pool.free_blocks(reversed(a))
    assert [b.ref_cnt for b in a] == [1, 0] and pool.num_free_blocks == 3
    # Freed blocks go to the tail: the never-used blocks 3, 4 are handed out before block 2.
    assert [b.block_id for b in pool.get_new_blocks(3)] == [3, 4, 2]
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)
    pool.free_blocks([a[0]])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a[0]])


def test_cached_block_survives_free_until_reused(s):
    pool = s.BlockPool(3)  # the null block and 2 usable blocks
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    h0 = s.hash_block_tokens(None, [1, 2])
    h1 = s.hash_block_tokens(h0, [3, 4])
    pool.cache_full_blocks(blocks, [h0, h1], 0, 1)  # only the first block is full
    assert pool.get_cached_block(h0) is blocks[0] and pool.get_cached_block(h1) is None
    pool.free_blocks(reversed(blocks))  # free order: block 2 first, so block 2 is reused first
    assert pool.get_cached_block(h0) is blocks[0], "a freed block stays in the prefix cache"
    pool.touch([blocks[0]])  # a hit on a free block takes it out of the free list
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free_blocks([blocks[0]])
    assert [b.block_id for b in pool.get_new_blocks(1)] == [2]
    assert pool.get_cached_block(h0) is blocks[0] and pool.num_evictions == 0
    assert [b.block_id for b in pool.get_new_blocks(1)] == [1]  # its hash is evicted now
    assert pool.get_cached_block(h0) is None and blocks[0].block_hash is None and pool.num_evictions == 1
    assert (pool.num_queries, pool.num_hits) == (5, 3)


def test_chained_hashes_are_stable(s):
    # Pinned digests: a change of encoding, of NONE_HASH, or a switch to Python's salted hash() breaks these.
    h0 = s.hash_block_tokens(None, [1, 2, 3, 4])
    assert h0.hex() == "1d3c37410e663e35d1381a62d654da5e1db001fceea8e0aba615824b02869ced"
    h1 = s.hash_block_tokens(h0, [5, 6, 7, 8], ("image-sha",))
    assert h1.hex() == "259f64044f3d108605a4bdfa7a82cdc39cef6bbbd1a00a3feac38df4195ce63f"
    assert s.hash_block_tokens(h0, [5, 6, 7, 8]) != h1  # extra keys enter the hash
    assert s.hash_block_tokens(s.hash_block_tokens(None, [0, 2, 3, 4]), [5, 6, 7, 8], ("image-sha",)) != h1
    assert s.hash_block_tokens(None, [1, 2, 3, 4]) == h0 and len(h0) == 32


def test_null_block_is_never_handed_out_cached_or_freed(s):
    with pytest.raises(ValueError, match="null block"):
        s.BlockPool(1)
    pool = s.BlockPool(4)
    null = pool.null_block
    assert null is pool.blocks[0] and null.block_id == 0 and 0 not in pool.free_list
    assert pool.num_usable_blocks == 3 and pool.num_free_blocks == 3
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [1, 2, 3] and pool.usage == 1.0
    with pytest.raises(ValueError, match="only 0 are free"):
        pool.get_new_blocks(1)  # the null block is no spare
    h0 = s.hash_block_tokens(None, [1, 2])
    h1 = s.hash_block_tokens(h0, [3, 4])
    pool.cache_full_blocks(blocks, [h0, h1, s.hash_block_tokens(h1, [5, 6])], 0, 3)
    assert null.block_hash is None and all(0 not in same for same in pool.cached_blocks.values())
    with pytest.raises(ValueError, match="null block"):
        pool.free_blocks([null])
    assert null.ref_cnt == 0 and 0 not in pool.free_list and pool.num_free_blocks == 0
    pool.free_blocks(reversed(blocks))
    assert list(pool.free_list) == [3, 2, 1] and pool.usage == 0.0
    for _ in range(4):  # churn: only usable blocks ever come out, cached or not
        got = pool.get_new_blocks(3)
        assert sorted(b.block_id for b in got) == [1, 2, 3]
        pool.free_blocks(got)
    assert null.ref_cnt == 0 and null.block_hash is None and pool.num_free_blocks == 3
    assert pool.reset_prefix_cache() and pool.cached_blocks == {}


# -- KV-cache manager ----------------------------------------------------------------------------------------------
def _req(s, rid, prompt, **params):
    eos = params.pop("eos_token_id", None)
    return s.Request(rid, list(prompt), s.SamplingParams(**params), eos_token_id=eos)


def test_prefix_hits_only_full_blocks(s):
    kv = s.KVCacheManager(block_size=4, num_blocks=16, enable_caching=True)
    a = _req(s, "a", range(1, 11))  # 10 tokens: blocks [1-4] [5-8] [9,10]
    assert kv.get_computed_blocks(a) == ([], 0)
    kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    # Same 10 tokens and more: the 2 full blocks hit, the partial third block of `a` does not.
    b = _req(s, "b", list(range(1, 11)) + [99, 98])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [blk.block_id for blk in hits] == kv.get_block_ids(a)[:2]
    assert kv.num_prefix_hit_blocks == 0, "a lookup alone is not a hit"
    kv.allocate_slots(b, 4, hits)
    assert kv.num_prefix_hit_blocks == 2 and kv.get_block_ids(b)[:2] == kv.get_block_ids(a)[:2]
    assert [blk.ref_cnt for blk in hits] == [2, 2]
    # A prompt of exactly 8 cached tokens hits only 1 block: the last token's block is always recomputed.
    c = _req(s, "c", range(1, 9))
    assert kv.get_computed_blocks(c)[1] == 4
    # A different first block breaks the chain even though the second block's tokens match.
    d = _req(s, "d", [0, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(d) == ([], 0)
    for r in (a, b):
        kv.free(r)
    assert kv.num_free_blocks == 15  # all but the null block


def test_prefix_hits_respect_multimodal_hash(s):
    kv = s.KVCacheManager(block_size=4, num_blocks=8, enable_caching=True)
    a = s.Request("a", [1, 9, 9, 9, 9, 2, 3, 4, 5], mm_placeholders=[(1, 4, "img-A")])
    kv.allocate_slots(a, 9)
    b = s.Request("b", [1, 9, 9, 9, 9, 2, 3, 4, 5], mm_placeholders=[(1, 4, "img-B")])
    assert kv.get_computed_blocks(b) == ([], 0), "same pad tokens, other image: no reuse"
    c = s.Request("c", [1, 9, 9, 9, 9, 2, 3, 4, 5], mm_placeholders=[(1, 4, "img-A")])
    assert kv.get_computed_blocks(c)[1] == 8


def test_free_evicts_the_request_tail_first(s):
    kv = s.KVCacheManager(block_size=4, num_blocks=4, enable_caching=True)  # 3 usable blocks
    a = _req(s, "a", range(1, 14))  # 13 tokens: 3 full blocks cached
    kv.allocate_slots(a, 12)
    assert kv.get_block_ids(a) == [1, 2, 3] and kv.num_free_blocks == 0
    a.num_computed_tokens = 12
    kv.free(a)
    other = _req(s, "other", [90, 91, 92, 93])
    assert kv.get_block_ids(a) == [] and kv.allocate_slots(other, 4)[0].block_id == 3  # a's last block goes first
    assert kv.get_computed_blocks(_req(s, "again", range(1, 14)))[1] == 8  # its shared prefix is still cached


def test_allocate_slots_returns_none_when_out_of_blocks(s):
    kv = s.KVCacheManager(block_size=4, num_blocks=4, enable_caching=True)  # 3 usable blocks
    a = _req(s, "a", range(8))
    assert len(kv.allocate_slots(a, 8)) == 2
    a.num_computed_tokens = 8
    kv.free(a)  # both blocks stay cached but free
    b = _req(s, "b", list(range(8)) + [50, 51, 52, 53, 54])  # 13 tokens, 2 blocks hit, 2 more needed
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # 3 free blocks, but 2 of them are the hits themselves: only 1 is left for the 2 new blocks.
    assert kv.allocate_slots(b, 5, hits) is None
    assert kv.num_free_blocks == 3 and kv.get_block_ids(b) == [] and kv.num_prefix_hit_blocks == 0
    assert len(kv.allocate_slots(b, 1, hits)) == 1  # 9 tokens need 3 blocks: 2 hits + 1 new
    kv.free(b)
    assert kv.num_free_blocks == 3 and kv.req_to_blocks == {}


# -- scheduler -----------------------------------------------------------------------------------------------------
class FakeModel:
    """Writes the token id at every scheduled slot, reads each sequence's whole context back through its block
    table, checks it, and predicts a token from it."""

    def __init__(self, s, cfg, eos=None):
        self.s, self.cfg, self.cache, self.eos = s, cfg, {}, eos

    def next_token(self, context):
        tok = 3 + (sum(t * (i + 1) for i, t in enumerate(context)) % 97)
        return self.eos if self.eos is not None and len(context) % 5 == 0 else tok

    def step(self, sched, out):
        cfg = self.cfg
        meta = self.s.build_batch_metadata(out, sched.requests, cfg.block_size, cfg.max_running,
                                           cfg.max_blocks_per_seq, self.s.make_token_buckets(cfg.max_num_batched_tokens))
        for slot, pos, tok in zip(meta.slot_mapping, meta.positions, meta.input_ids):
            if slot != self.s.PAD_SLOT_ID:
                self.cache[slot] = (pos, tok)
        sampled = {}
        for i, rid in enumerate(meta.req_ids):
            table, n = meta.block_tables[i], meta.seq_lens[i]
            context = [self.cache[table[p // cfg.block_size] * cfg.block_size + p % cfg.block_size] for p in range(n)]
            assert [p for p, _ in context] == list(range(n)), f"{rid}: cache holds other positions"
            assert [t for _, t in context] == sched.requests[rid].all_token_ids[:n], f"{rid}: cache holds other tokens"
            sampled[rid] = self.next_token([t for _, t in context])
        return sampled


def _run(s, cfg, requests, eos=None, max_steps=2000, on_step=None):
    sched, model = s.Scheduler(cfg), FakeModel(s, cfg, eos)
    for r in requests:
        sched.add_request(r)
    outputs, finished, trace = {}, [], []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        # Running requests in admission order: (computed, tokens, prompt tokens) before the step.
        before = {r.request_id: (r.num_computed_tokens, r.num_tokens, r.num_prompt_tokens) for r in sched.running}
        out = sched.schedule()
        trace.append((before, out))
        if on_step:
            on_step(sched, out)
        assert out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens
        assert out.num_seqs > 0, "a step with unfinished requests scheduled nothing"
        done = sched.update_from_output(out, model.step(sched, out))
        finished += done
        outputs.update({r.request_id: list(r.output_token_ids) for r in done})
    else:
        raise AssertionError("workload did not finish")
    return sched, outputs, finished, trace


def _assert_no_leak(sched, num_blocks):
    kv = sched.kv_cache_manager
    # Every block but the null block (block 0) is back in the free list.
    assert kv.num_free_blocks == num_blocks - 1 and kv.req_to_blocks == {}
    assert sorted(kv.block_pool.free_list) == list(range(1, num_blocks))
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.block_pool.null_block.block_hash is None
    assert sched.requests == {} and not sched.running and not sched.waiting


def _workload(s, n=4, prompt_len=11, max_tokens=9, shared_prefix=0):
    reqs = []
    for i in range(n):
        prompt = [7] * shared_prefix + [(13 * i + 5 * j) % 89 + 1 for j in range(prompt_len + i)]
        reqs.append(_req(s, f"r{i}", prompt, max_tokens=max_tokens))
    return reqs


def _reference_outputs(s):
    # Core mode with a roomy cache: one request at a time, never preempted.
    cfg = s.EngineConfig(mode="core", block_size=4, num_blocks=64, max_num_batched_tokens=64, max_model_len=64)
    return _run(s, cfg, _workload(s))[1]


def test_core_mode_one_request_at_a_time(s):
    cfg = s.EngineConfig(mode="core", block_size=4, num_blocks=64, max_num_batched_tokens=64, max_model_len=64)
    sched, outputs, _, trace = _run(s, cfg, _workload(s))
    assert all(out.num_seqs == 1 for _, out in trace)
    # r0's whole prompt in step 0, then 8 decodes (the 9th token needs no forward pass); then r1 starts.
    assert [out.num_scheduled_tokens[0] for _, out in trace[:10]] == [11] + [1] * 8 + [12]
    assert [out.scheduled_req_ids[0] for _, out in trace[:10]] == ["r0"] * 9 + ["r1"]
    assert sorted(outputs) == ["r0", "r1", "r2", "r3"] and all(len(o) == 9 for o in outputs.values())
    _assert_no_leak(sched, 64)


def test_ragged_mode_decodes_together_and_prefills_whole(s):
    cfg = s.EngineConfig(mode="ragged", block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                         max_model_len=64)
    sched, outputs, _, trace = _run(s, cfg, _workload(s))
    assert outputs == _reference_outputs(s)
    assert max(out.num_seqs for _, out in trace) == 4
    for _, out in trace:
        for n, c, pre in zip(out.num_scheduled_tokens, out.num_computed_tokens, out.is_prefill):
            assert (n, c) in {(11, 0), (12, 0), (13, 0), (14, 0)} if pre else n == 1
    _assert_no_leak(sched, 64)


def test_chunked_budget_respected_and_running_in_queue_order(s):
    cfg = s.EngineConfig(mode="chunked", block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=6,
                         max_model_len=64)
    sched, outputs, _, trace = _run(s, cfg, _workload(s))
    assert outputs == _reference_outputs(s)
    saw_mixed = False
    for before, out in trace:
        assert out.total_num_scheduled_tokens <= 6
        assert out.preempted_req_ids == []  # 63 usable blocks: nothing is ever preempted here
        # vLLM v1 order: the running requests first, in queue order, each given all it needs (a decode, the rest
        # of its prompt) up to what is left of the budget; only a spent budget leaves a running request out.
        running = list(before)
        num_running = sum(rid in before for rid in out.scheduled_req_ids)
        assert out.scheduled_req_ids[:num_running] == running[:num_running]
        budget = 6
        for rid, n in zip(out.scheduled_req_ids[:num_running], out.num_scheduled_tokens):
            computed, num_tokens, _ = before[rid]
            assert n == min(num_tokens - computed, budget)
            budget -= n
        if num_running < len(running):
            assert budget == 0 and out.num_seqs == num_running, "a running request was skipped with budget left"
        saw_mixed |= any(out.is_prefill) and not all(out.is_prefill)
    assert saw_mixed, "no step mixed decodes with a prefill chunk"
    # A prompt longer than the budget is cut into chunks; the partial chunks are not sampled.
    r0 = [(n, c, w) for _, out in trace for rid, n, c, w in
          zip(out.scheduled_req_ids, out.num_scheduled_tokens, out.num_computed_tokens, out.will_sample) if rid == "r0"]
    assert r0[:3] == [(6, 0, False), (5, 6, True), (1, 11, True)]
    _assert_no_leak(sched, 64)


def test_long_prefill_threshold_caps_chunks(s):
    cfg = s.EngineConfig(mode="chunked", block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
                         max_model_len=64, long_prefill_token_threshold=4)
    sched, outputs, _, trace = _run(s, cfg, _workload(s))
    assert outputs == _reference_outputs(s)
    assert max(n for _, out in trace for n in out.num_scheduled_tokens) == 4
    assert trace[0][1].num_scheduled_tokens == [4, 4, 4, 4]  # four prompts start together


def test_preemption_then_completion_under_tiny_cache(s):
    # Each request may hold up to ceil((14 + 9 - 1) / 4) = 6 blocks; 7 usable blocks cannot hold two of them.
    cfg = s.EngineConfig(mode="chunked", block_size=4, num_blocks=8, max_num_seqs=4, max_num_batched_tokens=16,
                         max_model_len=64)

    def check_victims(sched, out):
        for rid in out.preempted_req_ids:
            victim = next(r for r in sched.waiting if r.request_id == rid)
            assert victim.status == s.RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
            assert sched.kv_cache_manager.get_block_ids(victim) == [] and rid not in out.scheduled_req_ids
        if out.preempted_req_ids:
            assert sched.waiting[0].request_id == out.preempted_req_ids[-1], "the last victim goes to the front"

    sched, outputs, finished, trace = _run(s, cfg, _workload(s), on_step=check_victims)
    preempting = [(list(before), out.preempted_req_ids) for before, out in trace if out.preempted_req_ids]
    assert preempting, "the tiny cache never forced a preemption"
    for running_before, victims in preempting:
        # Lowest priority first: the victims are the latest admitted running requests, latest first.
        assert victims == running_before[::-1][:len(victims)]
    assert outputs == _reference_outputs(s), "recomputed requests must generate the same tokens"
    assert all(r.status == s.RequestStatus.FINISHED_LENGTH_CAPPED for r in finished)
    assert max(r.num_preemptions for r in finished) >= 1
    _assert_no_leak(sched, 8)


def test_preemption_picks_latest_admitted(s):
    cfg = s.EngineConfig(mode="ragged", block_size=4, num_blocks=5, max_num_seqs=4, max_num_batched_tokens=16,
                         max_model_len=16)  # 4 usable blocks
    sched, model = s.Scheduler(cfg), FakeModel(s, cfg)
    for i in range(3):
        sched.add_request(_req(s, f"r{i}", [i + 1] * 4, max_tokens=8))  # 1 block each, a 2nd block at token 5
    out = sched.schedule()
    assert out.scheduled_req_ids == ["r0", "r1", "r2"] and sched.kv_cache_manager.num_free_blocks == 1
    sched.update_from_output(out, model.step(sched, out))
    out = sched.schedule()  # all three need a 2nd block; r0 takes the free one, r1 gets r2's after preempting it
    assert out.scheduled_req_ids == ["r0", "r1"] and out.preempted_req_ids == ["r2"]
    assert [r.request_id for r in sched.waiting] == ["r2"] and sched.running == [sched.requests["r0"],
                                                                               sched.requests["r1"]]


def test_prefill_chunk_preempts_a_later_decoding_request(s):
    # b decodes while the older a is still prefilling; a is scheduled first (queue order) and its next chunk
    # needs b's only block, so b is preempted before it is scheduled in that step (3 usable blocks).
    cfg = s.EngineConfig(mode="chunked", block_size=4, num_blocks=4, max_num_seqs=2, max_num_batched_tokens=8,
                         max_model_len=16, long_prefill_token_threshold=4)
    sched, model = s.Scheduler(cfg), FakeModel(s, cfg)
    sched.add_request(_req(s, "a", range(1, 13), max_tokens=1))  # 12 KV tokens: all 3 usable blocks
    sched.add_request(_req(s, "b", [5, 6, 7], max_tokens=3))
    steps = []
    for _ in range(3):
        out = sched.schedule()
        steps.append((out.scheduled_req_ids, out.num_scheduled_tokens, out.preempted_req_ids))
        sched.update_from_output(out, model.step(sched, out))
    assert steps == [(["a", "b"], [4, 3], []), (["a", "b"], [4, 1], []), (["a"], [4], ["b"])]
    assert sched.requests["b"].num_computed_tokens == 0 and sched.waiting[0].request_id == "b"
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, model.step(sched, out))
    _assert_no_leak(sched, 4)


def test_running_prefill_chunk_is_scheduled_before_a_later_decode(s):
    # vLLM v1 has no decode-first pass: the older a, still prefilling, comes before b's decode.
    cfg = s.EngineConfig(mode="chunked", block_size=4, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=8,
                         max_model_len=32, long_prefill_token_threshold=4)
    sched, model = s.Scheduler(cfg), FakeModel(s, cfg)
    sched.add_request(_req(s, "a", range(1, 13), max_tokens=2))
    sched.add_request(_req(s, "b", [5, 6, 7], max_tokens=3))
    out = sched.schedule()
    assert (out.scheduled_req_ids, out.num_scheduled_tokens, out.is_prefill) == (["a", "b"], [4, 3], [True, True])
    sched.update_from_output(out, model.step(sched, out))
    out = sched.schedule()
    assert (out.scheduled_req_ids, out.num_scheduled_tokens) == (["a", "b"], [4, 1])
    assert out.is_prefill == [True, False] and out.will_sample == [False, True]
    assert out.num_computed_tokens == [4, 3]


def _finish_all(sched, model, out):
    while True:
        sched.update_from_output(out, model.step(sched, out))
        if not sched.has_unfinished_requests():
            return
        out = sched.schedule()


def test_self_preemption_stops_the_running_pass(s):
    # 4 usable blocks. Step 0 fills them: a 1 block, b 2 (an 8-token chunk), c 1. In step 1 a decodes in its
    # block; b's next chunk needs 2 new blocks: preempting c frees only 1, so b preempts itself.
    cfg = s.EngineConfig(mode="chunked", block_size=4, num_blocks=5, max_num_seqs=4, max_num_batched_tokens=16,
                         max_model_len=32, long_prefill_token_threshold=8)
    sched, model = s.Scheduler(cfg), FakeModel(s, cfg)
    sched.add_request(_req(s, "a", [1, 2, 3], max_tokens=2))
    sched.add_request(_req(s, "b", range(10, 26), max_tokens=1))  # 16 KV tokens: all 4 usable blocks
    sched.add_request(_req(s, "c", [4, 5, 6], max_tokens=2))
    sched.add_request(_req(s, "d", [7, 8], max_tokens=2))
    out = sched.schedule()
    assert (out.scheduled_req_ids, out.num_scheduled_tokens) == (["a", "b", "c"], [3, 8, 3])
    assert sched.kv_cache_manager.num_free_blocks == 0 and [r.request_id for r in sched.waiting] == ["d"]
    sched.update_from_output(out, model.step(sched, out))
    out = sched.schedule()
    assert (out.scheduled_req_ids, out.num_scheduled_tokens) == (["a"], [1])
    assert out.preempted_req_ids == ["c", "b"], "the last running request first, then b itself"
    assert sched.running == [sched.requests["a"]]
    assert [r.request_id for r in sched.waiting] == ["b", "c", "d"], "the last victim goes to the front"
    # 3 free blocks and 15 tokens of budget would admit b's 8-token chunk, yet a step that preempted admits none.
    assert sched.kv_cache_manager.num_free_blocks == 3 and out.total_num_scheduled_tokens == 1
    for rid in ("b", "c"):
        r = sched.requests[rid]
        assert r.status == s.RequestStatus.PREEMPTED and r.num_computed_tokens == 0 and r.num_preemptions == 1
        assert sched.kv_cache_manager.get_block_ids(r) == []
    sched.update_from_output(out, model.step(sched, out))  # a finishes
    out = sched.schedule()  # nothing preempted now: the waiting queue is admitted in its order
    # c recomputes its prompt and its sampled token (4), b starts over with an 8-token chunk.
    assert (out.scheduled_req_ids, out.num_scheduled_tokens, out.preempted_req_ids) == (["b", "c", "d"], [8, 4, 2], [])
    _finish_all(sched, model, out)
    _assert_no_leak(sched, 5)


def test_no_admission_in_a_step_that_preempted(s):
    # 4 usable blocks. a's third chunk needs a block when none is free, so the later b (2 blocks) is preempted;
    # one block is left over, and b's 4-token recompute chunk would fit it and the budget, but b waits a step.
    cfg = s.EngineConfig(mode="chunked", block_size=4, num_blocks=5, max_num_seqs=2, max_num_batched_tokens=16,
                         max_model_len=32, long_prefill_token_threshold=4)
    sched, model = s.Scheduler(cfg), FakeModel(s, cfg)
    sched.add_request(_req(s, "a", range(1, 13), max_tokens=1))
    sched.add_request(_req(s, "b", range(20, 25), max_tokens=2))
    steps = []
    for _ in range(3):
        out = sched.schedule()
        steps.append((out.scheduled_req_ids, out.num_scheduled_tokens, out.preempted_req_ids))
        if out.preempted_req_ids:
            assert sched.kv_cache_manager.num_free_blocks == 1 and [r.request_id for r in sched.waiting] == ["b"]
        sched.update_from_output(out, model.step(sched, out))
    assert steps == [(["a", "b"], [4, 4], []), (["a", "b"], [4, 1], []), (["a"], [4], ["b"])]
    out = sched.schedule()  # a has finished; b recomputes its 6 tokens, 4 at a time
    assert (out.scheduled_req_ids, out.num_scheduled_tokens, out.num_computed_tokens) == (["b"], [4], [0])
    _finish_all(sched, model, out)
    _assert_no_leak(sched, 5)


def test_prefix_reuse_in_chunked_mode(s):
    cfg = s.EngineConfig(mode="chunked", block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16,
                         max_model_len=64, enable_prefix_caching=True)
    reqs = _workload(s, shared_prefix=13)  # 3 full shared blocks, then a block mixing 7 with each own tokens
    sched, outputs, finished, _ = _run(s, cfg, reqs)
    plain = _run(s, s.EngineConfig(mode="chunked", block_size=4, num_blocks=64, max_num_seqs=4,
                                   max_num_batched_tokens=16, max_model_len=64), _workload(s, shared_prefix=13))[1]
    assert outputs == plain
    hits = {r.request_id: r.num_cached_tokens for r in finished}
    assert hits["r0"] == 0 and hits["r1"] == 12 and hits["r2"] == 12 and hits["r3"] == 12
    assert sched.kv_cache_manager.num_prefix_hit_blocks == 9
    _assert_no_leak(sched, 64)


def test_fully_cached_prompt_recomputes_last_block(s):
    cfg = s.EngineConfig(mode="ragged", block_size=4, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=16,
                         max_model_len=16, enable_prefix_caching=True)
    sched, model = s.Scheduler(cfg), FakeModel(s, cfg)
    sched.add_request(_req(s, "a", range(1, 9), max_tokens=1))
    out = sched.schedule()
    sched.update_from_output(out, model.step(sched, out))
    sched.add_request(_req(s, "b", range(1, 9), max_tokens=1))
    out = sched.schedule()
    assert (out.num_computed_tokens, out.num_scheduled_tokens) == ([4], [4])
    assert out.block_tables[0][0] == 1 and out.new_block_ids == [[out.block_tables[0][1]]]


def test_add_request_leaves_out_the_null_block(s):
    cfg = s.EngineConfig(mode="chunked", block_size=4, num_blocks=4, max_num_seqs=2, max_num_batched_tokens=8,
                         max_model_len=32)  # 3 usable blocks
    sched = s.Scheduler(cfg)
    with pytest.raises(ValueError, match=r"13 tokens need 4 blocks .* num_blocks=4 \(one is the null block\)"):
        sched.add_request(_req(s, "four", range(13), max_tokens=1))
    with pytest.raises(ValueError, match="can never fit"):
        sched.add_request(_req(s, "four_later", range(12), max_tokens=2))  # 13 KV tokens once it decodes
    sched.add_request(_req(s, "three", range(12), max_tokens=1))  # 12 KV tokens fit the 3 usable blocks
    assert sched.get_num_unfinished_requests() == 1


def test_stop_conditions(s):
    cfg = s.EngineConfig(mode="ragged", block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                         max_model_len=20)
    # FakeModel(eos=0) emits 0 when the context length is a multiple of 5: the 5th output of a 6-token prompt.
    reqs = [_req(s, "eos", [1] * 6, max_tokens=8, eos_token_id=0),
            _req(s, "ignore", [1] * 6, max_tokens=8, eos_token_id=0, ignore_eos=True),
            _req(s, "stop_id", [1] * 6, max_tokens=8, ignore_eos=True, stop_token_ids=[0]),
            _req(s, "model_len", [1] * 16, max_tokens=10, eos_token_id=99)]
    _, outputs, finished, _ = _run(s, cfg, reqs, eos=0)
    by_id = {r.request_id: r for r in finished}
    assert outputs["eos"][-1] == 0 and len(outputs["eos"]) == 5
    assert by_id["eos"].status == s.RequestStatus.FINISHED_STOPPED and by_id["eos"].stop_reason is None
    assert len(outputs["ignore"]) == 8 and by_id["ignore"].status == s.RequestStatus.FINISHED_LENGTH_CAPPED
    assert len(outputs["stop_id"]) == 5 and by_id["stop_id"].stop_reason == 0
    assert by_id["model_len"].num_tokens == 20 and by_id["model_len"].status == s.RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.RequestStatus.finish_reason(by_id["eos"].status) == "stop"


def test_add_request_errors(s):
    cfg = s.EngineConfig(mode="chunked", block_size=4, num_blocks=5, max_num_seqs=2, max_num_batched_tokens=8,
                         max_model_len=32)  # 4 usable blocks
    sched = s.Scheduler(cfg)
    with pytest.raises(ValueError, match="longer than max_model_len=32"):
        sched.add_request(_req(s, "long", range(33)))
    with pytest.raises(ValueError, match="can never fit .* num_blocks=5"):
        sched.add_request(_req(s, "big", range(16), max_tokens=2))  # 17 KV tokens need 5 blocks
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(_req(s, "empty", []))
    sched.add_request(_req(s, "ok", range(16), max_tokens=1))  # 16 KV tokens fit the 4 usable blocks exactly
    with pytest.raises(ValueError, match="already"):
        sched.add_request(_req(s, "ok", range(3)))
    assert sched.get_num_unfinished_requests() == 1


def test_abort_frees_blocks(s):
    cfg = s.EngineConfig(mode="ragged", block_size=4, num_blocks=8, max_num_seqs=2, max_num_batched_tokens=16,
                         max_model_len=16)
    sched = s.Scheduler(cfg)
    sched.add_request(_req(s, "a", range(6)))
    sched.add_request(_req(s, "b", range(6)))
    out = sched.schedule()
    sched.abort_request("a")
    assert sched.update_from_output(out, {"b": 5}) == []
    assert sched.schedule().finished_req_ids == ["a"]
    sched.abort_request("b")
    _assert_no_leak(sched, 8)


# -- batch metadata ------------------------------------------------------------------------------------------------
def test_pick_bucket(s):
    assert s.pick_bucket(5, [16, 4, 8]) == 8 and s.pick_bucket(8, [4, 8, 16]) == 8
    with pytest.raises(ValueError):
        s.pick_bucket(17, [4, 8, 16])
    assert s.make_token_buckets(40, 8) == [8, 16, 32, 64]
    # past 256 tokens the grid steps by 256: a prompt pads by less than that, not by up to its own length
    assert s.make_token_buckets(1337) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536]
    assert s.make_token_buckets(1000, 16, 128)[-3:] == [768, 896, 1024]


def test_block_tables_hold_no_null_block_and_padding_points_at_it(s):
    # A tiny prefix-cached chunked engine (preemptions, hits, evictions); every table the scheduler gives out
    # holds usable blocks only, and every padded entry of the batch metadata is the null block 0.
    cfg = s.EngineConfig(mode="chunked", block_size=4, num_blocks=9, max_num_seqs=3, max_num_batched_tokens=8,
                         max_model_len=64, enable_prefix_caching=True)
    null_id = 0
    seen = {"preempted": 0}

    def check(sched, out):
        assert sched.kv_cache_manager.block_pool.null_block.block_id == null_id
        for table, new in zip(out.block_tables, out.new_block_ids):
            assert null_id not in table and null_id not in new
        meta = s.build_batch_metadata(out, sched.requests, cfg.block_size, cfg.max_num_seqs + 1,
                                      cfg.max_blocks_per_seq, [16])
        for i, row in enumerate(meta.block_tables):
            table = out.block_tables[i] if i < out.num_seqs else []
            assert row == table + [null_id] * (cfg.max_blocks_per_seq - len(table))
        real, pad = meta.slot_mapping[:meta.num_tokens], meta.slot_mapping[meta.num_tokens:]
        assert all(slot // cfg.block_size != null_id for slot in real) and set(pad) <= {s.PAD_SLOT_ID}
        seen["preempted"] += len(out.preempted_req_ids)

    sched, outputs, _, _ = _run(s, cfg, _workload(s, shared_prefix=5), on_step=check)
    assert outputs == _run(s, s.EngineConfig(mode="chunked", block_size=4, num_blocks=64, max_num_seqs=3,
                                             max_num_batched_tokens=8, max_model_len=64),
                           _workload(s, shared_prefix=5))[1]
    assert seen["preempted"] > 0, "the tiny cache never preempted"
    assert sched.kv_cache_manager.num_prefix_hit_blocks > 0 and sched.kv_cache_manager.block_pool.num_evictions > 0
    _assert_no_leak(sched, 9)


def test_batch_metadata_literal(s):
    reqs = {"a": s.Request("a", [10, 11, 12, 13, 14], output_token_ids=[15]),  # decoding its 6th token
            "b": s.Request("b", [20, 21, 22]),  # whole prompt
            "c": s.Request("c", list(range(30, 40)))}  # 8 tokens hit the prefix cache, 2 to compute
    out = s.SchedulerOutput(
        scheduled_req_ids=["a", "b", "c"], num_scheduled_tokens=[1, 3, 2], num_computed_tokens=[5, 0, 8],
        is_prefill=[False, True, True], will_sample=[True, True, True], new_block_ids=[[], [2], [6]],
        block_tables=[[3, 7], [2], [5, 1, 6]], preempted_req_ids=[], finished_req_ids=[])
    meta = s.build_batch_metadata(out, reqs, block_size=4, max_num_seqs=4, max_blocks_per_seq=3,
                                  token_buckets=[4, 8, 16])
    assert meta.input_ids == [15, 20, 21, 22, 38, 39, 0, 0]
    assert meta.positions == [5, 0, 1, 2, 8, 9, 0, 0]
    # a: position 5 is block 7, offset 1 -> 29; b: block 2 -> 8, 9, 10; c: positions 8, 9 are block 6 -> 24, 25.
    assert meta.slot_mapping == [29, 8, 9, 10, 24, 25, -1, -1]
    assert meta.block_tables == [[3, 7, 0], [2, 0, 0], [5, 1, 6], [0, 0, 0]]
    assert meta.seq_lens == [6, 3, 10, 0]
    assert meta.query_start_loc == [0, 1, 4, 6, 6]
    assert meta.logits_indices == [0, 3, 5, 0]
    assert (meta.num_seqs, meta.num_tokens, meta.padded_num_tokens) == (3, 6, 8)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        s.build_batch_metadata(out, reqs, 4, 4, 2, [8])
    with pytest.raises(ValueError, match="max_num_seqs"):
        s.build_batch_metadata(out, reqs, 4, 2, 3, [8])


# -- the per-step trace (graded at L5 as schedule_trace) ------------------------------------------------------
def test_step_trace_records_schedule_preemptions_tables_and_block_events(s):
    # A pool that must preempt and evict: the trace is one entry per step, each what that step's SchedulerOutput
    # said, and its freed/evicted ids are exactly the pool's events of that step, in order.
    cfg = s.EngineConfig(block_size=4, num_blocks=9, max_num_seqs=3, max_num_batched_tokens=64, max_model_len=64,
                         mode="ragged", enable_prefix_caching=True, record_trace=True)
    freed_log, evicted_log = [], []

    def watch(sched, out):  # count the pool's events independently of take_block_events
        pool = sched.kv_cache_manager.block_pool
        freed_log.append(list(pool.freed_block_ids))
        evicted_log.append(list(pool.evicted_block_ids))

    sched, _, _, steps = _run(s, cfg, _workload(s, n=4, prompt_len=11, max_tokens=9), on_step=watch)
    trace = sched.trace
    assert len(trace) == len(steps)
    for entry, (_, out) in zip(trace, steps):
        assert entry.scheduled_req_ids == out.scheduled_req_ids
        assert entry.num_scheduled_tokens == out.num_scheduled_tokens
        assert entry.preempted_req_ids == out.preempted_req_ids
        assert entry.block_tables == out.block_tables and all(0 not in t for t in entry.block_tables)
    preempted = [rid for e in trace for rid in e.preempted_req_ids]
    evicted = [b for e in trace for b in e.evicted_block_ids]
    freed = [b for e in trace for b in e.freed_block_ids]
    assert preempted and evicted, "the scenario must preempt and evict"
    # events seen mid-step (after schedule) are a prefix of what the step's entry reports
    for entry, mid_freed, mid_evicted in zip(trace, freed_log, evicted_log):
        assert entry.freed_block_ids[:len(mid_freed)] == mid_freed
        assert entry.evicted_block_ids[:len(mid_evicted)] == mid_evicted
    assert 0 not in freed and 0 not in evicted
    # every block handed out comes back: freed ids cover all usable blocks that were ever used
    assert set(freed) <= set(range(1, cfg.num_blocks)) and sched.kv_cache_manager.block_pool.take_block_events() == ([], [])
    _assert_no_leak(sched, cfg.num_blocks)


def test_no_trace_unless_asked(s):
    cfg = s.EngineConfig(block_size=4, num_blocks=16, max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64,
                         mode="ragged")
    sched, _, _, steps = _run(s, cfg, _workload(s, n=2))
    assert steps and sched.trace == []
