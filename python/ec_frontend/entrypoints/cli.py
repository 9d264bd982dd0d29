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
from typing import TYPE_CHECKING

from ec_frontend import logs
from ec_frontend.config import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES
from ec_frontend.entrypoints.http.cli_args import (
    FrontendSettings,
    add_frontend_args,
    add_log_args,
    human_bytes,
    human_int,
    json_object,
)
from ec_frontend.entrypoints.http.protocol import add_http_args, http_limits, limits_group
from ec_frontend.entrypoints.http.vllm_flags import ONLY, OnlyValues, add_vllm_flags
from ec_frontend.entrypoints.openai.limits import ResourceLimits
from ec_frontend.entrypoints.openai.sampling import MAX_LOGPROBS
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
from ec_frontend.model.video import VideoLimits
from ec_frontend.model.video_cache import DEFAULT_CACHE_GB

if TYPE_CHECKING:
    from ec_frontend.entrypoints.launcher import ServeOptions

#: Subcommands: name -> (add its arguments, run it). Other modules may register more.
COMMANDS: dict[
    str, tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]
] = {}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as vLLM's `vllm serve MODEL` (the same as --model)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory, or a Hugging Face id (org/name): from the local Hugging "
        "Face cache, downloaded into it when missing unless HF_HUB_OFFLINE is set "
        "(default: the built-in tiny Qwen2-VL)",
    )
    p.add_argument(
        "--revision",
        default=None,
        help="with a Hugging Face id: the branch, tag or commit to use (default: main)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="accepted when it names the checkpoint itself (the tokenizer is always the "
        "checkpoint's own)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the engine's random state at startup: requests without a seed sample "
        "the same after every restart, and dummy weights are the same (default 0)",
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
        nargs="+",
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
    p.add_argument(
        "--max-model-len",
        type=human_int,
        default=None,
        help="context length in tokens (1k = 1000, 1K = 1024; auto or -1: the model's)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests batched per step")
    p.add_argument(
        "--max-num-batched-tokens",
        type=human_int,
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
        type=human_bytes,
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
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run every step eagerly: no CUDA graphs of decode steps (captured by default "
        "on CUDA with the triton attention backend)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of full blocks whose prefix (tokens, images, cache_salt) an earlier "
        "request computed (default on; --no-enable-prefix-caching or "
        "--disable-prefix-caching turns it off)",
    )
    p.add_argument(
        "--disable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help=argparse.SUPPRESS,
    )
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if any)")
    p.add_argument(
        "--dtype",
        default="auto",
        action=OnlyValues,
        allowed=("auto", "float32", "float16", "bfloat16", "half", "float"),
        reason="the model runs in float32, float16 or bfloat16",
        help="model dtype (auto: bfloat16 on CUDA, float32 on CPU; half = float16, "
        "float = float32)",
    )
    p.add_argument(
        "--load-format",
        default="auto",
        action=OnlyValues,
        allowed=ONLY["--load-format"][0],
        reason=ONLY["--load-format"][1],
        help="weights: the checkpoint's safetensors (auto), or random weights for its "
        "config.json (dummy: benchmarks without weights)",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        action=OnlyValues,
        allowed=("auto", "sdpa", "gather", "triton"),
        reason="the attention paths are this project's own (auto picks one)",
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
    add_log_args(p)
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
        "--disable-auto-tool-choice",
        dest="enable_auto_tool_choice",
        action="store_false",
        help=argparse.SUPPRESS,
    )
    p.add_argument(
        "--tool-call-parser",
        action=OnlyValues,
        allowed=TOOL_PARSERS,
        reason="the built-in tool call parsers are these",
        default=None,
        help="how tool calls are written by the model: hermes (the Qwen family's "
        "<tool_call> format)",
    )
    p.add_argument(
        "--structured-outputs-compile-timeout",
        type=float,
        default=DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
        help="seconds to validate a request's grammar (else 400) and to build its matcher "
        "in the engine, off the engine's step (else the request ends with an error) "
        f"(default {DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--structured-outputs-max-grammar-bytes",
        type=int,
        default=DEFAULT_MAX_GRAMMAR_BYTES,
        help="largest compiled grammar of a request (a schema, regex, choice list, "
        "grammar, structural tag or tool set), in bytes; a larger one is a 400 naming "
        f"its field (default {DEFAULT_MAX_GRAMMAR_BYTES}: about 45,000 short choices)",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes sharing the port and one engine; /metrics on any of "
        "them reports the whole group (default 1: this process serves)",
    )
    p.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help=f"most logprobs / top_logprobs a request may ask for (at most {MAX_LOGPROBS}, "
        f"the default)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, in place of the checkpoint's",
    )
    p.add_argument(
        "--limit-mm-per-prompt",
        type=json_object,
        default=None,
        metavar="JSON",
        help="vLLM's per-modality item limits, e.g. '{\"image\": 4}': the image count "
        "sets --max-media-items",
    )
    add_frontend_args(p)
    add_limit_args(p)
    add_http_args(p)
    add_media_args(p)
    add_vllm_flags(p)


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
        ("--max-video-frames", int, d.video.max_frames,
         "frames sampled from one video (default %(default)s)"),
        ("--max-video-frame-pixels", int, d.video.max_frame_pixels,
         "pixels (width x height, from the stream header) per video frame "
         "(default %(default)s)"),
        ("--max-video-pixels", int, d.video.max_video_pixels,
         "sampled frames x frame pixels of one video, checked before decoding "
         "(default %(default)s)"),
        ("--max-video-duration", float, d.video.max_duration_s,
         "seconds of one video, counted from its frames (default %(default)s)"),
        ("--mm-processor-cache-gb", float, DEFAULT_CACHE_GB,
         "GiB of processed videos each API server keeps, by content, so that a video "
         "sent again is not decoded again; 0: none (default %(default)s)"),
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
        video=VideoLimits(
            max_frames=args.max_video_frames,
            max_frame_pixels=args.max_video_frame_pixels,
            max_video_pixels=args.max_video_pixels,
            max_duration_s=args.max_video_duration,
        ),
        video_cache_bytes=int(args.mm_processor_cache_gb * 2**30),
    )


#: Flags that must be positive when given.
_POSITIVE = (
    "max_model_len", "max_num_seqs", "max_body_bytes", "port", "max_media_items",
    "max_image_pixels", "max_request_pixels", "max_processor_pixels", "max_prompt_chars",
    "max_fanout", "max_engine_requests", "max_header_bytes", "max_url_bytes",
    "header_timeout", "body_timeout", "keep_alive_timeout", "api_server_count",
    "max_video_frames", "max_video_frame_pixels", "max_video_pixels", "max_video_duration",
)  # fmt: skip
#: Flags that may be 0 (0 meaning "derived") but not negative.
_NON_NEGATIVE = (
    "processing_workers", "max_processing_queue", "max_connections", "drain_timeout",
    "mm_processor_cache_gb",
)  # fmt: skip


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


_DTYPES = {"half": "float16", "float": "float32"}


def vllm_flag_problem(args: argparse.Namespace) -> str | None:
    """vLLM's flags whose value this server cannot honour, as an error line."""
    if args.model_tag and args.model and args.model_tag != args.model:
        return f"give the model once: MODEL {args.model_tag!r} and --model {args.model!r} differ"
    if args.api_key is not None and len(args.api_key) > 1:
        return "--api-key: not supported: one API key per server"
    if not 0 <= args.max_logprobs <= MAX_LOGPROBS:
        return f"--max-logprobs {args.max_logprobs}: not supported: 0 to {MAX_LOGPROBS}"
    model = args.model_tag or args.model
    if args.tokenizer is not None and args.tokenizer != model:
        return (
            f"--tokenizer {args.tokenizer}: not supported: the tokenizer is the checkpoint's "
            "own (put it in the checkpoint directory)"
        )
    limit = args.limit_mm_per_prompt
    if limit is not None:
        other = sorted(set(limit) - {"image"})
        if other:
            return (
                f"--limit-mm-per-prompt: not supported: {other[0]!r} (only image items are "
                "limited per prompt)"
            )
        count = limit.get("image", args.max_media_items)
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            return '--limit-mm-per-prompt: "image" must be a count >= 0'
        args.max_media_items = count
    return None


def chat_template(value: str | None) -> str | None:
    """``--chat-template``: the contents of the file it names, else the text itself when
    it reads as a template; ``ValueError`` for anything else."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        if "{" in value:
            return value
        raise ValueError(f"--chat-template: cannot read {value}: {exc.strerror}") from None


def preflight_problem(args: argparse.Namespace) -> str | None:
    """What would stop the server after the model loaded, found before it loads."""
    from ec_frontend.engine.builder import flag_problem
    from ec_frontend.entrypoints import preflight

    return (
        (None if args.mock_engine else flag_problem(args))
        or preflight.transfer_problem(
            args.ec_transfer_config,
            args.kv_transfer_config,
            args.transfer_secret,
            args.transfer_secret_file,
            args.transfer_peers,
        )
        or (
            None
            if args.mock_engine
            else preflight.checkpoint_problem(
                args.model_tag or args.model, args.load_format, args.revision
            )
        )
        or preflight.port_problem(args.host, args.port)
    )


def serve_options(args: argparse.Namespace) -> ServeOptions | str:
    """The :class:`ServeOptions` of ``serve``'s parsed ``args``, or the problem with them
    (a line for stderr)."""
    keys = args.api_key or ()
    api_key = (
        (keys[0] if keys else None)
        or os.environ.get("EC_FRONTEND_API_KEY")
        or os.environ.get("VLLM_API_KEY")
    )
    problem = vllm_flag_problem(args) or check_flags(args, "serve")
    if problem is None:
        from PIL import Image

        Image.init()
        unknown = sorted(set(resource_limits(args).image_formats) - set(Image.OPEN))
        if unknown:
            problem = f"ec-frontend serve: --image-formats: unknown decoders {unknown}"
    template = None
    try:
        media = media_config(args)
        template = chat_template(args.chat_template)
    except ValueError as exc:
        problem = problem or f"ec-frontend serve: {exc}"
    frontend = FrontendSettings.from_args(args)
    problem = problem or frontend.problem() or preflight_problem(args)
    if problem is not None:
        if not problem.startswith("ec-frontend"):
            problem = f"ec-frontend serve: {problem}"
        return problem
    from ec_frontend.entrypoints.launcher import ServeOptions

    return ServeOptions(
        model=args.model_tag or args.model,
        revision=args.revision,
        seed=args.seed,
        max_logprobs=args.max_logprobs,
        chat_template=template,
        frontend=frontend,
        log_stats=not args.disable_log_stats,
        log_requests=args.log_requests,
        max_log_len=args.max_log_len,
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
        dtype=_DTYPES.get(args.dtype, args.dtype),
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
        structured_outputs_compile_timeout=args.structured_outputs_compile_timeout,
        structured_outputs_max_grammar_bytes=args.structured_outputs_max_grammar_bytes,
        api_server_count=args.api_server_count,
        media=media,
    )


def run_serve(args: argparse.Namespace) -> int:
    options = serve_options(args)
    if isinstance(options, str):
        print(options, file=sys.stderr)
        return 2
    first_line("serve")
    from ec_frontend.entrypoints.launcher import serve

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


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line; ``only``: define that subcommand alone (the others' imports
    are skipped, so that a command starts, or refuses a flag, sooner)."""
    parser = argparse.ArgumentParser(
        prog="ec-frontend",
        description="OpenAI-compatible serving for vision-language models (E/P/D)",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add_args, _) in COMMANDS.items():
        if only is not None and only in COMMANDS and name != only:
            continue
        add_args(sub.add_parser(name, help=(COMMAND_HELP.get(name) or name)))
    return parser


def first_line(command: str) -> None:
    """The process's first log line, before the heavy imports."""
    logging.getLogger("ec_frontend").info(
        "ec-frontend %s %s (pid %d)", _version(), command, os.getpid()
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ec-frontend")
    except PackageNotFoundError:
        return "unknown"


COMMAND_HELP: dict[str, str] = {
    "serve": "run the OpenAI-compatible server",
    "proxy": "route requests through encode, prefill and decode instances",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    logs.configure(getattr(args, "log_level", "info"))
    if args.command != "serve":  # serve says it once its flags have passed the checks
        first_line(args.command)
    _, run = COMMANDS[args.command]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
