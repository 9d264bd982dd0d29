"""The contract between the model runner and a vision-language model.

The runner owns scheduling state and the KV cache tensors; a model owns
weights and math. Everything a forward pass needs about the batch travels in
:class:`AttentionMetadata`, so a model never sees requests.

Shapes use ``T`` for the number of tokens scheduled in a step (all requests,
prefill chunks and decodes flattened together) and ``B`` for the number of
requests in the step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """What one KV cache block holds; the runner sizes the cache from it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block across all layers (K and V)."""
        elem = self.dtype.itemsize
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem


@dataclass(slots=True)
class AttentionMetadata:
    """The batch layout of one forward pass.

    Tokens of request ``i`` occupy rows ``query_start_loc[i]:query_start_loc[i+1]``
    of the flattened inputs. Request ``i`` has ``seq_lens[i]`` tokens in context
    after this step (cached plus new); its new tokens are the last
    ``query_lens[i]`` of them. ``block_tables[i]`` lists its KV blocks in order
    (padded with 0 past its last block). ``slot_mapping[t]`` is where token ``t``
    writes its K and V: ``block_id * block_size + offset``.
    """

    query_start_loc: torch.Tensor  # [B + 1] int64, on the model's device
    seq_lens: torch.Tensor  # [B] int64
    query_lens: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, max_blocks] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_size: int
    # Host copies of the small per-request vectors, to avoid device syncs.
    seq_lens_cpu: list[int]
    query_lens_cpu: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_cpu)


class VisionLanguageModel(ABC):
    """A model the runner can drive. Implementations stay stateless per step."""

    #: Token id of the image placeholder in prompts.
    image_token_id: int
    vocab_size: int
    hidden_size: int
    device: torch.device
    dtype: torch.dtype

    @property
    def encoder_output_size(self) -> int:
        """Columns of one encoder output row: what :meth:`encode_images` returns per
        placeholder token, what the EC connectors carry, and the width of
        :meth:`embed_tokens` and of ``forward``'s input. ``hidden_size`` unless the
        family feeds more per image token to the decoder (Qwen3-VL's DeepStack
        features ride in the same row, after the input embedding)."""
        return self.hidden_size

    @abstractmethod
    def kv_cache_spec(self) -> KVCacheSpec:
        """Layout of the KV cache this model reads and writes."""

    @abstractmethod
    def encode_images(
        self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor
    ) -> list[torch.Tensor]:
        """Run the vision tower once over a batch of images.

        ``pixel_values`` are the processor's patches of all images concatenated;
        ``image_grid_thw`` is ``[num_images, 3]``. Returns one
        ``[num_placeholder_tokens, encoder_output_size]`` tensor per image, in order.
        """

    @abstractmethod
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, encoder_output_size]`` input embeddings (columns past
        ``hidden_size``, if any, are zero: image rows get theirs from the encoder)."""

    @abstractmethod
    def forward(
        self,
        inputs_embeds: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """One language-model step over the whole batch.

        ``positions`` is ``[3, T]`` (M-RoPE: temporal, height, width; a 1-D RoPE family
        gets three equal rows, see :class:`~ec_frontend.model.registry.PositionSpec`). Each entry of
        ``kv_caches`` (one per layer) is ``[2, num_blocks, block_size, num_kv_heads,
        head_dim]``; the forward writes the new tokens' K and V at ``slot_mapping``
        and attends causally over each request's context. Returns ``[T, hidden_size]``.
        """

    def decode_graphs_supported(self) -> bool:
        """Whether :meth:`forward` over a step whose requests all decode (one new token
        each) may be captured in a CUDA graph and replayed on other inputs written into
        the same tensors: no host synchronisation, and no tensor shape that depends on
        the requests' context lengths (only on their number)."""
        return False

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` float32 logits."""
