#!/usr/bin/env bash
# The whole test suite: installs and builds what it needs (warnings are
# errors), compiles a release build too (its optimiser finds warnings the
# debug build does not), runs every meson test (each starts its own
# redis-server on a Unix socket), then builds again with AddressSanitizer
# and UndefinedBehaviorSanitizer and runs the library's own tests (units,
# allocation failures, fuzz corpus replays, CLI) under them. Ends with
# "N passed, N failed" counted from meson's test logs; exits non-zero if
# anything failed or no test ran. The first pass includes the short forms
# of the network-fault scenarios (suite netfault, tests/netfault/; as root,
# skipped without); their long forms are `bash tools/chaos.sh`.
#   SANITIZE=0   skip the sanitizer pass
#   SETUP=valgrind  run the first pass under valgrind (slow; see README)
set -uo pipefail
cd "$(dirname "$0")/.."
# A step that cannot even build ends the run here, with its output (a
# compiler's error) and the count line.
broken() {
    echo "$1"
    echo "0 passed, 1 failed"
    exit 1
}
# Runs a command quietly; shows what it printed if it fails.
quiet() {
    local log
    log=$(mktemp)
    if "$@" >"$log" 2>&1; then
        rm -f "$log"
        return 0
    fi
    tail -n 60 "$log"
    rm -f "$log"
    return 1
}
bash tools/deps.sh || broken "installing the dependencies failed"
bash tools/build.sh || broken "the build failed"
if [ ! -f build-rel/build.ninja ]; then
    quiet meson setup build-rel --buildtype=release -Dwerror=true || broken "configuring the release build failed"
fi
quiet meson compile -C build-rel || broken "the release build failed"
logs=()
status=0
args=(--print-errorlogs --num-processes 2)
[ -n "${SETUP:-}" ] && args+=(--setup "$SETUP")
meson test -C build "${args[@]}" || status=1
logs+=(build/meson-logs/testlog${SETUP:+-$SETUP}.json)
if [ "${SANITIZE:-1}" != 0 ]; then
    if [ ! -f build-asan/build.ninja ]; then
        quiet meson setup build-asan -Db_sanitize=address,undefined -Db_lundef=false -Dwerror=true ||
            broken "configuring the sanitizer build failed"
    fi
    quiet meson compile -C build-asan || broken "the sanitizer build failed"
    # The end-to-end suites (relay, consumer, ops, languages) run in the first
    # pass; under the sanitizers they are a separate, longer command (README).
    meson test -C build-asan --setup sanitize --print-errorlogs --num-processes 2 \
        errors options_doc schema writer envelope envelope_bytes redis_url redis_conn_commands redis_conn_connect target \
        redis_conn_callbacks redis_conn_failures tls tls_cli cli log_json tool_writers headers readme_examples \
        alloc_fail replay_requeue replay_inspect replay_errors \
        web_config fuzz_replay_envelope fuzz_replay_headers fuzz_replay_redis_url fuzz_replay_http_head \
        fuzz_replay_web_config || status=1
    logs+=(build-asan/meson-logs/testlog-sanitize.json)
fi
python3 - "$status" "${logs[@]}" <<'PY'
import json, sys
passed = failed = skipped = 0
for path in sys.argv[2:]:
    try:
        lines = open(path).read().splitlines()
    except OSError:
        print("missing test log %s" % path)
        failed += 1
        continue
    for line in lines:
        if not line.strip():
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
sys.exit(1 if failed or sys.argv[1] != "0" else 0)
PY
