"""Run by the vLLM environment's Python: print vLLM's ``vllm serve`` flags as JSON.

One object per option of vLLM's own serve parser (``make_arg_parser``):
``{"flags": [...option strings], "values": [...]}``, where ``values`` are the
command-line words that follow the flag in a plausible invocation (none for a
switch): vLLM's default when it is a plain value, else a choice, else a value of
the option's type. ``{"positional": dest}`` for a positional argument.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm.entrypoints.common.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser

_SAMPLES = {"int": "1", "float": "0.5", "loads": "{}", "str": "x"}


def _type_name(action: argparse.Action) -> str:
    kind = action.type
    if kind is None:
        return "str"
    name = getattr(kind, "__name__", "")
    if name == "_optional_type":  # vLLM wraps the real type in a closure
        for cell in kind.__closure__ or ():
            inner = getattr(cell.cell_contents, "__name__", "")
            if inner:
                return inner
    return name


def _sample(action: argparse.Action) -> list[str]:
    if action.nargs == 0:
        return []
    default = action.default
    if action.choices:
        choices = [str(c) for c in action.choices]
        return [str(default) if str(default) in choices else choices[0]]
    kind = _type_name(action)
    if isinstance(default, bool) or default is None or default == argparse.SUPPRESS:
        value = None
    elif isinstance(default, int | float | str) and str(default):
        value = str(default)
    elif isinstance(default, list | dict) and kind == "loads":
        value = json.dumps(default)
    else:
        value = None
    if value is None:
        if kind.startswith("human_readable_int"):
            value = "1024"
        elif kind in ("loads", "union_dict_and_str", "_parse_type", "parse_dataclass"):
            value = "{}"
        else:
            value = _SAMPLES.get(kind, "x")
    return [value]


def main() -> None:
    parser = make_arg_parser(FlexibleArgumentParser())
    out: list[dict[str, object]] = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not action.option_strings:
            out.append({"positional": action.dest})
            continue
        out.append({"flags": list(action.option_strings), "values": _sample(action)})
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
