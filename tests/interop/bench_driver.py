"""Runs ``vllm bench serve`` several times in one process (run by the vLLM venv's Python).

Usage: ``python bench_driver.py RUNS_JSON``, where the file holds
``[{"name": str, "argv": [str, ...]}, ...]``. Each ``argv`` is parsed by vLLM's own
``vllm bench serve`` argument parser and run by its ``main``, exactly as the
``vllm bench serve`` command does; importing vLLM once saves its start-up time for
every run after the first. The results are the JSON files vLLM writes itself
(``--save-result``). A run that raises is reported and the next one still runs.
"""

from __future__ import annotations

import json
import sys
import traceback

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser


def run(argv: list[str]) -> None:
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    failed = 0
    for spec in runs:
        print(f"=== {spec['name']}", flush=True)
        try:
            run(spec["argv"])
        except Exception:
            failed += 1
            traceback.print_exc()
    sys.exit(1 if failed else 0)
