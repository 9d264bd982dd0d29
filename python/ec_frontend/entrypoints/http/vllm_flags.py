"""vLLM's ``vllm serve`` flags -> what ``ec-frontend serve`` does with them: the one table.

Every flag of vLLM 0.33's ``vllm serve`` is either accepted with vLLM's meaning
(ours defines it, under vLLM's name or as an alias) or refused when given, with
one line ``ec-frontend serve: --FLAG: not supported: <reason / alternative>`` and
exit status 2, never argparse's bare "unrecognized arguments".

* :data:`ALIASES`: vLLM's name -> ours, where ours differ; :func:`add_vllm_flags`
  adds vLLM's as a second option string of our flag. (Pairs such as
  ``--disable-prefix-caching`` / ``--disable-uvicorn-access-log``, which switch our
  flag off, are defined beside our flag.)
* :data:`ONLY`: flags accepted only with some values (``--tensor-parallel-size 1``);
  any other value is refused with the reason.
* :data:`NO_OPS`: flags accepted and ignored because they describe what this
  server always does (each with the reason, shown in ``--help``).
* :data:`UNSUPPORTED`: reason -> flags refused whatever their value.

:func:`add_vllm_flags` registers the entries of the last three tables that the
parser does not define yet, so a flag implemented later (by ``cli.py``,
``media/options.py`` ...) simply takes precedence over its refusal. ``docs/server.md``
lists the same table for readers.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

#: vLLM's option string -> ours (same meaning, different name).
ALIASES: dict[str, str] = {
    "--kv-cache-memory-bytes": "--kv-cache-memory",
    "--device-memory-utilization": "--gpu-memory-utilization",
    "--h11-max-incomplete-event-size": "--max-header-bytes",
    "--renderer-num-workers": "--processing-workers",
    "--shutdown-timeout": "--drain-timeout",
    "-asc": "--api-server-count",
}

_ONE_DEVICE = "one device per instance: run more instances behind `ec-frontend proxy`"

#: Flags accepted only with these values (as vLLM spells them): flag -> (values, reason).
ONLY: dict[str, tuple[tuple[str, ...], str]] = {
    "--tensor-parallel-size": (("1",), _ONE_DEVICE),
    "--pipeline-parallel-size": (("1",), _ONE_DEVICE),
    "--data-parallel-size": (("1",), _ONE_DEVICE),
    "--decode-context-parallel-size": (("1",), _ONE_DEVICE),
    "--prefill-context-parallel-size": (("1",), _ONE_DEVICE),
    "--kv-cache-dtype": (("auto",), "the KV cache is kept in the model's --dtype"),
    "--runner": (("auto", "generate"), "generation models only (no pooling or draft runners)"),
    "--convert": (("auto", "none"), "generation models only (no embedding or classify adapters)"),
    "--tokenizer-mode": (("auto",), "the checkpoint's fast tokenizer is always used"),
    "--config-format": (("auto",), "the checkpoint's config.json is read (Hugging Face format)"),
    "--chat-template-content-format": (
        ("auto", "openai"),
        "messages reach the chat template in OpenAI's content-part format",
    ),
    "--scheduling-policy": (("fcfs",), "requests are scheduled first come, first served"),
    "--stream-interval": (("1",), "every token is streamed as soon as it is sampled"),
    "--logprobs-mode": (
        ("raw_logprobs",),
        "logprobs are the log-softmax of the raw logits (before penalties and temperature)",
    ),
    "--generation-config": (
        ("vllm",),
        "sampling defaults are vLLM's, set per request; the checkpoint's "
        "generation_config.json supplies only its EOS token ids",
    ),
    "--load-format": (
        ("auto", "safetensors", "dummy"),
        "weights load from safetensors (or random, dummy)",
    ),
}

#: vLLM's short forms of :data:`ONLY` flags.
SHORT: dict[str, str] = {
    "--tensor-parallel-size": "-tp",
    "--pipeline-parallel-size": "-pp",
    "--data-parallel-size": "-dp",
    "--decode-context-parallel-size": "-dcp",
    "--prefill-context-parallel-size": "-pcp",
}

#: Flags accepted as no-ops: flag -> why that is honest.
NO_OPS: dict[str, str] = {
    "--trust-remote-code": "no checkpoint code is ever run: the model families are "
    "implemented here, so there is nothing to trust",
    "--no-trust-remote-code": "no checkpoint code is ever run",
    "--enable-chunked-prefill": "prompts longer than --max-num-batched-tokens are always "
    "prefilled in chunks",
    "--no-enable-prompt-embeds": "prompt embeddings are never accepted",
    "--disable-lora": "no LoRA adapters are loaded",
}

#: Reason -> vLLM flags refused whatever their value (flags separated by spaces).
UNSUPPORTED_TEXT: dict[str, str] = {
    "one device per instance: run more instances behind `ec-frontend proxy`": """
        --headless --data-parallel-supervisor-port --dp-supervisor-probe-interval-s
        --dp-supervisor-probe-timeout-s --dp-supervisor-probe-failure-threshold
        --distributed-executor-backend --master-addr --master-port --nnodes -n --node-rank -r
        --distributed-timeout-seconds --cpu-distributed-timeout-seconds --numa-bind --no-numa-bind
        --numa-bind-nodes --numa-bind-cpus --device-ids --dcp-comm-backend --dcp-q-replicate
        --no-dcp-q-replicate --dcp-kv-cache-interleave-size --cp-kv-cache-interleave-size
        --data-parallel-rank -dpn --data-parallel-start-rank -dpr --data-parallel-size-local -dpl
        --data-parallel-address -dpa --data-parallel-rpc-port -dpp --data-parallel-backend -dpb
        --data-parallel-hybrid-lb --no-data-parallel-hybrid-lb -dph --data-parallel-external-lb
        --no-data-parallel-external-lb -dpe --data-parallel-multi-port-external-lb -dpm
        --enable-hc-sp --disable-hc-sp --enable-expert-parallel -ep --disable-expert-parallel
        --enable-batch-sharded-sampling --disable-batch-sharded-sampling --enable-ep-weight-filter
        --disable-ep-weight-filter --all2all-backend --enable-dbo --disable-dbo
        --enable-shm-tensor-arena --disable-shm-tensor-arena --ubatch-size --enable-elastic-ep
        --disable-elastic-ep --elastic-ep-max-dp-size --dbo-decode-token-threshold
        --dp-sync-interval --dbo-prefill-token-threshold --disable-nccl-for-dp-synchronization
        --enable-nccl-for-dp-synchronization --enable-eplb --disable-eplb --eplb-config
        --expert-placement-strategy --ray-workers-use-nsight --no-ray-workers-use-nsight
        --disable-custom-all-reduce --enable-custom-all-reduce --worker-cls --worker-extension-cls
        --enable-fault-tolerance --disable-fault-tolerance --fault-tolerance-config
        --enable-scale-out --disable-scale-out --mm-encoder-tp-mode --enable-nccl-comm-suspend
        --disable-nccl-comm-suspend
    """,
    "LoRA adapters are not implemented": """
        --lora-modules --enable-lora --max-loras --max-lora-rank --lora-dtype
        --enable-tower-connector-lora --disable-tower-connector-lora --max-cpu-loras
        --fully-sharded-loras --no-fully-sharded-loras --lora-target-modules --default-mm-loras
        --specialize-active-lora --no-specialize-active-lora --enable-mixed-moe-lora-format
        --disable-mixed-moe-lora-format --enable-moe-shared-loras --disable-moe-shared-loras
        --max-lora-cls-labels
    """,
    "weights load in --dtype; quantized checkpoints and KV caches are not supported": """
        --quantization -q --quantization-config --allow-deprecated-quantization
        --no-allow-deprecated-quantization --kv-cache-dtype-skip-layers --mm-encoder-attn-dtype
        --mm-encoder-fp8-scale-path --mm-encoder-fp8-scale-save-path
        --mm-encoder-fp8-scale-save-margin
    """,
    "speculative decoding is not implemented": """
        --speculative-config -sc --spec-method --spec-model --spec-tokens
    """,
    "no Mamba, hybrid or sliding-window models here (the families: docs/models.md)": """
        --mamba-backend --mamba-ssu-algorithm --enable-mamba-cache-stochastic-rounding
        --disable-mamba-cache-stochastic-rounding --mamba-cache-philox-rounds --mamba-cache-dtype
        --mamba-ssm-cache-dtype --mamba-block-size --prefix-match-unit --mamba-cache-mode
        --enable-mamba-shared-prefix-checkpoint --disable-mamba-shared-prefix-checkpoint
        --replayssm-buffer-len --use-replayssm --no-use-replayssm --swa-bounded-replay
        --no-swa-bounded-replay --gdn-prefill-backend --kda-prefill-backend --kda-decode-backend
        --disable-sliding-window --enable-sliding-window --disable-hybrid-kv-cache-manager
        --enable-hybrid-kv-cache-manager --kv-sharing-fast-prefill --no-kv-sharing-fast-prefill
        --engram-config --enable-return-routed-experts --disable-return-routed-experts --moe-backend
        --sparse-indexer-topk-backend
    """,
    "generation only: no pooling, embedding or scoring models": """
        --pooler-config --enable-flash-late-interaction --disable-flash-late-interaction
        --io-processor-plugin --diffusion-config -dc --tokens-only --no-tokens-only
    """,
    "weights and KV cache stay on the device (no offloading or sleep mode)": """
        --kv-offloading-size --kv-offloading-backend --offload-backend --cpu-offload-gb
        --cpu-offload-params --offload-group-size --offload-num-in-group --offload-prefetch-step
        --offload-params --enable-sleep-mode --disable-sleep-mode --sleep-mode-backend
        --sleep-mode-offload-cudagraph --no-sleep-mode-offload-cudagraph
        --sleep-preserve-parameter-names --enable-cumem-allocator --disable-cumem-allocator
        --weight-transfer-config --pt-load-map-location
    """,
    "kernels are this project's own: choose with --attention-backend and --enforce-eager": """
        --compilation-config -cc --attention-config -ac --kernel-config --linear-backend
        --ir-op-priority --monokernel --no-monokernel --enable-flashinfer-autotune
        --disable-flashinfer-autotune --optimization-level --performance-mode
        --mm-encoder-attn-backend --disable-cascade-attn --enable-cascade-attn --use-fp64-gumbel
        --no-use-fp64-gumbel --cudagraph-capture-sizes --max-cudagraph-capture-size
        --async-scheduling --no-async-scheduling --watchdog-config --jit-monitor-mode
        --jit-monitor-verbose --no-jit-monitor-verbose --aux-output-config --additional-config
        --model-impl --model-class-overrides --hf-overrides --logits-processors --scheduler-cls
        --return-sampling-mask --no-return-sampling-mask --enable-trace-replay
        --disable-trace-replay
    """,
    "the scheduler's policy is fixed: first come, first served, chunked prefill": """
        --long-prefill-token-threshold --long-prefill-token-threshold-adaptive
        --no-long-prefill-token-threshold-adaptive --max-num-scheduled-tokens --max-num-active-seqs
        --max-num-queued-reqs --max-num-queued-tokens --disable-chunked-mm-input
        --enable-chunked-mm-input --prefill-schedule-interval --watermark
        --scheduler-reserve-full-isl --no-scheduler-reserve-full-isl --disable-chunked-prefill
        --prefix-caching-hash-algo --prefix-cache-retention-interval --ec-manager-config
        --watermark-config --reasoning-config --structured-outputs-config
    """,
    "use --kv-cache-memory-bytes to size the KV cache": """
        --num-gpu-blocks-override
    """,
    "sampling parameters are set per request (vLLM's defaults otherwise)": """
        --override-generation-config
    """,
    "vLLM's tracing, profiling and extra metrics are not implemented (/metrics and "
    "the logs are this server's)": """
        --otlp-traces-endpoint --collect-detailed-traces --per-request-spec-decode-metrics
        --kv-cache-metrics --no-kv-cache-metrics --kv-cache-metrics-sample
        --custom-histogram-buckets --cudagraph-metrics --no-cudagraph-metrics
        --enable-layerwise-nvtx-tracing --disable-layerwise-nvtx-tracing --enable-mfu-metrics
        --disable-mfu-metrics --enable-logging-iteration-details --disable-logging-iteration-details
        --profiler-config --show-hidden-metrics-for-version --enable-per-request-metrics
        --disable-per-request-metrics --enable-server-load-tracking --disable-server-load-tracking
        --logging-config --log-config-file --aggregate-engine-logging --enable-log-outputs
        --disable-log-outputs --enable-log-deltas --disable-log-deltas --log-error-stack
        --no-log-error-stack --kv-events-config --fail-on-environ-validation
        --no-fail-on-environ-validation --disable-access-log-for-endpoints
    """,
    "the multimodal processor is this project's own (per-request mm_processor_kwargs;"
    " --max-media-items; docs/preprocessing.md)": """
        --mm-processor-kwargs --mm-processor-cache-type
        --mm-hasher-algorithm --mm-shm-cache-max-object-size-mb --interleave-mm-strings
        --no-interleave-mm-strings --skip-mm-profiling --no-skip-mm-profiling --video-pruning-rate
        --video-pruning-method --mm-tensor-ipc --mm-processor-device --mm-ipc-gpu-memory-gb
        --mm-device-do-normalize --no-mm-device-do-normalize --enable-mm-embeds --disable-mm-embeds
        --media-io-kwargs --language-model-only --no-language-model-only --trust-request-mm-kwargs
        --no-trust-request-mm-kwargs
    """,
    'an encoder-only instance is an EC producer: --ec-transfer-config with "ec_role":'
    ' "ec_producer" (docs/disaggregation.md)': """
        --mm-encoder-only --no-mm-encoder-only
    """,
    "checkpoints are local directories or Hugging Face ids in the local cache (set "
    "HF_TOKEN / HF_HUB_CACHE for the hub)": """
        --hf-config-path --code-revision --tokenizer-revision --hf-token --download-dir
        --safetensors-load-strategy --safetensors-prefetch-num-threads
        --safetensors-prefetch-block-size --model-loader-extra-config --ignore-patterns
        --use-tqdm-on-load --no-use-tqdm-on-load --max-parallel-loading-workers
        --skip-tokenizer-init --no-skip-tokenizer-init --enable-prompt-embeds
        --disable-prompt-embeds --config
    """,
    "the chat template: the checkpoint's or --chat-template (kwargs per request)": """
        --trust-request-chat-template --no-trust-request-chat-template
        --default-chat-template-kwargs
    """,
    "no reasoning parser: reasoning text stays in the message content": """
        --reasoning-parser --reasoning-parser-plugin --reasoning-effort-map
        --cohere-is-reasoning-model --no-cohere-is-reasoning-model --cohere-format
        --anthropic-disabled-thinking-effort
    """,
    "tool calls: --enable-auto-tool-choice with --tool-call-parser (built-in parsers only)": """
        --tool-parser-plugin --tool-strict-level --tool-server --exclude-tools-when-tool-choice-none
        --no-exclude-tools-when-tool-choice-none
    """,
    "the OpenAI responses keep OpenAI's shape (no vLLM response extensions)": """
        --response-role --return-tokens-as-token-ids --no-return-tokens-as-token-ids
        --enable-prompt-tokens-details --disable-prompt-tokens-details --enable-force-include-usage
        --disable-force-include-usage --sse-keep-alive-interval --enable-tokenizer-info-endpoint
        --disable-tokenizer-info-endpoint --fingerprint-mode --fingerprint-value
        --enable-request-id-headers --disable-request-id-headers
    """,
    "HTTP on TCP only (no gRPC, Unix sockets, middleware plugins or YAML configs)": """
        --grpc --grpc-port --uds --middleware --enable-ssl-refresh --disable-ssl-refresh
    """,
    "the docs routes are always served (behind the API key unless --public-docs)": """
        --disable-fastapi-docs --enable-fastapi-docs --enable-offline-docs --disable-offline-docs
    """,
    "headers are bounded by bytes (--max-header-bytes)": """
        --h11-max-header-count
    """,
}
UNSUPPORTED: dict[str, tuple[str, ...]] = {
    reason: tuple(flags.split()) for reason, flags in UNSUPPORTED_TEXT.items()
}


def refuse(parser: argparse.ArgumentParser, flag: str, reason: str) -> None:
    """Exit 2 with ``PROG: FLAG: not supported: REASON`` (one line)."""
    parser.exit(2, f"{parser.prog}: {flag}: not supported: {reason}\n")


class Refused(argparse.Action):
    """A vLLM flag this server does not implement: exits 2 with one line when given
    (whatever follows it is taken as its values, so the line names this flag)."""

    def __init__(self, option_strings: Sequence[str], dest: str, reason: str = "",
                 **kwargs: Any) -> None:  # fmt: skip
        kwargs.setdefault("nargs", "*")
        super().__init__(option_strings, dest, **kwargs)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        refuse(parser, option_string or self.option_strings[0], self.reason)


class OnlyValues(argparse.Action):
    """A flag accepted with the values ``allowed`` (compared as written, or after
    ``type``); any other value exits 2 with the ``reason`` line, in place of
    argparse's multi-line "invalid choice"."""

    def __init__(self, option_strings: Sequence[str], dest: str,
                 allowed: Sequence[str] = (), reason: str = "", **kwargs: Any) -> None:  # fmt: skip
        kwargs.setdefault("metavar", "{" + ",".join(allowed) + "}")
        super().__init__(option_strings, dest, **kwargs)
        self.allowed = tuple(allowed)
        self.reason = reason

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        if str(values) not in self.allowed:
            flag = option_string or self.option_strings[0]
            refuse(
                parser, f"{flag} {values}", f"{self.reason} (accepted: {', '.join(self.allowed)})"
            )
        setattr(namespace, self.dest, values)


class NoOp(argparse.Action):
    """A vLLM flag that describes what this server always does: accepted, ignored."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        return None


def _defined(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add :data:`ALIASES` to our flags, and register the :data:`ONLY`, :data:`NO_OPS`
    and :data:`UNSUPPORTED` flags that the parser does not define yet. Call it after
    every real flag is added."""
    for theirs, ours in ALIASES.items():
        action = parser._option_string_actions.get(ours)
        if action is not None and not _defined(parser, theirs):
            action.option_strings = [*action.option_strings, theirs]
            parser._option_string_actions[theirs] = action
    group = parser.add_argument_group(
        "vLLM flags accepted for compatibility (the full table: docs/server.md)"
    )
    for flag, (allowed, reason) in ONLY.items():
        if not _defined(parser, flag):
            short = [SHORT[flag]] if flag in SHORT and not _defined(parser, SHORT[flag]) else []
            group.add_argument(
                flag,
                *short,
                action=OnlyValues,
                allowed=allowed,
                reason=reason,
                dest="vllm_" + flag.lstrip("-").replace("-", "_"),
                help=f"accepted only as {' or '.join(allowed)}: {reason}",
            )
    for flag, reason in NO_OPS.items():
        if not _defined(parser, flag):
            group.add_argument(flag, action=NoOp, help=f"accepted, no effect: {reason}")
    for reason, flags in UNSUPPORTED.items():
        for flag in flags:
            if not _defined(parser, flag):
                parser.add_argument(
                    flag, action=Refused, reason=reason, dest="vllm_refused", help=argparse.SUPPRESS
                )


def refused_flags() -> dict[str, str]:
    """Every refused flag -> its reason (for docs and tests)."""
    return {flag: reason for reason, flags in UNSUPPORTED.items() for flag in flags}
