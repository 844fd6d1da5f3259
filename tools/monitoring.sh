#!/usr/bin/env bash
# The monitoring checks with Prometheus' own tool: installs Debian's
# prometheus package (for promtool; about 320 MB installed with its
# dependencies, so tools/deps.sh does not install it by default), builds,
# and runs the tests that use promtool: ops_promtool (`promtool check
# metrics` on scrapes of a live relay, the rules' and dashboard's names
# against the scrape) and ops_monitoring (`promtool check rules`, `promtool
# test rules`, the dashboard's JSON). The default suite runs them too,
# with the promtool checks skipped when promtool is missing.
# Debian's postinst enables and starts a Prometheus server (port 9090) where
# systemd runs; it is not needed here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/deps.sh prometheus
command -v promtool >/dev/null || { echo "monitoring: no promtool after installing prometheus" >&2; exit 1; }
bash tools/build.sh
meson test -C build --print-errorlogs ops_promtool ops_monitoring
