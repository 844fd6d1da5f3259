#!/usr/bin/env bash
# The main job, end to end: installs and builds what it needs, starts a
# private redis-server on a Unix socket, creates a demo database, writes
# orders with their outbox messages (some rolled back), runs the relay until
# the outbox is drained, and shows what reached the stream.
#   ORDERS=N  how many orders to write (default 1000)
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/deps.sh
bash tools/build.sh
orders=${ORDERS:-1000}
work=$(mktemp -d "${TMPDIR:-/tmp}/outbox-demo-XXXXXX")
redis_pid=""
cleanup() {
    if [ -n "$redis_pid" ]; then kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT
sock="$work/redis.sock"
redis-server --port 0 --unixsocket "$sock" --save "" --appendonly no --dir "$work" >"$work/redis.log" 2>&1 &
redis_pid=$!
for _ in $(seq 50); do redis-cli -s "$sock" ping >/dev/null 2>&1 && break; sleep 0.1; done

db="$work/shop.db"
echo "== creating $db and writing $orders orders (every 10th rolled back)"
build/tools/relay/outbox-relay init --db "$db"
build/tools/demo/outbox-demo --db "$db" --orders "$orders" --fail-every 10
echo "== outbox before the relay runs"
sqlite3 "$db" "SELECT CASE state WHEN 0 THEN 'pending' WHEN 1 THEN 'sending' WHEN 2 THEN 'published' ELSE 'dead' END AS state, count(*) FROM outbox_messages GROUP BY state;"
echo "== running the relay until the outbox is drained"
build/tools/relay/outbox-relay --db "$db" --redis "unix://$sock" --drain
echo "== outbox after"
sqlite3 "$db" "SELECT CASE state WHEN 0 THEN 'pending' WHEN 1 THEN 'sending' WHEN 2 THEN 'published' ELSE 'dead' END AS state, count(*) FROM outbox_messages GROUP BY state;"
echo "== stream outbox:orders: $(redis-cli -s "$sock" XLEN outbox:orders) entries; the first one:"
redis-cli -s "$sock" --no-raw XRANGE outbox:orders - + COUNT 1
echo "== the embedded mode: the relay on the application's own loop, woken by each commit"
build/tools/demo/outbox-demo --db "$db" --orders 200 --embedded --redis "unix://$sock"
echo "== stream outbox:orders now has $(redis-cli -s "$sock" XLEN outbox:orders) entries"
