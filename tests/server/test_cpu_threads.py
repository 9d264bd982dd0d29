"""How many torch threads a CPU engine gets (``--cpu-threads``)."""

from __future__ import annotations

import pytest
from ec_frontend.config import ConfigError
from ec_frontend.engine.builder import CPU_THREADS_ENV, cpu_threads, engine_process_threads
from ec_frontend.entrypoints.launcher import ServeOptions


@pytest.mark.parametrize(
    ("flag", "env", "builtin", "expected"),
    [
        (None, None, True, 1),
        (None, None, False, None),
        (4, None, True, 4),
        (3, "2", False, 3),
        (None, "2", True, 2),
        (None, "6", False, 6),
        (None, " ", False, None),
    ],
)
def test_threads_chosen(
    monkeypatch: pytest.MonkeyPatch,
    flag: int | None,
    env: str | None,
    builtin: bool,
    expected: int | None,
) -> None:
    if env is None:
        monkeypatch.delenv(CPU_THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(CPU_THREADS_ENV, env)
    assert cpu_threads(ServeOptions(cpu_threads=flag), builtin=builtin) == expected


@pytest.mark.parametrize(("flag", "env"), [(0, None), (-2, None), (None, "two"), (None, "0")])
def test_bad_thread_counts_are_config_errors(
    monkeypatch: pytest.MonkeyPatch, flag: int | None, env: str | None
) -> None:
    if env is None:
        monkeypatch.delenv(CPU_THREADS_ENV, raising=False)
    else:
        monkeypatch.setenv(CPU_THREADS_ENV, env)
    with pytest.raises(ConfigError):
        cpu_threads(ServeOptions(cpu_threads=flag), builtin=True)


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 2), (3, 3), (4, 3), (16, 15)])
def test_engine_process_threads_leave_a_core_to_the_server_from_4_cores(
    cores: int, threads: int
) -> None:
    assert engine_process_threads(cores) == threads
