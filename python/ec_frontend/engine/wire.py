"""The engine process's wire format: the message schema both sides import.

Two channels connect the engine process (``engine/core_proc.py``) and its clients
(``engine/mp_client.py``, one per API server):

* **input**, a ZMQ ROUTER socket (``<directory>/in``): ``[ADD, request_id, inputs,
  params]`` (with a fifth element, the request's group: the client request it is a
  choice of), ``[ABORT, [ids]]``, ``[ABORT_GROUPS, [groups]]`` (every request of
  those groups, whichever client added it: an abort through any API server of a
  group reaches the request), ``[STOP, id, reason]``, ``[SHUTDOWN]``;
* **output**, one Unix stream connection per client (``<directory>/out.sock``):
  ``[HELLO, identity]`` once from the client, answered ``[WELCOME, info]``; then
  one :class:`EngineOutputs` after every step that computed anything. Each message
  is one frame: its length (4 bytes, little-endian), then the header. The engine
  sends a step's message with one ``send`` on a socket it never blocks on (what
  the kernel does not take waits for the socket to drain); a ZMQ socket here
  cost a wake-up of ZMQ's I/O thread on both sides per step, which made up most
  of a mock engine's per-step cost.

Messages are msgpack (msgspec) headers, version :data:`PROTOCOL_VERSION`; outputs
are :class:`msgspec.Struct` s encoded as arrays (``array_like``): fields by name in
the code, positions only on the wire. Tensors (pixel values, M-RoPE positions,
image embeddings) travel as extra frames after the header, sent without copying
and received as views of the frame; the header holds their dtype and shape.
"""

from __future__ import annotations

import struct
import sys
import types
import warnings
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING, Any, TypeGuard

import msgspec
import zmq

from ec_frontend.engine.outputs import TokenLogprob

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ec_frontend.engine.outputs import RequestOutput
    from ec_frontend.types import JSONObject

PROTOCOL_VERSION = 2  # 2: ADD carries the group, ABORT_GROUPS

# ---- message kinds (the first element of every header) -----------------------
#: client -> engine (input socket)
ADD, ABORT, STOP, SHUTDOWN = "add", "abort", "stop", "shutdown"
ABORT_GROUPS = "abort_groups"
#: client -> engine (output socket), and the engine's answer
HELLO, WELCOME = b"hello", "welcome"
#: engine -> client (output socket)
OUTPUTS = "out"

_EXT_TENSOR = 1
_EXT_NDARRAY = 2


# ---- frames -------------------------------------------------------------------


#: A frame as ``send_multipart`` takes it and ``recv_multipart`` gives it back.
Frame = bytes | memoryview | zmq.Frame

#: The output channel's socket file in the engine's directory.
OUTPUT_SOCKET = "out.sock"
#: Most bytes one output frame may declare (a corrupt length ends the channel).
MAX_FRAME = 1 << 30
_LENGTH = struct.Struct("<I")


def stream_frame(header: bytes) -> bytes:
    """One output-channel frame: the header's length, then the header."""
    return _LENGTH.pack(len(header)) + header


class FrameReader:
    """Splits the bytes of an output channel into frames."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The frames completed by ``data`` (the rest waits for more)."""
        buf = self._buf
        buf += data
        frames: list[bytes] = []
        start, end = 0, len(buf)
        while end - start >= 4:
            (size,) = _LENGTH.unpack_from(buf, start)
            if size > MAX_FRAME:
                raise ValueError(f"an output frame declares {size} bytes")
            if end - start - 4 < size:
                break
            frames.append(bytes(buf[start + 4 : start + 4 + size]))
            start += 4 + size
        if start:
            del buf[:start]
        return frames


class Codec:
    """msgpack headers with tensors as extra frames. Not thread-safe: one per user."""

    def __init__(self) -> None:
        self._frames: list[Frame] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._inner = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)
        self._in_frames: Sequence[Frame] = []

    def encode(self, message: object) -> list[Frame]:
        """``[header, *tensor buffers]`` for ``zmq.Socket.send_multipart(copy=False)``."""
        self._frames = []
        try:
            header = self._encoder.encode(message)
            return [header, *self._frames]
        finally:
            self._frames = []

    def encode_header(self, message: object) -> bytes:
        """``message`` as one header (the output channel's messages carry no tensors)."""
        frames = self.encode(message)
        header = frames[0]
        if len(frames) != 1 or not isinstance(header, bytes):
            raise ValueError("an output-channel message carries no tensors")
        return header

    def decode(self, frames: Sequence[Frame]) -> Any:
        """The message of ``[header, *tensor frames]`` (frames from ``copy=False``); its
        shape is the sender's (msgpack values, tensors and arrays): Any to the caller."""
        self._in_frames = frames
        try:
            return self._decoder.decode(_buffer(frames[0]))
        finally:
            self._in_frames = []

    def _enc_hook(self, obj: object) -> msgspec.msgpack.Ext:
        import numpy as np

        if _is_tensor(obj):
            tensor = obj.detach()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            tensor = tensor.contiguous()
            dtype = str(tensor.dtype).removeprefix("torch.")
            shape = list(tensor.shape)
            flat = tensor.reshape(-1).view(_torch().uint8)
            raw = flat.numpy().data if tensor.numel() else b""
            return self._ext(_EXT_TENSOR, dtype, shape, raw)
        if isinstance(obj, np.ndarray):
            arr = np.ascontiguousarray(obj)
            return self._ext(_EXT_NDARRAY, arr.dtype.str, list(arr.shape), arr.reshape(-1).data)
        raise NotImplementedError(f"cannot send a {type(obj).__name__} to the engine")

    def _ext(
        self, code: int, dtype: str, shape: list[int], raw: memoryview | bytes
    ) -> msgspec.msgpack.Ext:
        index = len(self._frames) + 1
        self._frames.append(memoryview(raw).cast("B") if len(raw) else b"")
        return msgspec.msgpack.Ext(code, self._inner.encode((index, dtype, shape)))

    def _ext_hook(self, code: int, data: memoryview) -> torch.Tensor | np.ndarray[Any, Any]:
        index, dtype, shape = msgspec.msgpack.decode(data)
        buf = _buffer(self._in_frames[index])
        if code == _EXT_TENSOR:
            import torch

            torch_dtype = getattr(torch, dtype)
            if not len(buf):
                return torch.empty(shape, dtype=torch_dtype)
            with warnings.catch_warnings():
                # The frame is read-only to Python; the engine only reads its inputs.
                warnings.simplefilter("ignore")
                flat = torch.frombuffer(buf, dtype=torch.uint8)
            return flat.view(torch_dtype).view(shape)
        if code == _EXT_NDARRAY:
            import numpy as np

            return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
        raise ValueError(f"unknown extension type {code}")


def _buffer(frame: Frame) -> bytes | memoryview:
    return frame.buffer if isinstance(frame, zmq.Frame) else frame


def _torch() -> types.ModuleType:
    import torch

    return torch


def _is_tensor(obj: object) -> TypeGuard[torch.Tensor]:
    """A tensor (without importing torch where no tensor can exist yet)."""
    torch = sys.modules.get("torch")
    return type(obj).__module__ == "torch" or (torch is not None and isinstance(obj, torch.Tensor))


# ---- dataclasses on the wire ---------------------------------------------------


def pack_dataclass(obj: Any) -> dict[str, Any]:
    """A dataclass as a map of its fields (nested dataclasses too); tuple fields are
    named under ``__tuples__`` so that they come back as tuples."""
    out: dict[str, Any] = {}
    tuples: list[str] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if is_dataclass(value) and not isinstance(value, type):
            value = pack_dataclass(value)
        elif isinstance(value, list) and value and is_dataclass(value[0]):
            value = [pack_dataclass(v) for v in value]
        elif isinstance(value, tuple):
            tuples.append(f.name)
        out[f.name] = value
    if tuples:
        out["__tuples__"] = tuples
    return out


def unpack_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a packed dataclass (tuples restored)."""
    tuples = data.pop("__tuples__", ())
    for name in tuples:
        data[name] = tuple(data[name])
    return data


def pack_params(params: Any) -> dict[str, Any]:
    """Sampling params for the wire; a compiled grammar travels as its kind and text."""
    data = pack_dataclass(params)
    grammar = getattr(params, "structured_outputs", None)
    if grammar is not None:
        data["structured_outputs"] = [grammar.kind, grammar.grammar]
    return data


# ---- outputs ------------------------------------------------------------------


class EngineOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's delta of one step, as its client sees it (``request_id`` is
    the client's own id). ``finish_reason`` set: the request ended."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    #: ``[token_id, logprob, rank, top]`` per token (an array-like struct, decoded as it is).
    logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    error: str | None = None


class EngineOutputs(msgspec.Struct, array_like=True, gc=False, tag=OUTPUTS):
    """Everything one client gets after a step: its outputs (possibly none), the
    engine's stats snapshot (:class:`~ec_frontend.engine.stats.EngineStats`' field
    values in field order) and the client's request ids that connectors started or
    stopped holding after they finished."""

    outputs: list[EngineOutput]
    stats: list[Any]
    held_added: list[str] | None = None
    held_released: list[str] | None = None


def pack_output(out: RequestOutput, request_id: str) -> EngineOutput:
    """``out`` for the wire, under the client's ``request_id``."""
    return EngineOutput(
        request_id,
        out.token_ids,
        out.finish_reason,
        out.stop_reason,
        out.logprobs,
        out.num_cached_tokens,
        _wire_dict(out.kv_transfer_params),
        _wire_dict(out.ec_transfer_params),
        out.error,
    )


def _wire_dict(params: JSONObject | None) -> dict[str, Any] | None:
    """Transfer params as msgspec encodes them: a dict (they are one already)."""
    return params if params is None or isinstance(params, dict) else dict(params)


def outputs_decoder() -> msgspec.msgpack.Decoder[EngineOutputs]:
    """A decoder of the engine's step messages (no tensors travel in them)."""
    return msgspec.msgpack.Decoder(EngineOutputs)
