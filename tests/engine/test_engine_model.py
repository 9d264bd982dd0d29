"""EngineCore on the built-in model: encoder cache, E -> PD over shared storage,
continuous batching, preemption, stop strings and resilience."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ec_frontend.config import ECTransferConfig
from ec_frontend.connectors.base import ECConnectorRole
from ec_frontend.connectors.shared_storage import ECSharedStorageConnector
from ec_frontend.engine.core import EngineCore
from ec_frontend.engine.outputs import RequestOutput
from ec_frontend.engine.sampling_params import SamplingParams
from ec_frontend.entrypoints.http.errors import engine_failure

from ..helpers.video import make_clip

pytestmark = pytest.mark.slow


def storage(path: Path, role: str) -> dict[str, Any]:
    return {
        "ec_connector": "ECSharedStorageConnector",
        "ec_role": role,
        "ec_connector_extra_config": {"shared_storage_path": str(path)},
    }


def reference_and_produced(
    make_engine: Any, h: Any, inputs: Any, params: Callable[[], SamplingParams], tmp_path: Path
) -> tuple[RequestOutput, RequestOutput]:
    """Run ``inputs`` as request ``"r"`` on an aggregated engine (the reference) and on an
    EC producer that saves its encoder outputs under ``tmp_path``; both finished outputs."""
    agg, _ = make_engine()
    agg.add_request("r", inputs, params())
    want = h.run_to_completion(agg)["r"]
    enc, _ = make_engine(ec=storage(tmp_path, "ec_producer"))
    enc.add_request("r", inputs, params())
    produced = h.run_to_completion(enc)["r"]
    return want, produced


def test_same_image_twice_is_encoded_once(make_engine: Any, processor: Any, h: Any,
                                          greedy: Any) -> None:  # fmt: skip
    core, model = make_engine()
    img = h.image_media(1)
    core.add_request("a", h.chat_inputs(processor, "first", [img]), greedy())
    core.add_request("b", h.chat_inputs(processor, "second", [img]), greedy())
    core.add_request("c", h.chat_inputs(processor, "twice", [img, img]), greedy())
    results = h.run_to_completion(core)
    assert {r.finish_reason for r in results.values()} == {"length"}
    stats = core.stats()
    assert stats.encoder_items_computed_total == 1
    assert stats.encoder_cache_hits_total == 2
    assert model.calls["encode"] == 1
    h.assert_no_leaks(core)


def test_small_encoder_cache_evicts_and_runner_drops_freed(
    make_engine: Any, processor: Any, h: Any, greedy: Any
) -> None:
    # Each 112x112 image is 16 rows; the cache holds two.
    core, _ = make_engine(encoder_cache_size=32, encoder_compute_budget=32)
    images = [h.image_media(10 + i) for i in range(4)]
    for i, img in enumerate(images):
        core.add_request(f"r{i}", h.chat_inputs(processor, "x", [img]), greedy(2))
        h.run_to_completion(core)
    held = set(core.runner.encoder_cache)
    assert held == {m.mm_hash for m in images if core.encoder_cache.contains(m.mm_hash)}
    assert len(held) == 2 and images[0].mm_hash not in held
    # Evicted items are encoded again when needed.
    core.add_request("again", h.chat_inputs(processor, "x", [images[0]]), greedy(2))
    h.run_to_completion(core)
    assert core.stats().encoder_items_computed_total == 5
    h.assert_no_leaks(core)


def test_encoder_only_allocates_no_kv_and_never_calls_the_lm(
    make_engine: Any, processor: Any, h: Any, greedy: Any, tmp_path: Path
) -> None:
    core, model = make_engine(ec=storage(tmp_path, "ec_producer"))
    assert core.encoder_only and core.kv_cache is None and core.runner.kv_caches == []
    imgs = [h.image_media(20), h.image_media(21)]
    core.add_request("two", h.chat_inputs(processor, "x", imgs), greedy())
    core.add_request("text", h.chat_inputs(processor, "only text", []), greedy())
    results = h.run_to_completion(core)
    assert model.calls == {"encode": 1, "embed": 0, "forward": 0, "logits": 0}
    two = results["two"]
    assert two.finished and two.token_ids == [] and two.text == ""
    params = two.ec_transfer_params
    assert {k: (v["num_tokens"], v["modality"], v["item_indices"]) for k, v in params.items()} == {
        m.mm_hash: (16, "image", [i]) for i, m in enumerate(imgs)
    }
    for entry in params.values():
        t, gh, gw = entry["metadata"]["image_grid_thw"]
        assert t * gh * gw == 16 * 4
    assert results["text"].ec_transfer_params is None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{m.mm_hash}.safetensors" for m in imgs
    )
    stats = core.stats()
    assert stats.ec_items_saved_total == 2 and stats.prompt_tokens_computed_total == 0
    assert stats.generation_tokens_total == 0 and stats.lm_forward_calls_total == 0
    h.assert_no_leaks(core)


@dataclasses.dataclass(frozen=True)
class VideoReference:
    """A ``video_embeds`` reference as the processor reads it (the native item's
    ``video_grid_thw``, no bytes)."""

    mm_hash: str
    video_grid_thw: tuple[int, int, int]
    data: bytes | None = None


def test_encoder_reports_a_video_and_a_video_over_the_encoder_cache_fails_alone(
    make_engine: Any, processor: Any, h: Any, greedy: Any, tmp_path: Path
) -> None:
    """An encoder's entry for a video is vLLM's (``modality`` video, its
    ``video_grid_thw``); a reference with that grid is sized and placed exactly as the
    decoded video; a video with more placeholder rows than the encoder cache holds
    fails alone, naming ``--encoder-cache-size`` (400), as vLLM refuses it."""
    clip = make_clip(8)
    video = h.Media(clip, hashlib.blake2b(clip, digest_size=16).hexdigest())
    content = [{"type": "video", "media_index": 0}, {"type": "text", "text": "x"}]
    inputs = processor.process_chat([{"role": "user", "content": content}], [video])
    (feature,) = inputs.mm_features
    assert feature.modality == "video" and feature.image_grid_thw[0] == 4
    core, _ = make_engine(ec=storage(tmp_path, "ec_producer"))
    core.add_request("v", inputs, greedy())
    entry = h.run_to_completion(core)["v"].ec_transfer_params[video.mm_hash]
    assert entry["modality"] == "video" and entry["item_indices"] == [0]
    assert entry["metadata"] == {"video_grid_thw": list(feature.image_grid_thw)}
    assert entry["num_tokens"] == feature.length
    ref = VideoReference(video.mm_hash, feature.image_grid_thw)
    sized = processor.process_chat([{"role": "user", "content": content}], [ref])
    assert sized.prompt_token_ids == inputs.prompt_token_ids
    assert torch.equal(sized.mrope_positions, inputs.mrope_positions)
    assert sized.mm_features[0].pixel_values is None
    small, _ = make_engine(encoder_cache_size=16, encoder_compute_budget=16)
    assert feature.length > 16
    small.add_request("big", inputs, greedy())
    small.add_request("fits", h.chat_inputs(processor, "x", [h.image_media(5)]), greedy(2))
    results = h.run_to_completion(small)
    error = results["big"].error
    assert results["big"].finish_reason == "error" and "(--encoder-cache-size)" in error
    assert engine_failure(error).status == 400
    assert results["fits"].finish_reason == "length"
    h.assert_no_leaks(small)


def test_encoder_only_from_config_loads_no_language_model(
    builtin_model_dir: Path, tmp_path: Path, h: Any
) -> None:
    config = dataclasses.replace(
        h.engine_config(ec=storage(tmp_path, "ec_producer")), model=str(builtin_model_dir)
    )
    core, _ = EngineCore.from_config(config)
    assert core.model.language is None and core.model.vision is not None
    assert core.kv_cache is None


PROMPTS = {
    "text-only": ("tell me a story", 0),
    "one-image": ("what is in the picture?", 1),
    "two-images": ("compare the pictures", 2),
}


@pytest.mark.parametrize("case", list(PROMPTS))
def test_aggregated_and_disaggregated_agree(
    case: str, make_engine: Any, processor: Any, h: Any, greedy: Any, tmp_path: Path
) -> None:
    text, num_images = PROMPTS[case]
    images = [h.image_media(30 + i) for i in range(num_images)]
    inputs = h.chat_inputs(processor, text, images)

    want, produced = reference_and_produced(make_engine, h, inputs, lambda: greedy(10), tmp_path)
    ec_params = produced.ec_transfer_params

    pd, pd_model = make_engine(ec=storage(tmp_path, "ec_consumer"))
    pd.add_request("r", inputs, greedy(10, extra_args={"ec_transfer_params": ec_params}))
    got = h.run_to_completion(pd)["r"]

    assert len(want.token_ids) == 10
    assert got.token_ids == want.token_ids
    assert got.text == want.text
    assert pd_model.calls["encode"] == 0
    assert pd.stats().ec_items_loaded_total == num_images
    assert pd.stats().ec_load_fallbacks_total == 0
    h.assert_no_leaks(pd)


def test_consumer_without_pixels_loads_from_storage(
    make_engine: Any, processor: Any, h: Any, greedy: Any, tmp_path: Path
) -> None:
    inputs = h.chat_inputs(processor, "look", [h.image_media(40)])
    want = reference_and_produced(make_engine, h, inputs, greedy, tmp_path)[0].token_ids
    feats = inputs.mm_features
    generate = processor.process_generate(
        inputs.prompt_token_ids,
        {
            "mm_hashes": [f.mm_hash for f in feats],
            "mm_placeholders": [{"offset": f.offset, "length": f.length} for f in feats],
            "mm_grid_thw": [list(f.image_grid_thw) for f in feats],
        },
    )
    assert generate.mm_features[0].pixel_values is None
    pd, _ = make_engine(ec=storage(tmp_path, "ec_consumer"))
    pd.add_request("r", generate, greedy())
    assert h.run_to_completion(pd)["r"].token_ids == want


def test_corrupt_file_falls_back_to_local_encoding(
    make_engine: Any, processor: Any, h: Any, greedy: Any, tmp_path: Path
) -> None:
    img = h.image_media(50)
    inputs = h.chat_inputs(processor, "look", [img])
    want = reference_and_produced(make_engine, h, inputs, greedy, tmp_path)[0].token_ids
    path = tmp_path / f"{img.mm_hash}.safetensors"
    path.write_bytes(path.read_bytes()[:100])

    pd, pd_model = make_engine(ec=storage(tmp_path, "ec_consumer"))
    pd.add_request("r", inputs, greedy())
    assert h.run_to_completion(pd)["r"].token_ids == want
    stats = pd.stats()
    assert stats.ec_load_fallbacks_total == 1
    assert stats.ec_items_loaded_total == 0
    assert stats.encoder_items_computed_total == 1 and pd_model.calls["encode"] == 1
    h.assert_no_leaks(pd)


class SlowLoadConnector(ECSharedStorageConnector):
    """Loads on a background thread after a delay, and waits for it before returning."""

    DELAY_S = 0.3

    def __init__(self, config: ECTransferConfig, role: ECConnectorRole) -> None:
        super().__init__(config, role)
        self.loaded_at: float | None = None

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        def slow() -> None:
            time.sleep(self.DELAY_S)
            ECSharedStorageConnector.start_load_caches(self, encoder_cache)
            self.loaded_at = time.monotonic()

        worker = threading.Thread(target=slow)
        worker.start()
        worker.join()


def test_slow_consumer_load_completes_before_embeddings_are_gathered(
    make_engine: Any, vlm: Any, processor: Any, h: Any, greedy: Any, tmp_path: Path
) -> None:
    inputs = h.chat_inputs(processor, "look", [h.image_media(60)])
    want = reference_and_produced(make_engine, h, inputs, greedy, tmp_path)[0].token_ids

    config = ECTransferConfig.from_json(storage(tmp_path, "ec_consumer"))
    sched_side = SlowLoadConnector(config, ECConnectorRole.SCHEDULER)
    worker_side = SlowLoadConnector(config, ECConnectorRole.WORKER)
    model = h.CountingModel(vlm)
    gathered_at: list[float] = []
    model.on_forward = lambda: gathered_at.append(time.monotonic())
    pd = EngineCore(
        h.engine_config(ec=storage(tmp_path, "ec_consumer")),
        model,
        tokenizer=processor.tokenizer,
        ec_connectors=(sched_side, worker_side),
    )
    pd.add_request("r", inputs, greedy())
    assert h.run_to_completion(pd)["r"].token_ids == want
    assert worker_side.loaded_at is not None
    assert worker_side.loaded_at < gathered_at[0]
    assert pd.stats().ec_items_loaded_total == 1 and model.calls["encode"] == 0


def test_concurrent_requests_share_each_forward(
    make_engine: Any, processor: Any, h: Any, greedy: Any
) -> None:
    prompts = [h.chat_inputs(processor, f"story number {i}", []) for i in range(4)]
    alone = []
    for i, inputs in enumerate(prompts):
        core, _ = make_engine()
        core.add_request(f"r{i}", inputs, greedy(8))
        alone.append(h.run_to_completion(core)[f"r{i}"].token_ids)

    core, model = make_engine()
    for i, inputs in enumerate(prompts):
        core.add_request(f"r{i}", inputs, greedy(8))
    results = h.run_to_completion(core)
    # One prefill step for all four, then seven decode steps of four requests each.
    assert model.forward_batch_sizes == [4] * 8
    assert core.stats().lm_forward_calls_total == 8
    assert [results[f"r{i}"].token_ids for i in range(4)] == alone


def test_preemption_recomputes_to_the_same_tokens(
    make_engine: Any, processor: Any, h: Any, greedy: Any
) -> None:
    inputs = [h.chat_inputs(processor, f"picture {i}", [h.image_media(70 + i)]) for i in range(3)]
    roomy, _ = make_engine()
    for i, x in enumerate(inputs):
        roomy.add_request(f"r{i}", x, greedy(40))
    want = {k: v.token_ids for k, v in h.run_to_completion(roomy).items()}

    tight, _ = make_engine(num_kv_blocks=12, max_model_len=128)  # 11 usable blocks of 16
    for i, x in enumerate(inputs):
        tight.add_request(f"r{i}", x, greedy(40))
    got = {k: v.token_ids for k, v in h.run_to_completion(tight).items()}
    assert tight.stats().preemptions_total > 0
    assert got == want
    h.assert_no_leaks(tight)


def test_stop_strings_cut_the_text(make_engine: Any, processor: Any, h: Any, greedy: Any) -> None:
    inputs = h.chat_inputs(processor, "say something long", [])
    core, _ = make_engine()
    core.add_request("full", inputs, greedy(24))
    # The built-in model's greedy text ends in bytes that never form a character,
    # released only when the request finishes: pick the stop string before them.
    full = h.run_to_completion(core)["full"].text.split("\ufffd")[0]
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3
    cut = full.index(stop)
    for rid, include in (("ex", False), ("in", True)):
        params = greedy(24, stop=[stop], include_stop_str_in_output=include)
        core.add_request(rid, inputs, params)
    results = h.run_to_completion(core)
    assert results["ex"].text == full[:cut]
    assert results["in"].text == full[: cut + len(stop)]
    for rid in ("ex", "in"):
        assert results[rid].finish_reason == "stop" and results[rid].stop_reason == stop
        assert len(results[rid].token_ids) < 24
    h.assert_no_leaks(core)


def test_seeded_sampling_is_reproducible(make_engine: Any, processor: Any, h: Any) -> None:
    inputs = h.chat_inputs(processor, "random", [])

    def run(seed: int, neighbours: int) -> list[int]:
        core, _ = make_engine()
        params = SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=seed,
                                ignore_eos=True)  # fmt: skip
        core.add_request("r", inputs, params)
        for i in range(neighbours):
            core.add_request(f"n{i}", inputs, SamplingParams(max_tokens=12, temperature=1.0))
        return h.run_to_completion(core)["r"].token_ids

    first = run(7, 0)
    assert run(7, 3) == first
    assert run(8, 0) != first


def test_failures_stay_with_their_request(
    make_engine: Any, processor: Any, h: Any, greedy: Any
) -> None:
    core, _ = make_engine()
    good_img = h.chat_inputs(processor, "fine", [h.image_media(80)])
    broken = h.chat_inputs(processor, "broken", [h.image_media(81)])
    feature = broken.mm_features[0]
    feature.pixel_values = feature.pixel_values[:-3]  # patches no longer match the grid
    bad_ids = dataclasses.replace(h.chat_inputs(processor, "ids", []))
    bad_ids.prompt_token_ids = [*bad_ids.prompt_token_ids, core.model.vocab_size + 5]

    core.add_request("good-image", good_img, greedy(6))
    core.add_request("bad-image", broken, greedy(6))
    core.add_request("bad-ids", bad_ids, greedy(6))
    core.add_request("good-text", h.chat_inputs(processor, "text", []), greedy(6))
    core.add_request("aborted", h.chat_inputs(processor, "long", []), greedy(50))
    results: dict[str, Any] = {}
    for step in range(200):
        if not core.has_work():
            break
        if step == 3:
            core.abort("aborted")
        for out in core.step():
            if out.request_id in results:
                results[out.request_id].add(out)
            else:
                results[out.request_id] = out
    reasons = {k: v.finish_reason for k, v in results.items()}
    assert reasons == {
        "good-image": "length",
        "good-text": "length",
        "bad-image": "error",
        "bad-ids": "error",
        "aborted": "abort",
    }
    assert "could not be encoded" in results["bad-image"].error
    assert "outside the vocabulary" in results["bad-ids"].error
    assert 0 < len(results["aborted"].token_ids) < 50
    assert len(results["good-image"].token_ids) == 6
    stats = core.stats()
    assert stats.requests_failed_total == 2
    h.assert_no_leaks(core)
    assert stats.kv_blocks_used == 0 and stats.encoder_cache_refs == 0


def test_prefill_chunks_and_decodes_share_a_forward(
    make_engine: Any, processor: Any, h: Any, greedy: Any
) -> None:
    core, model = make_engine(max_num_batched_tokens=24)
    core.add_request("a", h.chat_inputs(processor, "short", []), greedy(12))
    core.step()
    core.step()
    long = h.chat_inputs(processor, "a longer prompt " * 6, [h.image_media(90)])
    assert len(long.prompt_token_ids) > 48
    core.add_request("b", long, greedy(4))
    seen: list[list[int]] = []
    inner_forward = model.forward

    def spy(embeds: Any, positions: Any, kv: Any, meta: Any) -> Any:
        seen.append(list(meta.query_lens_cpu))
        return inner_forward(embeds, positions, kv, meta)

    model.forward = spy  # type: ignore[method-assign]
    h.run_to_completion(core)
    # "a" decodes (1 token) in the same forwards as "b"'s prefill chunks (23 tokens).
    assert seen[0] == [1, 23] and seen[1] == [1, 23]
    h.assert_no_leaks(core)


@pytest.mark.parametrize(
    ("break_it", "message"),
    [
        (lambda x, p: setattr(x, "prompt_token_ids", []), "empty"),
        (lambda x, p: setattr(x, "prompt_token_ids", [*x.prompt_token_ids, -3]), "vocabulary"),
        (lambda x, p: setattr(x, "prompt_token_ids", x.prompt_token_ids * 40), "at most"),
        (lambda x, p: setattr(x, "mrope_positions", x.mrope_positions[:, :-1]), "mrope_positions"),
        (lambda x, p: setattr(x.mm_features[0], "offset", 10_000), "placeholder range"),
        (lambda x, p: setattr(p, "n", 2), "n must be 1"),
    ],
)
def test_unservable_inputs_fail_alone(
    break_it: Any, message: str, make_engine: Any, processor: Any, h: Any, greedy: Any
) -> None:
    core, _ = make_engine()
    bad = h.chat_inputs(processor, "bad", [h.image_media(3)])
    params = greedy(3)
    break_it(bad, params)
    core.add_request("bad", bad, params)
    core.add_request("good", h.chat_inputs(processor, "good", [h.image_media(4)]), greedy(3))
    results = h.run_to_completion(core)
    assert results["bad"].finish_reason == "error" and message in results["bad"].error
    assert results["good"].finish_reason == "length" and len(results["good"].token_ids) == 3
    h.assert_no_leaks(core)


def test_randomized_load_under_pressure_matches_a_roomy_run(
    make_engine: Any, processor: Any, h: Any, greedy: Any
) -> None:
    """Shared images, chunked prefill, a small KV and encoder cache, aborts: the
    surviving requests produce what a roomy engine produces, and nothing leaks."""
    import random

    rng = random.Random(1234)
    pool = [h.image_media(100 + i) for i in range(4)]
    requests = []
    for i in range(12):
        images = rng.sample(pool, rng.randint(0, 2))
        inputs = h.chat_inputs(processor, "words " * rng.randint(1, 12), images)
        requests.append((f"r{i}", inputs, rng.randint(1, 24)))
    aborted = {"r3", "r8"}

    def run(core: EngineCore, abort: bool) -> dict[str, Any]:
        for rid, inputs, n in requests:
            core.add_request(rid, inputs, greedy(n))

        def abort_at_step_5(step: int) -> None:
            if step == 5:
                core.abort(sorted(aborted))

        return h.run_to_completion(core, 2000, abort_at_step_5 if abort else None)

    roomy, _ = make_engine()
    want = run(roomy, abort=False)
    tight, _ = make_engine(
        num_kv_blocks=14, max_model_len=200, max_num_batched_tokens=40,
        encoder_cache_size=32, encoder_compute_budget=16, max_num_seqs=6,
    )  # fmt: skip
    got = run(tight, abort=True)
    for rid, _, n in requests:
        if rid in aborted:
            assert got[rid].finish_reason in ("abort", "length")
            continue
        assert got[rid].token_ids == want[rid].token_ids, rid
        assert len(got[rid].token_ids) == n
    stats = tight.stats()
    assert stats.preemptions_total > 0
    assert stats.encoder_cache_hits_total > 0
    h.assert_no_leaks(tight)
