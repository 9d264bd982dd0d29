"""Decode steps replayed from captured graphs (``engine/cuda_graphs.py``) give the
tokens the eager engine gives.

No GPU is needed here: the graphs are "captured" by :func:`eager_capture`, whose
replay runs the forward again over the same static tensors, so everything around
the CUDA capture is the production path (static inputs, padding to a captured
size, the scratch block of the padding rows, the fallback of mixed steps). The
attention is the ``triton`` kernel, run by Triton's interpreter in a child
process that sets ``TRITON_INTERPRET=1`` before Triton is imported. The CUDA
capture itself is checked by ``benches/gpu_check_tests.py`` on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from ec_frontend.engine.cuda_graphs import DecodeGraphs, GraphPlan, capture_sizes, eager_capture
from ec_frontend.model.interface import AttentionMetadata, KVCacheSpec, VisionLanguageModel
from ec_frontend.model.paged_attention import write_kv

from ..helpers.triton_interpreter import run_interpreted


class SlotWriter(VisionLanguageModel):
    """A one-layer "model" whose forward writes each token's embedding as its K and V
    at its slot and returns ``embedding * seq_len``: what a step writes and reads
    is visible in the cache and the output."""

    image_token_id = 0
    vocab_size = 8
    hidden_size = 4
    device = torch.device("cpu")
    dtype = torch.float32

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)

    def decode_graphs_supported(self) -> bool:
        return True

    def encode_images(self, pixel_values: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        kv = inputs_embeds[:, None, :]
        write_kv(kv_caches[0], kv, kv, attn_metadata.slot_mapping)
        return inputs_embeds * attn_metadata.seq_lens[:, None]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def _decode_meta(slots: list[int], seq_lens: list[int], block_size: int) -> AttentionMetadata:
    n = len(slots)
    return AttentionMetadata(
        query_start_loc=torch.arange(n + 1),
        seq_lens=torch.tensor(seq_lens),
        query_lens=torch.ones(n, dtype=torch.int64),
        block_tables=torch.tensor([[s // block_size] for s in slots]),
        slot_mapping=torch.tensor(slots),
        block_size=block_size,
        seq_lens_cpu=seq_lens,
        query_lens_cpu=[1] * n,
    )


def test_padding_rows_write_only_the_scratch_block() -> None:
    """A step of 5 decodes, then one of 3 (replayed at the captured size 4): the second
    writes its 3 slots and the scratch block, nothing the first step's fourth row
    held (its block may belong to another request by then)."""
    model, bs, scratch = SlotWriter(), 4, 8
    kv = [torch.zeros(2, scratch + 1, bs, 1, 4)]
    graphs = DecodeGraphs(
        model, kv, block_size=bs, plan=GraphPlan(6, 32, capture=eager_capture),
        scratch_block=scratch,
    )  # fmt: skip
    graphs.capture()
    kv[0].zero_()
    first = _decode_meta([1, 5, 9, 13, 17], [2, 2, 2, 2, 2], bs)
    assert graphs.padded_size(first) == 6
    embeds = torch.arange(20, dtype=torch.float32).view(5, 4) + 1
    out = graphs.run(embeds, torch.zeros(3, 5, dtype=torch.int64), first, 6)
    torch.testing.assert_close(out, embeds * 2)
    # The fourth request finished; its block now holds another request's prefill.
    kv[0][:, 3] = 100.0
    before = kv[0].clone()
    second = _decode_meta([2, 6, 10], [3, 3, 3], bs)
    assert graphs.padded_size(second) == 4
    embeds = -torch.arange(12, dtype=torch.float32).view(3, 4) - 1
    out = graphs.run(embeds, torch.zeros(3, 3, dtype=torch.int64), second, 4)
    torch.testing.assert_close(out, embeds * 3)
    changed = (kv[0] != before).flatten(3).any(-1).any(0)  # [blocks, positions]
    assert changed.nonzero().tolist() == [[0, 2], [1, 2], [2, 2], [scratch, 0]]
    assert graphs.replays == 2


def test_steps_that_cannot_replay_run_eagerly() -> None:
    model, bs = SlotWriter(), 4
    kv = [torch.zeros(2, 9, bs, 1, 4)]
    graphs = DecodeGraphs(
        model, kv, block_size=bs, plan=GraphPlan(6, 32, capture=eager_capture), scratch_block=8
    )
    assert graphs.padded_size(_decode_meta([1], [2], bs)) is None  # nothing captured yet
    graphs.capture()
    assert graphs.padded_size(_decode_meta([1], [2], bs)) == 1
    assert graphs.padded_size(_decode_meta(list(range(7)), [2] * 7, bs)) is None
    mixed = _decode_meta([1, 2], [2, 3], bs)
    mixed.query_lens_cpu = [1, 2]
    assert graphs.padded_size(mixed) is None
    wide = _decode_meta([1], [2], bs)
    wide.block_tables = torch.zeros(1, 9, dtype=torch.int64)  # wider than 32 tokens / 4
    assert graphs.padded_size(wide) is None


def test_a_failed_capture_leaves_every_step_eager(caplog: pytest.LogCaptureFixture) -> None:
    from ec_frontend.connectors.base import ECConnectorRole
    from ec_frontend.connectors.noop import NoOpECConnector
    from ec_frontend.engine.model_runner import ModelRunner

    def failing(fn: Any) -> Any:
        raise RuntimeError("operation not permitted when stream is capturing")

    def runner(plan: GraphPlan | None) -> ModelRunner:
        return ModelRunner(
            SlotWriter(), ec_connector=NoOpECConnector(None, ECConnectorRole.WORKER),
            num_kv_blocks=8, block_size=4, graph_plan=plan,
        )  # fmt: skip

    assert runner(None).decode_graphs is None
    assert runner(None).kv_caches[0].shape[1] == 8
    captured = runner(GraphPlan(4, 32, capture=eager_capture))
    assert captured.decode_graphs is not None and captured.kv_caches[0].shape[1] == 9
    with caplog.at_level("WARNING"):
        failed = runner(GraphPlan(4, 32, capture=failing))
    assert failed.decode_graphs is None
    assert "capturing decode graphs failed (RuntimeError: operation not permitted" in caplog.text


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


def run_schedule(graphed: bool, checkpoint: str | None = None) -> dict[str, Any]:
    """Ten requests (text and images, greedy and seeded sampling) arriving one per
    step into an engine of six sequences and a KV cache too small for all of them
    (preemptions), one aborted mid-way; the tokens of each, and what ran.
    ``checkpoint``: a directory, else the built-in model (Qwen2-VL)."""
    import torch
    from ec_frontend.config import CacheConfig, EngineConfig, SchedulerConfig
    from ec_frontend.engine.core import EngineCore
    from ec_frontend.engine.cuda_graphs import GraphPlan, eager_capture
    from ec_frontend.engine.sampling_params import SamplingParams
    from ec_frontend.model.builtin import ensure_builtin_checkpoint
    from ec_frontend.model.loader import load_model, load_processor

    from tests.engine.conftest import chat_inputs, image_media

    torch.manual_seed(0)
    path = Path(checkpoint) if checkpoint else ensure_builtin_checkpoint()
    model = load_model(path, device="cpu", dtype="float32", attention_backend="triton")
    processor = load_processor(path)
    sched = SchedulerConfig(max_num_seqs=6, max_model_len=128, max_num_batched_tokens=96)

    class GraphedCore(EngineCore):
        def _graph_plan(self, model: Any) -> GraphPlan | None:
            return GraphPlan(sched.max_num_seqs, sched.max_model_len, capture=eager_capture)

    config = EngineConfig(scheduler=sched, cache=CacheConfig(num_kv_blocks=14))
    core = (GraphedCore if graphed else EngineCore)(
        config, model, tokenizer=processor.tokenizer, eos_token_id=processor.eos_token_id
    )
    graphs = core.runner.decode_graphs
    runs: list[list[int]] = []
    if graphs is not None:
        inner = graphs.run

        def run(embeds: Any, positions: Any, meta: Any, size: int) -> Any:
            runs.append([meta.num_requests, size])
            return inner(embeds, positions, meta, size)

        graphs.run = run  # type: ignore[method-assign]
    pending = []
    for i in range(10):
        images = [image_media(40 + i)] if i % 3 == 0 else []
        inputs = chat_inputs(processor, "tell me a story " * (1 + i % 3), images)
        if i == 4:
            params = SamplingParams(max_tokens=30, temperature=0.8, seed=7, ignore_eos=True)
        else:
            params = SamplingParams(max_tokens=16 + 2 * i, temperature=0.0, ignore_eos=True)
        pending.append((f"r{i}", inputs, params))
    tokens: dict[str, list[int]] = {}
    step = 0
    while pending or core.has_work():
        if pending:
            core.add_request(*pending.pop(0))
        if step == 14:
            core.abort("r2")
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        step += 1
    stats = core.stats()
    return {
        "tokens": tokens,
        "graph_replays": stats.lm_graph_replays_total,
        "forward_calls": stats.lm_forward_calls_total,
        "preemptions": stats.preemptions_total,
        "runs": runs,
        "sizes": graphs.sizes if graphs is not None else [],
        "physical_blocks": core.runner.kv_caches[0].shape[1],
        "blocks_used": core.kv_cache.num_used_blocks if core.kv_cache is not None else -1,
    }


#: The Qwen3-VL decoder of the schedule: the families' tiny one (q/k norms, its own
#: head_dim, DeepStack rows added after layers 0 and 1) with 2 layers and one KV
#: head, so that Triton's interpreter runs a third of the decode programs.
QWEN3_TEXT = {"num_hidden_layers": 2, "num_key_value_heads": 1}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_graphed_decode_steps_give_the_eager_tokens(family: str, tmp_path: Path) -> None:
    """On the built-in Qwen2-VL model, and on a tiny Qwen3-VL checkpoint written by
    transformers (its own decoder: q/k norms, DeepStack rows in the input)."""
    checkpoint = ""
    if family == "qwen3_vl":
        from ..families.conftest import TINY_QWEN3_TEXT, write_qwen3_vl

        text = {**TINY_QWEN3_TEXT, **QWEN3_TEXT}
        checkpoint = str(write_qwen3_vl(tmp_path / "qwen3-vl", text=text))
    code = (
        "import json, sys\n"
        "from tests.engine.test_decode_graphs import run_schedule\n"
        "path = sys.argv[1] if len(sys.argv) > 1 else None\n"
        "print(json.dumps({'eager': run_schedule(False, path), "
        "'graphed': run_schedule(True, path)}))\n"
    )
    result = json.loads(run_interpreted(code, args=[checkpoint]).strip().splitlines()[-1])
    eager, graphed = result["eager"], result["graphed"]
    assert graphed["tokens"] == eager["tokens"]
    assert set(eager["tokens"]) == {f"r{i}" for i in range(10)}
    assert len(eager["tokens"]["r2"]) < 20  # aborted
    assert eager["graph_replays"] == 0 and eager["physical_blocks"] == 14
    # The scratch block is one past the scheduler's 14; none is held at the end.
    assert graphed["physical_blocks"] == 15 and graphed["blocks_used"] == 0
    assert graphed["preemptions"] > 0 and eager["preemptions"] == graphed["preemptions"]
    assert graphed["sizes"] == [1, 2, 4, 6]
    runs = graphed["runs"]
    assert graphed["graph_replays"] == len(runs) > 10
    # Mixed steps (prefills) ran eagerly; decode steps of every size were replayed,
    # padded where their size was not captured.
    assert graphed["forward_calls"] == eager["forward_calls"] > len(runs)
    assert {n for n, _ in runs} >= {1, 3, 5}
    assert any(size > n for n, size in runs)
    assert all(size == min(s for s in graphed["sizes"] if s >= n) for n, size in runs)
