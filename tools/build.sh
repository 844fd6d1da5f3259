#!/usr/bin/env bash
# Configures (once) and builds into ./build with warnings as errors.
set -euo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
# Quiet unless it fails: then what meson and the compiler said.
if [ ! -f build/build.ninja ]; then
    meson setup build -Dwerror=true >"$log" 2>&1 || { tail -n 60 "$log"; exit 1; }
fi
meson compile -C build >"$log" 2>&1 || { tail -n 60 "$log"; exit 1; }
