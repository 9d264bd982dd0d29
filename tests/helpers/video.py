"""Tiny video clips written by PyAV in the test itself (no binary fixtures).

Frame ``i`` of a clip is a flat colour whose red channel is ``30 * i`` (mod 256)
with a green bar ``4 * (i + 1)`` pixels wide on the left, so a decoded frame
tells which source frame it is.
"""

from __future__ import annotations

import io
import struct
import zlib
from fractions import Fraction

import av
import numpy as np
from ec_frontend.model.video_processor import QwenVideoRule


def frame_rgb(i: int, width: int, height: int) -> np.ndarray:
    rgb = np.zeros((height, width, 3), np.uint8)
    rgb[..., 0] = (30 * i) % 256
    rgb[..., 2] = 64
    rgb[:, : min(width, 4 * (i + 1)), 1] = 255
    return rgb


def make_clip(
    frames: int = 8,
    width: int = 84,
    height: int = 56,
    *,
    container: str = "mp4",
    codec: str = "libx264",
    rate: int | Fraction = 4,
    gop: int | None = None,
    audio: bool = False,
) -> bytes:
    """A clip of ``frames`` frames (``frame_rgb``), encoded in memory; with ``audio``
    an audio stream is muxed too."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
        sound = out.add_stream("aac", rate=8000) if audio else None
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(frame_rgb(i, width, height), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if sound is not None:
            _mux_silence(out, sound)
    return buf.getvalue()


def make_audio_only() -> bytes:
    """An M4A file: one AAC stream, no video."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        _mux_silence(out, out.add_stream("aac", rate=8000))
    return buf.getvalue()


def make_empty_video(container: str = "matroska") -> bytes:
    """A file whose header declares a video stream and which holds no frame."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream("mpeg4", rate=4)
        stream.width, stream.height, stream.pix_fmt = 56, 56, "yuv420p"
        out.start_encoding()
    return buf.getvalue()


def _mux_silence(out: av.container.OutputContainer, stream: av.audio.stream.AudioStream) -> None:
    samples = np.zeros((1, 1024), np.float32)
    for k in range(4):
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = 8000
        frame.pts = k * 1024
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)


def decode_all(data: bytes) -> list[np.ndarray]:
    """Every frame, decoded in order without seeking (the reference for sampling)."""
    with av.open(io.BytesIO(data)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(c.streams.video[0])]


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    crc = zlib.crc32(kind + body) & 0xFFFFFFFF
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)


def png_frame(width: int, height: int, *, rows: int | None = None) -> bytes:
    """A black RGB PNG of ``width`` x ``height`` written row by row (never held in
    memory whole); with ``rows`` only that many rows of data follow the header (a
    frame that declares its size and is cut short)."""
    deflate = zlib.compressobj(9)
    row = b"\x00" * (1 + 3 * width)
    body = b"".join(deflate.compress(row) for _ in range(height if rows is None else rows))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", body + deflate.flush())
        + _png_chunk(b"IEND", b"")
    )


def make_png_video(
    width: int, height: int, *, frames: int = 2, streams: int = 1, rows: int | None = None
) -> bytes:
    """A MOV of ``streams`` PNG video streams of ``width`` x ``height``, ``frames``
    frames each (``png_frame``, with ``rows``): huge frames in a small file."""
    frame = png_frame(width, height, rows=rows)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mov") as out:
        added = []
        for _ in range(streams):
            stream = out.add_stream("png", rate=4)
            stream.width, stream.height, stream.pix_fmt = width, height, "rgb24"
            added.append(stream)
        for i in range(frames):
            for stream in added:
                packet = av.Packet(frame)
                packet.stream, packet.pts, packet.dts = stream, i, i
                packet.time_base = Fraction(1, 4)
                out.mux(packet)
    return buf.getvalue()


def qwen_video_rule(min_pixels: int, max_pixels: int) -> QwenVideoRule:
    """The Qwen2-VL video rule with OpenAI CLIP's mean and std and this pixel range."""
    return QwenVideoRule(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=(0.48145466, 0.4578275, 0.40821073),
        image_std=(0.26862954, 0.26130258, 0.27577711),
        rescale_factor=1 / 255,
    )
