#!/usr/bin/env bash
# Runs every libFuzzer target for SECONDS each (default 600) with ASan and
# UBSan, starting from the seed corpus in tests/fuzz/corpus/. New inputs that
# crash are copied to tests/fuzz/regressions/<target>/, which the regular
# test suite replays (meson test --suite fuzz).
#   bash tools/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/deps.sh clang
secs=${1:-600}
shift || true
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(envelope headers redis_url http_head relay_config replay_filters web_config)
if [ ! -f build-fuzz/build.ninja ]; then
    CC=clang meson setup build-fuzz -Dfuzz=true -Db_sanitize=address,undefined -Db_lundef=false \
        -Dc_args=-fsanitize=fuzzer-no-link >/dev/null
fi
meson compile -C build-fuzz >/dev/null
declare -A corpus=([envelope]=envelope [headers]=msgpack_headers [redis_url]=redis_url [http_head]=http_head
                   [relay_config]=relay_config [replay_filters]=replay_filters [web_config]=web_config)
status=0
for t in "${targets[@]}"; do
    work=$(mktemp -d)
    cp -r "tests/fuzz/corpus/${corpus[$t]}/." "$work/"
    mkdir -p "tests/fuzz/regressions/$t"
    echo "== fuzz_$t for ${secs}s"
    if ! (cd "$work" && "$OLDPWD/build-fuzz/tests/fuzz/fuzz_$t" -max_total_time="$secs" -print_final_stats=1 \
            -artifact_prefix="$OLDPWD/tests/fuzz/regressions/$t/" "$work" 2>&1 | tail -15); then
        echo "fuzz_$t found a crash: see tests/fuzz/regressions/$t/"
        status=1
    fi
    rm -rf "$work"
done
exit $status
