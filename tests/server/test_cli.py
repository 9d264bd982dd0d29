"""``ec-frontend serve`` refuses bad flags with a message and a non-zero exit."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from ec_frontend.entrypoints.cli import build_parser, vllm_flag_problem
from ec_frontend.entrypoints.http.vllm_flags import refused_flags

pytestmark = pytest.mark.slow


def test_defaults() -> None:
    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model, args.mock_engine) == ("127.0.0.1", 8000, None, False)
    assert args.max_body_bytes == 64 * 1024 * 1024


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["org/model"], {"model_tag": "org/model"}),
        (["--kv-cache-memory-bytes", "1G"], {"kv_cache_memory": 1 << 30}),
        (["--kv-cache-memory", "2k"], {"kv_cache_memory": 2000}),
        (["--max-model-len", "32K"], {"max_model_len": 32768}),
        (["--max-model-len", "auto"], {"max_model_len": None}),
        (["--device-memory-utilization", "0.5"], {"gpu_memory_utilization": 0.5}),
        (["-asc", "2"], {"api_server_count": 2}),
        (["--disable-prefix-caching"], {"enable_prefix_caching": False}),
        (["--no-enforce-eager"], {"enforce_eager": False}),
        (["--dtype", "half"], {"dtype": "half"}),
        (["--log-level", "WARNING"], {"log_level": "warning"}),
        (["--uvicorn-log-level", "trace"], {"uvicorn_log_level": "trace"}),
        (["--disable-uvicorn-access-log"], {"access_log": False}),
        (["--enable-log-requests", "--max-log-len", "9"], {"log_requests": True, "max_log_len": 9}),
        (["--allowed-origins", '["http://a"]'], {"allowed_origins": ["http://a"]}),
        (["--shutdown-timeout", "5"], {"drain_timeout": 5.0}),
        (["--renderer-num-workers", "3"], {"processing_workers": 3}),
        (["--seed", "7", "--max-logprobs", "5"], {"seed": 7, "max_logprobs": 5}),
        (["-tp", "1", "--kv-cache-dtype", "auto", "--trust-remote-code"], {}),
    ],
)
def test_vllm_spellings(argv: list[str], expected: dict[str, object]) -> None:
    args = build_parser().parse_args(["serve", *argv])
    assert {k: getattr(args, k) for k in expected} == expected
    assert vllm_flag_problem(args) is None


def test_limit_mm_per_prompt_sets_the_image_count() -> None:
    args = build_parser().parse_args(["serve", "--limit-mm-per-prompt", '{"image": 3}'])
    assert vllm_flag_problem(args) is None
    assert args.max_media_items == 3
    args = build_parser().parse_args(["serve", "--limit-mm-per-prompt", '{"audio": 1}'])
    assert "not supported: 'audio'" in (vllm_flag_problem(args) or "")


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (["--port", "0"], 2, "--port must be > 0"),
        (["--max-body-bytes", "-5"], 2, "--max-body-bytes must be > 0"),
        (["--dtype", "int3"], 2, "--dtype int3: not supported: "),
        (["--kv-transfer-config", "{nope"], 2, "kv_transfer_config is not valid JSON"),
        (
            ["--ec-transfer-config", '{"ec_connector": "X", "ec_role": "boss"}'],
            2,
            "ec_role must be one of",
        ),
        (["--model", "/nonexistent/dir"], 2, "neither a checkpoint directory"),
        (["--max-fanout", "0"], 2, "--max-fanout must be > 0"),
        (["--max-image-pixels", "-1"], 2, "--max-image-pixels must be > 0"),
        (["--header-timeout", "0"], 2, "--header-timeout must be > 0"),
        (["--max-connections", "-1"], 2, "--max-connections must be >= 0"),
        (["--max-processing-queue", "-3"], 2, "--max-processing-queue must be >= 0"),
        (["--image-formats", "PNG,NOPE"], 2, "unknown decoders ['NOPE']"),
        (["-tp", "2"], 2, "-tp 2: not supported: one device per instance"),
        (["--quantization", "awq"], 2, "--quantization: not supported: "),
        (["--tokenizer", "other/tok"], 2, "--tokenizer other/tok: not supported: "),
        (["a/b", "--model", "c/d"], 2, "give the model once"),
    ],
)
def test_bad_flags_exit_cleanly(flags: list[str], code: int, message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ec_frontend.entrypoints.cli", "serve", "--device", "cpu", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == code
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    if "not supported" in message:
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("ec-frontend ")


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser("serve")
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_docs_name_every_flag_of_serve_help() -> None:
    """``docs/server.md`` names every option ``serve --help`` shows, and every refused
    vLLM flag."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    shown = [
        flag
        for action in _serve_parser()._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    ]
    assert len(shown) > 100
    missing = [flag for flag in shown if f"`{flag}" not in docs and f"{flag}`" not in docs]
    assert not missing, missing
    refused = [flag for flag in refused_flags() if f"`{flag}`" not in docs]
    assert not refused, refused
