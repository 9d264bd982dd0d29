#!/usr/bin/env bash
# Creates .venv-vllm, a separate virtual environment holding vLLM (pinned) and its own
# dependencies, for the interop tests (tests/interop/) that drive ec-frontend with vLLM's
# own code. The project's .venv is never touched. vLLM's source distribution, for its
# examples (the EPD proxy) and tests, is unpacked under .venv-vllm/sdist/vllm-VERSION.
#
# A full install from PyPI (vLLM, its torch and CUDA wheels: about 9.5 GB on disk) took
# 4.5 minutes on the 2-core development host; nothing of it is compiled. Installing vLLM
# without its dependencies against the project's torch/transformers was tried and dropped:
# vLLM 0.33.0 pins transformers<5.21 (the project has 5.24) and imports some twenty
# further modules before `vllm bench serve` even parses its arguments.
#
# Safe to run again, and from several shells at once (a lock serializes them): the venv is
# rebuilt only when the pinned requirement below changes (a stamp file records it) or a
# previous install did not finish.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${EC_FRONTEND_VLLM_VENV:-.venv-vllm}
VERSION=0.33.0
REQUIREMENT="vllm==$VERSION"
SDIST_SHA256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
PY=${PYTHON:-python3}

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9

stamp="$VENV/.ec-frontend-requirement"
sdist_dir="$VENV/sdist/vllm-$VERSION"

# vLLM's examples (its EPD proxy) and tests ship only in its source distribution. `pip
# download` cannot fetch it (it insists on building the metadata, which needs CUDA), so it
# is taken from the package index pip itself would use (its --index-url as PIP_INDEX_URL or
# pip.conf set it, else pip's default), read through pip's own option parsing: the project
# names no index host, and a mirror works. Its simple page (JSON, PEP 691, or HTML, PEP 503)
# gives the file's URL; the file is checked against its pinned sha256.
fetch_sdist() {
    [ -f "$sdist_dir/examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py" ] && return 0
    local tmp url
    tmp=$(mktemp -d)
    url=$("$VENV/bin/python" - "$VERSION" <<'PYEOF'
import json
import re
import sys
import urllib.parse
import urllib.request

from pip._internal.commands import create_command

options, _ = create_command("download").parse_args([])
page = options.index_url.rstrip("/") + "/vllm/"
accept = "application/vnd.pypi.simple.v1+json, text/html;q=0.1"
with urllib.request.urlopen(urllib.request.Request(page, headers={"Accept": accept}), timeout=120) as r:
    kind, body = r.headers.get("content-type", ""), r.read().decode()
name = f"vllm-{sys.argv[1]}.tar.gz"
if "json" in kind:
    links = [f["url"] for f in json.loads(body)["files"]]
else:
    links = re.findall(r'href="([^"]+)"', body)
for link in links:
    target = urllib.parse.urljoin(page, link.replace("&amp;", "&"))
    if urllib.parse.urlsplit(target).path.rsplit("/", 1)[-1] == name:
        print(target.split("#", 1)[0])
        break
else:
    sys.exit(f"{name} is not on the index {options.index_url}")
PYEOF
)
    "$PY" -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" \
        "$url" "$tmp/vllm.tar.gz"
    echo "$SDIST_SHA256  $tmp/vllm.tar.gz" | sha256sum -c --quiet -
    mkdir -p "$VENV/sdist"
    tar xzf "$tmp/vllm.tar.gz" -C "$VENV/sdist"
    rm -rf "$tmp"
}

if [ "$(cat "$stamp" 2>/dev/null || true)" = "$REQUIREMENT" ] && [ -x "$VENV/bin/vllm" ]; then
    fetch_sdist
    exit 0
fi

echo "setup_vllm: installing $REQUIREMENT into $VENV (several minutes, about 9.5 GB)" >&2
start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "$REQUIREMENT"
"$VENV/bin/vllm" bench serve --help >/dev/null 2>&1 \
    || { echo "setup_vllm: 'vllm bench serve' does not start in $VENV" >&2; exit 1; }
fetch_sdist
echo "$REQUIREMENT" >"$stamp"
echo "setup_vllm: done in $(($(date +%s) - start)) s" >&2
