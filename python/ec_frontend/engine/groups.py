"""Request groups: the engine requests of one client request, for aborts by its id.

A client request (an HTTP request: its ``X-Request-Id``, or a generate request's
``request_id``) becomes one engine request per choice, with ids derived from
its own (``<id>-<k>``, a collision suffix after that). An id alone cannot say
which client request an engine request belongs to (``team-7`` is choice 7 of
``team`` or a request of its own), so the server names the group when it adds
a request and aborts by group: exactly the engine requests of that client
request, whatever their ids.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class RequestGroups(Generic[K]):
    """Which group each request in flight belongs to (requests without one: none).

    ``K`` is whatever names a request where this is kept: an engine request id, or
    ``(client, id)`` in the engine process. Not thread-safe: one owner.
    """

    __slots__ = ("_group_of", "_members")

    def __init__(self) -> None:
        self._members: dict[str, set[K]] = {}
        self._group_of: dict[K, str] = {}

    def add(self, group: str | None, key: K) -> None:
        """``key`` joins ``group`` (``None``: no group)."""
        if group is None:
            return
        self._members.setdefault(group, set()).add(key)
        self._group_of[key] = group

    def discard(self, key: K) -> None:
        """``key`` has ended: it leaves its group."""
        group = self._group_of.pop(key, None)
        if group is None:
            return
        members = self._members[group]
        members.discard(key)
        if not members:
            del self._members[group]

    def members(self, groups: Iterable[str]) -> list[K]:
        """The requests of ``groups`` (exact names; unknown names have none)."""
        found: list[K] = []
        for group in groups:
            found.extend(self._members.get(group, ()))
        return found

    def __len__(self) -> int:
        return len(self._group_of)
