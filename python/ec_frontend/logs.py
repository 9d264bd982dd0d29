"""One log format for every process: API servers, the engine process and the proxy.

``2026-12-03 14:16:25,332 INFO ec_frontend.server: message``: the time, the level,
the logger and the message. :func:`configure` sets it on the root logger;
:func:`uvicorn_log_config` gives uvicorn the same, so its own lines (startup,
errors) carry a time too.
"""

from __future__ import annotations

import logging
import os
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
#: Seconds between two stats lines (``--disable-log-stats`` turns them off).
STATS_INTERVAL_ENV = "EC_FRONTEND_LOG_STATS_INTERVAL"
DEFAULT_STATS_INTERVAL_S = 10.0


def configure(level: int | str) -> None:
    """The root logger at ``level`` with :data:`LOG_FORMAT`, on stderr."""
    if isinstance(level, str):
        level = level.upper()
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)


def uvicorn_log_config(level: str) -> dict[str, Any]:
    """uvicorn's loggers with :data:`LOG_FORMAT` (its access logger stays quiet: the
    server writes its own access line)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": {"format": LOG_FORMAT}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "plain",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }


def stats_interval() -> float:
    """Seconds between stats lines: ``$EC_FRONTEND_LOG_STATS_INTERVAL``, else 10."""
    try:
        value = float(os.environ.get(STATS_INTERVAL_ENV, "") or DEFAULT_STATS_INTERVAL_S)
    except ValueError:
        return DEFAULT_STATS_INTERVAL_S
    return value if value > 0 else DEFAULT_STATS_INTERVAL_S
