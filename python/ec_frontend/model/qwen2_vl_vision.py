"""Qwen2-VL's vision transformer, without ``transformers``' modeling code.

The tower turns a request's patches (``[patches, C * T * P * P]``, as the image
and video processors flatten them) and their grids into merged token rows
(``[patches / merge**2, hidden_size]``): a 3-D patch convolution, blocks of
LayerNorm + attention with a 2-D rotary embedding + MLP, each frame attending
only to itself, then a merger that folds each ``merge x merge`` square of
patches into one row.

Why not ``transformers``' ``Qwen2VisionTransformerPretrainedModel``: importing
it imports ``transformers``' modeling stack and ``torch._dynamo``, about 1.4
CPU-seconds of every engine start for a tower of a few dozen lines. The module
names and parameter names are the same as ``transformers``' (``blocks.0.attn.qkv``,
``merger.mlp.0``, ...), so checkpoints load unchanged, and every step runs the
same torch operations in the same order, so the outputs are equal to the last
bit (``tests/model/test_qwen2_vl_vision.py`` compares them).

:func:`build_vision` builds this tower for every config it covers; a config
with a setting it does not implement (another activation, a non-axial rotary
embedding, non-square patches) gets ``transformers``' tower, as before.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from transformers import PretrainedConfig

#: The transformers tower this one stands in for (and falls back to).
TRANSFORMERS_TOWER = (
    "transformers.models.qwen2_vl.modeling_qwen2_vl:Qwen2VisionTransformerPretrainedModel"
)
_LAYER_NORM_EPS = 1e-6


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: The MLP activations of the tower, by the config's ``hidden_act`` name.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "silu": F.silu,
}


class _Activation(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.fn = ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class PatchEmbed(nn.Module):
    """Each ``C x T x P x P`` patch to one ``embed_dim`` vector (a strided Conv3d)."""

    def __init__(self, patch: int, temporal: int, channels: int, embed_dim: int) -> None:
        super().__init__()
        self.shape = (-1, channels, temporal, patch, patch)
        self.embed_dim = embed_dim
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(channels, embed_dim, kernel_size=kernel, stride=kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = patches.view(self.shape).to(dtype=self.proj.weight.dtype)
        out: torch.Tensor = self.proj(x).view(-1, self.embed_dim)
        return out


class RotaryEmbedding(nn.Module):
    """Axial 2-D rotary angles: the same frequencies for the row and the column."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        half = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: ``[N, 2]`` (row, column) -> ``(cos, sin)``, each ``[N, head_dim]``."""
        inv_freq = self.get_buffer("inv_freq")
        angles = positions[..., None].float() * inv_freq.to(positions.device, torch.float)
        return _spread(angles.cos()), _spread(angles.sin())


def _spread(per_axis: torch.Tensor) -> torch.Tensor:
    """``[N, 2, d]`` -> ``[N, 4d]``: row angles, column angles, both again."""
    rows_cols = torch.cat([per_axis[:, 0], per_axis[:, 1]], dim=-1)
    return torch.cat([rows_cols, rows_cols], dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[N, heads, head_dim]``, rotated in float32 and cast back."""
    xf = x.float()
    return ((xf * cos) + (_rotate_half(xf) * sin)).to(x.dtype)


class Attention(nn.Module):
    """Multi-head self-attention within each segment of ``lengths`` (one per frame)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(
        self, x: torch.Tensor, lengths: list[int], rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, -1).permute(1, 0, 2, 3).unbind(0)
        cos, sin = (r.unsqueeze(-2).float() for r in rope)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # [1, heads, N, head_dim], split into the segments along N.
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        outs = [
            F.scaled_dot_product_attention(qs, ks, vs, dropout_p=0.0, scale=self.scale)
            .transpose(1, 2)
            .contiguous()
            for qs, ks, vs in zip(
                q.split(lengths, dim=2),
                k.split(lengths, dim=2),
                v.split(lengths, dim=2),
                strict=True,
            )
        ]
        out: torch.Tensor = self.proj(torch.cat(outs, dim=1).reshape(n, -1).contiguous())
        return out


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = _Activation(act)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(self.act(self.fc1(x)))
        return out


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_hidden: int, act: str) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.attn = Attention(dim, heads)
        self.mlp = Mlp(dim, mlp_hidden, act)

    def forward(
        self, x: torch.Tensor, lengths: list[int], rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, rope)
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class PatchMerger(nn.Module):
    """LayerNorm, then each ``merge x merge`` square of patches (adjacent rows) to one row."""

    def __init__(self, out_dim: int, dim: int, merge: int) -> None:
        super().__init__()
        self.width = dim * merge**2
        self.ln_q = nn.LayerNorm(dim, eps=_LAYER_NORM_EPS)
        self.mlp = nn.Sequential(
            nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(self.ln_q(x).view(-1, self.width))
        return out


class Qwen2VisionTower(nn.Module):
    """The tower of one Qwen2-VL ``vision_config``; see the module docstring."""

    def __init__(self, vision_config: PretrainedConfig) -> None:
        super().__init__()
        cfg = vision_config
        #: Read by the engine's memory profile (patch and merge sizes), as on transformers'.
        self.config = vision_config
        dim, heads = int(cfg.embed_dim), int(cfg.num_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or dim // heads)
        self.merge = int(cfg.spatial_merge_size)
        self.patch_embed = PatchEmbed(
            int(cfg.patch_size), int(cfg.temporal_patch_size), int(cfg.in_channels), dim
        )
        self.rotary_pos_emb = RotaryEmbedding(head_dim, _rope_theta(cfg))
        mlp_hidden = int(dim * cfg.mlp_ratio)
        self.blocks = nn.ModuleList(
            Block(dim, heads, mlp_hidden, str(cfg.hidden_act)) for _ in range(int(cfg.depth))
        )
        self.merger = PatchMerger(int(cfg.hidden_size), dim, self.merge)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Patches ``[patches, C*T*P*P]`` of the items in ``grid_thw`` (``[items, 3]``) ->
        merged rows ``[patches / merge**2, hidden_size]``."""
        grids: list[list[int]] = grid_thw.tolist()
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        x = self.patch_embed(pixel_values)
        rope = self.rotary_pos_emb(self._positions(grids, x.device))
        for block in self.blocks:
            x = block(x, lengths, rope)
        merged: torch.Tensor = self.merger(x)
        return merged

    def _positions(self, grids: list[list[int]], device: torch.device) -> torch.Tensor:
        """``[patches, 2]`` (row, column) of every patch, in the processor's order: each
        ``merge x merge`` square's patches together, squares row by row, frame by frame."""
        m = self.merge
        out = []
        for t, h, w in grids:
            rows, cols = torch.meshgrid(
                torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij"
            )
            blocks = (h // m, m, w // m, m)
            rows = rows.reshape(blocks).transpose(1, 2).flatten()
            cols = cols.reshape(blocks).transpose(1, 2).flatten()
            out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
        return torch.cat(out, dim=0)


def _rope_theta(vision_config: PretrainedConfig) -> float:
    rope = getattr(vision_config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", 10_000.0))


def covers(vision_config: PretrainedConfig) -> bool:
    """Whether :class:`Qwen2VisionTower` implements every setting of the config."""
    rope = getattr(vision_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "axial"))
    return (
        getattr(vision_config, "hidden_act", None) in ACTIVATIONS
        and rope_type == "axial"
        and all(
            isinstance(getattr(vision_config, name, None), int)
            for name in ("patch_size", "temporal_patch_size", "in_channels", "spatial_merge_size")
        )
    )


def build_vision(config: PretrainedConfig) -> nn.Module:
    """The vision tower of a Qwen2-VL checkpoint config (float32 buffers): ours when it
    :func:`covers` the config, else ``transformers``' own class."""
    vision_config = config.vision_config
    if covers(vision_config):
        return Qwen2VisionTower(vision_config)
    module, _, name = TRANSFORMERS_TOWER.partition(":")
    tower_class: Any = getattr(importlib.import_module(module), name)
    tower: nn.Module = tower_class._from_config(vision_config, dtype=torch.float32)
    return tower
