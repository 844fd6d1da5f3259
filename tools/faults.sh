#!/usr/bin/env bash
# Fault harness: end to end against real processes, then conservation
# checked from the database and the streams alone.
#
# A writer (outbox-demo) commits orders with their messages at a steady rate,
# every 7th transaction rolled back; two outbox-relay processes publish from
# the same database file; a private redis-server (AOF, fsync always) receives.
# Faults are injected at random moments: relay A is killed with SIGKILL and
# restarted, Redis is killed and restarted; then Redis stops answering for 2 s
# (DEBUG SLEEP) and the relays' peak RSS meanwhile must stay under 64 MiB. Then the writer stops, one relay
# drains, and the harness checks:
#   lost        committed ids (not dead) missing from their stream   must be 0
#   orphans     stream entries without a committed row               must be 0
#   stuck       rows still leased (state 1) after the final drain    must be 0
#   duplicates  entries beyond the first of an id (at-least-once)    reported
#   dead        dead-lettered rows (visible, replayable)              reported
# and prints one summary line:
#   faults: committed=N lost=0 orphans=0 stuck=0 duplicates=D dead=X pending=0 relay_kills=K redis_restarts=R writer_failures=0 relay_rss_during_slow_redis_kb=M
#
#   bash tools/faults.sh                 the test-suite size (10 relay kills)
#   SOAK=1 bash tools/faults.sh          the soak (60 relay kills, 5 Redis restarts)
#   KILLS=N REDIS_RESTARTS=M IDEMPOTENT=1 ...   overrides; IDEMPOTENT=1 also requires duplicates=0
# Exit status 0 when every check holds. Uses OUTBOX_BUILD_DIR (default ./build).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${OUTBOX_BUILD_DIR:-$here/build}
relay_bin=$build/tools/relay/outbox-relay
demo_bin=$build/tools/demo/outbox-demo
if [ "${SOAK:-0}" = 1 ]; then kills=${KILLS:-60}; restarts=${REDIS_RESTARTS:-5}
else kills=${KILLS:-10}; restarts=${REDIS_RESTARTS:-1}; fi
idem=()
[ "${IDEMPOTENT:-0}" = 1 ] && idem=(--idempotent)

for tool in redis-server redis-cli sqlite3 python3; do
    command -v "$tool" >/dev/null || { echo "faults: $tool is missing" >&2; exit 2; }
done
[ -x "$relay_bin" ] && [ -x "$demo_bin" ] || { echo "faults: build first (no $relay_bin)" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/outbox-faults-XXXXXX")
sock=$work/redis.sock
db=$work/app.db
pids=()
redis_pid=""
writer_pid=""
relay_a=""
relay_b=""
cleanup() {
    for p in $writer_pid $relay_a $relay_b $redis_pid; do
        kill -9 "$p" 2>/dev/null
    done
    wait 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT

start_redis() {
    redis-server --port 0 --unixsocket "$sock" --dir "$work" --save "" --appendonly yes \
        --appendfsync always >>"$work/redis.log" 2>&1 &
    redis_pid=$!
    for _ in $(seq 100); do redis-cli -s "$sock" ping >/dev/null 2>&1 && return 0; sleep 0.05; done
    echo "faults: redis-server did not start" >&2
    exit 1
}
relay_args=(--db "$db" --redis "unix://$sock" --lease-ms 1000 --reply-timeout-ms 500 --connect-timeout-ms 500
            --backoff-min-ms 20 --backoff-max-ms 200 --scan-interval-ms 100 --log-level warn "${idem[@]}")
start_relay() { # start_relay NAME
    "$relay_bin" "${relay_args[@]}" --worker-id "$1-$RANDOM" >>"$work/relay-$1.log" 2>&1 &
    echo $!
}

start_redis
"$relay_bin" init --db "$db" >/dev/null || exit 1
# The writer: batches of orders, every 7th rolled back, until told to stop.
(
    while [ ! -f "$work/stop" ]; do
        "$demo_bin" --db "$db" --orders 50 --fail-every 7 >/dev/null 2>>"$work/writer.log" || echo fail >>"$work/writer.failed"
        sleep 0.05
    done
) &
writer_pid=$!
relay_a=$(start_relay a)
relay_b=$(start_relay b)

relay_kills=0
redis_restarts=0
every=$(( kills / (restarts + 1) + 1 ))
for i in $(seq "$kills"); do
    sleep "0.$(( RANDOM % 6 + 2 ))"
    kill -9 "$relay_a" 2>/dev/null
    wait "$relay_a" 2>/dev/null
    relay_kills=$((relay_kills + 1))
    relay_a=$(start_relay a)
    if [ "$redis_restarts" -lt "$restarts" ] && [ $((i % every)) -eq 0 ]; then
        kill -9 "$redis_pid" 2>/dev/null
        wait "$redis_pid" 2>/dev/null
        sleep 0.3
        start_redis
        redis_restarts=$((redis_restarts + 1))
    fi
done
while [ "$redis_restarts" -lt "$restarts" ]; do
    kill -9 "$redis_pid" 2>/dev/null; wait "$redis_pid" 2>/dev/null; sleep 0.3; start_redis
    redis_restarts=$((redis_restarts + 1))
done

# Slow replies: Redis stops answering for 2 s (DEBUG SLEEP) while the writer
# keeps committing; the relays' memory must stay bounded by their window.
rss_max=0
redis-cli -s "$sock" DEBUG SLEEP 2 >/dev/null 2>&1 &
sleeper=$!
for _ in $(seq 25); do
    for p in $relay_a $relay_b; do
        kb=$(awk '/^VmRSS:/ {print $2}' "/proc/$p/status" 2>/dev/null)
        [ -n "$kb" ] && [ "$kb" -gt "$rss_max" ] && rss_max=$kb
    done
    sleep 0.1
done
wait "$sleeper" 2>/dev/null

touch "$work/stop"
wait "$writer_pid" 2>/dev/null
writer_pid=""
kill -TERM "$relay_a" "$relay_b" 2>/dev/null
wait "$relay_a" "$relay_b" 2>/dev/null
relay_a=""
relay_b=""
# Final drain: leases of killed relays expire after 1 s and are taken over.
if ! timeout 120 "$relay_bin" "${relay_args[@]}" --worker-id final --drain >>"$work/relay-final.log" 2>&1; then
    echo "faults: the final drain did not finish" >&2
    tail -5 "$work/relay-final.log" >&2
    exit 1
fi

# Rows that were backing off when the drain found nothing due: drain again.
for _ in 1 2 3 4 5; do
    [ "$(sqlite3 "$db" "SELECT count(*) FROM outbox WHERE state < 2")" = 0 ] && break
    sleep 0.3
    timeout 60 "$relay_bin" "${relay_args[@]}" --worker-id final --drain >>"$work/relay-final.log" 2>&1
done

# Every stream's ids (the `id` field is the entry's first field).
lua="local r = {} for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do r[#r + 1] = e[2][2] end return r"
: >"$work/stream-ids"
for topic in $(sqlite3 "$db" "SELECT DISTINCT topic FROM outbox"); do
    redis-cli -s "$sock" --raw EVAL "$lua" 1 "outbox:$topic" >>"$work/stream-ids"
done
sqlite3 "$db" "SELECT id || ' ' || state FROM outbox" >"$work/rows"

python3 - "$work/rows" "$work/stream-ids" "$relay_kills" "$redis_restarts" "${IDEMPOTENT:-0}" \
    "$([ -f "$work/writer.failed" ] && wc -l <"$work/writer.failed" || echo 0)" "$rss_max" <<'PY'
import collections, sys
rows = dict(line.split() for line in open(sys.argv[1]) if line.strip())
entries = [line.strip() for line in open(sys.argv[2]) if line.strip()]
counts = collections.Counter(entries)
dead = sum(1 for s in rows.values() if s == "3")
lost = sum(1 for i, s in rows.items() if s != "3" and i not in counts)
orphans = sum(1 for i in counts if i not in rows)
stuck = sum(1 for s in rows.values() if s == "1")
pending = sum(1 for s in rows.values() if s == "0")
dups = sum(c - 1 for c in counts.values())
rss_kb = int(sys.argv[7])
print("faults: committed=%d lost=%d orphans=%d stuck=%d duplicates=%d dead=%d pending=%d relay_kills=%s redis_restarts=%s writer_failures=%s relay_rss_during_slow_redis_kb=%d"
      % (len(rows), lost, orphans, stuck, dups, dead, pending, sys.argv[3], sys.argv[4], sys.argv[6], rss_kb))
import os
# A sanitizer build's RSS is mostly shadow memory: the bound is for real builds.
rss_bound = "ASAN_OPTIONS" not in os.environ
bad = (lost or orphans or stuck or pending or len(rows) == 0 or (sys.argv[5] == "1" and dups)
       or (rss_bound and rss_kb > 64 * 1024))
sys.exit(1 if bad else 0)
PY
