#!/bin/sh
# Compiles every public header on its own, as C (strict, -Werror) and as C++,
# so that each one includes what it needs: those in include/ and those meson
# generates into the build tree's include/ (outbox/version.h). TAP output.
src=${OUTBOX_SOURCE_DIR:?}
build=${OUTBOX_BUILD_DIR:?}
cc=${CC:-cc}
cxx=${CXX:-c++}
n=0
fail=0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for h in $( (cd "$src/include" && find . -name '*.h'; cd "$build/include" && find . -name '*.h') | sed 's|^\./||' | sort -u); do
    printf '#include "%s"\n#include "%s"\nint outbox_header_test_%s;\n' "$h" "$h" "$(echo "$h" | tr -c 'a-z0-9\n' _)" >"$tmp/t.c"
    n=$((n + 1))
    if $cc -std=gnu99 -Wall -Wextra -Wpedantic -Werror -fsyntax-only -I"$src/include" -I"$build/include" "$tmp/t.c" 2>"$tmp/err"; then
        echo "ok $n - $h compiles alone as C (gnu99)"
    else
        echo "not ok $n - $h compiles alone as C (gnu99)"; sed 's/^/# /' "$tmp/err"; fail=1
    fi
    n=$((n + 1))
    if command -v "$cxx" >/dev/null 2>&1; then
        if $cxx -x c++ -Wall -Wextra -Werror -fsyntax-only -I"$src/include" -I"$build/include" "$tmp/t.c" 2>"$tmp/err"; then
            echo "ok $n - $h compiles alone as C++"
        else
            echo "not ok $n - $h compiles alone as C++"; sed 's/^/# /' "$tmp/err"; fail=1
        fi
    else
        echo "ok $n - $h as C++ # SKIP no C++ compiler"
    fi
done
echo "1..$n"
exit $fail
