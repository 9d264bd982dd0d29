#!/usr/bin/env bash
# The quick start (docs/quickstart.md) end to end: one server, then E+PD, then
# E+P+D on the built-in model, one chat request with an image through each, and
# the metric lines that show where the work was done. Needs `bash scripts/setup.sh`
# once, and ports 8000, 8100-8400, 5501 and 5600 free on 127.0.0.1. Logs go to
# $QUICKSTART_LOGS (default: a temporary directory).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PWD/.venv/bin:$PATH
logs=${QUICKSTART_LOGS:-$(mktemp -d)}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT

start() {  # start NAME ARGS...: an ec-frontend process in the background
  local name=$1; shift
  ec-frontend "$@" > "$logs/$name.log" 2>&1 &
  pids+=($!)
}
wait_up() {  # wait_up PORT: until its /health answers 200 (at most 2 minutes)
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0
    sleep 0.2
  done
  echo "nothing healthy on port $1; see $logs" >&2
  exit 1
}
metrics() {  # metrics PORT REGEX: the instance's metric lines that match
  curl -s "http://127.0.0.1:$1/metrics" | grep -E "^ec_frontend_($2)" || true
}
stop_all() {
  kill "${pids[@]}" 2>/dev/null || true
  wait 2>/dev/null || true
  pids=()
}

image=$(python - <<'PY'
import base64, io
from PIL import Image
buf = io.BytesIO()
Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
print("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
PY
)
ask() {  # ask PORT: one chat request with an image
  curl -sf "http://127.0.0.1:$1/v1/chat/completions" -H 'Content-Type: application/json' -d '{
    "model": "ec-frontend/qwen2-vl-tiny", "max_tokens": 8,
    "messages": [{"role": "user", "content": [
      {"type": "text", "text": "What is in this picture?"},
      {"type": "image_url", "image_url": {"url": "'"$image"'"}}]}]}' \
    | python -c 'import json, sys; r = json.load(sys.stdin); print("answer:", r["choices"][0]["finish_reason"], r["usage"])'
}

t0=$SECONDS
echo "== 1. one server"
start one serve --port 8000
wait_up 8000
ask 8000
metrics 8000 'encoder_items_computed_total|requests_total\{endpoint="/v1/chat'
stop_all

echo "== 2. E+PD ($((SECONDS - t0)) s)"
secret=$(mktemp)
openssl rand -hex 32 > "$secret"
export EC_FRONTEND_TRANSFER_SECRET=$(cat "$secret")
rm -f "$secret"
start e serve --port 8100 --ec-transfer-config \
  '{"ec_connector": "ECSideChannelConnector", "ec_role": "ec_producer", "ec_connector_extra_config": {"port": 5501}}'
start pd serve --port 8200 --ec-transfer-config \
  '{"ec_connector": "ECSideChannelConnector", "ec_role": "ec_consumer"}'
start proxy proxy --port 8000 --encode http://127.0.0.1:8100 --decode http://127.0.0.1:8200
wait_up 8100; wait_up 8200; wait_up 8000
ask 8000
echo "-- E:";  metrics 8100 'encoder_items_computed_total|ec_items_saved_total'
echo "-- PD:"; metrics 8200 'encoder_items_computed_total|ec_items_loaded_total|ec_load_fallbacks_total'
stop_all

echo "== 3. E+P+D ($((SECONDS - t0)) s)"
start e serve --port 8100 --ec-transfer-config \
  '{"ec_connector": "ECSideChannelConnector", "ec_role": "ec_producer", "ec_connector_extra_config": {"port": 5501}}'
start p serve --port 8300 \
  --ec-transfer-config '{"ec_connector": "ECSideChannelConnector", "ec_role": "ec_consumer"}' \
  --kv-transfer-config '{"kv_connector": "KVSideChannelConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"port": 5600}}'
start d serve --port 8400 \
  --kv-transfer-config '{"kv_connector": "KVSideChannelConnector", "kv_role": "kv_consumer"}'
start proxy proxy --port 8000 --encode http://127.0.0.1:8100 \
  --prefill http://127.0.0.1:8300 --decode http://127.0.0.1:8400
wait_up 8100; wait_up 8300; wait_up 8400; wait_up 8000
ask 8000
echo "-- E:"; metrics 8100 'encoder_items_computed_total|ec_items_saved_total'
echo "-- P:"; metrics 8300 'encoder_items_computed_total|ec_items_loaded_total|kv_tokens_sent_total'
echo "-- D:"; metrics 8400 'encoder_items_computed_total|prompt_tokens_computed_total|kv_tokens_received_total|kv_local_prefill_fallbacks_total'
stop_all
echo "done in $((SECONDS - t0)) s; logs in $logs"
