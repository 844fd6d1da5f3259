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
want = ["drain", "drain_tls", "drain_cluster", "idle", "latency", "sustained", "writer", "loop", "idempotent", "consume", "memory", "claim",
        "dbdir", "dbdir_idle", "dbdir_fair", "figures"]
fields = {
    "drain": ["msgs_per_s", "ceiling_per_s", "ratio", "sql_budget_us_per_msg", "sql_floor_us_per_msg",
              "sql_floor_ratio", "sql_floor_bare_us_per_msg", "sql_floor_bare_ratio", "relay_cpu_us_per_msg",
              "peer_naive_msgs_per_s", "peer_naive_cpu_us_per_msg", "ratio_peer_naive",
              "peer_ranged_msgs_per_s", "peer_ranged_cpu_us_per_msg", "ratio_peer_ranged",
              "peer_norow_msgs_per_s", "peer_norow_cpu_us_per_msg", "ratio_peer_norow", "ratio_peers_min",
              "ceiling_user_per_s", "ratio_user"],
    "drain_tls": ["msgs_per_s", "plain_msgs_per_s", "ratio"],
    "drain_cluster": ["ceiling_per_s", "single_ceiling_per_s", "ceiling_ratio"],
    "writer": ["ratio", "table_ratio", "txn_ratio"],
    "latency": ["runs"],
    # db_bytes_first_pass is -1 when a loaded machine does not finish the
    # first retention pass within --quick's 20 s: not required here.
    "sustained": ["achieved_msgs_per_s", "p50_ms", "p99_ms", "max_ms", "db_bytes_end", "relay_cpu_pct",
                  "relay_cpu_us_per_msg"],
    "claim": ["ratio", "sql_ratio"],
    "memory": ["peak_rss_mib"],
    "figures": ["target_ratio"],
    "dbdir": ["many_per_s", "one_per_s", "ratio", "sql_floor_ms_per_db", "sql_floor_threads_ms_per_db",
              "sql_floor_ratio_bound", "msgs_cpu_us_each", "sql_floor_msgs_redis_ratio_bound", "cpus_busy_many"],
    "dbdir_idle": ["rss_mib", "fds"],
    "dbdir_fair": ["big_seconds", "small_written", "small_published"],
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
    need = list(fields.get(s, []))
    if s == "drain_cluster" and d.get("relay_cluster"):
        need += ["msgs_per_s", "single_msgs_per_s", "ratio", "relay_cpu_us_per_msg", "single_relay_cpu_us_per_msg",
                 "cpu_ratio"]
    for f in need:
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
# ... and so do the many databases' SQL floors their drain.
dd = [json.loads(l[6:]) for l in open(sys.argv[1]) if '"scenario":"dbdir"' in l][0]
if dd["ratio"] > 1.5 * dd["sql_floor_ratio_bound"]:
    print("dbdir: ratio %s above its SQL floor's bound %s" % (dd["ratio"], dd["sql_floor_ratio_bound"]))
    sys.exit(1)
# The naive peer writes at least the bare per-row lifecycle's SQL, and none
# of the peers overlaps it with Redis: none beats its own SQL alone, and the
# ratios are the relay's rate over theirs.
if d["peer_naive_msgs_per_s"] > 1.5e6 / d["sql_floor_bare_us_per_msg"]:
    print("naive peer %s msg/s above the bare SQL floor of %s us/msg" % (d["peer_naive_msgs_per_s"],
                                                                       d["sql_floor_bare_us_per_msg"]))
    sys.exit(1)
for k in ("naive", "ranged", "norow"):
    want_ratio = d["msgs_per_s"] / d["peer_%s_msgs_per_s" % k]
    if abs(d["ratio_peer_%s" % k] - want_ratio) > 0.01 * want_ratio + 0.002:
        print("ratio_peer_%s is %s, msgs_per_s / peer_%s_msgs_per_s is %s" % (k, d["ratio_peer_%s" % k], k,
                                                                              want_ratio))
        sys.exit(1)
if abs(d["ratio_peers_min"] - min(d["ratio_peer_%s" % k] for k in ("naive", "ranged", "norow"))) > 0.002:
    print("ratio_peers_min is not the smallest peer ratio")
    sys.exit(1)
# figures: every variant's scrape, healthz and stats time, and the counts
# it replaced.
d = [json.loads(l[6:]) for l in open(sys.argv[1]) if '"figures"' in l][0]
for run in ("small_pending", "small_published", "big_pending", "big_published"):
    for f in ("scrape_ms", "healthz_ms", "stats_ms", "before_count_ms", "before_stats_ms"):
        if not (d.get(run) or {}).get(f, 0) > 0:
            print("figures: %s.%s is %r" % (run, f, (d.get(run) or {}).get(f)))
            sys.exit(1)
# sustained: quantiles in order, one backlog sample a second of writing, and
# no message missing (the relay publishes every row it was given).
d = [json.loads(l[6:]) for l in open(sys.argv[1]) if '"sustained"' in l][0]
if not d["p50_ms"] <= d["p99_ms"] <= d["max_ms"]:
    print("sustained: p50 %s p99 %s max %s out of order" % (d["p50_ms"], d["p99_ms"], d["max_ms"]))
    sys.exit(1)
if len(d["backlog_per_s"]) < d["seconds"] - 1 or d["missing"] != 0:
    print("sustained: %d backlog samples over %s s, %s missing" % (len(d["backlog_per_s"]), d["seconds"],
                                                                   d["missing"]))
    sys.exit(1)
PY
st=$?
ok "one BENCH line per scenario, in order, no errors, the quoted figures present" $st
[ $st = 0 ] || sed 's/^/# /' "$tmp/check"
echo "1..$n"
exit $fail
