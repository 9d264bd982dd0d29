"""Every flag of vLLM 0.33's ``vllm serve`` is accepted by ``ec-frontend serve`` or
refused with one ``not supported`` line: never argparse's bare errors.

The flag list is vLLM's own serve parser, read once per run by the vLLM
environment's Python (``vllm_flags_driver.py``); each flag is then parsed by our
parser in this process, as the command line would (no model is loaded).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from pathlib import Path
from typing import Any

import pytest
from ec_frontend.entrypoints.cli import build_parser, vllm_flag_problem

from .conftest import run_vllm

pytestmark = pytest.mark.slow

DRIVER = Path(__file__).with_name("vllm_flags_driver.py")
#: Values that vLLM's defaults do not suggest (vLLM's default: none).
VALUES = {"--tool-call-parser": ["hermes"], "--attention-backend": ["FLASH_ATTN"]}


@pytest.fixture(scope="module")
def vllm_flags(vllm_python: Path) -> list[dict[str, Any]]:
    out = run_vllm(vllm_python, [str(DRIVER)], timeout=240, cwd=DRIVER.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    flags: list[dict[str, Any]] = json.loads(out.stdout)
    assert len(flags) > 250, "vLLM's serve parser has more flags than that"
    return flags


@functools.cache
def parser() -> Any:
    return build_parser()


def outcome(argv: list[str]) -> tuple[str, str]:
    """``("accepted", "")``, ``("refused", line)`` or ``("argparse", stderr)``."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = parser().parse_args(["serve", *argv])
    except SystemExit as exc:
        text = err.getvalue()
        lines = text.strip().splitlines()
        if exc.code == 2 and len(lines) == 1 and ": not supported: " in lines[0]:
            return "refused", lines[0]
        return "argparse", text
    problem = vllm_flag_problem(args)
    if problem is None:
        return "accepted", ""
    return ("refused", problem) if "not supported: " in problem else ("argparse", problem)


def test_every_vllm_serve_flag_is_accepted_or_refused(vllm_flags: list[dict[str, Any]]) -> None:
    bad: list[str] = []
    counts = {"accepted": 0, "refused": 0}
    for entry in vllm_flags:
        if "positional" in entry:
            continue
        for flag in entry["flags"]:
            argv = [flag, *VALUES.get(flag, entry["values"])]
            kind, text = outcome(argv)
            if kind == "argparse":
                bad.append(f"{' '.join(argv)}: {text.strip()}")
                continue
            counts[kind] += 1
            if kind == "refused":
                assert flag in text, (flag, text)
    assert not bad, "\n".join(bad)
    # The table implements a real share of vLLM's command line, not only refusals.
    assert counts["accepted"] >= 60, counts


def test_vllm_positional_model(vllm_flags: list[dict[str, Any]]) -> None:
    assert {"positional": "model_tag"} in vllm_flags
    assert outcome(["Qwen/Qwen2-VL-2B-Instruct"]) == ("accepted", "")
