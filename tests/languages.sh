#!/usr/bin/env bash
# The outbox from other languages, end to end (examples/): the Python and PHP
# order services write orders and outbox rows with plain SQL in their own
# transactions (some roll back), outbox-relay publishes them to a private
# redis-server, the Node.js consumer reads them with a consumer group and the
# dedup contract of proto/dedup.md, and it shares that group (and its dedup
# state) with the C outbox-consume. Every committed message must arrive exactly
# once with its exact payload; no rolled-back one ever appears. Messages that
# name their database (entries with a db field, as a relay over many databases
# writes them) are applied once per database and id, by Node and C alike.
#
# TAP output. A missing runtime (python3, php with pdo_sqlite, node/npm, or an
# `npm ci` that fails, e.g. offline) turns its checks into "# SKIP". When no
# writer language (python3, php) can run, nothing can be carried end to end:
# the script prints "1..0 # SKIP ..." and exits 77 (a skip for meson's
# `exitcode` protocol; under `tap` meson counts any non-zero exit as an error).
# Needs OUTBOX_BUILD_DIR and OUTBOX_SOURCE_DIR.
# shellcheck disable=SC2317 # the check functions are called through run()
set -u
src=${OUTBOX_SOURCE_DIR:?}
build=${OUTBOX_BUILD_DIR:?}
relay=$build/tools/relay/outbox-relay
consume=$build/tools/consume/outbox-consume
tmp=$(mktemp -d)
db=$tmp/shop.db
sock=$tmp/redis.sock
url=unix://$sock
stream=outbox:orders
redis_pid=""
cleanup() {
    # Consumers and writers run under `timeout`; the server is ours to stop.
    if [ -n "$redis_pid" ]; then
        kill "$redis_pid" 2>/dev/null
        wait "$redis_pid" 2>/dev/null
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# ---------------------------------------------------------------- runtimes
# why[X] is empty when X is usable, else the reason to skip what needs it.
declare -A why=([py]="" [php]="" [node]="" [verify]="" [writer]="")
if ! command -v python3 >/dev/null || ! python3 -c 'import sqlite3, json' 2>/dev/null; then
    why[py]="python3 with sqlite3 not available"
    why[verify]="python3 (used to compare results) not available"
fi
if ! command -v php >/dev/null; then
    why[php]="php not installed"
elif ! php -r 'exit(extension_loaded("pdo_sqlite") ? 0 : 1);' 2>/dev/null; then
    why[php]="php has no pdo_sqlite"
fi
npm_ok=""
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
    why[node]="node or npm not installed"
elif ! node -e 'process.exit(+process.versions.node.split(".")[0] >= 18 ? 0 : 1)'; then
    why[node]="node $(node --version) is older than 18"
else
    # A private copy: the source tree stays free of node_modules.
    mkdir "$tmp/node"
    cp "$src/examples/node/package.json" "$src/examples/node/package-lock.json" \
        "$src/examples/node/consumer.js" "$tmp/node/"
    # Quietly, once per run; give up quickly when the registry cannot be reached.
    if (cd "$tmp/node" && timeout 60 npm ci --no-audit --no-fund --loglevel=error --fetch-retries=1 \
        --fetch-retry-mintimeout=1000 --fetch-retry-maxtimeout=5000 --fetch-timeout=20000) >"$tmp/npm.log" 2>&1; then
        npm_ok=1
    else
        why[node]="npm ci failed (offline registry?)"
    fi
fi
if [ -n "${why[py]}" ] && [ -n "${why[php]}" ]; then
    why[writer]="no writer language (python3, php with pdo_sqlite) available"
fi
if [ -n "${why[writer]}" ]; then
    # Without a writer nothing in other languages can be shown end to end.
    echo "1..0 # SKIP ${why[writer]}; node: ${why[node]:-available}"
    exit 0
fi

# ---------------------------------------------------------------- TAP helpers
n=0
fail=0
pass() {
    n=$((n + 1))
    echo "ok $n - $1"
}
flunk() { # flunk DESCRIPTION [LOGFILE]
    n=$((n + 1))
    echo "not ok $n - $1"
    [ -n "${2:-}" ] && [ -s "$2" ] && sed 's/^/# /' "$2" | head -60
    fail=1
}
skip() {
    n=$((n + 1))
    echo "ok $n - $1 # SKIP $2"
}
# run "REQUIREMENTS" DESCRIPTION COMMAND...: skips when a requirement (py, php,
# node, verify, writer) is unavailable, else runs COMMAND in a subshell (so an
# error inside it still yields a "not ok" line with its output).
run() {
    local reqs=$1 what=$2 r
    shift 2
    for r in $reqs; do
        if [ -n "${why[$r]}" ]; then
            skip "$what" "${why[$r]}"
            return 0
        fi
    done
    if ("$@") >"$tmp/out" 2>&1; then pass "$what"; else flunk "$what" "$tmp/out"; fi
}

if [ -n "$npm_ok" ]; then
    pass "npm ci installs the Node example's locked dependencies"
else
    skip "npm ci installs the Node example's locked dependencies" "${why[node]}"
    [ -s "$tmp/npm.log" ] && sed 's/^/# /' "$tmp/npm.log" | head -4
fi

# ---------------------------------------------------------------- comparisons
# check.py MODE ...: compares the outbox table, the stream and consumer output.
cat >"$tmp/check.py" <<'PY'
import collections, json, sqlite3, sys

def lines(path):
    with open(path, encoding="utf-8") as f:
        return [l.strip() for l in f if l.strip()]

def rows(db):
    c = sqlite3.connect(db)
    return {r[0]: r[1:] for r in c.execute(
        "SELECT id, topic, key, payload, headers, created_at, state FROM outbox_messages")}

def fail(problems):
    for p in problems[:30]:
        print(p)
    sys.exit(1 if problems else 0)

mode, args = sys.argv[1], sys.argv[2:]
problems = []
if mode == "table":          # DB COMMITTED ROLLED: messages and orders committed together
    db, committed, rolled = args
    t, committed, rolled = rows(db), lines(committed), lines(rolled)
    c = sqlite3.connect(db)
    problems += ["committed %s is not in the outbox table" % i for i in committed if i not in t]
    problems += ["rolled-back %s is in the outbox table" % i for i in rolled if i in t]
    problems += ["unexpected row %s" % i for i in set(t) - set(committed)]
    for i in committed:
        if i in t:
            p = json.loads(bytes(t[i][2]).decode("utf-8"))
            o = c.execute("SELECT customer, amount_cents FROM orders WHERE id = ?", (p["order_id"],)).fetchone()
            if o != (p["customer"], p["amount_cents"]):
                problems.append("message %s announces order %r, the orders table has %r" % (i, p, o))
    n_orders = c.execute("SELECT count(*) FROM orders").fetchone()[0]
    if n_orders != len(committed):
        problems.append("%d orders for %d committed messages" % (n_orders, len(committed)))
elif mode == "published":    # DB: every row published, none dead
    states = collections.Counter(r[5] for r in rows(sys.argv[2]).values())
    if set(states) != {2}:
        problems.append("row states (0 pending, 1 sending, 2 published, 3 dead): %s" % dict(states))
elif mode == "stream":       # STREAM_IDS COMMITTED ROLLED: each committed id once, no rolled-back one
    seen, committed, rolled = collections.Counter(lines(args[0])), lines(args[1]), set(lines(args[2]))
    problems += ["%s is %d times in the stream" % (i, seen[i]) for i in committed if seen[i] != 1]
    problems += ["rolled-back %s is in the stream" % i for i in seen if i in rolled]
    problems += ["unexpected %s in the stream" % i for i in set(seen) - set(committed) - rolled]
elif mode == "stream_excludes":  # STREAM_IDS ROLLED
    seen = set(lines(args[0]))
    problems += ["rolled-back %s is in the stream" % i for i in lines(args[1]) if i in seen]
elif mode == "output":       # DB OUT EXPECTED ROLLED [PHP_IDS]: each expected message applied once, exactly
    db, out, expected, rolled = args[:4]
    php = set(lines(args[4])) if len(args) > 4 else None
    t, expected, rolled = rows(db), lines(expected), set(lines(rolled))
    got = [json.loads(l) for l in lines(out)]
    count = collections.Counter(m["id"] for m in got)
    problems += ["%s applied %d times" % (i, count[i]) for i in expected if count[i] != 1]
    problems += ["rolled-back %s applied" % i for i in count if i in rolled]
    problems += ["%s applied, not expected here" % i for i in set(count) - set(expected) - rolled]
    for m in got:
        if m["id"] not in t:
            continue
        topic, key, payload, headers, created_at, _ = t[m["id"]]
        want = {"topic": topic, "key": key, "payload": bytes(payload).decode("utf-8"), "created_at": created_at}
        if php is not None:  # outbox-consume prints headers as JSON
            want["headers"] = ({"content-type": "application/json", "source": "php-order-service"}
                               if m["id"] in php else None)
        diff = {k: (m.get(k), v) for k, v in want.items() if m.get(k) != v}
        if diff:
            problems.append("%s differs (got, want): %r" % (m["id"], diff))
elif mode == "tenants":      # OUT EXPECTED: each "<db> <id>" of EXPECTED applied once, with its db
    got = collections.Counter((m["db"], m["id"]) for m in (json.loads(l) for l in lines(args[0])))
    expected = [tuple(l.split(" ", 1)) for l in lines(args[1])]
    problems += ["%s of %s applied %d times" % (i, d, got[(d, i)]) for d, i in expected if got[(d, i)] != 1]
    problems += ["%s of %s applied, not expected" % (i, d) for d, i in set(got) - set(expected)]
else:
    problems.append("unknown mode " + mode)
fail(problems)
PY
check() { python3 "$tmp/check.py" "$@"; }

# ---------------------------------------------------------------- helpers
rcli() { redis-cli -s "$sock" "$@"; }

# The message ids of the stream's entries, in stream order.
stream_ids() {
    rcli EVAL "local r = {}
        for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
            local f = e[2]
            for i = 1, #f, 2 do if f[i] == 'id' then r[#r + 1] = f[i + 1] end end
        end
        return r" 1 "$stream"
}

# duplicate IDS_FILE: appends a byte-exact copy of the first entry of each
# message (what a relay crash between XADD and mark produces). Server-side, so
# the binary envelope is copied as is.
duplicate() {
    local want copied
    want=$(wc -l <"$1")
    # shellcheck disable=SC2046
    copied=$(rcli EVAL "local want = {}
        for i = 1, #ARGV do want[ARGV[i]] = true end
        local n = 0
        for _, e in ipairs(redis.call('XRANGE', KEYS[1], '-', '+')) do
            local f = e[2]
            if f[1] == 'id' and want[f[2]] then
                want[f[2]] = nil
                redis.call('XADD', KEYS[1], '*', unpack(f))
                n = n + 1
            end
        end
        return n" 1 "$stream" $(cat "$1"))
    [ "$copied" = "$want" ] || { echo "copied $copied of $want entries"; return 1; }
}

# db_entry DB ID: an entry as a relay that names its database writes it
# (fields id, db, envelope, the envelope's db the same), the envelope's
# msgpack packed by hand (proto/envelope.md: a map of 8, db last).
db_entry() {
    python3 - "$2" "$1" >"$tmp/env.bin" <<'PY' || return 1
import struct, sys, time
def s(x):
    b = x.encode()
    assert len(b) < 32
    return bytes([0xa0 | len(b)]) + b
mid, db = sys.argv[1], sys.argv[2]
payload = ('{"tenant":"%s"}' % db).encode()
out = b"\x88" + s("v") + b"\x01" + s("id") + s(mid) + s("topic") + s("tenants") + s("key") + b"\xc0"
out += s("payload") + bytes([0xc4, len(payload)]) + payload + s("headers") + b"\xc0"
out += s("created_at") + b"\xcf" + struct.pack(">Q", int(time.time() * 1000)) + s("db") + s(db)
sys.stdout.buffer.write(out)
PY
    rcli -x XADD "$stream" '*' id "$2" db "$1" envelope <"$tmp/env.bin" >/dev/null
}
tenants_t1() { db_entry tenant-a t-1 && db_entry tenant-b t-1; }
tenants_t1_twice() { tenants_t1 && tenants_t1; }
audit_tenants() {
    c_consume audit-2 "$tmp/t.audit" audit && check tenants "$tmp/t.audit" "$tmp/tenants.expected"
}

nothing_pending() { # nothing_pending GROUP
    local p
    p=$(rcli XPENDING "$stream" "$1" | head -1)
    [ "$p" = 0 ] || { echo "group $1 has $p pending entries"; return 1; }
}

# write_orders py|php NAME ORDERS FAIL_EVERY: committed ids in NAME.ids,
# rolled-back ones in NAME.rolled; both appended to all.ids / all.rolled.
write_orders() {
    local lang=$1 name=$2 orders=$3 every=$4 committed rolled
    local -a cmd=(python3 "$src/examples/python/order_service.py")
    [ "$lang" = php ] && cmd=(php "$src/examples/php/order_service.php")
    if ! timeout 30 "${cmd[@]}" --db "$db" --orders "$orders" --fail-every "$every" \
        >"$tmp/$name.ids" 2>"$tmp/$name.err"; then
        cat "$tmp/$name.err"
        return 1
    fi
    awk '$1 == "rolled-back" { print $2 }' "$tmp/$name.err" >"$tmp/$name.rolled"
    committed=$(wc -l <"$tmp/$name.ids")
    rolled=$(wc -l <"$tmp/$name.rolled")
    cat "$tmp/$name.ids" >>"$tmp/all.ids"
    cat "$tmp/$name.rolled" >>"$tmp/all.rolled"
    if [ "$committed" -ne $((orders - orders / every)) ] || [ "$rolled" -ne $((orders / every)) ]; then
        echo "$committed committed and $rolled rolled back of $orders orders (every $every-th declined)"
        cat "$tmp/$name.err"
        return 1
    fi
}

relay_drain() { # and, when python3 can tell, every row is published
    timeout 30 "$relay" --db "$db" --redis "$url" --drain --log-level warn &&
        { [ -n "${why[verify]}" ] || check published "$db"; }
}

# *_consume CONSUMER OUT [GROUP [OPTIONS...]]: one consumer, --drain, JSON lines in OUT.
node_consume() {
    timeout 30 node "$tmp/node/consumer.js" --redis "$url" --stream "$stream" --group "${3:-billing}" \
        --consumer "$1" --drain "${@:4}" >"$2" 2>"$2.err" || { cat "$2.err"; return 1; }
}
c_consume() {
    timeout 30 "$consume" --redis "$url" --stream "$stream" --group "${3:-billing}" \
        --consumer "$1" --print --drain "${@:4}" >"$2" 2>"$2.err" || { cat "$2.err"; return 1; }
}
applies_nothing() { # applies_nothing OUT: the consumer printed no message
    [ ! -s "$1" ] || { echo "applied again:"; cat "$1"; return 1; }
}

# Both consumers at once in one group over the same entries, one entry per
# read so that they take turns. Writes are paused (CLIENT PAUSE WRITE, which
# holds XGROUP and XREADGROUP) until both have connected, so neither gets a
# head start from starting faster.
c_and_node_together() {
    local cp np cs ns
    rcli CLIENT PAUSE 10000 WRITE >/dev/null
    node_consume node-3 "$tmp/s3.node" billing --batch 1 &
    np=$!
    c_consume c-3 "$tmp/s3.c" billing --batch 1 --max-inflight 1 &
    cp=$!
    for _ in $(seq 100); do
        rcli CLIENT LIST | grep -q 'name=outbox-consumer-node ' &&
            rcli CLIENT LIST | grep -q 'name=outbox-consumer ' && break
        sleep 0.05
    done
    rcli CLIENT UNPAUSE >/dev/null
    wait "$cp"
    cs=$?
    wait "$np"
    ns=$?
    {   # how the work was shared: it varies from run to run
        echo "# C applied $(wc -l <"$tmp/s3.c"), Node applied $(wc -l <"$tmp/s3.node")"
        grep -h drained "$tmp/s3.c.err" "$tmp/s3.node.err" | sed 's/^/#   /'
    } >"$tmp/s3.note"
    cat "$tmp/s3.c" "$tmp/s3.node" >"$tmp/s3.all"
    [ "$cs" = 0 ] && [ "$ns" = 0 ]
}

duplicate_twice() { duplicate "$1" && duplicate "$1"; }
audit_group() {
    c_consume audit-1 "$tmp/audit.out" audit &&
        check output "$db" "$tmp/audit.out" "$tmp/all.ids" "$tmp/all.rolled" "$tmp/from_php.list"
}

dedup_markers() { # dedup_markers NAMESPACE IDS: every id is marked D, with a TTL
    local -a keys=()
    local id marked
    while read -r id; do keys+=("$1:{$stream}:$id"); done <"$2"
    marked=$(rcli EVAL "local n = 0
        for _, k in ipairs(KEYS) do
            if redis.call('GET', k) == 'D' and redis.call('PTTL', k) > 0 then n = n + 1 end
        end
        return n" "${#keys[@]}" "${keys[@]}")
    if [ "${#keys[@]}" -eq 0 ] || [ "$marked" != "${#keys[@]}" ]; then
        echo "$marked of ${#keys[@]} keys like ${keys[0]:-} are D with a TTL"
        return 1
    fi
}

# ---------------------------------------------------------------- setup
: >"$tmp/all.ids"
: >"$tmp/all.rolled"
redis-server --port 0 --unixsocket "$sock" --save '' --appendonly no --dir "$tmp" >"$tmp/redis.log" 2>&1 &
redis_pid=$!
for _ in $(seq 50); do rcli ping >/dev/null 2>&1 && break; sleep 0.1; done
run "" "private redis-server answers on its Unix socket" rcli ping
run "" "outbox-relay init creates the outbox table" "$relay" init --db "$db"

# ---------------------------------------------------------------- writers
run "py" "Python order service: 20 orders, every 4th rolled back" write_orders py py1 20 4
run "php" "PHP order service: 20 orders, every 5th rolled back" write_orders php php1 20 5
run "verify" "committed messages and their orders are in the database, rolled-back ones are not" \
    check table "$db" "$tmp/all.ids" "$tmp/all.rolled"
run "" "outbox-relay --drain publishes every row" relay_drain
stream_ids >"$tmp/stream1.ids"
run "verify" "each committed message is once in $stream, no rolled-back one" \
    check stream "$tmp/stream1.ids" "$tmp/all.ids" "$tmp/all.rolled"
cp "$tmp/all.ids" "$tmp/batch1.ids"

# ---------------------------------------------------------------- Node consumer
run "node" "Node consumer drains group billing" node_consume node-1 "$tmp/node1.out"
run "node verify" "Node applied every committed message once, exact id/topic/key/payload/created_at" \
    check output "$db" "$tmp/node1.out" "$tmp/batch1.ids" "$tmp/all.rolled"
run "node" "Node left dedup:billing:{$stream}:<id> = D (with retention) for each" \
    dedup_markers "dedup:billing" "$tmp/batch1.ids"
run "node" "nothing pending in group billing" nothing_pending billing

# ---------------------------------------------------------------- one group, C and Node
# Node -> C: duplicates of what Node applied are skipped by the C consumer.
head -5 "$tmp/batch1.ids" >"$tmp/dup1.ids"
run "node" "duplicate 5 entries Node applied" duplicate "$tmp/dup1.ids"
run "node" "outbox-consume in group billing skips them (Node's dedup state)" c_consume c-1 "$tmp/s1.out"
run "node" "... and applies nothing" applies_nothing "$tmp/s1.out"
run "node" "... and acknowledges them" nothing_pending billing

# C -> Node: a new batch applied by the C consumer, then duplicated for Node.
first=py
[ -n "${why[py]}" ] && first=php
run "$first" "new batch A ($first): 6 orders, every 3rd rolled back" write_orders "$first" a 6 3
run "" "outbox-relay --drain publishes batch A" relay_drain
run "node" "outbox-consume drains group billing" c_consume c-2 "$tmp/s2.c"
run "node verify" "... applying each message of batch A once, exactly" \
    check output "$db" "$tmp/s2.c" "$tmp/a.ids" "$tmp/all.rolled"
run "node" "duplicate batch A" duplicate "$tmp/a.ids"
run "node" "Node in group billing skips them (the C consumer's dedup state)" node_consume node-2 "$tmp/s2.node"
run "node" "... and applies nothing" applies_nothing "$tmp/s2.node"
run "node" "... and acknowledges them" nothing_pending billing

# Both at once, over a batch where every message is there three times.
: >"$tmp/b.ids"
run "py" "new batch B (Python): 16 orders, every 4th rolled back" write_orders py b-py 16 4
run "php" "new batch B (PHP): 16 orders, every 4th rolled back" write_orders php b-php 16 4
cat "$tmp"/b-*.ids >"$tmp/b.ids" 2>/dev/null
run "" "outbox-relay --drain publishes batch B" relay_drain
run "node" "duplicate batch B twice" duplicate_twice "$tmp/b.ids"
run "node" "outbox-consume and Node drain group billing together" c_and_node_together
[ -s "$tmp/s3.note" ] && cat "$tmp/s3.note"
run "node verify" "together they applied each message of batch B once, exactly" \
    check output "$db" "$tmp/s3.all" "$tmp/b.ids" "$tmp/all.rolled"
run "node" "nothing pending in group billing" nothing_pending billing

# ---------------------------------------------------------------- another group
# A second service (group audit, namespace dedup:audit) applies every message
# once more, duplicates included in the stream; outbox-consume prints headers.
stream_ids >"$tmp/stream_final.ids"
run "verify" "no rolled-back message ever reached $stream" \
    check stream_excludes "$tmp/stream_final.ids" "$tmp/all.rolled"
cat "$tmp/php1.ids" "$tmp/b-php.ids" >"$tmp/from_php.list" 2>/dev/null
[ "$first" = php ] && cat "$tmp/a.ids" >>"$tmp/from_php.list"
run "verify" "group audit (outbox-consume) applies every committed message once, headers included" \
    audit_group

# ---------------------------------------------------------------- messages that name their database
# Two databases of one relay both write message id t-1 to one stream: two
# messages, each applied once per group, deduplicated as <db>:<id>.
stream=outbox:tenants
printf '%s\n' "tenant-a t-1" "tenant-b t-1" >"$tmp/tenants.expected"
printf '%s\n' "tenant-a:t-1" "tenant-b:t-1" >"$tmp/tenants.keys"
run "verify" "entries of message t-1 from databases tenant-a and tenant-b, each twice" \
    tenants_t1_twice
run "node" "Node drains group billing over them" node_consume node-4 "$tmp/t1.node"
run "node verify" "... applying t-1 of tenant-a and of tenant-b once each, db in its line" \
    check tenants "$tmp/t1.node" "$tmp/tenants.expected"
run "node verify" "Node left dedup:billing:{$stream}:<db>:t-1 = D for each database" \
    dedup_markers "dedup:billing" "$tmp/tenants.keys"
run "node verify" "both appended again" tenants_t1
run "node verify" "outbox-consume in group billing skips them (Node's per-database dedup state)" \
    c_consume c-4 "$tmp/t2.c"
run "node verify" "... and applies nothing" applies_nothing "$tmp/t2.c"
run "verify" "group audit (outbox-consume) applies t-1 of each database once, db in its JSON line" \
    audit_tenants
run "verify" "outbox-consume left dedup:audit:{$stream}:<db>:t-1 = D for each database" \
    dedup_markers "dedup:audit" "$tmp/tenants.keys"
run "verify" "nothing pending in group audit" nothing_pending audit

echo "1..$n"
exit $fail
