"""A launcher as one is written for vLLM 0.33's EPD proxy in ``--dynamic-registration``
mode: it registers instances with ``POST /instances`` (``X-API-Key`` from
``$ADMIN_API_KEY``, a record ``{"role", "url"}``) and unregisters them with
``DELETE /instances?url=...``. Standard library only, so it runs in either
environment; it knows nothing of ec-frontend.

    ADMIN_API_KEY=... python epd_launcher.py PROXY_URL register ROLE=URL [ROLE=URL ...]
    ADMIN_API_KEY=... python epd_launcher.py PROXY_URL unregister URL [URL ...]

Prints one JSON answer per instance; exits 1 on the first refusal.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request


def call(method: str, url: str, body: dict[str, str] | None = None) -> dict[str, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("X-API-Key", os.environ.get("ADMIN_API_KEY", ""))
    if data is not None:
        request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        answer: dict[str, object] = json.loads(response.read())
        return answer


def main(argv: list[str]) -> int:
    proxy, action, *items = argv
    endpoint = proxy.rstrip("/") + "/instances"
    try:
        for item in items:
            if action == "register":
                role, _, url = item.partition("=")
                print(json.dumps(call("POST", endpoint, {"role": role, "url": url})))
            else:
                query = urllib.parse.urlencode({"url": item})
                print(json.dumps(call("DELETE", f"{endpoint}?{query}")))
    except urllib.error.HTTPError as exc:
        print(f"{exc.code} {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
