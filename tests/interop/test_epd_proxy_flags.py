"""Every flag of vLLM 0.33's EPD proxy (``disagg_epd_proxy.py`` in its source
distribution) is accepted by ``ec-frontend proxy`` or refused with one ``not
supported`` line: never argparse's bare errors.

The flags are read from the script's own ``add_argument`` calls (its syntax tree; the
script is not run), each with vLLM's default as its value (module constants
resolved); our parser then parses each in this process, as the command line would.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
from ec_frontend.entrypoints.cli import build_parser

pytestmark = pytest.mark.slow

SCRIPT = Path("sdist/vllm-0.33.0/examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py")
#: A value for flags whose vLLM default says nothing (an empty URL list).
URL = "http://127.0.0.1:9"


def epd_proxy_flags(source: str) -> list[tuple[str, list[str]]]:
    """``(flag, values)`` for each option of the script's parser."""
    tree = ast.parse(source)
    constants = {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    out: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
        keywords = {k.arg: k.value for k in node.keywords}
        action = keywords.get("action")
        if isinstance(action, ast.Constant) and action.value in ("store_true", "store_false"):
            values: list[str] = []
        else:
            default = keywords.get("default")
            value = None
            if isinstance(default, ast.Constant):
                value = default.value
            elif isinstance(default, ast.Name):
                value = constants[default.id]
            values = [str(value) if value not in (None, "") else URL]
        out += [(f, values) for f in flags if isinstance(f, str) and f.startswith("--")]
    return out


def outcome(argv: list[str]) -> tuple[str, str, Any]:
    """``("accepted", "", args)``, ``("refused", line, None)`` or ``("argparse", stderr, None)``."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser().parse_args(["proxy", *argv])
    except SystemExit as exc:
        lines = err.getvalue().strip().splitlines()
        if exc.code == 2 and len(lines) == 1 and ": not supported: " in lines[0]:
            return "refused", lines[0], None
        return "argparse", err.getvalue(), None
    return "accepted", "", args


def test_every_epd_proxy_flag_is_accepted_or_refused(vllm_python: Path) -> None:
    flags = epd_proxy_flags((vllm_python.parents[1] / SCRIPT).read_text())
    assert len(flags) >= 15, flags
    kinds: dict[str, list[str]] = {"accepted": [], "refused": [], "argparse": []}
    for flag, values in flags:
        kind, text, _ = outcome(["--decode", URL, flag, *values])
        kinds[kind].append(f"{flag} {' '.join(values)}: {text.strip()}")
        if kind == "refused":
            assert flag in text, text
    assert not kinds["argparse"], "\n".join(kinds["argparse"])
    refused = {line.split(" ", 1)[0] for line in kinds["refused"]}
    assert refused == {"--no-rewrite", "--decode-retries", "--ec-consumer-zmq-addrs"}, kinds
    assert len(kinds["accepted"]) == len(flags) - 3


@pytest.mark.parametrize(
    ("argv", "expect"),
    [
        (["--log-requests"], {"access_log": True, "log_level": "debug"}),
        (["--decode-retries", "0", "--ec-consumer-dp-size", "1"], {}),
        (["--encode-servers-urls", f"{URL},{URL}0"], {"encode": [URL, URL + "0"]}),
        (["--prefill-servers-urls", "none"], {"prefill": []}),
    ],
)
def test_epd_proxy_spellings(argv: list[str], expect: dict[str, Any]) -> None:
    kind, text, args = outcome(["--decode-servers-urls", URL, *argv])
    assert kind == "accepted", text
    assert isinstance(args, argparse.Namespace)
    assert args.decode == [URL]
    assert {k: getattr(args, k) for k in expect} == expect
