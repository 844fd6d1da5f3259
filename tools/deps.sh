#!/usr/bin/env bash
# Installs what building and testing outbox needs, from Debian's packages.
# Runs apt-get only when something is missing, so repeated runs are quick.
# Extra package names may be given as arguments: tools/fuzz.sh adds clang,
# tools/package.sh debhelper, lintian and systemd, tools/monitoring.sh
# prometheus (for promtool), so the default list stays quick to install.
# nftables and iproute2 are for the network-fault suite (tests/netfault/:
# nft rules and tc inside a network namespace of its own).
set -euo pipefail
pkgs=(build-essential pkg-config meson ninja-build python3
      libuv1-dev libhiredis-dev libsqlite3-dev libmsgpack-dev libinih-dev
      redis-server redis-tools sqlite3 valgrind curl
      libhttp-parser-dev libssl-dev libyaml-dev libcrypt-dev openssl php-cli php-sqlite3 nodejs
      nftables iproute2 "$@")
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "deps: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian's package starts a system redis-server on port 6379; the project
# never uses it (tests and the demo start their own on a Unix socket).
