"""Video bytes -> sampled RGB frames with their times, bounded, every failure an
:class:`InputError`.

Contract of :func:`decode_video`:

* the container is opened with PyAV (FFmpeg in its wheel); it must hold a video
  stream (an audio-only file is refused) whose frame size, read from the
  stream's header before any frame is decoded, is within
  ``limits.max_frame_pixels``;
* the video's frames are counted and timed from its packets (demuxed, not
  decoded), so a header's claims (a 24-hour duration, a frame count) are never
  trusted: the duration is the frame count over the stream's rate, within
  ``limits.max_duration_s``; a file with fewer frames than its header declares
  (a frame count, or a duration longer by more than a tenth and two frames)
  is refused as truncated;
* frames are sampled as vLLM 0.33's video loader samples them
  (:func:`sample_indices`): ``num_frames`` (default 32) and ``fps`` (default:
  none) both bound the count, the smaller wins, at least one frame, spread by
  ``linspace`` over the whole video; the count is within ``limits.max_frames``
  and count x frame pixels within ``limits.max_video_pixels``, checked before
  decoding, so decoded memory is bounded by the caps;
* only the sampled frames are kept: the decoder seeks to the keyframe before a
  sampled frame when that skips a whole keyframe interval, and otherwise decodes
  forward;
  for H.264 and HEVC, frames that no other frame references (most B-frames) are
  not decoded unless they are sampled (FFmpeg's ``skip_frame``, set per packet);
* a sampled frame that cannot be decoded (truncated or corrupt data) fails the
  video; a frame of another size than the stream's header says fails it too;
* every decoded video is counted, with its sampled frames and its container
  bytes (``ec_frontend_videos_decoded_total``, ``..._video_frames_decoded_total``,
  ``..._video_bytes_decoded_total`` on ``/metrics``).

The call is CPU-bound and blocking: the server runs it on its input-processing
pool, never on the event loop.
"""

from __future__ import annotations

import bisect
import io
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from ec_frontend.metrics import VIDEO_BYTES_DECODED, VIDEO_FRAMES_DECODED, VIDEOS_DECODED
from ec_frontend.model.errors import InputError

#: Codecs whose decoders drop non-reference frames on request (``skip_frame``
#: ``NONREF``) without touching the frames that are decoded.
SKIP_NONREF_CODECS = frozenset({"h264", "hevc"})

#: vLLM 0.33's defaults: ``VideoMediaIO(num_frames=32)``, the loader's ``fps=-1``.
DEFAULT_NUM_FRAMES = 32
DEFAULT_FPS = -1.0


@dataclass(frozen=True, slots=True)
class VideoLimits:
    """Bounds on one video (the ``--max-video-*`` flags)."""

    #: Sampled frames per video.
    max_frames: int = 128
    #: Width x height of a frame, from the stream's header.
    max_frame_pixels: int = 8_294_400  # 3840 x 2160
    #: Sampled frames x frame pixels: the decoded RGB frames take 3 bytes per pixel.
    max_video_pixels: int = 132_710_400  # 64 frames of 1920 x 1080 (about 400 MB)
    #: Seconds of video (frames over the stream's rate).
    max_duration_s: float = 3600.0

    def __post_init__(self) -> None:
        if min(self.max_frames, self.max_frame_pixels, self.max_video_pixels) <= 0:
            raise ValueError("video limits must be > 0")
        if not self.max_duration_s > 0:
            raise ValueError("the video duration limit must be > 0")


@dataclass(frozen=True, slots=True)
class VideoSampling:
    """vLLM's ``media_io_kwargs["video"]``: ``num_frames`` (0 or less: every frame) and
    ``fps`` (0 or less: no rate bound)."""

    num_frames: int = DEFAULT_NUM_FRAMES
    fps: float = DEFAULT_FPS

    @classmethod
    def from_kwargs(cls, media_io_kwargs: Mapping[str, Any] | None) -> VideoSampling:
        """As vLLM merges them: a request that sets only one of the two drops the other
        default (the parser has checked the types)."""
        video = (media_io_kwargs or {}).get("video") or {}
        num_frames = video.get("num_frames")
        fps = video.get("fps")
        if num_frames is None and fps is None:
            return cls()
        return cls(
            num_frames=-1 if num_frames is None else int(num_frames),
            fps=-1.0 if fps is None else float(fps),
        )


@dataclass(frozen=True, slots=True)
class DecodedVideo:
    """Sampled frames ``[n, height, width, 3]`` uint8 RGB, their indices in the video,
    their presentation times in seconds, and the video's frame count and rate."""

    frames: np.ndarray
    indices: list[int]
    timestamps: list[float]
    total_frames: int
    fps: float


def sample_indices(total: int, duration_s: float, sampling: VideoSampling) -> list[int]:
    """The frames vLLM 0.33's uniform loader takes (``VideoBackend``): the fewer of
    ``num_frames`` and ``floor(duration * fps)`` (each when positive), capped by the
    video's frames, at least one; every frame when that is all of them, else
    ``linspace(0, total - 1, n)`` truncated to integers."""
    n = total
    if sampling.num_frames > 0:
        n = min(sampling.num_frames, total)
    if sampling.fps > 0:
        n = min(n, math.floor(duration_s * sampling.fps))
    n = max(1, n)
    if n == total:
        return list(range(total))
    return [int(i) for i in np.linspace(0, total - 1, n, dtype=int)]


def _bad(index: int, what: str, code: str = "invalid_video") -> InputError:
    return InputError(f"video {index} {what}", code=code)


def decode_video(
    data: bytes | None,
    *,
    index: int,
    sampling: VideoSampling,
    limits: VideoLimits,
    check: Callable[[int, int, int], None] | None = None,
) -> DecodedVideo:
    """The sampled frames of ``data`` (module docstring); ``index`` names the item.
    ``check(frames, height, width)``, when given, is called with the sampled frame
    count and the frame size before any frame is decoded (it raises to refuse)."""
    import av  # FFmpeg's libraries load on the first video, not at import

    if not data:
        raise _bad(index, "is empty" if data is not None else "has no data")
    try:
        # FFmpeg's probe decodes a frame of each stream while opening: cap its frame
        # size there already (every stream the header declares), so a header claiming
        # huge frames allocates nothing.
        container = av.open(
            io.BytesIO(data),
            mode="r",
            metadata_errors="ignore",
            options={"max_pixels": str(limits.max_frame_pixels)},
        )
    except (av.FFmpegError, ValueError, OSError) as exc:
        raise _bad(index, f"is not a readable video container ({exc})") from exc
    try:
        decoded = _decode(container, index, sampling, limits, check)
    except (av.FFmpegError, OSError) as exc:
        raise _bad(index, f"could not be decoded (corrupt or truncated: {exc})") from exc
    finally:
        container.close()
    with _count_lock:
        VIDEOS_DECODED.inc()
        VIDEO_FRAMES_DECODED.inc(amount=len(decoded.indices))
        VIDEO_BYTES_DECODED.inc(amount=len(data))
    return decoded


_count_lock = threading.Lock()


def _decode(
    container: Any,
    index: int,
    sampling: VideoSampling,
    limits: VideoLimits,
    check: Callable[[int, int, int], None] | None,
) -> DecodedVideo:
    if not container.streams.video:
        raise _bad(index, "has no video stream (audio-only or not a video)")
    stream = container.streams.video[0]
    if stream.codec_context is None:  # a codec this FFmpeg has no decoder for
        raise _bad(index, "has a video stream in a codec that cannot be decoded here")
    width, height = int(stream.codec_context.width), int(stream.codec_context.height)
    if width <= 0 or height <= 0:
        # FFmpeg clears the size of a stream whose frames are over its ``max_pixels``.
        raise _bad(
            index,
            f"has no frame size within {limits.max_frame_pixels} pixels per frame "
            "(--max-video-frame-pixels): frames too large, or a corrupt stream header",
            "video_too_large",
        )
    if width * height > limits.max_frame_pixels:
        raise _bad(
            index,
            f"is {width}x{height}, more than {limits.max_frame_pixels} pixels per frame "
            "(--max-video-frame-pixels)",
            "video_too_large",
        )
    # Count and time the frames from the packets (nothing decoded): headers lie.
    pts: list[int] = []
    # Keyframes by presentation time, each with the time to seek to for it: its
    # decode time where lower (MPEG-TS seeks by decode time, and a seek to a
    # keyframe's presentation time lands after it when frames are reordered).
    keyframes: dict[int, int] = {}
    for packet in container.demux(stream):
        if packet.pts is None or packet.size == 0:
            continue
        pts.append(int(packet.pts))
        if packet.is_keyframe:
            dts = packet.dts
            keyframes[int(packet.pts)] = int(packet.pts if dts is None else min(dts, packet.pts))
    pts.sort()
    total = len(pts)
    if total == 0:
        raise _bad(index, "has no frames")
    rate = stream.average_rate or stream.guessed_rate
    time_base = stream.time_base or Fraction(1, 1)
    if rate and rate > 0:
        fps = float(rate)
    else:
        span = float((pts[-1] - pts[0]) * time_base)
        fps = (total - 1) / span if total > 1 and span > 0 else 1.0
    duration = total / fps
    if duration > limits.max_duration_s:
        raise _bad(
            index,
            f"is {duration:.1f} s long, more than {limits.max_duration_s:g} s "
            "(--max-video-duration)",
            "video_too_long",
        )
    _check_complete(container, stream, total, duration, index)
    wanted = sample_indices(total, duration, sampling)
    if len(wanted) > limits.max_frames:
        raise _bad(
            index,
            f"samples {len(wanted)} frames, more than {limits.max_frames} "
            "(--max-video-frames); ask for fewer with media_io_kwargs.video.num_frames or fps",
            "video_too_large",
        )
    if len(wanted) * width * height > limits.max_video_pixels:
        raise _bad(
            index,
            f"samples {len(wanted)} frames of {width}x{height}, more than "
            f"{limits.max_video_pixels} pixels (--max-video-pixels)",
            "video_too_large",
        )
    if check is not None:
        check(len(wanted), height, width)
    targets = [pts[i] for i in wanted]
    frames = _frames_at(container, stream, targets, keyframes, index, (height, width))
    base = pts[0]
    times = [float((t - base) * time_base) for t in targets]
    return DecodedVideo(np.stack(frames), wanted, times, total, fps)


def _check_complete(container: Any, stream: Any, total: int, duration: float, index: int) -> None:
    """Refuses a file that holds fewer frames than its header declares."""
    declared_frames = int(stream.frames or 0)
    if declared_frames and total < declared_frames:
        raise _bad(
            index,
            f"is truncated or corrupt: its header declares {declared_frames} frames, "
            f"{total} are there",
        )
    if stream.duration and stream.time_base:
        declared = float(stream.duration * stream.time_base)
    elif container.duration:
        declared = container.duration / 1_000_000
    else:
        return
    if duration < declared * 0.9 - 2 * duration / total:
        raise _bad(
            index,
            f"is truncated or corrupt: its header declares {declared:.1f} s, its frames "
            f"cover {duration:.1f} s",
        )


def _frames_at(
    container: Any,
    stream: Any,
    targets: list[int],
    keyframes: dict[int, int],
    index: int,
    shape: tuple[int, int],
) -> list[np.ndarray]:
    """RGB frames at the presentation times ``targets`` (ascending, repeats allowed),
    seeking to the keyframe before a target when that skips at least one whole
    keyframe interval, else decoding forward (``keyframes``: presentation time ->
    the time to seek to)."""
    starts = sorted(keyframes)
    out: list[np.ndarray] = []
    wanted = set(targets)
    decoder: Any = None
    ahead: Any = None  # a decoded frame past the previous target, not yet used
    last = -1 << 62  # pts of the last frame taken from the decoder
    for target in targets:
        if out and ahead is None and target == last:
            out.append(out[-1])
            continue
        k = bisect.bisect_right(starts, target) - 1
        key = starts[k] if k >= 0 else None
        # A seek flushes the decoder (and its threads): it pays only when a whole
        # keyframe interval lies between the last decoded frame and the target's
        # keyframe. To the next keyframe, decoding on is cheaper (the frames no
        # other frame references are skipped anyway): 32 of 300 frames of 720p
        # H.264, a keyframe every 30, decode in 0.44 s this way, 0.81 s seeking.
        if decoder is None or (key is not None and k > bisect.bisect_right(starts, last)):
            container.seek(keyframes[key] if key is not None else 0, stream=stream, backward=True)
            decoder, ahead = _decoded(container, stream, wanted), None
        found = None
        while found is None:
            frame = ahead if ahead is not None else next(decoder, None)
            ahead = None
            if frame is None:
                break
            if frame.pts is None:
                continue
            last = int(frame.pts)
            if last < target:
                continue
            if last > target:
                ahead = frame
                break
            found = frame
        if found is None:
            raise _bad(index, "is truncated or corrupt: a sampled frame could not be decoded")
        rgb = found.to_ndarray(format="rgb24")
        if rgb.shape[:2] != shape:
            raise _bad(
                index,
                f"changes its frame size to {rgb.shape[1]}x{rgb.shape[0]} "
                f"from {shape[1]}x{shape[0]}",
            )
        out.append(rgb)
    return out


def _decoded(container: Any, stream: Any, wanted: set[int]) -> Iterator[Any]:
    """The frames of ``stream`` from the container's position on, as
    ``container.decode`` gives them, except that for :data:`SKIP_NONREF_CODECS` a
    packet whose time is not in ``wanted`` asks the decoder to drop its frame when no
    other frame references it (the frames that are decoded are unchanged)."""
    context = stream.codec_context
    skip = context.name in SKIP_NONREF_CODECS
    try:
        for packet in container.demux(stream):
            if skip:
                needed = packet.pts is None or int(packet.pts) in wanted
                context.skip_frame = "DEFAULT" if needed else "NONREF"
            yield from packet.decode()
    finally:
        if skip:
            context.skip_frame = "DEFAULT"
