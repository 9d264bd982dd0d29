"""The files a checkpoint directory needs besides its config and weights: a
tokenizer and an image processor config. Each check returns one error line, or
``None``; nothing heavy is imported, so ``ec-frontend serve`` runs them before it
loads anything (``entrypoints/preflight.py``) and the loader again when it loads.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Any one of these is a tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


def tokenizer_problem(directory: Path) -> str | None:
    """``directory`` has none of :data:`TOKENIZER_FILES`."""
    if any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    return f"{directory} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})"


def image_processor_problem(directory: Path) -> str | None:
    """``directory`` has neither ``preprocessor_config.json`` nor a
    ``processor_config.json`` with an ``image_processor`` entry."""
    if (directory / "preprocessor_config.json").is_file():
        return None
    try:
        combined = json.loads((directory / "processor_config.json").read_text(encoding="utf-8"))
        if "image_processor" in combined:
            return None
    except (OSError, ValueError, TypeError):
        pass
    return (
        f"{directory} has no image processor config (preprocessor_config.json, or "
        "processor_config.json with an image_processor entry)"
    )
