#!/usr/bin/env bash
# tokenway as a gateway, side by side with LiteLLM's proxy, in front of the same instant upstream
# stub, in one run (../shared/bench/gateway_peers.sh does the runs; this sets tokenway up for its
# `gw` mode): `tokenway serve --config` with one model routed to the stub ($STUB_URL), no local
# engine, keys, limits, the SQLite ledger and traces all on, and one API key with limits far above
# the load, so every call is authenticated, admitted, reconciled, written to the ledger and traced.
#
#   bash bench/gateway_peers.sh                      # LiteLLM and tokenway, the default rates
#   GATEWAYS=gw RATES="100 300" bash bench/gateway_peers.sh
#
# Knobs: as ../shared/bench/gateway_peers.sh (GATEWAYS, RATES, STREAM_RATES, DURATION, OUT, ...);
# TW_PORT (18300), TW_ARGS (extra `tokenway serve` flags). Results: $OUT/summary.md.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/.." && pwd)
SHARED=${SHARED:-$REPO/../shared/bench}
TW_PORT=${TW_PORT:-18300}
TW_ARGS=${TW_ARGS:-}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/tw-gw.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

STUB_PORT=${STUB_PORT:-18100}
cat > "$WORK/gateway.toml" <<EOF
[[models]]
name = "bench-model"
context_window = 8192
  [[models.replicas]]
  kind = "openai"
  name = "stub"
  url = "http://127.0.0.1:$STUB_PORT/v1"
  model = "bench-model"
EOF
KEY=$("$REPO/.venv/bin/tokenway" keys --db "$WORK/keys.db" create --name bench --rpm 100000000 --tpm 100000000000 2>/dev/null)

export GATEWAYS=${GATEWAYS:-"litellm gw"} GW_NAME=${GW_NAME:-tokenway} GW_URL=http://127.0.0.1:$TW_PORT GW_KEY=$KEY STUB_PORT
export GW_CMD="exec '$REPO/.venv/bin/tokenway' serve --host 127.0.0.1 --port $TW_PORT --config '$WORK/gateway.toml' \
  --db '$WORK/keys.db' --no-embeddings --log-level warning $TW_ARGS"
bash "$SHARED/gateway_peers.sh"
