#!/usr/bin/env bash
# Fault harness: end to end against real processes, then conservation
# checked from the database and the streams alone.
#
# A writer (outbox-demo) commits orders with their messages at a steady rate,
# every 7th transaction rolled back; two outbox-relay processes publish from
# the same database file; a private redis-server (AOF, fsync always) receives.
# Faults are injected at random moments: relay A is killed with SIGKILL and
# restarted, Redis is killed and restarted; then Redis stops answering for 2 s
# (DEBUG SLEEP) and the relays' peak RSS meanwhile must stay under 64 MiB. Then Redis reaches its
# maxmemory with the noeviction policy (every XADD refused with OOM for a few seconds: the relays
# must log the failures and retry, and publish again once memory is freed), and a key of the wrong
# type sits at one topic's stream name (that topic's rows fail with WRONGTYPE until they are dead
# while orders keep flowing; then the key is deleted, the dead rows are requeued with
# outbox-replay, and they must arrive). Then the writer stops, one relay drains, and the harness
# checks:
#   lost        committed ids (not dead) missing from their stream   must be 0
#   orphans     stream entries without a committed row               must be 0
#   stuck       rows still leased (state 1) after the final drain    must be 0
#   duplicates  entries beyond the first of an id (at-least-once)    reported
#   dead        dead-lettered rows (visible, replayable)              reported
#   misordered  entries of one key whose first appearances in the stream
#               are not in commit order                              must be 0
#   oom_retries relay log lines of publishes refused with OOM, retried  must be > 0
#   wrongtype   rows of the wrong-type topic: dead before the requeue,
#               all published after it                               all of them
# and prints one summary line:
#   faults: committed=N lost=0 orphans=0 stuck=0 duplicates=D dead=X pending=0 misordered=0 relay_kills=K redis_restarts=R writer_failures=0 relay_rss_during_slow_redis_kb=M oom_rounds=O oom_retries=F wrongtype_dead=W wrongtype_published=W
#
#   bash tools/faults.sh                 the test-suite size (10 relay kills, one OOM phase)
#   SOAK=1 bash tools/faults.sh          the soak (60 relay kills, 5 Redis restarts, 3 OOM phases)
#   KILLS=N REDIS_RESTARTS=M OOM_ROUNDS=O OOM_SECONDS=S IDEMPOTENT=1 ...   overrides; IDEMPOTENT=1
#                                        also requires duplicates=0
# TLS=1 makes the relays publish over TLS (rediss://localhost:PORT, a TLS port of the same
# redis-server, certificates made with the openssl command; the relays trust the test CA
# through OpenSSL's SSL_CERT_FILE).
# RELAY_WRAPPER="valgrind --error-exitcode=99 ..." runs every relay under that command; its
# output goes to the relay logs, and the harness fails if any relay exited with 99.
# Exit status 0 when every check holds. Uses OUTBOX_BUILD_DIR (default ./build).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${OUTBOX_BUILD_DIR:-$here/build}
relay_bin=$build/tools/relay/outbox-relay
demo_bin=$build/tools/demo/outbox-demo
replay_bin=$build/tools/replay/outbox-replay
if [ "${SOAK:-0}" = 1 ]; then kills=${KILLS:-60}; restarts=${REDIS_RESTARTS:-5}; oom_rounds=${OOM_ROUNDS:-3}
else kills=${KILLS:-10}; restarts=${REDIS_RESTARTS:-1}; oom_rounds=${OOM_ROUNDS:-1}; fi
# Seconds of OOM per phase: well below the time a message needs to spend
# its --max-attempts (60 attempts, at least ~100 ms apart once backed off).
oom_seconds=${OOM_SECONDS:-2.5}
# shellcheck disable=SC2206
wrapper=(${RELAY_WRAPPER:-})
idem=()
[ "${IDEMPOTENT:-0}" = 1 ] && idem=(--idempotent)

for tool in redis-server redis-cli sqlite3 python3; do
    command -v "$tool" >/dev/null || { echo "faults: $tool is missing" >&2; exit 2; }
done
[ -x "$relay_bin" ] && [ -x "$demo_bin" ] && [ -x "$replay_bin" ] || { echo "faults: build first (no $relay_bin)" >&2; exit 2; }

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

redis_url="unix://$sock"
tls_args=()
if [ "${TLS:-0}" = 1 ]; then
    command -v openssl >/dev/null || { echo "faults: openssl is missing" >&2; exit 2; }
    ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
    printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\n' >"$work/server.ext"
    { openssl req -x509 "${ec[@]}" -keyout "$work/ca.key" -out "$work/ca.crt" -days 2 -subj "/CN=faults CA" &&
      openssl req "${ec[@]}" -keyout "$work/server.key" -out "$work/server.csr" -subj /CN=localhost &&
      openssl x509 -req -in "$work/server.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" -CAcreateserial \
          -out "$work/server.crt" -days 2 -extfile "$work/server.ext"; } >"$work/openssl.log" 2>&1 ||
        { cat "$work/openssl.log" >&2; echo "faults: openssl failed" >&2; exit 1; }
    tls_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    tls_args=(--bind 127.0.0.1 --tls-port "$tls_port" --tls-cert-file "$work/server.crt"
              --tls-key-file "$work/server.key" --tls-ca-cert-file "$work/ca.crt" --tls-auth-clients no)
    redis_url="rediss://localhost:$tls_port"
    export SSL_CERT_FILE=$work/ca.crt
    echo "faults: the relays publish over TLS to $redis_url" >&2
fi

start_redis() {
    redis-server --port 0 --unixsocket "$sock" --dir "$work" --save "" --appendonly yes \
        --appendfsync always "${tls_args[@]}" >>"$work/redis.log" 2>&1 &
    redis_pid=$!
    for _ in $(seq 100); do redis-cli -s "$sock" ping >/dev/null 2>&1 && return 0; sleep 0.05; done
    echo "faults: redis-server did not start" >&2
    exit 1
}
relay_args=(--db "$db" --redis "$redis_url" --lease-ms 1000 --reply-timeout-ms 500 --connect-timeout-ms 500
            --backoff-min-ms 20 --backoff-max-ms 200 --scan-interval-ms 100 --max-attempts 60 --log-level warn
            "${idem[@]}")
start_relay() { # start_relay NAME
    "${wrapper[@]}" "$relay_bin" "${relay_args[@]}" --worker-id "$1-$RANDOM" >>"$work/relay-$1.log" 2>&1 &
    echo $!
}
rcli() { redis-cli -s "$sock" "$@"; }
sql() { sqlite3 -cmd ".timeout 10000" "$db" "$@"; }
# Waits up to $1 seconds for the shell condition $2; 0 when it holds.
wait_for() {
    local end=$((SECONDS + $1))
    while [ "$SECONDS" -lt "$end" ]; do eval "$2" && return 0; sleep 0.2; done
    eval "$2"
}
# A relay that valgrind found an error in exits with 99.
wrapper_failed=0
reap_relay() { # reap_relay PID
    wait "$1" 2>/dev/null
    [ $? = 99 ] && wrapper_failed=$((wrapper_failed + 1))
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

# maxmemory reached with the noeviction policy: a filler key takes memory,
# maxmemory is set 4 MiB below what Redis uses, so every XADD (and the
# idempotent script) is refused with OOM while the writer keeps committing.
# The relays must retry, not dead-letter; once the filler is deleted they
# must publish again.
oom_failed=0
for round in $(seq "$oom_rounds"); do
    rcli SET faults:filler "" >/dev/null
    rcli SETRANGE faults:filler $((16 * 1024 * 1024 - 1)) x >/dev/null
    used=$(rcli INFO memory | tr -d '\r' | awk -F: '$1 == "used_memory" {print $2}')
    rcli CONFIG SET maxmemory-policy noeviction >/dev/null
    rcli CONFIG SET maxmemory $((used - 4 * 1024 * 1024)) >/dev/null
    sleep 0.3 # replies already on their way are accepted
    xlen_oom=$(rcli XLEN outbox:orders)
    sleep "$oom_seconds"
    xlen_oom_end=$(rcli XLEN outbox:orders)
    if [ "$xlen_oom_end" != "$xlen_oom" ]; then
        echo "faults: OOM round $round: the stream grew from $xlen_oom to $xlen_oom_end under maxmemory" >&2
        oom_failed=1
    fi
    rcli DEL faults:filler >/dev/null
    if ! wait_for 20 '[ "$(rcli XLEN outbox:orders)" -gt "$xlen_oom_end" ]'; then
        echo "faults: OOM round $round: no progress after memory was freed" >&2
        oom_failed=1
    fi
    rcli CONFIG SET maxmemory 0 >/dev/null
done
oom_retries=$(cat "$work"/relay-[ab].log 2>/dev/null | grep 'publish failed, will retry' | grep -c 'OOM')

# A key of the wrong type at one topic's stream name: that topic's rows fail
# with WRONGTYPE until --max-attempts makes them dead, while the orders keep
# flowing; after the key is deleted, outbox-replay requeues them and they
# must all arrive.
wt_topic=faults.wrongtype
wt_rows=20
rcli SET "outbox:$wt_topic" not-a-stream >/dev/null
xlen_wt=$(rcli XLEN outbox:orders)
# Without a key, so that each row retries on its own (rows sharing a key wait
# for the one before them, and requeued dead rows may overtake the rest).
wt_values=$(seq -s, -f "('wrongtype-%g', '$wt_topic', NULL, CAST('{}' AS BLOB))" "$wt_rows")
sql "PRAGMA synchronous=FULL; INSERT INTO outbox(id, topic, key, payload) VALUES $wt_values" || exit 1
wt_dead_q="SELECT count(*) FROM outbox_messages WHERE topic = '$wt_topic' AND state = 3"
wait_for 60 '[ "$(sql "$wt_dead_q")" = "$wt_rows" ]'
wrongtype_dead=$(sql "$wt_dead_q")
wt_failed=0
if [ "$wrongtype_dead" != "$wt_rows" ]; then
    echo "faults: only $wrongtype_dead of $wt_rows rows of the wrong-type topic went dead" >&2
    wt_failed=1
fi
if ! [ "$(rcli XLEN outbox:orders)" -gt "$xlen_wt" ]; then
    echo "faults: the orders stopped flowing while $wt_topic failed" >&2
    wt_failed=1
fi
if ! grep -q WRONGTYPE "$work"/relay-[ab].log; then
    echo "faults: no WRONGTYPE failure in the relay logs" >&2
    wt_failed=1
fi
rcli DEL "outbox:$wt_topic" >/dev/null
"$replay_bin" requeue --db "$db" --topic "$wt_topic" --state dead \
    --reason "faults: the wrong-type key was deleted" --yes >>"$work/replay.log" 2>&1 || wt_failed=1
wt_pub_q="SELECT count(*) FROM outbox_messages WHERE topic = '$wt_topic' AND state = 2"
wait_for 30 '[ "$(sql "$wt_pub_q")" = "$wt_rows" ]'

touch "$work/stop"
wait "$writer_pid" 2>/dev/null
writer_pid=""
kill -TERM "$relay_a" "$relay_b" 2>/dev/null
reap_relay "$relay_a"
reap_relay "$relay_b"
relay_a=""
relay_b=""
# Final drain: leases of killed relays expire after 1 s and are taken over.
if ! timeout "${DRAIN_TIMEOUT:-120}" "${wrapper[@]}" "$relay_bin" "${relay_args[@]}" --worker-id final --drain \
        >>"$work/relay-final.log" 2>&1; then
    echo "faults: the final drain did not finish" >&2
    tail -5 "$work/relay-final.log" >&2
    exit 1
fi

# Rows that were backing off when the drain found nothing due: drain again.
for _ in 1 2 3 4 5; do
    [ "$(sqlite3 "$db" "SELECT count(*) FROM outbox_messages WHERE state < 2")" = 0 ] && break
    sleep 0.3
    timeout "${DRAIN_TIMEOUT:-60}" "${wrapper[@]}" "$relay_bin" "${relay_args[@]}" --worker-id final --drain \
        >>"$work/relay-final.log" 2>&1
    [ $? = 99 ] && wrapper_failed=$((wrapper_failed + 1))
done

# Every stream's ids (the `id` field is the entry's first field).
lua="local r = {} for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do r[#r + 1] = e[2][2] end return r"
: >"$work/stream-ids"
for topic in $(sqlite3 "$db" "SELECT DISTINCT topic FROM outbox_messages"); do
    redis-cli -s "$sock" --raw EVAL "$lua" 1 "outbox:$topic" >>"$work/stream-ids"
done
# id, state, seq, topic and key (ids, topics and the demo's keys have no spaces).
sqlite3 "$db" "SELECT id || ' ' || state || ' ' || seq || ' ' || topic || ' ' || ifnull(key, '-') FROM outbox_messages" >"$work/rows"
wrongtype_published=$(sql "$wt_pub_q")
# What valgrind (RELAY_WRAPPER) said, before the work directory goes.
[ "$wrapper_failed" -gt 0 ] && grep -h '^==[0-9]*==' "$work"/relay-*.log | head -100 >&2

python3 - "$work/rows" "$work/stream-ids" "$relay_kills" "$redis_restarts" "${IDEMPOTENT:-0}" \
    "$([ -f "$work/writer.failed" ] && wc -l <"$work/writer.failed" || echo 0)" "$rss_max" \
    "$oom_rounds" "$oom_retries" "$oom_failed" "$wrongtype_dead" "$wrongtype_published" "$wt_rows" "$wt_failed" \
    "$wrapper_failed" <<'PY'
import collections, os, sys
rows = {}
for line in open(sys.argv[1]):
    if line.strip():
        i, state, seq, topic, key = line.split()
        rows[i] = (state, int(seq), topic, key)
entries = [line.strip() for line in open(sys.argv[2]) if line.strip()]
counts = collections.Counter(entries)
dead = sum(1 for r in rows.values() if r[0] == "3")
lost = sum(1 for i, r in rows.items() if r[0] != "3" and i not in counts)
orphans = sum(1 for i in counts if i not in rows)
stuck = sum(1 for r in rows.values() if r[0] == "1")
pending = sum(1 for r in rows.values() if r[0] == "0")
dups = sum(c - 1 for c in counts.values())
# Per topic and key, first appearances in the streams must follow seq.
last_seq = {}
seen = set()
misordered = 0
for i in entries:
    if i in seen or i not in rows:
        continue
    seen.add(i)
    _, seq, topic, key = rows[i]
    if key == "-":
        continue
    if last_seq.get((topic, key), -1) > seq:
        misordered += 1
    last_seq[(topic, key)] = max(seq, last_seq.get((topic, key), -1))
rss_kb = int(sys.argv[7])
oom_rounds, oom_retries, oom_failed = int(sys.argv[8]), int(sys.argv[9]), int(sys.argv[10])
wt_dead, wt_pub, wt_rows, wt_failed = int(sys.argv[11]), int(sys.argv[12]), int(sys.argv[13]), int(sys.argv[14])
wrapper_failed = int(sys.argv[15])
print("faults: committed=%d lost=%d orphans=%d stuck=%d duplicates=%d dead=%d pending=%d misordered=%d relay_kills=%s redis_restarts=%s writer_failures=%s relay_rss_during_slow_redis_kb=%d oom_rounds=%d oom_retries=%d wrongtype_dead=%d wrongtype_published=%d"
      % (len(rows), lost, orphans, stuck, dups, dead, pending, misordered, sys.argv[3], sys.argv[4], sys.argv[6], rss_kb,
         oom_rounds, oom_retries, wt_dead, wt_pub))
if wrapper_failed:
    print("faults: %d relay runs reported errors under RELAY_WRAPPER (see the relay logs)" % wrapper_failed)
# A sanitizer build's or valgrind's RSS is mostly their own: the bound is for real builds.
rss_bound = not any(os.environ.get(v) for v in ("ASAN_OPTIONS", "RELAY_WRAPPER", "OUTBOX_UNDER_VALGRIND"))
bad = (lost or orphans or stuck or pending or misordered or len(rows) == 0 or (sys.argv[5] == "1" and dups)
       or (rss_bound and rss_kb > 64 * 1024)
       or oom_failed or (oom_rounds > 0 and oom_retries == 0)
       or wt_failed or wt_dead != wt_rows or wt_pub != wt_rows or wrapper_failed)
sys.exit(1 if bad else 0)
PY
