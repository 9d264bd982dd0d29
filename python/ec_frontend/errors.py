"""Errors that every layer shares (the lowest floor, with :mod:`ec_frontend.config`).

* :class:`ConfigError`: a configuration that cannot work, raised while settings are
  validated (flags, transfer configs, connector settings); ``param`` names the field.
* :class:`StartupError`: the server or its engine cannot start as configured (an
  unloadable model, an engine process that died while starting).

Errors a client causes are the HTTP layer's (``entrypoints/http/errors.py``).
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


__all__ = ["ConfigError", "StartupError"]
