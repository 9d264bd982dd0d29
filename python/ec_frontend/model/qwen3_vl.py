"""Qwen3-VL: ``transformers``' Qwen3-VL vision tower and a Qwen3 decoder on the paged KV cache.

The decoder differs from Qwen2's in three ways: q/k/v carry no bias but the
queries and keys are RMS-normalised per head (``q_norm`` / ``k_norm``) before
the rotary embedding; ``head_dim`` is its own config value; and M-RoPE is
interleaved (frequency ``j`` rotates with the height row when ``j % 3 == 1``,
with the width row when ``j % 3 == 2``, inside the sections' bounds; with the
temporal row otherwise). Image positions are Qwen2-VL's. A video is split at
its temporal patches (``Qwen3VLProcessor`` writes each patch's time between
them): each patch is an item of grid ``(1, h, w)``, positioned as an image
(:class:`~ec_frontend.model.video_processor.Qwen3VideoRule`).

DeepStack: the tower also merges the hidden states of a few of its blocks
(``vision_config.deepstack_visual_indexes``) into extra per-token features, and
the decoder adds feature ``i`` to the image tokens' hidden states after its
layer ``i``. An item's encoder output therefore carries, per placeholder token,
the input embedding followed by the ``k`` DeepStack features:
``[tokens, hidden_size * (1 + k)]`` (:attr:`Qwen3VLModel.encoder_output_size`).
That one tensor is what the encoder cache holds and the EC connectors move, so
an encoder instance hands a consumer everything the decoder needs. Text
tokens' embeddings carry zeros in those columns, which leaves their hidden
states as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ec_frontend.model.errors import ModelLoadError
from ec_frontend.model.interface import AttentionMetadata
from ec_frontend.model.paged_attention import PagedLayout, build_layout, paged_attention, write_kv
from ec_frontend.model.qwen2_text import Qwen2TextModel, RMSNorm, rotate
from ec_frontend.model.qwen2_vl import QWEN_VL_WEIGHT_PREFIXES, Qwen2VLModel
from ec_frontend.model.registry import ModelFamily, PositionSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Rope = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class Qwen3TextConfig:
    """Shape of a Qwen3-VL language model, read from the checkpoint's ``text_config``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool
    attention_bias: bool
    #: Decoder layers after which a DeepStack feature is added (the tower's count).
    num_deepstack: int

    def validate(self) -> None:
        """Raise ``ValueError`` for a shape this implementation cannot run."""
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} must sum to head_dim / 2 "
                f"= {self.head_dim // 2}"
            )
        if self.num_deepstack > self.num_layers:
            raise ValueError(
                f"{self.num_deepstack} DeepStack features for {self.num_layers} decoder layers"
            )


def qwen3_text_config(config: PretrainedConfig) -> Qwen3TextConfig:
    """The decoder shape of a Qwen3-VL config; :class:`ModelLoadError` for what it cannot run."""
    text, vision = config.text_config, config.vision_config
    rope = dict(text.rope_parameters or {})
    if rope.get("rope_type", "default") != "default":
        raise ModelLoadError(f"Qwen3-VL: rope_type {rope.get('rope_type')!r} is not supported")
    section = tuple(rope.get("mrope_section") or ())
    if len(section) != 3:
        raise ModelLoadError(f"Qwen3-VL: config has no 3-part mrope_section (got {list(section)})")
    if text.hidden_act != "silu":
        raise ModelLoadError(f"Qwen3-VL: unsupported hidden_act {text.hidden_act!r}")
    if int(vision.out_hidden_size) != int(text.hidden_size):
        raise ModelLoadError(
            f"Qwen3-VL: vision out_hidden_size {vision.out_hidden_size} != text hidden_size "
            f"{text.hidden_size}"
        )
    heads = text.num_attention_heads
    return Qwen3TextConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_layers=text.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=text.num_key_value_heads or heads,
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", 5_000_000.0)),
        mrope_section=(int(section[0]), int(section[1]), int(section[2])),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=bool(getattr(text, "attention_bias", False)),
        num_deepstack=len(vision.deepstack_visual_indexes or ()),
    )


def interleaved_components(section: tuple[int, int, int]) -> torch.Tensor:
    """Which position row (0 temporal, 1 height, 2 width) rotates each of the
    ``sum(section)`` frequencies under interleaved M-RoPE."""
    half = sum(section)
    component = torch.zeros(half, dtype=torch.int64)
    for row in (1, 2):
        component[row : 3 * section[row] : 3] = row
    return component


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3TextConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.scale = d**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        layout: PagedLayout,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        n = x.shape[0]
        cos, sin = rope[0][:, None, :], rope[1][:, None, :]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(n, self.num_kv_heads, self.head_dim))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        write_kv(kv_cache, k, v, slots)
        out = paged_attention(q, k, v, kv_cache, layout, self.scale)
        projected: torch.Tensor = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return projected


class Qwen3TextModel(Qwen2TextModel):
    """Embeddings, decoder layers with DeepStack injection, final norm and LM head.

    :meth:`forward` takes ``[T, hidden_size * (1 + num_deepstack)]`` rows: the input
    embedding, then the DeepStack features added after layers ``0 .. k-1``.
    """

    attention = Qwen3Attention
    cfg: Qwen3TextConfig

    def __init__(self, cfg: Qwen3TextConfig) -> None:
        super().__init__(cfg)
        self.rotary.component = interleaved_components(cfg.mrope_section)

    @property
    def row_size(self) -> int:
        return self.cfg.hidden_size * (1 + self.cfg.num_deepstack)

    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.cfg.hidden_size
        if inputs.shape[-1] != self.row_size:
            raise ValueError(f"inputs have {inputs.shape[-1]} columns, expected {self.row_size}")
        layout = build_layout(meta, inputs.device, self.attention_backend)
        slots = meta.slot_mapping.to(inputs.device)
        rope = self.rotary(positions.to(inputs.device), inputs.dtype)
        deepstack = inputs[:, hidden:].unflatten(-1, (self.cfg.num_deepstack, hidden))
        h = inputs[:, :hidden]
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            h = layer(h, rope, kv_cache, layout, slots)
            if i < self.cfg.num_deepstack:
                h = h + deepstack[:, i]
        normed: torch.Tensor = self.norm(h)
        return normed


class Qwen3VLModel(Qwen2VLModel):
    """A loaded Qwen3-VL checkpoint: its tower's merged tokens and DeepStack features
    travel as one encoder output row per placeholder token."""

    text_config: Qwen3TextConfig

    @property
    def encoder_output_size(self) -> int:
        return self.hidden_size * (1 + self.text_config.num_deepstack)

    def _encoder_rows(self, out: Any) -> torch.Tensor:
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)


def positions(config: PretrainedConfig) -> PositionSpec:
    return PositionSpec("mrope", qwen3_text_config(config).mrope_section, interleaved=True)


FAMILY = ModelFamily(
    name="Qwen3-VL",
    model_types=("qwen3_vl",),
    architectures=("Qwen3VLForConditionalGeneration",),
    vision_tower="transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel",
    weight_prefixes=QWEN_VL_WEIGHT_PREFIXES,
    text_config=qwen3_text_config,
    positions=positions,
    model_class="ec_frontend.model.qwen3_vl:Qwen3VLModel",
    language_model="ec_frontend.model.qwen3_vl:Qwen3TextModel",
    video_rule="ec_frontend.model.video_processor:Qwen3VideoRule",
)
