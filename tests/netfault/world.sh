# world.sh: a private network world for the network-fault scenarios, sourced
# by each scenario script (bash).
#
# The world is a network namespace of its own (its name holds the shell's
# pid) with only `lo` inside, where every redis-server listens on its own
# 127.0.0.x address (and on a Unix socket in the world's temporary directory,
# so that the checker, in the root namespace, reads every node whatever the
# partition rules say). The relays and consumers run inside it too, so their
# TCP traffic crosses `lo` of that namespace only, and there is no route out.
# Faults are nft rules in a table of our own on that `lo` (in the input hook,
# so a dropped packet vanishes without the sender hearing of it, as on a real
# black hole), and tbf on `lo` for a slow link. A private mount namespace
# with a small tmpfs gives a disk that fills.
#
# Every process is started through nf_spawn, remembered by pid and killed by
# pid; the namespace, the mount and the temporary directory go in an EXIT
# trap, also when a scenario fails half-way. Every wait has a deadline,
# scaled by OUTBOX_SLOW (a factor, default 1; 10 under valgrind).
#
# Functions (the scenario scripts' vocabulary):
#   nf_require                  exit 77 with the reason when the world cannot be made
#   nf_world_up                 the namespace, lo up, the nft table, the trap
#   nf_spawn NAME CMD...        CMD inside the namespace, log NAME.log; sets NF_LAST_PID
#   nf_stop PID [SIG]           signal, then wait (bounded), then SIGKILL
#   nf_redis NAME ADDR [ARG...] a redis-server on ADDR:6379 and $NF_WORK/NAME.sock
#   nf_cli NAME ARG...          redis-cli to NAME through its Unix socket
#   nf_wait SECONDS CMD...      0 once CMD succeeds, 1 at the (scaled) deadline
#   nf_blackhole A B            drop every packet between A and B, both ways
#   nf_loss A B PCT             drop PCT % of the packets between A and B, each way
#   nf_reset A B [PCT]          answer (PCT % of) the TCP segments between A and B with a reset
#   nf_isolate A B...           black holes between A and each B
#   nf_heal                     remove every rule; prints nothing, sets NF_HEAL_MS
#   nf_slow_link RATE           tbf on lo (e.g. 1mbit); nf_fast_link removes it
#   nf_private_mounts "$@"      re-runs the calling script in a private mount namespace
#   nf_tmpfs SIZE               a tmpfs of SIZE (e.g. 16m) at $NF_WORK/disk; sets NF_DISK
#   nf_fill / nf_unfill         fill that tmpfs with a filler file / delete it
#   nf_now_ms                   the wall clock in ms (Redis's entry ids use the same clock)

nf_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
nf_src=$(cd "$nf_here/../.." && pwd)
nf_build=${OUTBOX_BUILD_DIR:-$nf_src/build}
NF_RELAY_BIN=$nf_build/tools/relay/outbox-relay
NF_CONSUME_BIN=$nf_build/tools/consume/outbox-consume
NF_SLOW=${OUTBOX_SLOW:-1}
if [ -n "${OUTBOX_UNDER_VALGRIND:-}" ] && [ "${OUTBOX_UNDER_VALGRIND}" != 0 ]; then NF_SLOW=$((NF_SLOW * 10)); fi
NF_PIDS=()
NF_NS=""
NF_WORK=""
NF_DISK=""
NF_TABLE=outbox_netfault
NF_LAST_PID=""
NF_HEAL_MS=""

nf_log() { echo "netfault: $*" >&2; }
nf_fail() { nf_log "FAIL: $*"; exit 1; }
nf_now_ms() { date +%s%3N; }

# The test harness's convention: 77 is a skip, with its reason on stdout.
nf_skip() { echo "SKIP: $*"; exit 77; }

nf_require() {
    [ "$(id -u)" = 0 ] || nf_skip "needs root: creates a network namespace and nft rules"
    local tool
    for tool in ip nft tc redis-server redis-cli sqlite3 python3 unshare; do
        command -v "$tool" >/dev/null || nf_skip "$tool is missing (bash tools/deps.sh installs it)"
    done
    [ -x "$NF_RELAY_BIN" ] || nf_skip "build first: no $NF_RELAY_BIN"
    # A namespace made and removed here says whether ip netns and nft work at all.
    local probe="outbox-nf-probe-$$"
    ip netns add "$probe" 2>/dev/null || nf_skip "ip netns add does not work here"
    if ! ip netns exec "$probe" nft add table inet probe 2>/dev/null; then
        ip netns del "$probe"
        nf_skip "nft does not work inside a network namespace here"
    fi
    ip netns del "$probe"
}

# Re-runs the calling script (with its arguments) in a private mount
# namespace, once: a tmpfs mounted there never shows on the machine, and it
# goes when the last process inside exits.
nf_private_mounts() {
    if [ "${NF_IN_PRIVATE_MOUNTS:-}" != 1 ]; then
        NF_IN_PRIVATE_MOUNTS=1 exec unshare -m --propagation private bash "$0" "$@"
    fi
}

nf_world_up() {
    NF_WORK=$(mktemp -d "${TMPDIR:-/tmp}/outbox-netfault-XXXXXX")
    NF_NS="outbox-nf-$$-$RANDOM"
    trap nf_world_down EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    ip netns add "$NF_NS" || nf_fail "ip netns add $NF_NS"
    ip -n "$NF_NS" link set lo up || nf_fail "lo up in $NF_NS"
    # Input hook: the sender's stack thinks the packet left, and nobody answers.
    ip netns exec "$NF_NS" nft -f - <<EOF || nf_fail "nft table"
table inet $NF_TABLE {
    chain faults { type filter hook input priority 0; policy accept; }
}
EOF
}

nf_world_down() {
    local p i
    # Every process we started, by pid: a polite signal first, so that
    # relays flush their logs, then SIGKILL for whatever is left.
    for p in "${NF_PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
    for i in $(seq 50); do
        local alive=0
        for p in "${NF_PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for p in "${NF_PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
    for p in "${NF_PIDS[@]}"; do wait "$p" 2>/dev/null; done
    [ -n "$NF_NS" ] && ip netns del "$NF_NS" 2>/dev/null
    [ -n "$NF_DISK" ] && umount -l "$NF_DISK" 2>/dev/null
    if [ -n "$NF_WORK" ]; then
        if [ -n "${NF_KEEP:-}" ]; then nf_log "kept $NF_WORK"; else rm -rf "$NF_WORK"; fi
    fi
    return 0
}

# nf_wait SECONDS CMD...: polls CMD every 20 ms until it succeeds or the
# deadline (SECONDS times OUTBOX_SLOW) passes; the last try decides.
nf_wait() {
    local secs=$1
    shift
    local end=$(( $(nf_now_ms) + ${secs%.*} * 1000 * NF_SLOW ))
    while [ "$(nf_now_ms)" -lt "$end" ]; do
        "$@" && return 0
        sleep 0.02
    done
    "$@"
}

nf_spawn() { # nf_spawn NAME CMD...
    local name=$1
    shift
    ip netns exec "$NF_NS" "$@" >>"$NF_WORK/$name.log" 2>&1 &
    NF_LAST_PID=$!
    NF_PIDS+=("$NF_LAST_PID")
}

# nf_stop PID [SIG]: 0 when it exited with status 0.
nf_stop() {
    local pid=$1 sig=${2:-TERM} rc
    kill -s "$sig" "$pid" 2>/dev/null
    for _ in $(seq $((200 * NF_SLOW))); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.05
    done
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    rc=$?
    return "$rc"
}

nf_sock() { echo "$NF_WORK/$1.sock"; }
nf_cli() { local n=$1; shift; redis-cli -s "$(nf_sock "$n")" "$@"; }
nf_ping() { [ "$(nf_cli "$1" PING 2>/dev/null)" = PONG ]; }

# nf_redis NAME ADDR [ARG...]: a redis-server inside the namespace on
# ADDR:6379, its outgoing connections (replication, cluster bus) from ADDR
# too, so that a rule naming ADDR catches them; waits until it answers. A
# master sends a replica its full sync at once (the default waits 5 s for
# more replicas), so that a healed node catches up in the time of the data.
nf_redis() {
    local name=$1 addr=$2
    shift 2
    mkdir -p "$NF_WORK/$name"
    nf_spawn "$name" redis-server --bind "$addr" --port 6379 --bind-source-addr "$addr" \
        --protected-mode no --unixsocket "$(nf_sock "$name")" --unixsocketperm 700 \
        --dir "$NF_WORK/$name" --save "" --appendonly no --logfile "" --repl-diskless-sync-delay 0 "$@"
    eval "NF_PID_$name=$NF_LAST_PID"
    nf_wait 10 nf_ping "$name" || nf_fail "redis-server $name did not start (see $name.log)"
}

# The rules of one fault go in as one nft transaction: both directions at
# once, never one half of a partition for a moment.
nf_rules_add() { # nf_rules_add RULE... (each "saddr daddr match... verdict")
    local r
    for r in "$@"; do echo "add rule inet $NF_TABLE faults $r"; done | ip netns exec "$NF_NS" nft -f -
}
nf_blackhole() { # nf_blackhole A B
    nf_rules_add "ip saddr $1 ip daddr $2 drop" "ip saddr $2 ip daddr $1 drop"
}
nf_isolate() { # nf_isolate A B...: A cut off from each B
    local a=$1 b rules=()
    shift
    for b in "$@"; do rules+=("ip saddr $a ip daddr $b drop" "ip saddr $b ip daddr $a drop"); done
    nf_rules_add "${rules[@]}"
}
nf_loss() { # nf_loss A B PCT
    nf_rules_add "ip saddr $1 ip daddr $2 numgen random mod 100 < $3 drop" \
        "ip saddr $2 ip daddr $1 numgen random mod 100 < $3 drop"
}
nf_reset() { # nf_reset A B [PCT]
    local when=""
    [ -n "${3:-}" ] && when="numgen random mod 100 < $3"
    nf_rules_add "ip saddr $1 ip daddr $2 meta l4proto tcp $when reject with tcp reset" \
        "ip saddr $2 ip daddr $1 meta l4proto tcp $when reject with tcp reset"
}
nf_heal() {
    ip netns exec "$NF_NS" nft flush chain inet "$NF_TABLE" faults || nf_fail "nft flush"
    NF_HEAL_MS=$(nf_now_ms)
}
nf_rules() { ip netns exec "$NF_NS" nft list chain inet "$NF_TABLE" faults; }

# A packet larger than tbf's bucket never leaves, and lo's MTU (64 KiB) is
# far above a 32 kbit bucket: while the link is slow, lo carries Ethernet's
# 1500 bytes, as a real slow link would.
nf_slow_link() { # nf_slow_link RATE: every packet on lo through one token bucket
    ip -n "$NF_NS" link set lo mtu 1500 || nf_fail "lo mtu 1500"
    ip netns exec "$NF_NS" tc qdisc add dev lo root tbf rate "$1" burst 32kbit latency 400ms ||
        nf_fail "tc tbf"
}
nf_fast_link() {
    ip netns exec "$NF_NS" tc qdisc del dev lo root || nf_fail "tc qdisc del"
    ip -n "$NF_NS" link set lo mtu 65536 || nf_fail "lo mtu 65536"
    NF_HEAL_MS=$(nf_now_ms)
}

# nf_tmpfs SIZE: only inside nf_private_mounts.
nf_tmpfs() {
    [ "${NF_IN_PRIVATE_MOUNTS:-}" = 1 ] || nf_fail "nf_tmpfs outside a private mount namespace"
    NF_DISK=$NF_WORK/disk
    mkdir -p "$NF_DISK"
    mount -t tmpfs -o "size=$1" tmpfs "$NF_DISK" || nf_skip "cannot mount a tmpfs here"
}
# Writes the filler until the filesystem refuses (dd's ENOSPC ends it).
nf_fill() {
    dd if=/dev/zero of="$NF_DISK/filler" bs=64k >/dev/null 2>&1
    dd if=/dev/zero of="$NF_DISK/filler2" bs=512 >/dev/null 2>&1
    return 0
}
nf_unfill() { rm -f "$NF_DISK/filler" "$NF_DISK/filler2"; }
