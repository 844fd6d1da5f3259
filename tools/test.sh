#!/usr/bin/env bash
# The whole test suite: installs and builds what it needs (warnings are
# errors), runs every meson test (each starts its own redis-server on a Unix
# socket), and ends with "N passed, N failed" counted from meson's test log.
#   SETUP=sanitize|valgrind  run the suite under that meson test setup
#                            (sanitize needs a build with -Db_sanitize, see README)
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/deps.sh || exit 1
bash tools/build.sh || exit 1
args=(--print-errorlogs --num-processes 2)
[ -n "${SETUP:-}" ] && args+=(--setup "$SETUP")
meson test -C build "${args[@]}"
status=$?
python3 - build/meson-logs/testlog.json "$status" <<'PY'
import json, sys
passed = failed = skipped = 0
for line in open(sys.argv[1]):
    line = line.strip()
    if not line:
        continue
    r = json.loads(line).get("result")
    if r in ("OK", "EXPECTEDFAIL"):
        passed += 1
    elif r == "SKIP":
        skipped += 1
    else:
        failed += 1
if passed + failed == 0:
    print("no test ran")
    sys.exit(1)
print("%d passed, %d failed, %d skipped" % (passed, failed, skipped) if skipped else "%d passed, %d failed" % (passed, failed))
sys.exit(1 if failed or sys.argv[2] != "0" else 0)
PY
