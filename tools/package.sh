#!/usr/bin/env bash
# Builds the Debian packages (outbox-relay, liboutbox0, liboutbox-dev) from
# the tree with dpkg-buildpackage, leaves them in dist/, then checks them:
# the version is meson.build's, the packages unpack (dpkg -x) into a
# temporary root where the system user and the state directory are made as
# the postinst makes them, the installed outbox-relay runs (--version, the
# shipped relay.ini) and a program builds against liboutbox-dev through
# pkg-config and runs on liboutbox0, systemd-analyze verifies the installed
# unit and scores its sandbox, and lintian finds nothing but the documented
# overrides (debian/*.lintian-overrides), on the source package and the
# binaries. Exits non-zero on the first failure.
# The build runs in a copy of the tree (git's files, committed or not), so
# the checkout gets no debian/ build droppings.
#   KEEP=1   keep the temporary directory (printed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
top=$PWD
# Only this command needs these: the default CI (tools/deps.sh) stays small.
bash tools/deps.sh debhelper dpkg-dev lintian systemd

say() { printf 'package: %s\n' "$*" >&2; }
die() { say "FAILED: $*"; exit 1; }

version=$(meson introspect --projectinfo meson.build | python3 -c 'import json, sys; print(json.load(sys.stdin)["version"])')
deb_version=$(dpkg-parsechangelog -S Version)
[ "$deb_version" = "$version" ] ||
    die "debian/changelog says $deb_version, meson.build says $version: add a debian/changelog entry for $version"

work=$(mktemp -d /tmp/outbox-package.XXXXXX)
if [ "${KEEP:-0}" = 1 ]; then trap 'say "kept $work"' EXIT; else trap 'rm -rf "$work"' EXIT; fi
src=$work/outbox-$version
mkdir -p "$src"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard | grep -zv '^dist/' |
        while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done |
        tar -cf - --null -T - | tar -xf - -C "$src"
else
    tar -cf - --exclude='./build*' --exclude=./dist --exclude=./.git . | tar -xf - -C "$src"
fi

say "building outbox $version (log: dist/build.log)"
rm -rf dist
mkdir -p dist
# The source package too, from the pristine copy, for lintian's source checks.
(cd "$work" && dpkg-source -b "outbox-$version") >dist/build.log 2>&1 || die "dpkg-source -b (dist/build.log)"
if ! (cd "$src" && DEB_BUILD_OPTIONS="parallel=$(nproc) ${DEB_BUILD_OPTIONS:-}" \
        dpkg-buildpackage -us -uc -b) >>dist/build.log 2>&1; then
    tail -n 40 dist/build.log >&2
    die "dpkg-buildpackage (dist/build.log)"
fi
cp "$work"/*.deb "$work"/*.changes "$work"/*.buildinfo "$work"/*.dsc "$work"/*.tar.* dist/
for p in outbox-relay liboutbox0 liboutbox-dev; do
    ls dist/${p}_"$version"_*.deb >/dev/null 2>&1 || die "no $p package in dist/"
done
for d in dist/*.deb; do
    say "$(basename "$d"): $(dpkg-deb -f "$d" Installed-Size) KiB installed, $(du -k "$d" | cut -f1) KiB"
done

# Installed into a temporary root.
root=$work/root
for d in dist/*.deb; do dpkg -x "$d" "$root"; done
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
out=$("$root/usr/bin/outbox-relay" --version)
[ "$out" = "outbox-relay $version (liboutbox $version)" ] || die "installed outbox-relay --version: $out"
say "installed outbox-relay --version: $out"
for t in outbox-consume outbox-replay; do
    "$root/usr/bin/$t" --help >/dev/null || die "installed $t --help"
done
# What the postinst does (systemd-sysusers, then systemd-tmpfiles), done in
# the temporary root: the user, its group and the state directory.
systemd-sysusers --root="$root" "$root/usr/lib/sysusers.d/outbox-relay.conf" 2>/dev/null ||
    die "systemd-sysusers with the packaged outbox-relay.conf"
grep -q '^outbox:x:[0-9]*:[0-9]*:.*:/var/lib/outbox:/usr/sbin/nologin$' "$root/etc/passwd" ||
    die "no system user outbox: $(cat "$root/etc/passwd")"
systemd-tmpfiles --root="$root" --create "$root/usr/lib/tmpfiles.d/outbox-relay.conf" ||
    die "systemd-tmpfiles with the packaged outbox-relay.conf"
uid=$(sed -n 's/^outbox:x:\([0-9]*\):.*/\1/p' "$root/etc/passwd")
[ "$(stat -c '%a %u' "$root/var/lib/outbox")" = "770 $uid" ] ||
    die "/var/lib/outbox: $(stat -c '%a %u:%g' "$root/var/lib/outbox"), not 770 outbox"
say "sysusers and tmpfiles: user outbox ($uid), /var/lib/outbox 0770 outbox:outbox"
# The default configuration parses; only the database is missing.
set +e
out=$("$root/usr/bin/outbox-relay" run --config "$root/etc/outbox/relay.ini" 2>&1)
rc=$?
set -e
[ $rc = 2 ] && grep -q -- "--db" <<<"$out" || die "relay.ini as shipped (exit $rc): $out"
# Every commented default is a valid key and value.
sed -n 's/^;\([a-z-]* = \)/\1/p' "$root/etc/outbox/relay.ini" | grep -v '^redis = unix' >"$work/all.ini"
set +e
out=$("$root/usr/bin/outbox-relay" run --config "$work/all.ini" --db "$work/none/x.db" 2>&1)
rc=$?
set -e
[ $rc = 2 ] && grep -q "x.db" <<<"$out" || die "relay.ini with every default set (exit $rc): $out"
say "relay.ini: parses as shipped and with every commented default set"

# liboutbox-dev: the README's writer example builds with pkg-config's flags
# and runs on the packaged shared library.
awk '/^```c$/ { n++; if (n == 1) inside = 1; next } /^```/ { inside = 0 } inside' README.md >"$work/writer.c"
pc="PKG_CONFIG_SYSROOT_DIR=$root PKG_CONFIG_PATH=$root/usr/lib/$multiarch/pkgconfig"
cflags=$(env $pc pkg-config --cflags outbox)
libs=$(env $pc pkg-config --libs outbox)
cc -o "$work/writer" "$work/writer.c" $cflags $libs || die "the writer example against liboutbox-dev"
ldd_out=$(LD_LIBRARY_PATH=$root/usr/lib/$multiarch ldd "$work/writer")
grep -q "liboutbox.so.0 => $root" <<<"$ldd_out" || die "the example does not load the packaged liboutbox.so.0"
LD_LIBRARY_PATH=$root/usr/lib/$multiarch "$work/writer" "$work/w.db" | grep -q "committed message" ||
    die "the writer example on liboutbox0"
cc -static-libgcc -o "$work/writer-static" "$work/writer.c" $cflags $root/usr/lib/$multiarch/liboutbox.a \
    $(env $pc pkg-config --libs --static outbox | sed 's/-loutbox//') || die "static link against liboutbox.a"
"$work/writer-static" "$work/w2.db" | grep -q "committed message" || die "the statically linked example"
say "liboutbox-dev: pkg-config, shared and static link of the README example, both run"

# The unit as installed. systemd-analyze verify needs ExecStart's binary at
# its path and the system's units (targets) beside it: it checks a copy of
# the unit whose ExecStart points into the temporary root, the only change.
unit=$root/lib/systemd/system/outbox-relay.service
[ -f "$unit" ] || die "no /lib/systemd/system/outbox-relay.service in outbox-relay"
[ "$(grep -c '^ExecStart=' "$unit")" = 1 ] && grep -q '^ExecStart=/usr/bin/outbox-relay ' "$unit" ||
    die "ExecStart is not one /usr/bin/outbox-relay command"
mkdir -p "$work/unit"
sed "s|^ExecStart=/usr/bin/|ExecStart=$root/usr/bin/|" "$unit" >"$work/unit/outbox-relay.service"
# Documentation=man:outbox-relay(1) is checked once the package ships it.
man=yes
[ -e "$root/usr/share/man/man1/outbox-relay.1.gz" ] || man=no
if ! out=$(systemd-analyze verify --man=$man "$work/unit/outbox-relay.service" 2>&1) || [ -n "$out" ]; then
    printf '%s\n' "$out" >&2
    die "systemd-analyze verify"
fi
say "systemd-analyze verify --man=$man: clean"
security=$(systemd-analyze security --offline=yes "$work/unit/outbox-relay.service" 2>&1 | tail -n 1)
say "systemd-analyze security: $security"

# Source and binary packages. The log shows the overrides with their
# reasons; with --show-overrides lintian's exit status (2) counts overridden
# tags too, so the errors and warnings are read from the output.
set +e
lintian --fail-on error,warning --display-info --show-overrides dist/*.dsc dist/*.changes >dist/lintian.log 2>&1
rc=$?
set -e
if { [ $rc != 0 ] && [ $rc != 2 ]; } || grep -q '^[EW]: ' dist/lintian.log; then
    cat dist/lintian.log >&2
    die "lintian, exit $rc (dist/lintian.log)"
fi
say "lintian: $(grep -c '^[EWI]: ' dist/lintian.log || true) tags, $(grep -c '^O: ' dist/lintian.log || true) overridden (dist/lintian.log)"
say "done: $(cd dist && ls *.deb | tr '\n' ' ')"
