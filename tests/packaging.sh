#!/usr/bin/env bash
# The quick part of the packaging checks (tools/package.sh builds and checks
# the packages themselves): debian/changelog's version is meson.build's, the
# programs meson installs are the ones debian/outbox-relay.install ships,
# the shipped relay.ini parses (as shipped and with every commented default
# set), and systemd-analyze verify accepts the unit (its ExecStart pointed
# at the build's binary, its Documentation= at the built man page; skipped
# without systemd-analyze). TAP output.
set -u
src=${OUTBOX_SOURCE_DIR:?}
build=${OUTBOX_BUILD_DIR:?}
# shellcheck source=tests/harness/tap.sh
. "$src/tests/harness/tap.sh"
relay=$build/tools/relay/outbox-relay
unit=$src/tools/systemd/outbox-relay.service

version=$(meson introspect --projectinfo "$build" | python3 -c 'import json, sys; print(json.load(sys.stdin)["version"])')
deb_version=$(sed -n '1s/^[^ ]* (\([^)]*\)).*/\1/p' "$src/debian/changelog")
check "debian/changelog's version ($deb_version) is meson.build's ($version)" test "$deb_version" = "$version"

installed_bins() {
    meson introspect --installed "$build" | python3 -c '
import json, os, sys
for dest in sorted(json.load(sys.stdin).values()):
    if os.path.basename(os.path.dirname(dest)) == "bin":
        print(os.path.basename(dest))'
}
shipped_bins() {
    sed -n 's|^usr/bin/\([^ ]*\)$|\1|p' "$src/debian/outbox-relay.install" | sort
}
check "debian/outbox-relay.install ships the programs meson installs ($(installed_bins | tr '\n' ' '))" \
    diff <(installed_bins) <(shipped_bins)

# The symbols file lists exactly what the shared library exports, so that a
# new public function cannot ship without its entry (dpkg-gensymbols would
# only warn when the packages are built).
exported_syms() {
    nm -D --defined-only "$build/src/liboutbox.so" | awk '$2 == "T" { print $3 }' | sort
}
listed_syms() {
    sed -n 's/^ \([A-Za-z0-9_]*\)@Base .*/\1/p' "$src/debian/liboutbox0.symbols" | sort
}
check "debian/liboutbox0.symbols lists exactly the library's exported functions" \
    diff <(exported_syms) <(listed_syms)

# Exit 2 naming --db: the file parsed, only the database is missing.
parses_as_shipped() {
    local out rc
    out=$("$relay" run --config "$src/tools/systemd/relay.ini" 2>&1)
    rc=$?
    echo "exit $rc: $out"
    [ $rc = 2 ] && grep -q -- "--db" <<<"$out"
}
check "relay.ini as shipped parses (only --db is missing)" parses_as_shipped
all_defaults() {
    local out rc
    sed -n 's/^;\([a-z-]* = \)/\1/p' "$src/tools/systemd/relay.ini" | grep -v '^redis = unix' >"$tmp/all.ini"
    out=$("$relay" run --config "$tmp/all.ini" --db "$tmp/none/x.db" 2>&1)
    rc=$?
    echo "exit $rc: $out"
    [ $rc = 2 ] && grep -q "x.db" <<<"$out"
}
check "relay.ini with every commented default set parses (the missing database is the error)" all_defaults
check "the unit starts /usr/bin/outbox-relay with /etc/outbox/relay.ini" \
    grep -qx 'ExecStart=/usr/bin/outbox-relay run --config /etc/outbox/relay.ini' "$unit"

if command -v systemd-analyze >/dev/null; then
    mkdir -p "$tmp/unit"
    sed "s|^ExecStart=/usr/bin/outbox-relay |ExecStart=$relay |" "$unit" >"$tmp/unit/outbox-relay.service"
    # Documentation=man:outbox-relay(1): the page as built.
    mkdir -p "$tmp/man/man1"
    cp "$build/man/outbox-relay.1" "$tmp/man/man1/"
    verify() {
        local out
        out=$(MANPATH=$tmp/man systemd-analyze verify --man=yes "$tmp/unit/outbox-relay.service" 2>&1) ||
            { echo "$out"; return 1; }
        echo "$out"
        [ -z "$out" ]
    }
    check "systemd-analyze verify --man=yes: the unit is clean and its man page is found" verify
else
    n=$((n + 1))
    echo "ok $n - # SKIP systemd-analyze verify: systemd-analyze is not installed"
fi
echo "1..$n"
exit $fail
