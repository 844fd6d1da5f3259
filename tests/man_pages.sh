#!/usr/bin/env bash
# The man pages (man/) say what the programs' --help says: each page renders
# without warnings (man --warnings), every subcommand, filter and option of
# --help is in the rendered page with its text, every option the page lists
# is one of --help's, outbox-relay.ini(5) has a key for every option of the
# relay's table, and meson installs the four pages that
# debian/outbox-relay.install ships. TAP output.
set -u
src=${OUTBOX_SOURCE_DIR:?}
build=${OUTBOX_BUILD_DIR:?}
# shellcheck source=tests/harness/tap.sh
. "$src/tests/harness/tap.sh"

# Rendered as man shows it, wide enough that no option line wraps.
render() {
    LC_ALL=C.UTF-8 MANWIDTH=200 man -l -Tutf8 "$1" 2>&1 | col -b
}
warnings() {
    local out
    out=$(LC_ALL=C.UTF-8 MANROFFSEQ='' MANWIDTH=80 man --warnings -E UTF-8 -l -Tutf8 -Z "$1" 2>&1 >/dev/null)
    echo "$out"
    [ -z "$out" ]
}

# compare PAGE PROGRAM BLOCK... : --help's items of the blocks are in the
# rendered page, and the page's option entries are all in --help.
compare() {
    local page=$1 program=$2
    shift 2
    render "$page" >"$tmp/page.txt"
    "$program" --help >"$tmp/help.txt"
    python3 - "$src/man" "$tmp/page.txt" "$tmp/help.txt" "$@" <<'EOF'
import re, sys
sys.path.insert(0, sys.argv[1])
import mkman
page = open(sys.argv[2]).read()
blocks = mkman.parse_help(open(sys.argv[3]).read())
norm = lambda s: ' '.join(s.split())
flat = norm(page)
bad = 0
terms = set()
for name in sys.argv[4:]:
    if name not in blocks:
        print('--help has no block %s' % name)
        bad += 1
        continue
    for term, text in blocks[name]:
        terms.add(term)
        # A tag shorter than the indent shares its line with the text.
        if not re.search(r'^ {7}%s(?: +\S.*)?$' % re.escape(term), page, re.M):
            print('the page has no entry %s' % term)
            bad += 1
        elif norm(text) not in flat:
            print('%s: --help says "%s", the page does not' % (term, norm(text)))
            bad += 1
for m in re.finditer(r'^ {7}(-\S.*)$', page, re.M):
    if not any(m.group(1) == t or m.group(1).startswith(t + ' ') for t in terms):
        print('the page lists %s, --help does not' % m.group(1))
        bad += 1
print('%d entries compared' % len(terms))
sys.exit(1 if bad or not terms else 0)
EOF
}

ini_keys() {
    render "$1" >"$tmp/ini.txt"
    "$2" --help >"$tmp/help.txt"
    python3 - "$src/man" "$tmp/ini.txt" "$tmp/help.txt" <<'EOF'
import re, sys
sys.path.insert(0, sys.argv[1])
import mkman
page = open(sys.argv[2]).read()
options = [t for t, _ in mkman.parse_help(open(sys.argv[3]).read())['Options']]
bad = 0
for term in options:
    m = re.match(r'^--([a-z0-9-]+)(?: (\S+))?$', term)
    if not m or m.group(1) == 'config':
        continue
    key = '%s = %s' % (m.group(1), m.group(2) or 'BOOLEAN')
    env = 'OUTBOX_' + m.group(1).upper().replace('-', '_')
    if not re.search(r'^ {7}%s$' % re.escape(key), page, re.M) or env not in page:
        print('no key "%s" (with %s)' % (key, env))
        bad += 1
keys = re.findall(r'^ {7}([a-z0-9-]+) = ', page, re.M)
print('%d keys' % len(keys))
sys.exit(1 if bad or not keys else 0)
EOF
}

installed_pages() {
    meson introspect --installed "$build" | python3 -c '
import json, sys
for dest in sorted(json.load(sys.stdin).values()):
    if "/man/man" in dest:
        print(dest.split("/share/", 1)[1])'
}
shipped_pages() {
    sed -n 's|^usr/share/\(man/man[0-9]/[^ ]*\)$|\1|p' "$src/debian/outbox-relay.install" | sort
}

relay=$build/tools/relay/outbox-relay
consume=$build/tools/consume/outbox-consume
replay=$build/tools/replay/outbox-replay
man=$build/man
if ! command -v man >/dev/null || ! command -v col >/dev/null; then
    echo "1..0 # SKIP man or col is not installed"
    exit 0
fi
for p in outbox-relay.1 outbox-relay.ini.5 outbox-consume.1 outbox-replay.1; do
    check "$p renders without warnings" warnings "$man/$p"
done
check "outbox-relay(1) lists --help's options with their text" compare "$man/outbox-relay.1" "$relay" Options
check "outbox-consume(1) lists --help's options with their text" compare "$man/outbox-consume.1" "$consume" Options
check "outbox-replay(1) lists --help's subcommands, filters and options with their text" \
    compare "$man/outbox-replay.1" "$replay" Subcommands Filters Options
check "outbox-relay.ini(5) has a key (and its environment variable) for every option of the table" \
    ini_keys "$man/outbox-relay.ini.5" "$relay"
check "meson installs the man pages debian/outbox-relay.install ships ($(installed_pages | tr '\n' ' '))" \
    diff <(installed_pages) <(shipped_pages)
check "meson installs four man pages" test "$(installed_pages | wc -l)" = 4
echo "1..$n"
exit $fail
