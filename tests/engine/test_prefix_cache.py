"""Prefix caching: block keys, the shared block pool, the scheduler's use of it, and
the real engine on the built-in model (token identity, metrics, salts, reclaiming)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from ec_frontend.config import SchedulerConfig
from ec_frontend.connectors.kv_base import KVConnectorRole
from ec_frontend.connectors.noop import NoOpKVConnector
from ec_frontend.engine.block_hash import extend_block_hashes
from ec_frontend.engine.encoder_cache import EncoderCacheManager
from ec_frontend.engine.kv_cache import KVCacheManager
from ec_frontend.engine.outputs import ModelRunnerOutput
from ec_frontend.engine.request import Request
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.engine.scheduler import Scheduler
from ec_frontend.entrypoints.cli import build_parser
from ec_frontend.model.processor import ProcessedInputs

BS = 4


def tokens_request(rid: str, ids: list[int], *, salt: str | None = None, **kw: Any) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=2), cache_salt=salt, **kw)


def keys(request: Request, block_size: int = BS) -> list[bytes]:
    return list(extend_block_hashes(request, block_size, request.num_tokens // block_size))


# ---- block keys -------------------------------------------------------------


def test_block_keys_chain_tokens_images_and_salt(h: Any) -> None:
    ids = list(range(100, 116))
    base = keys(tokens_request("a", ids))
    assert len(base) == 4 and len(set(base)) == 4
    assert keys(tokens_request("b", ids)) == base
    # A different token in block 1 changes block 1 and every later key (the chain).
    other = keys(tokens_request("c", [*ids[:5], 999, *ids[6:]]))
    assert other[0] == base[0] and all(x != y for x, y in zip(other[1:], base[1:], strict=True))
    # Salts: no key is shared between tenants, equal salts share all.
    salted = keys(tokens_request("d", ids, salt="tenant-a"))
    assert not set(salted) & set(base)
    assert not set(salted) & set(keys(tokens_request("e", ids, salt="tenant-b")))
    assert keys(tokens_request("f", ids, salt="tenant-a")) == salted
    # Equal placeholder tokens, different images: keys differ from the image's first block.
    img = [h.IMAGE_TOKEN] * 6
    ids2 = ids[:6] + img + ids[12:]
    one = keys(tokens_request("g", ids2, mm_features=[h.fake_feature("x", 6, 6)]))
    two = keys(tokens_request("h", ids2, mm_features=[h.fake_feature("y", 6, 6)]))
    assert one[0] == two[0] and one[1] != two[1] and one[3] != two[3]
    # Output tokens extend the keys without changing the earlier ones.
    r = tokens_request("i", ids[:14])
    first = keys(r)
    r.output_token_ids += [114, 115]
    assert keys(r)[:3] == first and keys(r) == base


# ---- the block pool -----------------------------------------------------------


def test_hits_share_refcounted_blocks_and_never_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=BS, enable_prefix_caching=True)
    ids = list(range(1, 17))  # exactly 4 blocks
    a = tokens_request("a", ids)
    assert kv.find_cached_prefix(a) == []
    assert kv.allocate("a", 16) is not None
    assert len(kv.cache_blocks(a, 16)) == 4
    table_a = list(kv.block_table("a"))
    # The same 16 tokens: 3 blocks hit, the 4th holds the last token, computed again.
    b = tokens_request("b", ids)
    hit = kv.find_cached_prefix(b)
    assert hit == table_a[:3]
    used = kv.num_used_blocks
    new = kv.allocate("b", 16, hit)
    assert new is not None and len(new) == 1 and kv.num_used_blocks == used + 1
    assert kv.block_table("b")[:3] == table_a[:3]
    # A longer request hits all four.
    c = tokens_request("c", [*ids, 50, 51])
    assert kv.find_cached_prefix(c) == table_a
    kv.free("a")
    kv.free("b")
    assert kv.num_used_blocks == 0 and kv.num_cached_blocks == 4
    # Freed but keyed: still a hit, taken back from the free queue.
    assert kv.find_cached_prefix(c) == table_a
    assert kv.allocate("c", 18, table_a) is not None
    assert kv.num_used_blocks == 5
    kv.free("c")
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == 19


def test_reclaimed_under_pressure_least_recently_freed_first() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=BS, enable_prefix_caching=True)  # 8 usable
    first = tokens_request("first", list(range(1, 13)))  # 3 blocks
    second = tokens_request("second", list(range(101, 113)))  # 3 blocks
    for r in (first, second):
        kv.allocate(r.request_id, 12)
        kv.cache_blocks(r, 12)
        kv.free(r.request_id)
    assert kv.num_cached_blocks == 6 and kv.num_free_blocks == 8
    # 3 blocks: the 2 never-keyed ones, then first's last block (least recently freed).
    assert kv.allocate("x", 12) is not None
    assert kv.num_cached_blocks == 5
    assert len(kv.find_cached_prefix(tokens_request("f2", list(range(1, 14))))) == 2
    assert len(kv.find_cached_prefix(tokens_request("s2", list(range(101, 114))))) == 3
    # Everything: every key goes, nothing fails.
    kv.free("x")
    assert kv.allocate("y", 32) is not None
    assert kv.num_cached_blocks == 0 and kv.num_free_blocks == 0
    assert kv.find_cached_prefix(tokens_request("s3", list(range(101, 114)))) == []
    assert kv.allocate("z", 1) is None
    kv.free("y")
    assert kv.num_free_blocks == 8


def test_disabled_pool_keys_nothing() -> None:
    kv = KVCacheManager(num_blocks=9, block_size=BS)
    r = tokens_request("a", list(range(1, 13)))
    kv.allocate("a", 12)
    assert kv.cache_blocks(r, 12) == [] and kv.find_cached_prefix(r) == []


# ---- the scheduler ------------------------------------------------------------


def make_scheduler(blocks: int = 64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128),
        kv_cache=KVCacheManager(blocks, BS, enable_prefix_caching=True),
        encoder_cache=EncoderCacheManager(64),
    )


def test_same_step_readers_fail_with_their_writer(h: Any) -> None:
    sched = make_scheduler()
    ids = list(range(1, 42))
    for rid in ("writer", "reader"):
        sched.add_request(tokens_request(rid, ids))
    so = sched.schedule()
    items = {s.request_id: s for s in so.scheduled}
    assert items["writer"].num_computed_tokens == 0
    assert items["reader"].num_computed_tokens == 40  # 10 blocks shared within the step
    assert items["reader"].new_block_ids[:10] == items["writer"].new_block_ids[:10]
    out = h.fake_runner_output(so)
    out.failed["writer"] = "media item could not be encoded"
    finals = {o.request_id: o for o in sched.update_from_output(so, out)}
    assert finals["writer"].finish_reason == "error"
    assert finals["reader"].finish_reason == "error"
    assert "computing its cached prefix failed" in (finals["reader"].error or "")
    # Nothing unwritten stays keyed: a later request computes its whole prompt.
    assert sched.kv_cache is not None and sched.kv_cache.num_cached_blocks == 0
    sched.add_request(tokens_request("later", ids))
    (item,) = sched.schedule().scheduled
    assert item.num_computed_tokens == 0


def test_salts_never_share_in_the_scheduler(h: Any) -> None:
    sched = make_scheduler()
    ids = list(range(1, 42))
    computed: dict[str, int] = {}
    for rid, salt in (("a1", "a"), ("b1", "b"), ("none", None), ("a2", "a"), ("b2", "b")):
        sched.add_request(tokens_request(rid, ids, salt=salt))
        so = sched.schedule()
        computed[rid] = next(s for s in so.scheduled if s.request_id == rid).num_computed_tokens
        sched.update_from_output(so, h.fake_runner_output(so))
    assert computed == {"a1": 0, "b1": 0, "none": 0, "a2": 40, "b2": 40}
    assert sched.counters.prefix_cache_hits == 80
    assert sched.counters.prefix_cache_queries == 5 * 41


class RemoteKV(NoOpKVConnector):
    """Says the KV of request ``remote`` comes from elsewhere (all but its last token)."""

    def __init__(self, load_async: bool) -> None:
        super().__init__(None, KVConnectorRole.SCHEDULER)
        self.load_async = load_async

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        if request.request_id != "remote":
            return 0, False
        return request.num_tokens - 1 - num_computed, self.load_async


@pytest.mark.parametrize("load_async", [False, True])
def test_received_kv_is_kept_and_serves_later_requests(load_async: bool, h: Any) -> None:
    """A decode instance: the request whose prompt KV arrives is not looked up (and
    keeps its received tokens when it resumes); the blocks it received, once keyed,
    give a later local request with the same prompt a hit."""
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128),
        kv_cache=KVCacheManager(64, BS, enable_prefix_caching=True),
        encoder_cache=EncoderCacheManager(64),
        kv_connector=RemoteKV(load_async),
    )
    ids = list(range(1, 21))
    sched.add_request(tokens_request("remote", ids))
    so = sched.schedule()
    if load_async:
        assert so.scheduled == []
        sched.update_from_output(so, ModelRunnerOutput(kv_finished_recving={"remote"}))
        so = sched.schedule()
    (item,) = so.scheduled
    assert (item.num_computed_tokens, item.num_scheduled_tokens) == (19, 1)
    sched.update_from_output(so, h.fake_runner_output(so))
    assert sched.counters.prefix_cache_queries == 0
    sched.add_request(tokens_request("local", ids))
    so = sched.schedule()
    local = next(s for s in so.scheduled if s.request_id == "local")
    assert local.num_computed_tokens == 16
    assert sched.counters.prefix_cache_hits == 16
    assert sched.counters.kv_tokens_received == 19


# ---- the real engine on the built-in model ------------------------------------


def extend(prev: ProcessedInputs, out_ids: list[int], new_ids: list[int]) -> ProcessedInputs:
    """The next turn: the previous prompt, its answer and new tokens (text after the
    last image keeps the decode positions ``i + delta``)."""
    ids = prev.prompt_token_ids + out_ids + new_ids
    n0, delta = len(prev.prompt_token_ids), prev.mrope_position_delta
    tail = (torch.arange(n0, len(ids), dtype=torch.int64) + delta).expand(3, -1)
    positions = torch.cat([prev.mrope_positions, tail], dim=1)
    return ProcessedInputs(
        ids, list(prev.mm_features), positions, delta, cache_salt=prev.cache_salt
    )


def user_turn(processor: Any, text: str) -> list[int]:
    chat = f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    return list(processor.tokenizer.encode(chat, add_special_tokens=False))


def test_second_turn_computes_only_its_new_tokens(
    make_engine: Any, processor: Any, greedy: Any, h: Any
) -> None:
    core, _ = make_engine()
    off, _ = make_engine(enable_prefix_caching=False)
    turn1 = h.chat_inputs(processor, "describe the picture in detail", [h.image_media(3)])
    first = h.run_to_completion(_add(core, "t1", turn1, greedy(8)))["t1"]
    assert first.num_cached_tokens == 0
    turn2 = extend(turn1, first.token_ids, user_turn(processor, "and the colours?"))
    before = core.stats()
    second = h.run_to_completion(_add(core, "t2", turn2, greedy(8)))["t2"]
    after = core.stats()
    # Turn 1's prompt and answer have their KV, except the answer's last token.
    known = len(turn1.prompt_token_ids) + len(first.token_ids) - 1
    hit = known // 16 * 16
    computed = after.prompt_tokens_computed_total - before.prompt_tokens_computed_total
    assert computed == len(turn2.prompt_token_ids) - hit
    assert after.prefix_cache_hits_total - before.prefix_cache_hits_total == hit
    assert after.prefix_cache_queries_total - before.prefix_cache_queries_total == len(
        turn2.prompt_token_ids
    )
    assert second.num_cached_tokens == hit
    assert after.encoder_items_computed_total == before.encoder_items_computed_total
    # The same tokens as an engine without prefix caching.
    ref = h.run_to_completion(_add(off, "t2", turn2, greedy(8)))["t2"]
    assert second.token_ids == ref.token_ids
    assert off.stats().prefix_cache_hits_total == 0
    h.assert_no_leaks(core)


def test_cache_salt_scopes_the_engine_cache(
    make_engine: Any, processor: Any, greedy: Any, h: Any
) -> None:
    core, _ = make_engine()
    base = h.chat_inputs(processor, "a question long enough for several blocks", [h.image_media(5)])

    def salted(salt: str | None) -> ProcessedInputs:
        return ProcessedInputs(
            base.prompt_token_ids, base.mm_features, base.mrope_positions,
            base.mrope_position_delta, cache_salt=salt,
        )  # fmt: skip

    cached = {}
    for i, salt in enumerate(("tenant-a", "tenant-b", None, "tenant-a", None, "tenant-b")):
        rid = f"r{i}"
        cached[rid] = h.run_to_completion(_add(core, rid, salted(salt), greedy(2)))[rid]
    hit = (len(base.prompt_token_ids) - 1) // 16 * 16
    assert [cached[f"r{i}"].num_cached_tokens for i in range(6)] == [0, 0, 0, hit, hit, hit]
    assert len({tuple(o.token_ids) for o in cached.values()}) == 1
    h.assert_no_leaks(core)


def test_cached_blocks_are_reclaimed_under_pressure(
    make_engine: Any, processor: Any, greedy: Any, h: Any
) -> None:
    # 40 blocks: every new prompt must reclaim blocks earlier prompts left keyed.
    core, _ = make_engine(num_kv_blocks=40, max_model_len=256)
    prompts = [processor.process_prompt([100 + i, *range(200, 380)]) for i in range(8)]
    assert all(len(p.prompt_token_ids) > 160 for p in prompts)
    for i, p in enumerate(prompts):
        out = h.run_to_completion(_add(core, f"p{i}", p, greedy(4)))[f"p{i}"]
        assert out.finish_reason == "length" and out.num_cached_tokens == 0
        assert core.kv_cache is not None and core.kv_cache.num_cached_blocks <= 39
    # The latest prompt is still cached; the first was reclaimed.
    late = h.run_to_completion(_add(core, "late", prompts[-1], greedy(4)))["late"]
    early = h.run_to_completion(_add(core, "early", prompts[0], greedy(4)))["early"]
    assert late.num_cached_tokens > 0 and early.num_cached_tokens == 0
    h.assert_no_leaks(core)


def _add(core: Any, rid: str, inputs: ProcessedInputs, params: SamplingParams) -> Any:
    core.add_request(rid, inputs, params)
    return core


@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_multi_turn_is_token_identical_to_no_caching(
    make_engine: Any, processor: Any, greedy: Any, h: Any, seed: int
) -> None:
    """Three conversations of three turns (images in the first, one image shared by
    two conversations), each turn sent twice (``n = 2`` as the server fans it out), on
    a cache small enough to preempt, with an abort per round; chunked prefill at 64
    tokens. The reference is an engine without prefix caching and with room for
    everything; an aborted request's tokens must be a prefix of the reference's."""
    rng = random.Random(seed)
    cached, _ = make_engine(num_kv_blocks=18, max_num_batched_tokens=64, max_model_len=256)
    ref, _ = make_engine(enable_prefix_caching=False, max_num_batched_tokens=64)
    shared = h.image_media(40)
    convs = [
        h.chat_inputs(processor, "first conversation", [shared, h.image_media(41)]),
        h.chat_inputs(processor, "second conversation, about the same picture", [shared]),
        h.chat_inputs(processor, "third, text only " * 8, []),
    ]
    for turn in range(3):
        params = {c: greedy(rng.randint(3, 12)) for c in range(len(convs))}
        ids = [f"t{turn}c{c}x{k}" for c in range(len(convs)) for k in range(2)]
        for rid in ids:
            c = int(rid.split("c")[1][0])
            cached.add_request(rid, convs[c], params[c])
            ref.add_request(rid, convs[c], params[c])
        victim, when = rng.choice(ids), rng.randint(2, 6)

        def abort(step: int, victim: str = victim, when: int = when) -> None:
            if step == when:
                cached.abort(victim)

        got = h.run_to_completion(cached, before_step=abort)
        want = h.run_to_completion(ref)
        for rid in ids:
            if got[rid].finish_reason == "abort":
                assert want[rid].token_ids[: len(got[rid].token_ids)] == got[rid].token_ids
            else:
                assert got[rid].token_ids == want[rid].token_ids, rid
        for c in range(len(convs)):
            answer = got[f"t{turn}c{c}x0"].token_ids
            text = f"turn {turn} question {rng.randint(0, 999)}"
            convs[c] = extend(convs[c], answer, user_turn(processor, text))
    stats = cached.stats()
    assert stats.preemptions_total > 0
    assert stats.prefix_cache_hits_total > stats.prefix_cache_queries_total // 3
    h.assert_no_leaks(cached)
    h.assert_no_leaks(ref)


def test_cli_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).enable_prefix_caching is True
    assert parser.parse_args(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching is False
    assert parser.parse_args(["serve", "--enable-prefix-caching"]).enable_prefix_caching is True


def test_unwritten_runner_failure_keeps_nothing_keyed(h: Any) -> None:
    sched = make_scheduler()
    sched.add_request(tokens_request("a", list(range(1, 30))))
    so = sched.schedule()
    sched.update_from_output(so, ModelRunnerOutput(failed={"a": "model step failed: boom"}))
    assert sched.kv_cache is not None
    assert sched.kv_cache.num_cached_blocks == 0 and sched.kv_cache.num_used_blocks == 0


def test_an_image_loaded_over_ec_is_keyed_like_a_local_one(
    make_engine: Any, processor: Any, greedy: Any, h: Any, tmp_path: Any
) -> None:
    """E+PD: the consumer loads the image's encoder output (no pixels), and a later
    request carrying the same image's pixels hits the blocks computed from the
    loaded output (same ``mm_hash``, same keys): nothing is encoded or loaded again,
    and the tokens equal an aggregated engine without caching."""
    storage = {
        "ec_connector": "ECSharedStorageConnector",
        "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)},
    }
    local = h.chat_inputs(processor, "what is shown here, in detail?", [h.image_media(61)])
    enc, _ = make_engine(ec={**storage, "ec_role": "ec_producer"})
    h.run_to_completion(_add(enc, "e", local, greedy(1)))
    feats = local.mm_features
    remote = processor.process_generate(
        local.prompt_token_ids,
        {
            "mm_hashes": [f.mm_hash for f in feats],
            "mm_placeholders": [{"offset": f.offset, "length": f.length} for f in feats],
            "mm_grid_thw": [list(f.image_grid_thw) for f in feats],
        },
    )
    assert remote.mm_features[0].pixel_values is None
    pd, _ = make_engine(ec={**storage, "ec_role": "ec_consumer"})
    first = h.run_to_completion(_add(pd, "loaded", remote, greedy(6)))["loaded"]
    loaded = pd.stats()
    assert loaded.ec_items_loaded_total == 1 and loaded.encoder_items_computed_total == 0
    second = h.run_to_completion(_add(pd, "local", local, greedy(6)))["local"]
    after = pd.stats()
    assert second.num_cached_tokens == (len(local.prompt_token_ids) - 1) // 16 * 16
    assert after.ec_items_loaded_total == 1 and after.encoder_items_computed_total == 0
    ref, _ = make_engine(enable_prefix_caching=False)
    want = h.run_to_completion(_add(ref, "r", local, greedy(6)))["r"].token_ids
    assert first.token_ids == want and second.token_ids == want
    h.assert_no_leaks(pd)
