#!/usr/bin/env bash
# outbox-bench --quick runs every scenario end to end (its own redis-server,
# databases, relay daemons) and prints one well-formed BENCH line each, with
# the figures the docs quote. Targets are not judged here: the machine is
# shared and the sizes are small. TAP output.
set -u
build=${OUTBOX_BUILD_DIR:?}
if [ -n "${OUTBOX_UNDER_VALGRIND:-}" ]; then
    # Every relay daemon of every scenario would run under memcheck: far
    # too slow, and the relay's paths are the relay suites' job there.
    echo "1..0 # SKIP not under valgrind"
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
n=0
fail=0
ok() { # ok DESCRIPTION CONDITION-STATUS
    n=$((n + 1))
    if [ "$2" = 0 ]; then echo "ok $n - $1"; else echo "not ok $n - $1"; fail=1; fi
}

TMPDIR=$tmp "$build/tools/bench/outbox-bench" --quick --json-only >"$tmp/out" 2>"$tmp/err"
rc=$?
ok "outbox-bench --quick exits 0 (every scenario ran)" $rc
[ $rc = 0 ] || sed 's/^/# /' "$tmp/err" "$tmp/out"
python3 - "$tmp/out" >"$tmp/check" 2>&1 <<'PY'
import json, sys
want = ["drain", "drain_tls", "idle", "latency", "writer", "loop", "idempotent", "consume", "memory", "claim"]
fields = {
    "drain": ["msgs_per_s", "ceiling_per_s", "ratio", "sql_budget_us_per_msg", "sql_floor_us_per_msg",
              "sql_floor_ratio", "sql_floor_bare_us_per_msg", "sql_floor_bare_ratio"],
    "drain_tls": ["msgs_per_s", "plain_msgs_per_s", "ratio"],
    "writer": ["ratio", "table_ratio", "txn_ratio"],
    "latency": ["runs"],
    "claim": ["ratio", "sql_ratio"],
    "memory": ["peak_rss_mib"],
}
seen = []
for line in open(sys.argv[1]):
    if not line.startswith("BENCH "):
        print("not a BENCH line: %r" % line[:200])
        sys.exit(1)
    d = json.loads(line[6:])
    s = d.get("scenario")
    if "error" in d:
        print("%s: %s" % (s, d["error"]))
        sys.exit(1)
    for f in fields.get(s, []):
        v = d.get(f)
        if v is None or (isinstance(v, (int, float)) and not v > 0):
            print("%s: %s is %r" % (s, f, v))
            sys.exit(1)
    seen.append(s)
if seen != want:
    print("scenarios %s, want %s" % (seen, want))
    sys.exit(1)
# The SQL floors bound the drain from above: the relay cannot beat them.
d = [json.loads(l[6:]) for l in open(sys.argv[1]) if '"drain"' in l][0]
if not d["sql_floor_us_per_msg"] > 0 or d["msgs_per_s"] > 1.5e6 / d["sql_floor_us_per_msg"]:
    print("drain %s msg/s above its SQL floor of %s us/msg" % (d["msgs_per_s"], d["sql_floor_us_per_msg"]))
    sys.exit(1)
PY
st=$?
ok "one BENCH line per scenario, in order, no errors, the quoted figures present" $st
[ $st = 0 ] || sed 's/^/# /' "$tmp/check"
echo "1..$n"
exit $fail
