"""Types that every floor shares: JSON values as they cross a wire or a request body.

``JSONValue`` is what ``orjson.loads`` / ``msgspec`` can give back for a JSON text,
recursively; containers are read-only views (``Sequence``, ``Mapping``), so a
``list[int]`` or a ``dict[str, str]`` is one without a copy. Code that builds a JSON
object mutably uses ``JSONDict``; code that reads one takes ``JSONObject`` and narrows
each value it uses with ``isinstance``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias

__all__ = ["JSONDict", "JSONObject", "JSONValue"]

JSONValue: TypeAlias = (
    "str | int | float | bool | Sequence[JSONValue] | Mapping[str, JSONValue] | None"
)
#: A JSON object to read (a request's transfer params, a peer's header).
JSONObject: TypeAlias = Mapping[str, JSONValue]
#: A JSON object being built.
JSONDict: TypeAlias = dict[str, JSONValue]
