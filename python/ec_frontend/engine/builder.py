"""The model-backed engine for ``ec-frontend serve`` (everything but ``--mock-engine``)."""

from __future__ import annotations

import importlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ec_frontend.config import (
    BLOCK_SIZES,
    TRANSFER_SECRET_ENV,
    TRITON_BACKEND_NEEDS,
    CacheConfig,
    ECTransferConfig,
    EngineConfig,
    KVTransferConfig,
    SchedulerConfig,
    TransferTrust,
)
from ec_frontend.errors import ConfigError

if TYPE_CHECKING:
    from collections.abc import Callable

    from ec_frontend.engine.client import EngineClient
    from ec_frontend.engine.core import EngineCore
    from ec_frontend.engine.core_proc import EngineProcess
    from ec_frontend.model.processor import InputProcessor, ProcessedInputs


class EngineArgs(Protocol):
    """The flags the engine is built from (``ec-frontend serve``'s ``ServeOptions``
    has them all); a protocol, so that the engine layer does not import the launcher."""

    @property
    def model(self) -> str | None: ...
    @property
    def revision(self) -> str | None: ...
    @property
    def seed(self) -> int: ...
    @property
    def max_model_len(self) -> int | None: ...
    @property
    def max_num_seqs(self) -> int | None: ...
    @property
    def max_num_batched_tokens(self) -> int | None: ...
    @property
    def structured_outputs_compile_timeout(self) -> float: ...
    @property
    def gpu_memory_utilization(self) -> float: ...
    @property
    def kv_cache_memory(self) -> int | None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def encoder_cache_size(self) -> int | None: ...
    @property
    def enforce_eager(self) -> bool: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def device(self) -> str | None: ...
    @property
    def dtype(self) -> str: ...
    @property
    def load_format(self) -> str: ...
    @property
    def attention_backend(self) -> str: ...
    @property
    def cpu_threads(self) -> int | None: ...
    @property
    def ec_transfer_config(self) -> str | None: ...
    @property
    def kv_transfer_config(self) -> str | None: ...
    @property
    def transfer_secret(self) -> str | None: ...
    @property
    def transfer_secret_file(self) -> str | None: ...
    @property
    def transfer_peers(self) -> str | None: ...
    @property
    def engine_mode(self) -> str: ...


log = logging.getLogger("ec_frontend.server")

#: Comma-separated modules imported before the engine starts (connector plugins
#: call ``ec_frontend.connectors.factory.register_*_connector`` when imported).
PLUGINS_ENV = "EC_FRONTEND_PLUGINS"
#: Torch threads for a model on the CPU (the ``--cpu-threads`` flag wins).
CPU_THREADS_ENV = "EC_FRONTEND_CPU_THREADS"


def load_plugins() -> list[str]:
    """Import the modules named in ``$EC_FRONTEND_PLUGINS``; their names."""
    names = [n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(",") if n.strip()]
    for name in names:
        importlib.import_module(name)
    return names


def _dtype(opts: EngineArgs) -> str:
    if opts.dtype != "auto":
        return opts.dtype
    device = opts.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return "bfloat16" if device.startswith("cuda") else "float32"


def cpu_threads(opts: EngineArgs, builtin: bool) -> int | None:
    """Torch threads for a CPU engine: the flag, else the environment, else 1 for the
    built-in model (its matrices are so small that a second thread only adds
    synchronisation, which on a loaded host costs more than the work), else ``None``
    (torch's default)."""
    if opts.cpu_threads is not None:
        n = opts.cpu_threads
    elif os.environ.get(CPU_THREADS_ENV, "").strip():
        try:
            n = int(os.environ[CPU_THREADS_ENV])
        except ValueError:
            raise ConfigError(f"${CPU_THREADS_ENV} must be an integer", "cpu_threads") from None
    elif builtin:
        n = 1
    else:
        return None
    if n < 1:
        raise ConfigError(f"--cpu-threads must be at least 1, got {n}", "cpu_threads")
    return n


def engine_process_threads(cores: int) -> int:
    """Torch threads of a CPU engine in its own process when nothing says how many.

    From 4 cores up, one core is left to the server process, so that the engine's
    intra-op threads never wait at a barrier for a thread the server preempted.
    Below that, a core kept back costs the engine a third or half of its compute,
    which a model of real size needs more than the server needs a core of its own:
    measured on 2 cores, a 40M-parameter Qwen2-VL at 32 concurrent streamed chats
    with images gave 787 output tok/s on both cores vs 661 on one (in-process: 614).
    The built-in model is the exception (:func:`cpu_threads` gives it 1 thread): its
    steps are so short that the server is busy all the time (1,715 vs 3,696 tok/s).
    """
    return cores if cores < 4 else cores - 1


def _flag_error(flag: str, problem: str, value: object) -> ConfigError:
    return ConfigError(f"--{flag} {problem}, got {value}", flag.replace("-", "_"))


def cache_config(opts: EngineArgs, encoder_rows: int) -> CacheConfig:
    """The KV and encoder cache settings of ``opts``; ``ConfigError`` naming the flag.
    Without ``--encoder-cache-size`` the encoder cache holds at least ``encoder_rows``
    (one step's encoder budget)."""
    util = opts.gpu_memory_utilization
    if not 0 < util <= 1:
        raise _flag_error("gpu-memory-utilization", "must be in (0, 1]", util)
    if opts.block_size not in BLOCK_SIZES:
        sizes = ", ".join(map(str, BLOCK_SIZES))
        raise _flag_error("block-size", f"must be one of {sizes}", opts.block_size)
    for flag, value in (
        ("kv-cache-memory", opts.kv_cache_memory),
        ("encoder-cache-size", opts.encoder_cache_size),
    ):
        if value is not None and value <= 0:
            raise _flag_error(flag, "must be > 0", value)
    encoder = opts.encoder_cache_size or max(CacheConfig.encoder_cache_size, encoder_rows)
    return CacheConfig(
        block_size=opts.block_size,
        kv_cache_memory_bytes=opts.kv_cache_memory,
        gpu_memory_utilization=util,
        encoder_cache_size=encoder,
        enforce_eager=opts.enforce_eager,
        enable_prefix_caching=opts.enable_prefix_caching,
    )


def _scheduler_args(opts: EngineArgs, max_len: int) -> dict[str, Any]:
    sched: dict[str, Any] = {"max_model_len": max_len}
    timeout = opts.structured_outputs_compile_timeout
    if not timeout > 0:
        raise _flag_error("structured-outputs-compile-timeout", "must be > 0", timeout)
    sched["grammar_compile_timeout_s"] = timeout
    if opts.max_num_seqs is not None:
        sched["max_num_seqs"] = opts.max_num_seqs
    if opts.max_num_batched_tokens is not None:
        if opts.max_num_batched_tokens <= 0:
            raise _flag_error("max-num-batched-tokens", "must be > 0", opts.max_num_batched_tokens)
        sched["max_num_batched_tokens"] = opts.max_num_batched_tokens
    return sched


def flag_problem(opts: EngineArgs) -> str | None:
    """The first engine flag that cannot work whatever the checkpoint, as an error line
    (the same line the engine's own checks give); imports nothing heavy, so the command
    line runs it before the model loads. A cache and scheduler size out of range, or
    ``--attention-backend triton`` on ``--device cpu`` without Triton's interpreter."""
    try:
        cache_config(opts, 0)
        _scheduler_args(opts, 1)
    except ConfigError as exc:
        return str(exc)
    device = (opts.device or "").split(":")[0]
    interpreting = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if opts.attention_backend == "triton" and device == "cpu" and not interpreting:
        return TRITON_BACKEND_NEEDS
    return None


def _warn_untrusted(
    ec: ECTransferConfig | None, kv: KVTransferConfig | None, trust: TransferTrust
) -> None:
    """Say once, at start, that a consumer with no trusted issuer ignores transfer params."""
    consumes = [c for c, on in (("EC", ec and ec.is_consumer), ("KV", kv and kv.is_consumer)) if on]
    if consumes and trust.trusts_nothing:
        log.warning(
            "%s consumer with no transfer secret and no --transfer-peers: transfer params "
            "in requests will be ignored (items encoded and prompts prefilled here). To act "
            "on them, give every instance and the proxy the same secret "
            "(--transfer-secret-file PATH or $%s), or name the producers with "
            "--transfer-peers HOST[:PORTS]",
            " and ".join(consumes),
            TRANSFER_SECRET_ENV,
        )


def engine_config(opts: EngineArgs) -> tuple[EngineConfig, str]:
    """The engine config and the checkpoint directory for ``opts``."""
    trust = TransferTrust.from_options(
        opts.transfer_secret, opts.transfer_secret_file, opts.transfer_peers
    )
    ec_json, kv_json = opts.ec_transfer_config, opts.kv_transfer_config
    ec = ECTransferConfig.from_json(ec_json, trust) if ec_json else None
    kv = KVTransferConfig.from_json(kv_json, trust) if kv_json else None
    _warn_untrusted(ec, kv, trust)
    from ec_frontend.model.builtin import BUILTIN_MODEL_ID, BUILTIN_NAME, ensure_builtin_checkpoint
    from ec_frontend.model.loader import load_config, resolve_model_path

    if opts.model is None:
        path = ensure_builtin_checkpoint()
        model_id = BUILTIN_MODEL_ID
    else:
        path = resolve_model_path(opts.model, revision=opts.revision)
        name = path.resolve().name
        if not Path(opts.model).exists():
            # A Hugging Face id names the model (as vLLM does), not its cache snapshot.
            model_id = opts.model
        else:
            # The built-in checkpoint has one id wherever it was written.
            model_id = BUILTIN_MODEL_ID if name == BUILTIN_NAME else name
    hf = load_config(path)
    model_max = int(hf.text_config.max_position_embeddings)
    max_len = opts.max_model_len or model_max
    if max_len > model_max:
        raise ConfigError(
            f"--max-model-len {max_len} exceeds the model's {model_max} positions", "max_model_len"
        )
    sched = SchedulerConfig(**_scheduler_args(opts, max_len))
    config = EngineConfig(
        model=str(path),
        model_id=model_id,
        device=opts.device,
        dtype=_dtype(opts),
        seed=opts.seed,
        scheduler=sched,
        cache=cache_config(opts, sched.encoder_budget),
        ec_transfer=ec,
        kv_transfer=kv,
        load_format=opts.load_format,
        attention_backend=opts.attention_backend,
    )
    return config, str(path)


def _builtin_id() -> str:
    from ec_frontend.model.builtin import BUILTIN_MODEL_ID

    return BUILTIN_MODEL_ID


def build_core(config: EngineConfig) -> tuple[EngineCore, Callable[[], InputProcessor]]:
    """In the engine process: ``(EngineCore, processor loader)``. The core gets no
    tokenizer (its clients detokenize); the loader builds the input processor on
    first use (a structured-output grammar needs the tokenizer)."""
    from ec_frontend.engine.core import EngineCore, _generation_eos
    from ec_frontend.model.loader import load_processor

    path, model_id = EngineCore.checkpoint(config)
    model = EngineCore.load_model(config, path)
    loaded: list[InputProcessor] = []

    def processor() -> InputProcessor:
        if not loaded:
            loaded.append(load_processor(path, model_id=config.model_id or model_id))
        return loaded[0]

    eos = _generation_eos(path) or processor().eos_token_id
    return EngineCore(config, model, eos_token_id=eos), processor


def create_engine(
    opts: EngineArgs, spawned: EngineProcess | None = None
) -> tuple[EngineClient[Any], str, int]:
    """``(engine, model_id, max_model_len)``; raises ``ValueError`` on bad options and
    :class:`~ec_frontend.engine.core_proc.StartupError` when the engine cannot load.
    ``opts.engine_mode`` picks the engine process (``multiprocess``; ``spawned``: an
    engine interpreter started ahead, see ``EngineProcess.spawn``) or a thread of
    this one (``inprocess``)."""
    load_plugins()
    config, path = engine_config(opts)
    threads = cpu_threads(opts, builtin=config.model_id == _builtin_id())
    log.info("loading %s (%s, %s)", path, config.device or "auto device", config.dtype)
    if opts.engine_mode == "multiprocess":
        import torch

        from ec_frontend.engine.mp_client import MPEngineClient

        # The server's own torch work (image processing) runs on a pool of threads;
        # intra-op threads there would spin against the engine's on the same cores.
        torch.set_num_threads(1)
        if threads is None:
            threads = engine_process_threads(len(os.sched_getaffinity(0)))

        level = log.getEffectiveLevel()
        client: EngineClient[Any] = MPEngineClient.start(
            config, cpu_threads=threads, log_level=level, spawned=spawned
        )
        return client, config.model_id, config.scheduler.max_model_len
    import torch

    from ec_frontend.engine.async_engine import AsyncEngine

    device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and threads is not None:
        torch.set_num_threads(threads)
    engine: EngineClient[ProcessedInputs] = AsyncEngine.from_config(config)
    return engine, config.model_id, config.scheduler.max_model_len
