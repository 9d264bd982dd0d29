"""Which media items a prompt chunk needs this step, and where each comes from.

For every item overlapping a chunk, in the order of DESIGN 3: a hit in the
encoder cache (the request references it; nothing to compute), else on an EC
consumer an item the connector can load, else a local encode within the
encoder compute budget. Planning has no effect beyond referencing hits (and
evicting unreferenced entries to make room); :meth:`EncoderInputPlanner.commit`
reserves the space once the scheduler has admitted the chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ec_frontend.connectors.base import ECConnectorBase
    from ec_frontend.engine.encoder_cache import EncoderCacheManager
    from ec_frontend.engine.request import Request
    from ec_frontend.model.processor import MultiModalFeature


def decode_deferred_image(feature: MultiModalFeature) -> bool:
    """Pixels for an image the processor deferred (it expected a cache hit)."""
    if getattr(feature, "deferred", None) is None:
        return False
    from ec_frontend.model.native_preprocess import decode_deferred

    return decode_deferred(feature)


def no_source(feature: MultiModalFeature) -> str:
    """Why a media item with no pixel values cannot be encoded here."""
    if getattr(feature, "deferred", None) is not None:
        return f"media item {feature.mm_hash} could not be decoded again for its encoder"
    return (
        f"media reference {feature.mm_hash} is neither cached nor loadable here, and the "
        "request carries no image to encode"
    )


@dataclass(slots=True)
class EncoderPlan:
    """Feature indices to ``encode`` and to ``load``; the (possibly shortened) chunk
    length; the encoder budget left; an ``error`` for an item with no source; the
    number of cache ``hits`` the request gained, and the items an encoder found
    ``stored`` by another instance (not computed again)."""

    encode: list[int]
    load: list[int]
    num_new_tokens: int
    encoder_budget: int
    error: str | None = None
    hits: int = 0
    stored: list[str] = field(default_factory=list)


class EncoderInputPlanner:
    """Plans and commits media items for the scheduler (bookkeeping only)."""

    def __init__(
        self,
        encoder_cache: EncoderCacheManager,
        ec_connector: ECConnectorBase | None,
        full_budget: int,
        *,
        encoder_only: bool = False,
    ) -> None:
        self.encoder_cache = encoder_cache
        self.ec_connector = ec_connector
        self.full_budget = full_budget
        #: An encoder-only producer on a shared store skips items already in it: the
        #: consumers load them from there, whichever encoder computed them.
        self.skip_stored = (
            encoder_only
            and ec_connector is not None
            and ec_connector.shares_outputs
            and ec_connector.is_producer
            and not ec_connector.is_consumer
        )

    def plan(self, request: Request, start: int, num_new: int, encoder_budget: int) -> EncoderPlan:
        """Which items the chunk ``[start, start + num_new)`` needs, and from where.

        May shorten the chunk to stop before an item that does not fit this step.
        Has no effect other than referencing encoder-cache hits (and evicting
        unreferenced entries to make room).
        """
        if not request.mm_features:
            return EncoderPlan([], [], max(0, num_new), encoder_budget)
        encode: list[int] = []
        load: list[int] = []
        seen: set[str] = set()
        rows = 0
        hits = 0
        stored: list[str] = []
        end = start + num_new
        ec_connector = self.ec_connector
        consumer = ec_connector is not None and ec_connector.is_consumer
        for i, feature in enumerate(request.mm_features):
            if feature.offset >= end:
                break
            if feature.offset + feature.length <= start:
                continue
            if feature.mm_hash in seen or self.encoder_cache.has_ref(request, i):
                continue
            if self.encoder_cache.check_and_update_cache(request, i):
                hits += 1
                continue
            if (
                self.skip_stored
                and ec_connector is not None
                and ec_connector.has_cache_item(feature.mm_hash, request)
            ):
                stored.append(feature.mm_hash)
                seen.add(feature.mm_hash)
                continue
            loadable = (
                consumer
                and ec_connector is not None
                and ec_connector.has_cache_item(feature.mm_hash, request)
            )
            # An item larger than the whole budget runs alone rather than never.
            fits_budget = (
                loadable or feature.length <= encoder_budget or encoder_budget == self.full_budget
            )
            if not fits_budget or not self.encoder_cache.can_allocate(rows + feature.length):
                num_new = feature.offset - start
                break
            if loadable:
                load.append(i)
            elif feature.pixel_values is None and not decode_deferred_image(feature):
                return EncoderPlan([], [], 0, encoder_budget, no_source(feature))
            else:
                encode.append(i)
                encoder_budget -= feature.length
            seen.add(feature.mm_hash)
            rows += feature.length
        return EncoderPlan(encode, load, max(0, num_new), encoder_budget, hits=hits, stored=stored)

    def commit(self, request: Request, plan: EncoderPlan) -> None:
        """Reserve cache space for the plan's items; announce loads to the connector."""
        for i in plan.encode:
            self.encoder_cache.allocate(request, i)
        for i in plan.load:
            self.encoder_cache.allocate(request, i)
            if self.ec_connector is not None:
                self.ec_connector.update_state_after_alloc(request, i)
