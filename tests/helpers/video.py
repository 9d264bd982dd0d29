"""Tiny video clips written by PyAV in the test itself (no binary fixtures).

Frame ``i`` of a clip is a flat colour whose red channel is ``30 * i`` (mod 256)
with a green bar ``4 * (i + 1)`` pixels wide on the left, so a decoded frame
tells which source frame it is.
"""

from __future__ import annotations

import io
from fractions import Fraction

import av
import numpy as np


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
