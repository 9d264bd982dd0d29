"""``ec-frontend``: the command line.

``ec-frontend serve`` starts the OpenAI-compatible server (flags as vLLM's
``vllm serve`` where they exist). The API key may also come from
``EC_FRONTEND_API_KEY`` or ``VLLM_API_KEY``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from ec_frontend.entrypoints.http.protocol import add_http_args, http_limits, limits_group
from ec_frontend.entrypoints.launcher import ServeOptions, serve
from ec_frontend.entrypoints.openai.limits import ResourceLimits
from ec_frontend.entrypoints.openai.tool_parsers import TOOL_PARSERS
from ec_frontend.entrypoints.proxy.cli import (
    ADMIN_KEY_ENV,
    add_proxy_args,
    add_transfer_trust_args,
    run_proxy,
)
from ec_frontend.entrypoints.proxy.registration import DEFAULT_INTERVAL_S, ROLES, Registrar
from ec_frontend.media.options import add_media_args, media_config
from ec_frontend.model.media import DEFAULT_IMAGE_FORMATS

#: Subcommands: name -> (add its arguments, run it). Other modules may register more.
COMMANDS: dict[
    str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory, or a Hugging Face id (org/name) found in the local "
        "Hugging Face cache (default: the built-in tiny Qwen2-VL)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    reg = p.add_argument_group("registration with EPD proxies (vLLM's /instances API)")
    reg.add_argument(
        "--register-with",
        nargs="+",
        default=[],
        metavar="PROXY_URL",
        help="once healthy, register with these proxies (ec-frontend proxy or vLLM's EPD "
        "proxy in --dynamic-registration mode; admin key from $ADMIN_API_KEY), re-announce "
        "every --register-interval seconds and unregister on exit",
    )
    reg.add_argument(
        "--register-role",
        choices=ROLES,
        default=None,
        help="the role to register under (required with --register-with)",
    )
    reg.add_argument(
        "--register-url",
        default=None,
        metavar="URL",
        help="the URL the proxies reach this instance at (default http://HOST:PORT)",
    )
    reg.add_argument(
        "--register-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="seconds between announcements (default %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1 and /inference routes "
        "(env: EC_FRONTEND_API_KEY or VLLM_API_KEY)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use; the first is reported (default: the model id)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length in tokens")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests batched per step")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens computed per step; a longer prompt is prefilled in chunks (default 2048)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of the GPU's memory this instance may use; the KV cache gets what "
        "the weights and a profile run at --max-num-batched-tokens leave (default 0.9)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=int,
        default=None,
        help="KV cache bytes, in place of --gpu-memory-utilization (default on the CPU: "
        "256 MiB, or one --max-model-len sequence when that needs more)",
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV cache block (default 16)"
    )
    p.add_argument(
        "--encoder-cache-size",
        type=int,
        default=None,
        help="encoder output rows (image placeholder tokens) kept for running requests "
        "(default 16384, at least --max-num-batched-tokens)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly: no CUDA graphs of decode steps (captured by default "
        "on CUDA with the triton attention backend)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of full blocks whose prefix (tokens, images, cache_salt) an earlier "
        "request computed (default on; --no-enable-prefix-caching turns it off)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if any)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="model dtype (auto: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "safetensors", "dummy"],
        help="weights: the checkpoint's safetensors (auto), or random weights for its "
        "config.json (dummy: benchmarks without weights)",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "sdpa", "gather", "triton"],
        help="attention over the paged KV cache: auto is triton on CUDA when Triton is "
        "installed (decodes read the cache in place; decode steps run as CUDA graphs), "
        "sdpa elsewhere; gather is the reference path",
    )
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch threads when the model runs on the CPU (env: EC_FRONTEND_CPU_THREADS; "
        "default: 1 for the built-in model, whose matrices are too small to share, "
        "else torch's default)",
    )
    p.add_argument(
        "--ec-transfer-config",
        default=None,
        help='JSON, e.g. \'{"ec_connector": "ECSharedStorageConnector", "ec_role": '
        '"ec_producer", "ec_connector_extra_config": {"shared_storage_path": "/tmp/ec"}}\'',
    )
    p.add_argument(
        "--kv-transfer-config",
        default=None,
        help='JSON, e.g. \'{"kv_connector": "KVSideChannelConnector", "kv_role": "kv_producer"}\'',
    )
    add_transfer_trust_args(p)
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="largest accepted request body; larger ones get 413 (default 64 MiB)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
    )
    p.add_argument(
        "--mock-engine",
        action="store_true",
        help="no model: tokens are echoed (for benchmarking the frontend alone)",
    )
    p.add_argument(
        "--engine-mode",
        choices=["multiprocess", "inprocess"],
        default="multiprocess",
        help="multiprocess: the engine core runs in its own process (the default); "
        "inprocess: in a thread of the server process",
    )
    p.add_argument(
        "--mock-token-latency-ms",
        type=float,
        default=0.0,
        help="with --mock-engine: delay before each generated token",
    )
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds until the server has exited: in-flight requests finish, "
        "or are aborted and their connections closed near the end",
    )
    p.add_argument(
        "--public-metrics",
        action="store_true",
        help="serve /metrics without the API key (by default it needs the key when one is set)",
    )
    p.add_argument(
        "--public-docs",
        action="store_true",
        help="serve /docs, /redoc and /openapi.json without the API key",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": tool calls are parsed out of the output '
        "(needs --tool-call-parser)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSERS,
        default=None,
        help="how tool calls are written by the model: hermes (the Qwen family's "
        "<tool_call> format)",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes sharing the port and one engine; /metrics on any of "
        "them reports the whole group (default 1: this process serves)",
    )
    add_limit_args(p)
    add_http_args(p)
    add_media_args(p)


def add_limit_args(p: argparse.ArgumentParser) -> None:
    """Per-request resource bounds (``docs/security.md``, "HTTP and resource limits")."""
    d = ResourceLimits()
    limits_group(p, "resource limits", [
        ("--max-media-items", int, d.max_media_items,
         "media items per request (default %(default)s)"),
        ("--max-image-pixels", int, d.max_image_pixels,
         "pixels (width x height, read from the header) per image (default %(default)s)"),
        ("--max-request-pixels", int, d.max_request_pixels,
         "pixels of all the images of a request (default %(default)s)"),
        ("--image-formats", str, ",".join(DEFAULT_IMAGE_FORMATS),
         "comma-separated Pillow decoders a request may reach (default %(default)s)"),
        ("--max-processor-pixels", int, None,
         "largest mm_processor_kwargs min_pixels / max_pixels (default: the checkpoint's "
         "max_pixels)"),
        ("--max-prompt-chars", int, None,
         "characters of prompt text, checked before tokenization (default: 16 x "
         "max-model-len)"),
        ("--max-fanout", int, d.max_fanout,
         "engine requests per HTTP request, prompts x n (default %(default)s)"),
        ("--max-engine-requests", int, None,
         "engine requests in flight, a request's whole fan-out counted on arrival; over "
         "it, 429 (default: 16 x the engine's max-num-seqs, at least 256: 1024 for the "
         "default 64; shared among --api-server-count servers)"),
        ("--processing-workers", int, 0,
         "threads decoding images and tokenizing (default: one per CPU, at most 4)"),
        ("--max-processing-queue", int, d.max_processing_queue,
         "requests waiting for a processing thread; over it, 429 (default %(default)s)"),
    ])  # fmt: skip


def resource_limits(args: argparse.Namespace) -> ResourceLimits:
    formats = tuple(f.strip().upper() for f in args.image_formats.split(",") if f.strip())
    return ResourceLimits(
        max_media_items=args.max_media_items,
        max_image_pixels=args.max_image_pixels,
        max_request_pixels=args.max_request_pixels,
        image_formats=formats,
        max_processor_pixels=args.max_processor_pixels,
        max_prompt_chars=args.max_prompt_chars,
        max_fanout=args.max_fanout,
        processing_workers=args.processing_workers,
        max_processing_queue=args.max_processing_queue,
    )


#: Flags that must be positive when given.
_POSITIVE = (
    "max_model_len", "max_num_seqs", "max_body_bytes", "port", "max_media_items",
    "max_image_pixels", "max_request_pixels", "max_processor_pixels", "max_prompt_chars",
    "max_fanout", "max_engine_requests", "max_header_bytes", "max_url_bytes",
    "header_timeout", "body_timeout", "keep_alive_timeout", "api_server_count",
)  # fmt: skip
#: Flags that may be 0 (0 meaning "derived") but not negative.
_NON_NEGATIVE = ("processing_workers", "max_processing_queue", "max_connections", "drain_timeout")


def check_flags(args: argparse.Namespace, command: str) -> str | None:
    """The first flag with an out-of-range value, as an error line; ``None`` when all fit."""
    for name in _POSITIVE + _NON_NEGATIVE:
        value = getattr(args, name, None)
        if value is None:
            continue
        if value < 0 or (value == 0 and name in _POSITIVE):
            bound = "> 0" if name in _POSITIVE else ">= 0"
            return f"ec-frontend {command}: --{name.replace('_', '-')} must be {bound}"
    return None


def run_serve(args: argparse.Namespace) -> int:
    api_key = (
        args.api_key or os.environ.get("EC_FRONTEND_API_KEY") or os.environ.get("VLLM_API_KEY")
    )
    problem = check_flags(args, "serve")
    if problem is None:
        from PIL import Image

        Image.init()
        unknown = sorted(set(resource_limits(args).image_formats) - set(Image.OPEN))
        if unknown:
            problem = f"ec-frontend serve: --image-formats: unknown decoders {unknown}"
    try:
        media = media_config(args)
    except ValueError as exc:
        problem = problem or f"ec-frontend serve: {exc}"
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    options = ServeOptions(
        model=args.model,
        host=args.host,
        port=args.port,
        api_key=api_key or None,
        served_model_names=tuple(args.served_model_name or ()),
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        encoder_cache_size=args.encoder_cache_size,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        attention_backend=args.attention_backend,
        cpu_threads=args.cpu_threads,
        ec_transfer_config=args.ec_transfer_config,
        kv_transfer_config=args.kv_transfer_config,
        transfer_secret=args.transfer_secret,
        transfer_secret_file=args.transfer_secret_file,
        transfer_peers=args.transfer_peers,
        max_body_bytes=args.max_body_bytes,
        log_level=args.log_level,
        mock_engine=args.mock_engine,
        engine_mode=args.engine_mode,
        mock_token_latency_s=args.mock_token_latency_ms / 1000.0,
        access_log=args.access_log,
        drain_timeout_s=args.drain_timeout,
        body_timeout_s=args.body_timeout,
        limits=resource_limits(args),
        http=http_limits(args),
        max_engine_requests=args.max_engine_requests,
        public_metrics=args.public_metrics,
        public_docs=args.public_docs,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        api_server_count=args.api_server_count,
        media=media,
    )
    registrar = None
    if args.register_with:
        try:
            registrar = _registrar(args)
        except ValueError as exc:
            print(f"ec-frontend serve: {exc}", file=sys.stderr)
            return 2
        registrar.start()
    try:
        if options.api_server_count > 1:
            from ec_frontend.entrypoints.api_servers import serve_group

            serve_group(options)
        return serve(options)
    finally:
        if registrar is not None:
            registrar.stop()


def _registrar(args: argparse.Namespace) -> Registrar:
    if args.register_role is None:
        raise ValueError("--register-with needs --register-role")
    if args.register_interval <= 0:
        raise ValueError("--register-interval must be positive")
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = args.register_url or f"http://{host}:{args.port}"
    key = os.environ.get(ADMIN_KEY_ENV, "")
    return Registrar(args.register_with, args.register_role, url, key, args.register_interval)


COMMANDS["serve"] = (add_serve_args, run_serve)
COMMANDS["proxy"] = (add_proxy_args, run_proxy)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ec-frontend",
        description="OpenAI-compatible serving for vision-language models (E/P/D)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=(COMMAND_HELP.get(name) or name)))
    return parser


COMMAND_HELP: dict[str, str] = {
    "serve": "run the OpenAI-compatible server",
    "proxy": "route requests through encode, prefill and decode instances",
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "info").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    _, run = COMMANDS[args.command]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
