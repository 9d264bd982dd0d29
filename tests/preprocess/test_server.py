"""The server's image path with the native preprocessor against the same server on
transformers' path (``EC_FRONTEND_DISABLE_NATIVE_PREPROCESS=1``), built-in model on
the CPU, through the openai client: greedy outputs token-identical for text plus one
and two images (every format kind), bad images a 400 naming the image with the
instance still serving, and ``ec_frontend_images_preprocessed_total`` counting
exactly the images decoded."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from ec_frontend.model.native_preprocess import DISABLE_ENV
from PIL import Image

from ..helpers.processes import Proc, start_all
from .corpus import encode, pixels
from .test_bad_input import bomb

pytestmark = pytest.mark.slow

MODEL = "tiny"


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def serve(model_dir: Path, name: str, env: dict[str, str], *extra: str) -> Proc:
    args = ["--model", str(model_dir), "--device", "cpu", "--max-model-len", "2048",
            "--served-model-name", MODEL, *extra]  # fmt: skip
    return Proc("serve", args, name, env=env)


@pytest.fixture(scope="module")
def servers(builtin_model_dir: Path) -> Iterator[dict[str, Proc]]:
    # The native instance runs its engine in the server's process, so that its metric
    # counts every decode of the instance, the engine's deferred ones included.
    procs = start_all(
        [
            serve(builtin_model_dir, "native", {DISABLE_ENV: "0"}, "--engine-mode", "inprocess"),
            serve(builtin_model_dir, "python", {DISABLE_ENV: "1"}),
        ]
    )
    yield {"native": procs[0], "python": procs[1]}
    for p in procs:
        p.stop()


#: Images each instance has decoded (the native path decodes an image's bytes once;
#: later requests carrying them are served from the encoder cache without pixels).
SEEN: dict[str, set[str]] = {"native": set(), "python": set()}


def decodes(server: str, names: list[str]) -> int:
    """How many images of ``names`` instance ``server`` decodes, and note them."""
    if server == "python":
        return len(names)
    fresh = set(names) - SEEN[server]
    SEEN[server] |= fresh
    return len(fresh)


def chat(url: str, images: list[str], text: str = "describe") -> Any:
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in images]
    with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
        return client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=12,
            temperature=0,
            logprobs=True,
        )


RGB = Image.fromarray(pixels(180, 250, 3, seed=3))
RGBA = Image.fromarray(pixels(97, 131, 4, seed=4), "RGBA")
IMAGES = {
    "jpeg": data_url(encode(RGB, "JPEG", quality=85), "image/jpeg"),
    "png_rgba": data_url(encode(RGBA, "PNG")),
    "webp": data_url(encode(RGB, "WEBP", quality=80), "image/webp"),
    "gif": data_url(encode(RGB.quantize(64, method=Image.Quantize.FASTOCTREE), "GIF"), "image/gif"),
    "cmyk_jpeg": data_url(
        encode(Image.fromarray(pixels(60, 333, 4, seed=5), "CMYK"), "JPEG"), "image/jpeg"
    ),
}

CASES = [["jpeg"], ["png_rgba"], ["webp", "gif"], ["cmyk_jpeg", "jpeg"]]


@pytest.mark.parametrize("names", CASES, ids=["+".join(c) for c in CASES])
def test_greedy_output_is_token_identical(servers: dict[str, Proc], names: list[str]) -> None:
    before = {k: p.metric("images_preprocessed_total") for k, p in servers.items()}
    outs = {k: chat(p.url, [IMAGES[n] for n in names]) for k, p in servers.items()}
    native, python = outs["native"], outs["python"]
    assert native.usage.prompt_tokens == python.usage.prompt_tokens
    assert native.choices[0].message.content == python.choices[0].message.content
    tokens = [[t.token for t in o.choices[0].logprobs.content] for o in (native, python)]
    assert tokens[0] == tokens[1] and len(tokens[0]) > 0
    for k, p in servers.items():
        assert p.metric("images_preprocessed_total") - before[k] == decodes(k, names)


BAD = [
    (b"\x89PNG", "image 1"),
    (encode(RGB, "TIFF"), "TIFF"),
    (b"<svg xmlns='http://www.w3.org/2000/svg'/>", "SVG"),
    (b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + b"\0" * 40, "HEIC"),
    (encode(RGB, "PNG")[:300], "image 1"),
    (bomb(), "30000x30000"),
]


@pytest.mark.parametrize(("data", "words"), BAD, ids=["short", "tiff", "svg", "heic", "truncated",
                                                      "bomb"])  # fmt: skip
def test_bad_image_is_a_400_naming_it(servers: dict[str, Proc], data: bytes, words: str) -> None:
    native = servers["native"]
    before = native.metric("images_preprocessed_total")
    with pytest.raises(openai.BadRequestError) as info:
        chat(native.url, [IMAGES["jpeg"], data_url(data)])
    error = info.value.body
    assert isinstance(error, dict)
    assert "image 1" in error["message"] and words in error["message"]
    assert native.metric("images_preprocessed_total") == before
    assert chat(native.url, [IMAGES["jpeg"]]).choices[0].finish_reason in ("length", "stop")
    decodes("native", ["jpeg"])


def test_an_encoder_cache_hit_decodes_no_image(servers: dict[str, Proc]) -> None:
    native = servers["native"]
    image = data_url(encode(Image.fromarray(pixels(150, 210, 3, seed=77)), "JPEG"), "image/jpeg")
    before = native.metric("images_preprocessed_total")
    first = chat(native.url, [image], text="what is this")
    assert native.metric("images_preprocessed_total") - before == 1
    for _ in range(3):
        again = chat(native.url, [image], text="what is this")
        assert native.metric("images_preprocessed_total") - before == 1
        assert again.usage.prompt_tokens == first.usage.prompt_tokens
        tokens = [[t.token for t in o.choices[0].logprobs.content] for o in (first, again)]
        assert tokens[0] == tokens[1]
    # The same bytes with another pixel range are another preprocessing: decoded.
    with openai.OpenAI(base_url=native.url + "/v1", api_key="x", max_retries=0) as client:
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}
            ],
            max_tokens=2,
            extra_body={"mm_processor_kwargs": {"max_pixels": 56 * 56 * 4}},
        )
    assert native.metric("images_preprocessed_total") - before == 2
