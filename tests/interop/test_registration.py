"""Runtime registration both ways with vLLM 0.33's EPD proxy API.

* ``epd_launcher.py``, a launcher written against vLLM's ``/instances`` API
  (standard library only, run by the vLLM environment's Python), registers an
  ec-frontend encoder and E+PD instance with ``ec-frontend proxy
  --dynamic-registration``, which then serves through them;
* the same two instances, started with ``serve --register-with`` pointing at
  vLLM's own ``disagg_epd_proxy.py --dynamic-registration`` (unmodified),
  register themselves there, and vLLM's proxy serves through them.

Both must answer what the PD instance answers alone, with the PD instance
computing no encoder item (it loads them from the encoder over the side channel).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ec_frontend.config import TRANSFER_SECRET_ENV

from ..disagg.conftest import SECRET, messages, png_data_url, serve, side_channel_ec
from ..helpers.processes import LOCAL, Proc, start_all
from .conftest import MODEL_NAME, VllmScript
from .test_epd_proxy import PROXY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ADMIN_KEY = "interop-admin-key"
LAUNCHER = Path(__file__).parent / "epd_launcher.py"
IMAGES = [png_data_url(56, (30, 120, 220)), png_data_url(56, (220, 120, 30))]


@pytest.fixture(scope="module")
def dep(vllm_python: Path, builtin_model_dir: Path) -> Iterator[dict[str, Any]]:
    vpx = VllmScript(
        vllm_python,
        PROXY,
        ["--host", "127.0.0.1", "--port", "{port}", "--dynamic-registration",
         "--probe-interval", "1"],
        "/health",
        env={"ADMIN_API_KEY": ADMIN_KEY},
    )  # fmt: skip
    px = Proc("proxy", ["--dynamic-registration", "--probe-interval", "1"], "px",
              env={TRANSFER_SECRET_ENV: SECRET, "ADMIN_API_KEY": ADMIN_KEY})  # fmt: skip
    announce = ["--register-with", vpx.url, "--register-interval", "1", "--register-role"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADMIN_API_KEY", ADMIN_KEY)
        e = serve(builtin_model_dir, "e", ec=side_channel_ec("ec_producer"),
                  extra=[*announce, "encode"])  # fmt: skip
        pd = serve(builtin_model_dir, "pd", ec=side_channel_ec("ec_consumer"),
                   extra=[*announce, "prefill_decode"])  # fmt: skip
    try:
        vpx.wait_ready()
        start_all([px, e, pd])
        yield {"vpx": vpx, "px": px, "e": e, "pd": pd}
    finally:
        for p in (e, pd, px):
            p.stop()
        vpx.stop()


def chat(url: str, image: str) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": messages("describe it", image), "max_tokens": 8,
            "temperature": 0.0}  # fmt: skip
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def launcher(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``epd_launcher.py`` run by the vLLM environment's Python, with the admin key."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["ADMIN_API_KEY"] = ADMIN_KEY
    return subprocess.run([str(python), str(LAUNCHER), *args], capture_output=True, text=True,
                          timeout=60, env=env, check=False)  # fmt: skip


def test_a_vllm_launcher_registers_our_instances_with_our_proxy(
    dep: dict[str, Any], vllm_python: Path
) -> None:
    px, e, pd = dep["px"], dep["e"], dep["pd"]
    run = launcher(vllm_python, px.url, "register", f"encode={e.url}", f"prefill_decode={pd.url}")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ['{"registered": true}'] * 2
    status = httpx.get(px.url + "/instances").json()
    assert status["encode"]["live"] == [e.url]
    assert status["prefill_decode"]["live"] == [pd.url]
    computed = pd.metric("encoder_items_computed_total")
    got = answer(chat(px.url, IMAGES[0]))
    assert pd.metric("encoder_items_computed_total") == computed
    assert got == answer(chat(pd.url, IMAGES[0]))
    run = launcher(vllm_python, px.url, "unregister", e.url)
    assert run.returncode == 0 and run.stdout.strip() == '{"removed": true}', run.stderr
    assert httpx.get(px.url + "/instances").json()["encode"]["live"] == []


def test_our_instances_register_with_vllms_proxy_and_serve_through_it(
    dep: dict[str, Any],
) -> None:
    vpx, e, pd = dep["vpx"], dep["e"], dep["pd"]
    deadline = time.monotonic() + 30
    while True:
        status = LOCAL.get(vpx.url + "/instances").json()
        if status["encode"]["live"] == [e.url] and status["prefill_decode"]["live"] == [pd.url]:
            break
        assert time.monotonic() < deadline, (status, vpx.log())
        time.sleep(0.2)
    computed = pd.metric("encoder_items_computed_total")
    got = answer(chat(vpx.url, IMAGES[1]))
    assert pd.metric("encoder_items_computed_total") == computed, vpx.log()
    assert got == answer(chat(pd.url, IMAGES[1]))
    assert e.metric("encoder_items_computed_total") >= 1
    assert e.stop() == 0
    gone = time.monotonic() + 10
    while e.url in LOCAL.get(vpx.url + "/instances").json()["encode"]["live"]:
        assert time.monotonic() < gone, "the encoder did not unregister on exit"
        time.sleep(0.2)
