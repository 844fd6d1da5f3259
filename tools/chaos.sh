#!/usr/bin/env bash
# The network-fault suite's long form: every scenario of tests/netfault/
# with the durations it is specified with (an 8 s black hole, 10 s of 20 %
# loss, 1 MiB messages over a 1 Mbit/s link, 3 s of resets and 30 s of
# random ones, a full disk for 10 s, a Sentinel split brain and a Cluster
# minority with and without --wait-replicas 1, the consumer through the
# network faults and through a Sentinel failover),
# each in a world of its own. Prints each scenario's checks, then one table
# row per scenario (Markdown, as in docs/RELIABILITY.md):
#   scenario | committed | lost | duplicates | order violations | resume ms |
#   after failover ms | catch-up s (undisturbed s, ratio) | notes
# Exit status 0 when every scenario's checks held (the async-replication
# runs measure their loss rather than assert it), 77 when the suite cannot
# run here (not root, no ip netns or nft), 1 otherwise. Needs a build
# (OUTBOX_BUILD_DIR, default ./build).
#   CHAOS_SCENARIOS="blackhole sentinel"   only these
#   CHAOS_MODE=short                       the meson tests' short forms
#   OUTBOX_SLOW=N                          every deadline N times longer
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export OUTBOX_BUILD_DIR=${OUTBOX_BUILD_DIR:-$here/build}
scenarios=${CHAOS_SCENARIOS:-blackhole loss slow_link reset_all reset_random disk_full sentinel sentinel_wait cluster cluster_wait consumer consumer_sentinel}
mode=${CHAOS_MODE:-long}
out=$(mktemp -d "${TMPDIR:-/tmp}/outbox-chaos-XXXXXX")
trap 'rm -rf "$out"' EXIT
status=0
for s in $scenarios; do
    echo "== $s ($mode)"
    bash "$here/tests/netfault/run.sh" "$s" "$mode" | tee "$out/$s.log"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 77 ] && exit 77
    [ "$rc" = 0 ] || { echo "== $s: FAILED (exit $rc)"; status=1; }
done
echo
echo "| scenario | committed | lost | duplicates | order violations | resume ms | after failover ms | catch-up s (undisturbed s, ratio) | notes |"
echo "|---|---|---|---|---|---|---|---|---|"
for s in $scenarios; do
    python3 - "$out/$s.log" "$s" <<'PY'
import sys
r = {}
for line in open(sys.argv[1]):
    if line.startswith("RESULT "):
        r = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
if not r:
    print("| %s | (no result) | | | | | | | |" % sys.argv[2])
    sys.exit(0)
failover = r.get("switch_resume_ms") or r.get("promoted_resume_ms") or "-"
lost = r["lost"] if r.get("lost_fraction") in (None, "0.0") else "%s (%.2f %%)" % (r["lost"], 100 * float(r["lost_fraction"]))
catch = "-" if r.get("catchup_s") in (None, "-") else "%s (%s, %sx)" % (r["catchup_s"], r.get("baseline_s", "-"), r.get("catchup_ratio", "-"))
known = {"scenario", "committed", "lost", "duplicates", "order_violations", "rolled_back_published", "resume_ms",
         "catchup_s", "baseline_s", "catchup_ratio", "backlog_at_heal", "lost_marked", "lost_fraction",
         "switch_resume_ms", "promoted_resume_ms"}
notes = " ".join("%s=%s" % (k, v) for k, v in r.items() if k not in known)
notes = ("backlog_at_heal=%s lost_marked=%s %s" % (r.get("backlog_at_heal", "-"), r.get("lost_marked", "-"), notes)).strip()
print("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (r["scenario"], r["committed"], lost, r["duplicates"],
      r["order_violations"], r.get("resume_ms", "-"), failover, catch, notes))
PY
done
exit "$status"
