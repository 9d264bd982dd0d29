"""An instance announcing itself to EPD proxies (``ec-frontend serve --register-with``).

It speaks vLLM 0.33's EPD-proxy registration API, which ``ec-frontend proxy
--dynamic-registration`` serves too: once the instance's own ``/health``
answers 200, ``POST /instances`` on each proxy with ``X-API-Key`` (the admin
key, ``$ADMIN_API_KEY``) and the record ``{"role", "url"}``; the same POST
again every ``interval_s`` seconds (a known record is a no-op there, and a
proxy that restarted learns the instance again); ``DELETE /instances?url=...``
when the instance stops. A proxy that cannot be reached or refuses is logged
and tried again at the next interval; the instance serves regardless.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import httpx

log = logging.getLogger("ec_frontend.registration")

ROLES = ("encode", "prefill", "decode", "prefill_decode")
DEFAULT_INTERVAL_S = 10.0


class Registrar:
    """Keeps one instance registered with some proxies while it runs."""

    def __init__(
        self,
        proxies: Sequence[str],
        role: str,
        url: str,
        admin_key: str,
        interval_s: float = DEFAULT_INTERVAL_S,
        timeout_s: float = 5.0,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"the registration role must be one of {', '.join(ROLES)}")
        for base in (*proxies, url):
            if not base.startswith(("http://", "https://")):
                raise ValueError(f"not an http(s) URL: {base!r}")
        if not admin_key:
            raise ValueError("registering with a proxy needs its admin key ($ADMIN_API_KEY)")
        self.proxies = tuple(p.rstrip("/") for p in proxies)
        self.record = {"role": role, "url": url.rstrip("/")}
        self.interval_s = interval_s
        self._headers = {"X-API-Key": admin_key}
        self._client = httpx.Client(timeout=timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registrar", daemon=True)
        self.registered: set[str] = set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stops announcing, and unregisters from every proxy that took the record."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._client.timeout.read or 5.0)
        for proxy in sorted(self.registered):
            try:
                self._client.delete(
                    proxy + "/instances", params={"url": self.record["url"]}, headers=self._headers
                )
            except httpx.HTTPError as exc:
                log.warning("could not unregister from %s: %r", proxy, exc)
        self._client.close()

    def _ready(self) -> bool:
        try:
            return self._client.get(self.record["url"] + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _run(self) -> None:
        while not self._ready():
            if self._stop.wait(0.2):
                return
        while True:
            for proxy in self.proxies:
                self._announce(proxy)
            if self._stop.wait(self.interval_s):
                return

    def _announce(self, proxy: str) -> None:
        try:
            resp = self._client.post(proxy + "/instances", json=self.record, headers=self._headers)
        except httpx.HTTPError as exc:
            log.warning("could not register with %s: %r", proxy, exc)
            return
        if resp.status_code != 200:
            log.warning("%s refused the registration (%d): %s", proxy, resp.status_code,
                        resp.text[:300])  # fmt: skip
            return
        if proxy not in self.registered:
            log.info("registered with %s as %s %s", proxy, self.record["role"], self.record["url"])
        self.registered.add(proxy)
