"""Errors that every layer shares (the lowest floor, with :mod:`ec_frontend.config`).

* :class:`ConfigError`: a configuration that cannot work, raised while settings are
  validated (flags, transfer configs, connector settings); ``param`` names the field.
* :class:`StartupError`: the server or its engine cannot start as configured (an
  unloadable model, an engine process that died while starting).

Errors a client causes are the HTTP layer's (``entrypoints/http/errors.py``); the
engine marks the one kind it reports by message, a constrained request's grammar
that could not be built or followed, with :data:`GRAMMAR_FAILURE_PREFIX`.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """An engine configuration that cannot work; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class StartupError(RuntimeError):
    """The server or its engine cannot start as configured; the message is one line."""


#: How every engine-side failure of a constrained request's grammar begins (the
#: server answers it as the client's error: 400 ``grammar_error``).
GRAMMAR_FAILURE_PREFIX = "structured output: "


__all__ = ["GRAMMAR_FAILURE_PREFIX", "ConfigError", "StartupError"]
