#!/usr/bin/env bash
# Compiles every ```c block of README.md as a program against the built
# library, runs the writer example on a fresh database and the embedding
# example against a private redis-server. TAP output.
set -u
src=${OUTBOX_SOURCE_DIR:?}
build=${OUTBOX_BUILD_DIR:?}
tmp=$(mktemp -d)
redis_pid=""
cleanup() {
    if [ -n "$redis_pid" ]; then kill "$redis_pid" 2>/dev/null; wait "$redis_pid" 2>/dev/null; fi
    rm -rf "$tmp"
}
trap cleanup EXIT
n=0
fail=0
check() { # check DESCRIPTION COMMAND...
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

awk -v dir="$tmp" '
    /^```c$/ { n++; out = dir "/example" n ".c"; inside = 1; next }
    /^```/   { inside = 0; next }
    inside   { print > out }
' "$src/README.md"
count=$(ls "$tmp"/example*.c 2>/dev/null | wc -l)
check "README has 2 C examples (found $count)" test "$count" -eq 2

# A sanitizer build's archive needs the same runtime when linking.
san=""
if nm "$build/src/liboutbox.a" 2>/dev/null | grep -q "__asan_"; then
    san="-fsanitize=address,undefined"
fi
libs="$san $build/src/liboutbox.a $(pkg-config --libs libuv hiredis sqlite3 msgpack openssl yaml-0.1 libcrypt) -lhttp_parser -lpthread -lm"
for f in "$tmp"/example*.c; do
    b=${f%.c}
    # shellcheck disable=SC2086
    check "$(basename "$f") compiles without warnings" \
        cc -std=gnu11 -Wall -Wextra -Wno-unused-parameter -Werror -I"$src/include" -I"$build/include" "$f" -o "$b" $libs
done

check "writer example commits an order and its message" "$tmp/example1" "$tmp/shop.db"
check "the message row is there" bash -c "[ \"\$(sqlite3 '$tmp/shop.db' 'SELECT count(*) FROM outbox_messages JOIN orders ON orders.id = 42')\" = 1 ]"

redis-server --port 0 --unixsocket "$tmp/redis.sock" --save "" --appendonly no --dir "$tmp" >"$tmp/redis.log" 2>&1 &
redis_pid=$!
for _ in $(seq 50); do redis-cli -s "$tmp/redis.sock" ping >/dev/null 2>&1 && break; sleep 0.1; done
check "embedding example publishes and exits" timeout 30 "$tmp/example2" "$tmp/app.db" "unix://$tmp/redis.sock"
check "its 3 messages are in outbox:events" bash -c "[ \"\$(redis-cli -s '$tmp/redis.sock' XLEN outbox:events)\" = 3 ]"
echo "1..$n"
exit $fail
