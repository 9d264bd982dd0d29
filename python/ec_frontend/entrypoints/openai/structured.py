"""A parsed request's structured outputs and tools -> a compiled grammar and a tool plan.

The native parser has checked the shapes (``ParsedRequest.structured``); here the
constraint is compiled by the engine's library on the input-processing threads
(cached by spec), and every refusal is a 400 naming the parameter:

* a schema, regex or grammar the library cannot compile (``param`` is where the
  request gave it, e.g. ``response_format.json_schema.schema``);
* a grammar over ``--structured-outputs-max-grammar-bytes``, or one whose validation
  outlasts ``--structured-outputs-compile-timeout``;
* ``tool_choice: auto`` (also the default with ``tools``) on a server started
  without ``--enable-auto-tool-choice --tool-call-parser`` (as vLLM);
* a constraint on a server with no tokenizer (``--mock-engine``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any

from ec_frontend.config import DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S, DEFAULT_MAX_GRAMMAR_BYTES
from ec_frontend.entrypoints.http.errors import APIError
from ec_frontend.entrypoints.openai.tool_parsers import ToolPlan, plan_from, tool_call_grammar

if TYPE_CHECKING:
    from ec_frontend.engine.structured_output import CompiledGrammar, GrammarCompiler


class StructuredCompiler:
    """Builds the engine's grammar compiler on first use (it wraps the tokenizer)."""

    def __init__(
        self,
        engine: Any,
        vocab_size: int | None,
        *,
        max_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES,
        compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S,
    ) -> None:
        self._engine = engine
        self._vocab_size = vocab_size
        self._max_bytes = max_bytes
        self._compile_timeout_s = compile_timeout_s
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compiler(self, param: str) -> GrammarCompiler:
        """The compiler; a 400 naming ``param`` (the field that asked for it) when
        this server has no tokenizer to build one."""
        with self._lock:
            if self._compiler is None:
                self._compiler = self._build(param)
            return self._compiler

    def prepare(self) -> None:
        """Build the compiler now, if this server has a tokenizer."""
        with contextlib.suppress(APIError):
            self.compiler("structured_outputs")

    def _build(self, param: str) -> GrammarCompiler:
        # Imported on first use: a server that never constrains (--mock-engine) does
        # not load the library, torch or transformers.
        from ec_frontend.engine.structured_output import GrammarBudget, GrammarCompiler

        processor = getattr(self._engine, "processor", None)
        tokenizer = getattr(processor, "tokenizer", None)
        vocab = self._vocab_size or getattr(processor, "vocab_size", None)
        if tokenizer is None or not hasattr(tokenizer, "backend_tokenizer") or vocab is None:
            raise APIError(
                400,
                f"'{param}' needs the model's tokenizer to constrain the output, and this "
                "server has none (--mock-engine)",
                param=param,
                code="unsupported_value",
            )
        eos = getattr(self._engine, "eos_token_id", None)
        if eos is None:
            eos = tokenizer.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        budget = GrammarBudget(self._max_bytes, self._compile_timeout_s)
        return GrammarCompiler(tokenizer, vocab, eos_ids, budget)

    def compile(
        self,
        structured: dict[str, Any] | None,
        *,
        auto_tools: bool,
    ) -> tuple[CompiledGrammar | None, ToolPlan | None]:
        """The request's grammar (or ``None``) and its tool plan (or ``None``);
        blocking: call it on a worker thread."""
        if not structured:
            return None, None
        plan = plan_from(structured)
        if plan is not None and plan.choice == "auto" and not auto_tools:
            raise APIError(
                400,
                '"auto" tool choice requires --enable-auto-tool-choice and '
                "--tool-call-parser to be set",
                param="tool_choice",
                code="invalid_value",
            )
        from ec_frontend.engine.structured_output import StructuredOutputError

        constraint = structured.get("constraint")
        try:
            if plan is not None and plan.forced:
                compiler = self.compiler("tool_choice")
                self._check_parameters(compiler, plan, structured.get("endpoint") == "responses")
                return compiler.compile("lark", tool_call_grammar(plan), "tools"), plan
            if constraint is None:
                return None, plan
            param = constraint["param"]
            compiler = self.compiler(param.split(".")[0])
            grammar = compiler.compile(constraint["kind"], constraint["spec"], param)
        except StructuredOutputError as exc:
            raise APIError(400, exc.message, param=exc.param, code="invalid_value") from exc
        return grammar, plan

    @staticmethod
    def _check_parameters(compiler: GrammarCompiler, plan: ToolPlan, flat: bool) -> None:
        """Each tool's ``parameters`` compiles (named in the error by its own path)."""
        for i, tool in enumerate(plan.tools):
            if tool.get("parameters") is not None:
                at = f"tools[{i}].parameters" if flat else f"tools[{i}].function.parameters"
                compiler.compile("json", tool["parameters"], at)
