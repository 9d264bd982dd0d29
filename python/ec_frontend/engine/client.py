"""EngineClient: what the OpenAI server needs of an engine.

Three engines serve the server, and none of them inherits from the others:
:class:`~ec_frontend.engine.async_engine.AsyncEngine` (the core stepped by a thread of
this process), :class:`~ec_frontend.engine.mp_client.MPEngineClient` (the core in an
engine process, reached over ZMQ) and :class:`~ec_frontend.engine.mock.MockEngine`
(no model). Each satisfies :class:`EngineClient` structurally; mypy checks that
where each is built, by typed assignments (``engine/builder.py`` for the model
engines, ``entrypoints/launcher.py`` for the mock and the mock engine process).

The server takes inputs from the engine's own :attr:`EngineClient.processor` and
hands them back to the same engine's :meth:`EngineClient.add_request`; it never
looks inside them. So the protocol is generic in that inputs type
(``ProcessedInputs`` for the model engines, ``MockInputs`` for the mock), and the
server holds an ``EngineClient[Any]``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from ec_frontend._core import MediaItem
    from ec_frontend.engine.outputs import RequestOutput
    from ec_frontend.engine.sampling_params import SamplingParams
    from ec_frontend.engine.stats import EngineStats

__all__ = ["EngineClient", "InputsProcessor", "OutputStream"]

InputsT = TypeVar("InputsT")
InputsT_co = TypeVar("InputsT_co", covariant=True)


class OutputStream(Protocol):
    """One request's output deltas, the last one ``finished``. Closing the stream
    (``aclose``) before then aborts the request."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...
    def __anext__(self) -> Awaitable[RequestOutput]: ...
    def aclose(self) -> Awaitable[None]: ...


class InputsProcessor(Protocol[InputsT_co]):
    """Turns a parsed request into the engine's inputs (tokenizer, chat template,
    images). Runs on the server's side of the engine, often in a worker thread."""

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's Hugging Face tokenizer (the mock's: a character tokenizer);
        the server decodes prompts and bad words with it."""

    def process_chat(
        self,
        messages: list[dict[str, Any]],
        media: Sequence[MediaItem],
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        media_io_kwargs: dict[str, Any] | None = None,
    ) -> InputsT_co:
        """A chat request's prompt: the chat template over ``messages``, with the
        placeholders of ``media`` expanded (videos sampled by ``media_io_kwargs``)."""

    def process_prompt(self, prompt: str | list[int]) -> InputsT_co:
        """A completions prompt (text or token ids)."""

    def process_generate(self, token_ids: list[int], features: dict[str, Any] | None) -> InputsT_co:
        """A generate request: token ids with their multimodal features placed."""


class EngineClient(Protocol[InputsT]):
    """The engine as the OpenAI server uses it.

    Contract: request ids are the caller's and unique among the requests in flight
    (:meth:`holds_request` says which are taken); :meth:`add_request` is called from a
    running event loop and raises ``ValueError`` for an id in flight; a stream ends
    with one ``finished`` output (``finish_reason="abort"`` after :meth:`abort`).
    """

    @property
    def processor(self) -> InputsProcessor[InputsT]:
        """Makes the inputs :meth:`add_request` takes."""

    @property
    def is_running(self) -> bool:
        """False once the engine stopped or died (``/health`` answers 503)."""

    def add_request(
        self,
        request_id: str,
        inputs: InputsT,
        params: SamplingParams,
        group: str | None = None,
    ) -> OutputStream:
        """Submit a request; iterate the stream for its deltas. ``group``: the client
        request it belongs to (``engine/groups.py``), for :meth:`abort_groups`."""

    async def abort(self, request_id: str) -> None:
        """End a request early; its stream ends with ``finish_reason="abort"``."""

    async def abort_groups(self, groups: Sequence[str]) -> None:
        """Abort every request of these client requests (exact names), in this engine
        and, for an engine process, through every API server of its group."""

    def holds_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is taken: in flight, or finished and still held (a
        connector's KV or encoder outputs not yet pulled by another instance)."""

    def stats(self) -> EngineStats:
        """The latest statistics snapshot (``/metrics``)."""

    def shutdown(self) -> None:
        """Stop the engine; unfinished requests end with an error output."""
