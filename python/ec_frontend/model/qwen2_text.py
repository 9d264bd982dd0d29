"""The Qwen2-VL language model on the paged KV cache.

Qwen2 decoder layers (RMSNorm, attention with q/k/v bias and grouped KV heads,
M-RoPE, SwiGLU MLP) over the flattened tokens of a whole step: every linear
layer runs once over all ``T`` tokens, attention goes through
:mod:`ec_frontend.model.paged_attention`. Parameter names match the
``model.language_model.*`` names of ``transformers`` (without that prefix).

The q/k/v projections run as one matrix product, and so do the MLP's gate and
up projections: on first use their weights are moved into one tensor that the
separate parameters then view (:class:`FusedLinears`), so names, state dicts and
memory stay those of the separate layers. Q and K are rotated together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ec_frontend.model.errors import ModelLoadError
from ec_frontend.model.interface import AttentionMetadata
from ec_frontend.model.paged_attention import (
    PagedLayout,
    build_layout,
    paged_attention,
    write_kv,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

Rope = tuple[torch.Tensor, torch.Tensor]


class TextShape(Protocol):
    """What the decoder and the loaded model read of a language model's shape:
    :class:`TextModelConfig`, or a family's own (Qwen3-VL's adds DeepStack)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def mrope_section(self) -> tuple[int, int, int]: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def attention_bias(self) -> bool: ...
    def validate(self) -> None:
        """Raise ``ValueError`` for a shape the decoder cannot run."""


@dataclass(frozen=True, slots=True)
class TextModelConfig:
    """Shape of the language model, read from a checkpoint's ``text_config``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    tie_word_embeddings: bool
    #: q/k/v projections with a bias (Qwen2); Llama has none.
    attention_bias: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def validate(self) -> None:
        """Raise ``ValueError`` for a shape this implementation cannot run."""
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if sum(self.mrope_section) * 2 != self.head_dim:
            raise ValueError(
                f"mrope_section {list(self.mrope_section)} must sum to head_dim / 2 "
                f"= {self.head_dim // 2}"
            )


def qwen2_text_config(config: PretrainedConfig) -> TextModelConfig:
    """The language-model shape of a Qwen2-VL style checkpoint config (its
    ``text_config``: a Qwen2 decoder with M-RoPE); :class:`ModelLoadError` for a
    shape this decoder does not run."""
    text = config.text_config
    rope = text.rope_parameters or {}
    section = tuple(rope.get("mrope_section") or ())
    if len(section) != 3:
        raise ModelLoadError(f"config has no 3-part mrope_section (got {list(section)})")
    if getattr(text, "use_sliding_window", False):
        raise ModelLoadError("sliding-window attention is not supported")
    return decoder_config(
        config,
        rope_theta=float(rope.get("rope_theta", 1_000_000.0)),
        mrope_section=(int(section[0]), int(section[1]), int(section[2])),
        attention_bias=True,
    )


def decoder_config(
    config: PretrainedConfig,
    *,
    rope_theta: float,
    mrope_section: tuple[int, int, int],
    attention_bias: bool,
) -> TextModelConfig:
    """The shape of ``config.text_config`` (a SwiGLU decoder) with the family's rotary
    settings; :class:`ModelLoadError` for another activation."""
    text = config.text_config
    if text.hidden_act != "silu":
        raise ModelLoadError(f"unsupported hidden_act {text.hidden_act!r} (expected 'silu')")
    return TextModelConfig(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_layers=text.num_hidden_layers,
        num_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads or text.num_attention_heads,
        rms_norm_eps=text.rms_norm_eps,
        rope_theta=rope_theta,
        mrope_section=mrope_section,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=attention_bias,
    )


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class MRotaryEmbedding(nn.Module):
    """Multimodal RoPE: the rotary frequencies are split into temporal, height and
    width sections, each rotated by its own row of the ``[3, T]`` positions.

    The frequencies stay float32 whatever dtype the model is cast to.
    """

    def __init__(self, head_dim: int, theta: float, section: tuple[int, int, int]) -> None:
        super().__init__()
        self.inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        )
        self.component = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """``[3, T]`` positions -> ``(cos, sin)``, each ``[T, head_dim]`` in ``dtype``."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
            self.component = self.component.to(positions.device)
        freqs = positions.float()[..., None] * self.inv_freq  # [3, T, head_dim / 2]
        index = self.component.view(1, 1, -1).expand(1, freqs.shape[1], -1)
        freqs = freqs.gather(0, index)[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def signed(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """``(cos, signed_sin)``: :meth:`forward`'s pair with the first half of ``sin``
        negated, as :func:`_rotate_signed` takes it."""
        cos, sin = self(positions, dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rotate_signed(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`rotate` with the sign of the rotated half folded into ``signed_sin``
    (``[-sin_1, sin_2]``): the same values, one negation fewer per call."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


class FusedLinears:
    """Several linear layers over the same input as one matrix product.

    The layers' weights (and biases) are concatenated once into one tensor and
    each parameter's data becomes a view of its rows, so the parameters keep
    their names and values and no memory is doubled. If a parameter is later
    given new storage (``.to()``, a reassigned ``.data``), the next call fuses
    again.
    """

    def __init__(self, *layers: nn.Linear) -> None:
        self.layers = layers
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def _fused(self) -> bool:
        weight = self.weight
        if weight is None or weight.device != self.layers[0].weight.device:
            return False
        row = 0
        for layer in self.layers:
            rows = layer.weight.shape[0]
            if layer.weight.data_ptr() != weight[row].data_ptr():
                return False
            if self.bias is not None and layer.bias.data_ptr() != self.bias[row].data_ptr():
                return False
            row += rows
        return True

    def _fuse(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.no_grad():
            weight = torch.cat([layer.weight for layer in self.layers])
            has_bias = all(layer.bias is not None for layer in self.layers)
            bias = torch.cat([layer.bias for layer in self.layers]) if has_bias else None
            row = 0
            for layer in self.layers:
                rows = layer.weight.shape[0]
                layer.weight.data = weight[row : row + rows]
                if bias is not None:
                    layer.bias.data = bias[row : row + rows]
                row += rows
        self.weight, self.bias = weight, bias
        return weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if weight is None or not self._fused():
            weight, bias = self._fuse()
        if bias is None and any(layer.bias is not None for layer in self.layers):
            return torch.cat([layer(x) for layer in self.layers], dim=-1)
        return F.linear(x, weight, bias)


class Attention(nn.Module):
    def __init__(self, cfg: TextShape) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)
        self.scale = d**-0.5
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        layout: PagedLayout,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """``rope`` is ``(cos, signed_sin)`` from :meth:`MRotaryEmbedding.signed`."""
        n = x.shape[0]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).view(n, heads + 2 * kv_heads, self.head_dim)
        qk = _rotate_signed(qkv[:, : heads + kv_heads], rope[0][:, None, :], rope[1][:, None, :])
        q, k = qk[:, :heads], qk[:, heads:]
        v = qkv[:, heads + kv_heads :]
        write_kv(kv_cache, k, v, slots)
        out = paged_attention(q, k, v, kv_cache, layout, self.scale)
        projected: torch.Tensor = self.o_proj(out.reshape(n, self.num_heads * self.head_dim))
        return projected


class MLP(nn.Module):
    def __init__(self, cfg: TextShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        size = gate_up.shape[-1] // 2
        down: torch.Tensor = self.down_proj(F.silu(gate_up[..., :size]) * gate_up[..., size:])
        return down


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextShape, attention: type[nn.Module] = Attention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        h: torch.Tensor,
        rope: Rope,
        kv_cache: torch.Tensor,
        layout: PagedLayout,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), rope, kv_cache, layout, slots)
        out: torch.Tensor = h + self.mlp(self.post_attention_layernorm(h))
        return out


class Qwen2TextModel(nn.Module):
    """Embeddings, decoder layers, final norm and LM head (tied or not)."""

    #: The decoder layers' attention (a family with another one sets its own).
    attention: type[nn.Module] = Attention

    def __init__(self, cfg: TextShape) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.attention) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = MRotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
        #: One of :data:`~ec_frontend.model.paged_attention.BACKENDS`.
        self.attention_backend = "sdpa"
        self.lm_head = None
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        layout = build_layout(meta, inputs_embeds.device, self.attention_backend)
        slots = meta.slot_mapping.to(inputs_embeds.device)
        rope = self.rotary.signed(positions.to(inputs_embeds.device), inputs_embeds.dtype)
        h = inputs_embeds
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer(h, rope, kv_cache, layout, slots)
        normed: torch.Tensor = self.norm(h)
        return normed

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden_states.to(weight.dtype), weight).float()
