#!/usr/bin/env bash
# The exe_wrapper of the valgrind test setup (tests/meson.build):
#   valgrind_wrap.sh VALGRIND [OPTION...] -- TEST [ARG...]
# runs a compiled TEST under VALGRIND with the options; a shell-script TEST
# runs as it is, because valgrind would check the shell (dash, bash), not
# this project's code.
set -euo pipefail
vg=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
    vg+=("$1")
    shift
done
shift
if [ "$(head -c 2 "$1")" = '#!' ]; then
    exec "$@"
fi
exec "${vg[@]}" "$@"
