"""Random JSON schemas whose valid documents are short (every string, array and
number is bounded), so that a constrained random model finishes within its budget.

A random model, constrained, happily writes ``0.6666666...`` until ``max_tokens``
when a number's fraction is unbounded: valid JSON up to the cut, reported as
``finish_reason: length``. The numbers here carry ``multipleOf`` for that reason.
"""

from __future__ import annotations

import random
import string
from typing import Any

PATTERNS = ("^[a-z]{1,6}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$", "^[A-Z][a-z]{0,4}$")


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 6)))


def _scalar(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(("string", "pattern", "integer", "number", "boolean", "enum", "null"))
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 8)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "integer":
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        # ``multipleOf`` bounds the fraction digits (0.5 and 0.25 are exact in binary,
        # so a validator's float division agrees).
        return {
            "type": "number",
            "minimum": lo,
            "maximum": lo + rng.randint(1, 50),
            "multipleOf": rng.choice((0.5, 0.25)),
        }
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        values: list[Any] = [_name(rng) for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.5:
            values.append(rng.randint(0, 9))
        return {"enum": values}
    return {"type": "null"}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object at the top; objects, arrays, enums, patterns and ranges inside."""
    roll = rng.random()
    if depth == 0 or (depth < 3 and roll < 0.3):
        names = list(dict.fromkeys(_name(rng) for _ in range(rng.randint(1, 4))))
        props = {n: random_schema(rng, depth + 1) for n in names}
        required = [n for n in names if rng.random() < 0.7]
        return {
            "type": "object",
            "properties": props,
            "required": required,
            "additionalProperties": False,
        }
    if depth < 3 and roll < 0.5:
        lo = rng.randint(0, 2)
        return {
            "type": "array",
            "items": random_schema(rng, depth + 1),
            "minItems": lo,
            "maxItems": lo + rng.randint(0, 2),
        }
    return _scalar(rng)
