#!/usr/bin/env bash
# Configures (once) and builds into ./build with warnings as errors.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f build/build.ninja ]; then
    meson setup build -Dwerror=true >/dev/null
fi
meson compile -C build >/dev/null
