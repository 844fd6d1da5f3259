#!/usr/bin/env bash
# selftest.sh: the network-fault suite's own instruments, shown to fail when
# they should. check.py is given a database and a stream made by hand with
# one of each thing it must count (a lost message, one marked published
# but missing, a duplicate, an entry for a rolled-back transaction, an
# entry without a row, a per-key order violation) and must count each
# exactly; it must refuse inputs it cannot read (exit 2). world.sh must
# remove its namespace, processes and directory when a scenario fails
# half-way, and run.sh must skip (77) without root and refuse an unknown
# scenario. TAP output; the parts that need root are skipped without it.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${OUTBOX_BUILD_DIR:-$here/../../build}
relay_bin=$build/tools/relay/outbox-relay
# shellcheck source=../harness/tap.sh
source "$here/../harness/tap.sh"
for tool in redis-server redis-cli sqlite3 python3; do
    command -v "$tool" >/dev/null || { echo "1..0 # SKIP $tool is missing"; exit 0; }
done

# ---- check.py against a known picture -------------------------------------
sock=$tmp/redis.sock
redis-server --port 0 --unixsocket "$sock" --dir "$tmp" --save "" --appendonly no >"$tmp/redis.log" 2>&1 &
redis_pid=$!
trap 'kill "$redis_pid" 2>/dev/null; wait "$redis_pid" 2>/dev/null; rm -rf "$tmp"' EXIT
for _ in $(seq 200); do [ "$(redis-cli -s "$sock" PING 2>/dev/null)" = PONG ] && break; sleep 0.05; done
db=$tmp/app.db
"$relay_bin" init --db "$db" >/dev/null || { echo "Bail out! outbox-relay init"; exit 1; }
# Six committed rows, two keys; m-5 and m-6 unkeyed.
sqlite3 "$db" "INSERT INTO outbox(id, topic, key, payload) VALUES
    ('m-1', 't', 'a', x'00'), ('m-2', 't', 'a', x'00'), ('m-3', 't', 'b', x'00'),
    ('m-4', 't', 'b', x'00'), ('m-5', 't', NULL, x'00'), ('m-6', 't', NULL, x'00')"
# m-6 is marked published although no entry has it: a loss the relay does
# not know about (as after a failover that dropped acknowledged writes).
sqlite3 "$db" "UPDATE outbox SET state = 2, published_at = 1 WHERE id = 'm-6'"
printf 'r-1\nr-2\n' >"$tmp/rolled-back"
xadd() { redis-cli -s "$sock" XADD outbox:t "$1" id "$2" envelope x >/dev/null; }
# m-2 before m-1 (key a out of order), m-3 twice, m-4 missing, m-5 present,
# r-1 (rolled back) published, f-1 (neither) published.
xadd 1000-1 m-2
xadd 1000-2 m-1
xadd 2000-1 m-3
xadd 2000-2 m-3
xadd 3000-1 m-5
xadd 3500-1 r-1
xadd 4000-1 f-1
printf 'm-1\nm-1\nm-2\nx-9\n' >"$tmp/effects"
out=$(python3 "$here/check.py" --db "$db" --node "r=$sock" --rolled-back "$tmp/rolled-back" \
    --heal-ms 1500 --event late=3600 --effects "$tmp/effects")
echo "# $out"
field() { echo "$out" | tr ' ' '\n' | sed -n "s/^$1=//p"; }
is() { [ "$(field "$1")" = "$2" ] || { echo "$1 is $(field "$1"), want $2"; return 1; }; }
check "committed: the six rows" is committed 6
check "found: m-1, m-2, m-3, m-5" is found 4
check "lost: m-4 and m-6" is lost 2
check "lost_marked: m-6, marked published and missing" is lost_marked 1
check "duplicates: the second m-3" is duplicates 1
check "rolled_back_published: r-1" is rolled_back_published 1
check "foreign: f-1" is foreign 1
check "order_violations: m-2 before m-1 on key a" is order_violations 1
check "resume_ms: the first entry at or after 1500 is at 2000" is resume_ms 500
check "late_resume_ms: the first entry at or after 3600 is at 4000" is late_resume_ms 400
check "effects: m-3, m-4, m-5, m-6 missing" is effects_missing 4
check "effects: m-1 applied twice" is effects_duplicated 1
check "effects: x-9 applied for nothing committed" is effects_foreign 1
check "lost_fraction: 2 of 6" is lost_fraction 0.333333
exit_is() { local want=$1; shift; python3 "$here/check.py" "$@" >/dev/null 2>"$tmp/err"; local rc=$?; [ "$rc" = "$want" ] || { echo "exit $rc, want $want"; cat "$tmp/err"; return 1; }; }
check "a node whose socket does not exist: exit 2" exit_is 2 --db "$db" --node "r=$tmp/nothing.sock"
check "a database that does not exist: exit 2" exit_is 2 --db "$tmp/nothing.db" --node "r=$sock"
check "a database without the outbox schema: exit 2" exit_is 2 --db "$tmp/redis.log" --node "r=$sock"
check "no node: a usage error" exit_is 2 --db "$db"

# ---- run.sh and world.sh --------------------------------------------------
check "an unknown scenario: exit 2" bash -c "bash '$here/run.sh' no_such_scenario >/dev/null 2>&1; [ \$? = 2 ]"
if [ "$(id -u)" != 0 ]; then
    echo "ok $((n + 1)) # SKIP not root: the world's clean-up and the skip without root need root"
    n=$((n + 1))
else
    if command -v setpriv >/dev/null; then
        skipped() {
            local o
            o=$(setpriv --reuid=65534 --regid=65534 --clear-groups bash "$here/run.sh" blackhole 2>&1)
            local rc=$?
            echo "$o"
            [ "$rc" = 77 ] && echo "$o" | grep -q "needs root"
        }
        check "without root: exit 77 with the reason" skipped
    fi
    # A scenario that fails half-way: the namespace, the server and the
    # directory must all be gone afterwards.
    failing() {
        bash -c "
            source '$here/world.sh'
            nf_require
            nf_world_up
            nf_redis r1 127.0.0.2
            echo \"\$NF_NS \$NF_PID_r1 \$NF_WORK\" >'$tmp/world'
            nf_fail 'on purpose'
        " >/dev/null 2>&1
        local rc=$? ns pid work
        read -r ns pid work <"$tmp/world" || { echo "the world did not come up"; return 1; }
        [ "$rc" = 1 ] || { echo "exit $rc, want 1"; return 1; }
        ip netns list | grep -qw "$ns" && { echo "namespace $ns left"; return 1; }
        kill -0 "$pid" 2>/dev/null && { echo "redis-server $pid left running"; return 1; }
        [ -e "$work" ] && { echo "$work left"; return 1; }
        return 0
    }
    check "a scenario that fails half-way leaves no namespace, process or directory" failing
fi
echo "1..$n"
exit "$fail"
