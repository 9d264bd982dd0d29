"""The bad-input corpus: every body raises RequestError with its code, param and a message."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import ec_frontend as ecf
import pytest

from .bad_inputs import BAD_INPUTS, BadInput


def test_corpus_is_large_and_covers_every_endpoint() -> None:
    assert len(BAD_INPUTS) >= 50
    assert len({c.id for c in BAD_INPUTS}) == len(BAD_INPUTS)
    assert {c.endpoint for c in BAD_INPUTS} == {"chat", "completions", "responses", "generate"}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c.id for c in BAD_INPUTS])
def test_bad_input_raises_typed_error(case: BadInput) -> None:
    with pytest.raises(ecf.RequestError) as info:
        ecf.parse_request(case.endpoint, case.body)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.code, err.param) == (case.code, case.param), err.message
    assert isinstance(err.message, str) and err.message
    assert str(err) == err.message


def test_corpus_in_a_subprocess_survives() -> None:
    """The whole corpus, twice over, in a fresh interpreter that must exit cleanly."""
    script = textwrap.dedent(
        """
        import importlib.util, sys
        import ec_frontend as ecf
        spec = importlib.util.spec_from_file_location("bad_inputs", sys.argv[1])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bad_inputs"] = mod
        spec.loader.exec_module(mod)
        raised = 0
        for _ in range(2):
            for case in mod.BAD_INPUTS:
                try:
                    ecf.parse_request(case.endpoint, case.body)
                except ecf.RequestError:
                    raised += 1
        print(raised)
        """
    )
    corpus = Path(__file__).with_name("bad_inputs.py")
    done = subprocess.run(
        [sys.executable, "-c", script, str(corpus)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) == 2 * len(BAD_INPUTS)
