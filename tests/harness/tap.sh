# tap.sh: what the shell tests share, sourced after they set -u: a temporary
# directory $tmp removed at exit, and check, which runs one TAP test point.
# A test ends with: echo "1..$n"; exit $fail
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
n=0
fail=0
check() { # check DESCRIPTION COMMAND...: ok when COMMAND succeeds, else its output as diagnostics
    local what=$1
    shift
    n=$((n + 1))
    if "$@" >"$tmp/out" 2>&1; then
        echo "ok $n - $what"
    else
        echo "not ok $n - $what"
        sed 's/^/# /' "$tmp/out"
        fail=1
    fi
}
