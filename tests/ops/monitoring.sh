#!/usr/bin/env bash
# The monitoring files of tools/prometheus/: the Grafana dashboard is valid
# JSON (python3 -m json.tool), the alert rules pass `promtool check rules`
# and their unit tests `promtool test rules` (series in, alerts out), the
# dashboard's queries parse as PromQL (promtool check rules again). The
# promtool checks are skipped when promtool (Debian's prometheus package,
# installed by tools/monitoring.sh) is missing. That the rules and panels
# query names the relay serves is checked against a live scrape by
# test_promtool.c. TAP output.
set -u
src=${OUTBOX_SOURCE_DIR:?}
dir=$src/tools/prometheus
. "$src/tests/harness/tap.sh"
skip() {
    n=$((n + 1))
    echo "ok $n - # SKIP $1"
}

check "outbox-dashboard.json is valid JSON" python3 -m json.tool "$dir/outbox-dashboard.json"
promtool=${PROMTOOL:-$(command -v promtool || true)}
if [ -n "$promtool" ] && [ -x "$promtool" ]; then
    check "promtool check rules outbox.rules.yml" "$promtool" check rules "$dir/outbox.rules.yml"
    # promtool resolves rule_files relative to the test file.
    check "promtool test rules outbox.rules.test.yml" "$promtool" test rules "$dir/outbox.rules.test.yml"
    # The panels' queries parse as PromQL: each becomes a recording rule
    # (JSON is YAML) with Grafana's variables replaced by plain values.
    python3 - "$dir/outbox-dashboard.json" >"$tmp/dashboard.rules.yml" <<'PY'
import json, sys
rules = []
def walk(panels):
    for p in panels:
        walk(p.get("panels", []))
        for t in p.get("targets", []):
            e = t["expr"].replace("$__rate_interval", "5m").replace("$instance", ".*").replace("$topic", ".*")
            rules.append({"record": "dashboard:query%d" % len(rules), "expr": e})
walk(json.load(open(sys.argv[1]))["panels"])
print(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))
PY
    check "every dashboard query parses as PromQL (promtool check rules)" "$promtool" check rules "$tmp/dashboard.rules.yml"
else
    skip "promtool check rules: promtool is not installed (bash tools/monitoring.sh installs it)"
    skip "promtool test rules: promtool is not installed"
    skip "dashboard queries parse as PromQL: promtool is not installed"
fi
echo "1..$n"
exit $fail
