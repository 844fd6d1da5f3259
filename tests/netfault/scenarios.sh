# scenarios.sh: the network-fault scenarios, sourced by run.sh after
# world.sh. Each scenario is a function sc_NAME that builds its world,
# commits a backlog, starts a writer (committing and rolling back) and the
# relay, injects its fault mid-drain, heals, and leaves the verdict to
# sc_settle: the backlog drains, an undisturbed backlog of the same size is
# drained in the same run for comparison, the writer stops, and check.py
# counts what was found, lost, duplicated and misordered.
#
# SC_MODE is short (the meson tests: seconds per scenario) or long
# (tools/chaos.sh: the durations the scenarios are specified with).

SC_MODE=${SC_MODE:-short}
sc_p() { if [ "$SC_MODE" = long ]; then echo "$2"; else echo "$1"; fi; } # sc_p SHORT LONG

# The relay as these scenarios run it: faults are noticed within a second
# (reply and connect timeouts), retries start fast and never exhaust the
# attempts (a dead row would hide a loss), and published rows are kept so
# that the checker reads every row's state.
SC_RELAY_ARGS=(--lease-ms 5000 --reply-timeout-ms 1000 --connect-timeout-ms 1000 --backoff-min-ms 50
               --backoff-max-ms 500 --scan-interval-ms 100 --max-attempts 100000 --retention-ms 0
               --log-level ${SC_LOG_LEVEL:-info})
SC_RELAY_ADDR=127.0.0.1 # what a relay inside the namespace connects from
SC_TOPIC=nf
SC_STREAM=outbox:$SC_TOPIC
SC_NODES=()         # NAME=SOCKET of every Redis node, for the checker
SC_ASSERT_TIMING=() # resume / switch / promoted / catchup: the targets asserted here
SC_EXPECT_LOSS=0    # 1 where an async-replication window is measured, not asserted
SC_WRITER_PID=""
SC_FAILED=0
SC_POINTS=0

sc_ok() { # sc_ok DESCRIPTION COMMAND...
    local what=$1
    shift
    SC_POINTS=$((SC_POINTS + 1))
    if "$@"; then echo "ok $SC_POINTS - $what"; else echo "not ok $SC_POINTS - $what"; SC_FAILED=1; fi
}

sc_host_spawn() { # sc_host_spawn NAME CMD...: a process in the root namespace, tracked by pid
    local name=$1
    shift
    "$@" >>"$NF_WORK/$name.log" 2>&1 &
    NF_LAST_PID=$!
    NF_PIDS+=("$NF_LAST_PID")
}

sc_db_init() { # sc_db_init [DIR]
    SC_DB=${1:-$NF_WORK}/app.db
    "$NF_RELAY_BIN" init --db "$SC_DB" >/dev/null || nf_fail "outbox-relay init"
}
sc_sql() { sqlite3 -cmd ".timeout 30000" "$SC_DB" "$@"; }
sc_writer() { python3 "$nf_here/writer.py" --db "$SC_DB" --topic "$SC_TOPIC" --rolled-back "$NF_WORK/rolled-back" "$@"; }

# The backlog: N rows in one transaction, ids w-0 .. w-(N-1).
sc_backlog() { sc_writer --backlog "$1" --payload-bytes "${2:-200}" >/dev/null || nf_fail "backlog"; SC_NEXT=$1; }

# The writer: one transaction at a time at RATE per second, every 5th rolled
# back, until the stop file appears.
sc_writer_start() { # sc_writer_start RATE [PAYLOAD_BYTES]
    rm -f "$NF_WORK/stop"
    sc_host_spawn writer python3 "$nf_here/writer.py" --db "$SC_DB" --topic "$SC_TOPIC" \
        --rolled-back "$NF_WORK/rolled-back" --until "$NF_WORK/stop" --rate "$1" --start "$SC_NEXT" \
        --payload-bytes "${2:-200}"
    SC_WRITER_PID=$NF_LAST_PID
}
sc_writer_stop() {
    [ -n "$SC_WRITER_PID" ] || return 0
    touch "$NF_WORK/stop"
    local i
    for i in $(seq $((400 * NF_SLOW))); do kill -0 "$SC_WRITER_PID" 2>/dev/null || break; sleep 0.05; done
    wait "$SC_WRITER_PID" 2>/dev/null
    SC_WRITER_PID=""
}

sc_relay() { # sc_relay NAME URL [ARG...]: sets SC_RELAY_PID
    local name=$1 url=$2
    shift 2
    nf_spawn "relay-$name" "$NF_RELAY_BIN" run --db "$SC_DB" --redis "$url" "${SC_RELAY_ARGS[@]}" \
        --worker-id "$name" "$@"
    SC_RELAY_PID=$NF_LAST_PID
}

sc_xlen() { nf_cli "$1" XLEN "$SC_STREAM" 2>/dev/null; }
sc_xlen_at_least() { local n; n=$(sc_xlen "$1"); [ -n "$n" ] && [ "$n" -ge "$2" ]; }
sc_unpublished() { sc_sql "SELECT count(*) FROM outbox_messages WHERE state < 2 ${1:+AND $1}"; }
sc_none_unpublished() { [ "$(sc_unpublished "$@")" = 0 ]; }
sc_alive() { kill -0 "$1" 2>/dev/null; }

# Mid-drain: the relay has started on the backlog. Nothing else is done
# here, so that the fault follows at once; sc_fault_backlog, called right
# after the fault is in, says how much of the backlog was left.
sc_mid_drain() { # sc_mid_drain NODE BACKLOG
    nf_wait 30 sc_xlen_at_least "$1" $(($2 / 50)) || nf_fail "the relay did not start publishing the backlog"
}
sc_fault_backlog() { # sc_fault_backlog NODE BACKLOG: adds backlog_at_fault to the RESULT line
    local left=$(($2 - $(sc_xlen "$1")))
    [ "$left" -gt 0 ] || { left=0; nf_log "the backlog had drained before the fault was in"; }
    SC_EXTRA="backlog_at_fault=$left ${SC_EXTRA:-}"
}

# After the heal: the backlog drains, then an undisturbed backlog of the
# size the fault left (at least 100 rows; BACKLOG_AT_HEAL, the rows still
# unpublished then, is only a fallback) drains with the writer still
# running, then the writer stops and everything must be published.
sc_settle() { # sc_settle BACKLOG_AT_HEAL
    local backlog=$1 t_heal=$NF_HEAL_MS
    nf_wait "$(sc_p 60 180)" sc_none_unpublished "created_at < $t_heal" ||
        nf_log "the backlog did not drain in time: $(sc_unpublished "created_at < $t_heal") left"
    # The backlog the fault left is what the stream lacked at the heal (rows
    # created before it and first published after it); rows whose XADD was
    # done but whose mark was not are not in it. check.py counts it.
    local nodes=() k
    for k in "${SC_NODES[@]}"; do nodes+=(--node "$k"); done
    backlog=$(python3 "$nf_here/check.py" --db "$SC_DB" "${nodes[@]}" --heal-ms "$t_heal" |
        tr ' ' '\n' | sed -n 's/^backlog_at_heal=//p')
    [ "${backlog:-0}" -ge 100 ] || backlog=100
    sc_writer --backlog "$backlog" --prefix b --payload-bytes "${SC_PAYLOAD:-200}" >/dev/null
    nf_wait "$(sc_p 60 180)" sc_none_unpublished "id LIKE 'b-%'" || nf_log "the baseline did not drain in time"
    sc_writer_stop
    nf_wait "$(sc_p 60 180)" sc_none_unpublished || nf_log "rows left unpublished: $(sc_unpublished)"
}

# sc_at_most FIGURE BOUND: the figure was measured ("-" when not) and is at most BOUND.
sc_at_most() { [ "$1" != - ] && [ "$1" -le "$2" ]; }

# sc_check NAME [CHECK ARGS...]: runs the checker and the assertions.
sc_check() {
    local name=$1 line k
    shift
    local nodes=()
    for k in "${SC_NODES[@]}"; do nodes+=(--node "$k"); done
    line=$(python3 "$nf_here/check.py" --db "$SC_DB" "${nodes[@]}" --rolled-back "$NF_WORK/rolled-back" \
        --prefix outbox: ${NF_HEAL_MS:+--heal-ms "$NF_HEAL_MS"} --baseline b- "$@") || nf_fail "check.py failed"
    echo "# check: $line"
    declare -gA R=()
    local events=""
    for kv in $line; do
        R[${kv%%=*}]=${kv#*=}
        case ${kv%%=*} in resume_ms) ;; *_resume_ms) events+=" $kv" ;; esac
    done
    echo "RESULT scenario=$name committed=${R[committed]} lost=${R[lost]} duplicates=${R[duplicates]}" \
        "order_violations=${R[order_violations]} rolled_back_published=${R[rolled_back_published]}" \
        "resume_ms=${R[resume_ms]:--} catchup_s=${R[catchup_s]:--} baseline_s=${R[baseline_s]:--}" \
        "catchup_ratio=${R[catchup_ratio]:--} backlog_at_heal=${R[backlog_at_heal]:--}" \
        "lost_marked=${R[lost_marked]} lost_fraction=${R[lost_fraction]}${events} ${SC_EXTRA:-}"
    sc_ok "committed rows exist (${R[committed]})" [ "${R[committed]}" -gt 0 ]
    if [ "$SC_EXPECT_LOSS" = 1 ]; then
        echo "# lost ${R[lost]} of ${R[committed]} (${R[lost_fraction]}): the async-replication window, measured"
    else
        sc_ok "nothing lost (${R[lost]})" [ "${R[lost]}" = 0 ]
    fi
    sc_ok "every committed row is marked published (${R[unpublished]} left)" [ "${R[unpublished]}" = 0 ]
    sc_ok "no dead rows (${R[dead]})" [ "${R[dead]}" = 0 ]
    sc_ok "per-key order kept (${R[order_violations]} violations)" [ "${R[order_violations]}" = 0 ]
    sc_ok "nothing published for a rolled-back transaction (${R[rolled_back_published]} of ${R[rolled_back]})" \
        [ "${R[rolled_back_published]}" = 0 ]
    sc_ok "no entry without a row (${R[foreign]})" [ "${R[foreign]}" = 0 ]
    sc_ok "the writer rolled some transactions back (${R[rolled_back]})" [ "${R[rolled_back]}" -gt 0 ]
    local t
    for t in "${SC_ASSERT_TIMING[@]}"; do
        case $t in
        resume) sc_ok "publishing resumed within 1 s of the heal (${R[resume_ms]} ms)" \
                    sc_at_most "${R[resume_ms]:--}" $((1000 * ${OUTBOX_SLOW:-1})) ;;
        switch) sc_ok "the first entry on the new master within 1 s of +switch-master (${R[switch_resume_ms]} ms)" \
                    sc_at_most "${R[switch_resume_ms]:--}" 1000 ;;
        promoted) sc_ok "the first entry on the promoted replica within 1 s of its promotion (${R[promoted_resume_ms]} ms)" \
                    sc_at_most "${R[promoted_resume_ms]:--}" $((1000 * ${OUTBOX_SLOW:-1})) ;;
        catchup) sc_ok "the backlog drained within 2x the undisturbed drain (${R[catchup_s]} s vs ${R[baseline_s]} s)" \
                    python3 -c "import sys; sys.exit(0 if float('${R[catchup_s]}') <= 2 * float('${R[baseline_s]}') else 1)" ;;
        esac
    done
}

# ---- single node: 1, 2, 3 -------------------------------------------------

sc_single_up() {
    nf_world_up
    nf_redis r1 127.0.0.2
    SC_NODES=("r1=$(nf_sock r1)")
    sc_db_init
    SC_URL=redis://127.0.0.2:6379
}

# sc_single_fault NAME BACKLOG SECONDS FAULT...: the fault (a world.sh
# function and its arguments) for SECONDS, mid-drain, then healed.
sc_single_fault() {
    local name=$1 backlog=$2 secs=$3
    shift 3
    sc_single_up
    sc_backlog "$backlog"
    sc_writer_start 100
    sc_relay a "$SC_URL"
    sc_mid_drain r1 "$backlog"
    "$@" || nf_fail "could not inject the fault: $*"
    sc_fault_backlog r1 "$backlog"
    # The fault lasts a fixed time: its duration is what the scenario is.
    sleep "$secs"
    sc_ok "the relay is still running under the fault" sc_alive "$SC_RELAY_PID"
    local left
    left=$(sc_unpublished)
    nf_heal
    sc_settle "$left"
    sc_ok "the relay is still running after the heal" sc_alive "$SC_RELAY_PID"
    sc_check "$name"
}

# The 1 s resume is asserted in both forms; the 2x catch-up in the long
# form only, whose backlog takes over a second undisturbed (in the short
# form the resume itself is most of a catch-up of 0.2 s).
sc_timing() { SC_ASSERT_TIMING=(resume); [ "$SC_MODE" = long ] && SC_ASSERT_TIMING+=("$@"); return 0; }

sc_blackhole() {
    sc_timing catchup
    sc_single_fault blackhole "$(sc_p 15000 150000)" "$(sc_p 2 8)" nf_blackhole "$SC_RELAY_ADDR" 127.0.0.2
}
sc_loss() {
    sc_timing catchup
    sc_single_fault loss20 "$(sc_p 15000 150000)" "$(sc_p 2 10)" nf_loss "$SC_RELAY_ADDR" 127.0.0.2 20
}
sc_reset_all() {
    sc_timing catchup
    sc_single_fault reset_all "$(sc_p 15000 150000)" "$(sc_p 1 3)" nf_reset "$SC_RELAY_ADDR" 127.0.0.2
}
sc_reset_random() {
    sc_timing
    sc_single_fault reset_random "$(sc_p 15000 300000)" "$(sc_p 2 30)" nf_reset "$SC_RELAY_ADDR" 127.0.0.2 5
}

# A slow link (tbf on lo, every packet) while messages of 1 MiB drain: how
# long each takes against what the link allows, and whether it finishes.
sc_slow_link() {
    local n rate secs
    n=$(sc_p 2 4)
    rate=$(sc_p 8mbit 1mbit)
    SC_PAYLOAD=$((1024 * 1024))
    SC_ASSERT_TIMING=()
    sc_single_up
    sc_backlog "$n" "$SC_PAYLOAD"
    sc_writer_start 20 1024
    nf_slow_link "$rate"
    local t0
    t0=$(nf_now_ms)
    # The relay's defaults for timeouts: a 1 MiB XADD needs 8.4 s at 1 Mbit/s.
    SC_RELAY_ARGS=(--max-attempts 100000 --retention-ms 0 --log-level info --backoff-min-ms 50 --backoff-max-ms 500)
    sc_relay a "$SC_URL"
    secs=$(sc_p 15 120)
    nf_wait "$secs" sc_none_unpublished "seq <= $n"
    local t1 published
    t1=$(nf_now_ms)
    published=$(sc_sql "SELECT count(*) FROM outbox_messages WHERE state = 2 AND seq <= $n")
    SC_EXTRA="slow_published=$published/$n slow_ms=$((t1 - t0)) link=$rate"
    echo "# under $rate: $published of $n messages of 1 MiB published in $((t1 - t0)) ms"
    nf_fast_link
    SC_PAYLOAD=1024
    sc_settle "$n"
    sc_check slow_link
}

# ---- 7. disk full ---------------------------------------------------------

sc_log_has() { grep -q -- "$2" "$NF_WORK/$1.log" 2>/dev/null; }

# The database's filesystem (a tmpfs in the private mount namespace) fills
# mid-drain: the writer's commits fail with SQLITE_FULL, the relay's marks
# and claims fail; it must stay up, a relay started meanwhile must wait, and
# once the filler is deleted publishing resumes with nothing lost and the
# database intact.
sc_disk_full() {
    local backlog left
    backlog=$(sc_p 20000 60000)
    SC_ASSERT_TIMING=()
    nf_world_up
    nf_redis r1 127.0.0.2
    SC_NODES=("r1=$(nf_sock r1)")
    # Room after the heal for the backlog's rows, the baseline (as large as
    # what the fault left) and a WAL of up to the relay's RESTART threshold
    # (64 MiB) while two relays and the writer read: 96m was too small for
    # the long form, which filled the disk again for good with its baseline.
    nf_tmpfs "$(sc_p 48m 256m)"
    sc_db_init "$NF_DISK"
    SC_URL=redis://127.0.0.2:6379
    sc_backlog "$backlog"
    sc_writer_start 100
    sc_relay a "$SC_URL"
    local relay_a=$SC_RELAY_PID
    sc_mid_drain r1 "$backlog"
    # Redis holds the writes while the disk fills, so that the relay has
    # messages on their way whose marks must then fail, however fast it is.
    nf_cli r1 CLIENT PAUSE 60000 WRITE >/dev/null
    sc_fault_backlog r1 "$backlog"
    nf_fill
    nf_cli r1 CLIENT UNPAUSE >/dev/null
    sc_ok "the writer's commits fail with SQLITE_FULL" \
        nf_wait 20 sc_log_has writer "database or disk is full"
    sc_ok "the relay's database writes fail and it says so" \
        nf_wait 20 sc_log_has relay-a "database error"
    sc_relay b "$SC_URL"
    local relay_b=$SC_RELAY_PID
    sc_ok "a relay started on the full disk waits (logs the failure, keeps running)" \
        nf_wait 20 sc_log_has relay-b "database error\|database unavailable\|database open failed"
    sleep "$(sc_p 2 10)" # the disk stays full this long: the scenario's duration
    sc_ok "the first relay is still running on the full disk" sc_alive "$relay_a"
    sc_ok "both relays are still running on the full disk" sc_alive "$relay_b"
    left=$(sc_unpublished)
    nf_unfill
    NF_HEAL_MS=$(nf_now_ms)
    sc_settle "$left"
    sc_ok "both relays are still running after space was freed" eval 'sc_alive "$relay_a" && sc_alive "$relay_b"'
    local integrity
    integrity=$(sc_sql "PRAGMA integrity_check")
    sc_ok "PRAGMA integrity_check: $integrity" [ "$integrity" = ok ]
    sc_check disk_full
}

# ---- 4. Sentinel split brain ----------------------------------------------

sc_role() { nf_cli "$1" ROLE 2>/dev/null | head -1; }
sc_role_is() { [ "$(sc_role "$1")" = "$2" ]; }
sc_link_up() { nf_cli "$1" INFO replication 2>/dev/null | grep -q '^master_link_status:up'; }
sc_all_links_up() { local n; for n in "$@"; do sc_link_up "$n" || return 1; done; }
sc_sentinel_knows() { # sc_sentinel_knows SENTINEL: sees both replicas and the other two sentinels
    local info
    info=$(nf_cli "$1" SENTINEL master mymaster 2>/dev/null | tr -d '\r' | paste - - | tr '\t' '=')
    echo "$info" | grep -qx 'num-slaves=2' && echo "$info" | grep -qx 'num-other-sentinels=2'
}
sc_sentinel_master_is() { # sc_sentinel_master_is SENTINEL ADDR
    [ "$(nf_cli "$1" SENTINEL get-master-addr-by-name mymaster 2>/dev/null | head -1)" = "$2" ]
}
sc_event_seen() { grep -q -- "$1" "$NF_WORK/events.log" 2>/dev/null; }
sc_event_ms() { grep -m1 -- "$1" "$NF_WORK/events.log" | cut -d' ' -f1; }

# One master (m1, 127.0.0.2) with two replicas (r1, .3; r2, .4) and three
# sentinels (.11-.13), each with its own address, source address and
# announce-ip. Two replicas, so that the promoted one has a replica at once
# (the sentinels reconfigure r2 during the failover): Sentinel makes a
# healed old master a replica only some 10 s after it reappears (it waits
# for the role it reports to settle), and with a single replica WAIT
# would measure that wait rather than the relay. Both replicas have the
# same replica-priority, so that Sentinel promotes the one with the larger
# replication offset: with r2 less preferred (as this world once had it),
# an entry that only r2 had acknowledged when the cut came passed WAIT 1
# and was lost with the promotion of r1 (1 row in some runs under load).
# The relay warns of such a deployment (sc_sentinel_split checks that it
# does not here).
# failover-timeout bounds, among other things, how long the sentinels leave
# a healed old master as a master before they make it a replica: 3 s rather
# than the default 3 minutes.
sc_sentinel_up() {
    nf_world_up
    nf_redis m1 127.0.0.2
    nf_redis r1 127.0.0.3 --replicaof 127.0.0.2 6379
    nf_redis r2 127.0.0.4 --replicaof 127.0.0.2 6379
    nf_wait 20 sc_all_links_up r1 r2 || nf_fail "the replicas did not sync"
    local i addr
    for i in 1 2 3; do
        addr=127.0.0.1$i
        mkdir -p "$NF_WORK/s$i"
        cat >"$NF_WORK/s$i/sentinel.conf" <<CONF
port 26379
bind $addr
bind-source-addr $addr
protected-mode no
unixsocket $(nf_sock "s$i")
unixsocketperm 700
dir $NF_WORK/s$i
sentinel announce-ip $addr
sentinel monitor mymaster 127.0.0.2 6379 2
sentinel down-after-milliseconds mymaster 1000
sentinel failover-timeout mymaster 3000
sentinel parallel-syncs mymaster 1
CONF
        nf_spawn "s$i" redis-server "$NF_WORK/s$i/sentinel.conf" --sentinel
    done
    for i in 1 2 3; do
        nf_wait 30 sc_sentinel_knows "s$i" || nf_fail "sentinel s$i does not see the replica and the other sentinels"
    done
    sc_host_spawn events python3 "$nf_here/events.py" "$(nf_sock s1)" +switch-master +sdown +odown
    SC_NODES=("m1=$(nf_sock m1)" "r1=$(nf_sock r1)" "r2=$(nf_sock r2)")
    sc_db_init
    SC_URL="redis-sentinel://127.0.0.11:26379,127.0.0.12:26379,127.0.0.13:26379#mymaster"
}

# sc_sentinel_split NAME [RELAY ARGS...]: the master cut off from its
# replica and the sentinels (not from the relay) until +switch-master, then
# healed; the old master must come back as a replica of the new one.
sc_sentinel_split() {
    local name=$1 backlog left t_switch t_cut
    shift
    backlog=$(sc_p 2000 100000)
    sc_sentinel_up
    sc_backlog "$backlog"
    sc_writer_start 100
    sc_relay a "$SC_URL" "$@"
    sc_mid_drain m1 "$backlog"
    t_cut=$(nf_now_ms)
    nf_isolate 127.0.0.2 127.0.0.3 127.0.0.4 127.0.0.11 127.0.0.12 127.0.0.13 || nf_fail "the partition"
    sc_fault_backlog m1 "$backlog"
    sc_ok "the sentinels promote the replica (+switch-master)" nf_wait 30 sc_event_seen +switch-master
    t_switch=$(sc_event_ms +switch-master)
    # The old master stays cut off a little longer than the promotion, as a
    # partition does not heal on cue: the relay may still be writing to it.
    sleep "$(sc_p 0.5 5)"
    sc_ok "the relay is still running in the split brain" sc_alive "$SC_RELAY_PID"
    left=$(sc_unpublished)
    nf_heal
    sc_ok "the old master comes back as a replica" nf_wait 30 sc_role_is m1 slave
    nf_wait 30 sc_link_up m1 || nf_log "the old master's replication link is not up"
    sc_settle "$left"
    SC_EXTRA+=" switch_after_cut_ms=$((t_switch - t_cut)) heal_after_switch_ms=$((NF_HEAL_MS - t_switch))"
    sc_ok "the relay does not warn that its WAITs miss a failover" \
        eval '! grep -q "does not cover a failover" "$NF_WORK/relay-a.log"'
    sc_check "$name" --event "switch=$t_switch"
    echo "# after +switch-master: first entry on the new master after ${R[switch_resume_ms]:--} ms"
}

sc_sentinel() {
    SC_EXPECT_LOSS=1
    SC_ASSERT_TIMING=()
    sc_sentinel_split sentinel
}
sc_sentinel_wait() {
    # The relay hears +switch-master from the sentinels and moves at once;
    # asserted in the short form, measured in the long one.
    SC_ASSERT_TIMING=()
    [ "$SC_MODE" = short ] && SC_ASSERT_TIMING=(switch)
    sc_sentinel_split sentinel_wait --wait-replicas 1 --wait-timeout-ms 500
}

# ---- 5. Cluster minority --------------------------------------------------

sc_cluster_ok() { nf_cli "$1" CLUSTER INFO 2>/dev/null | grep -q '^cluster_state:ok'; }
sc_all_cluster_ok() { local n; for n in c1 c2 c3 c4 c5 c6; do sc_cluster_ok "$n" || return 1; done; }

# Three masters (c1-c3, 127.0.0.2-4) and three replicas (c4-c6, .5-.7),
# cluster-node-timeout short, so that a master cut off from the majority
# is replaced by its replica within seconds.
sc_cluster_up() {
    local i
    nf_world_up
    for i in 1 2 3 4 5 6; do
        nf_redis "c$i" "127.0.0.$((i + 1))" --cluster-enabled yes --cluster-config-file nodes.conf \
            --cluster-node-timeout "${SC_NODE_TIMEOUT:-1000}"
    done
    ip netns exec "$NF_NS" redis-cli --cluster create 127.0.0.2:6379 127.0.0.3:6379 127.0.0.4:6379 \
        127.0.0.5:6379 127.0.0.6:6379 127.0.0.7:6379 --cluster-replicas 1 --cluster-yes \
        >"$NF_WORK/cluster-create.log" 2>&1 || nf_fail "redis-cli --cluster create (see cluster-create.log)"
    nf_wait 30 sc_all_cluster_ok || nf_fail "the cluster did not reach state ok"
    SC_NODES=()
    for i in 1 2 3 4 5 6; do SC_NODES+=("c$i=$(nf_sock "c$i")"); done
    # The master that holds the stream's slot, and its replica.
    local slot
    slot=$(nf_cli c1 CLUSTER KEYSLOT "$SC_STREAM")
    local owner m r
    owner=$(python3 "$nf_here/slot_owner.py" "$(nf_sock c1)" "$SC_STREAM") ||
        nf_fail "no master (or no replica) for slot $slot"
    m=${owner%% *} r=${owner#* }
    SC_VICTIM=c$((${m##*.} - 1)) SC_VICTIM_REPLICA=c$((${r##*.} - 1))
    nf_wait 30 sc_all_links_up c4 c5 c6 || nf_fail "the replicas did not sync"
    sc_db_init
    SC_URL="redis-cluster://127.0.0.2:6379,127.0.0.3:6379,127.0.0.4:6379"
    nf_log "slot $slot of $SC_STREAM: master $SC_VICTIM, replica $SC_VICTIM_REPLICA"
}

sc_addr() { echo "127.0.0.$(( ${1#c} + 1 ))"; }

# sc_cluster_minority NAME [RELAY ARGS...]: the stream's master cut off
# from every other node (not from the relay) until its replica is master,
# then healed; the old master must come back as a replica.
sc_cluster_minority() {
    local name=$1 backlog left t_cut t_promoted others=() i
    shift
    backlog=$(sc_p 2000 100000)
    sc_cluster_up
    sc_backlog "$backlog"
    sc_writer_start 100
    sc_relay a "$SC_URL" "$@"
    sc_mid_drain "$SC_VICTIM" "$backlog"
    for i in 1 2 3 4 5 6; do [ "c$i" = "$SC_VICTIM" ] || others+=("$(sc_addr "c$i")"); done
    t_cut=$(nf_now_ms)
    nf_isolate "$(sc_addr "$SC_VICTIM")" "${others[@]}" || nf_fail "the partition"
    sc_fault_backlog "$SC_VICTIM" "$backlog"
    sc_ok "the replica $SC_VICTIM_REPLICA is promoted" nf_wait 30 sc_role_is "$SC_VICTIM_REPLICA" master
    t_promoted=$(nf_now_ms)
    sleep "$(sc_p 0.5 5)" # the partition outlasts the promotion a little, as real ones do
    sc_ok "the relay is still running in the minority partition" sc_alive "$SC_RELAY_PID"
    left=$(sc_unpublished)
    nf_heal
    sc_ok "the old master comes back as a replica" nf_wait 30 sc_role_is "$SC_VICTIM" slave
    nf_wait 30 sc_link_up "$SC_VICTIM" || nf_log "the old master's replication link is not up"
    sc_settle "$left"
    SC_EXTRA+=" promoted_after_cut_ms=$((t_promoted - t_cut)) heal_after_promotion_ms=$((NF_HEAL_MS - t_promoted))"
    sc_check "$name" --event "promoted=$t_promoted"
    echo "# after the promotion: first entry after ${R[promoted_resume_ms]:--} ms"
}

sc_cluster() {
    SC_EXPECT_LOSS=1
    SC_ASSERT_TIMING=(promoted)
    sc_cluster_minority cluster
}
sc_cluster_wait() {
    SC_ASSERT_TIMING=(promoted)
    sc_cluster_minority cluster_wait --wait-replicas 1 --wait-timeout-ms 500
}

# ---- 6. the consumer side -------------------------------------------------

sc_effects() { [ -f "$NF_WORK/effects" ] && wc -l <"$NF_WORK/effects" || echo 0; }
sc_effects_at_least() { [ "$(sc_effects)" -ge "$1" ]; }
# Distinct messages with an effect: an effect applied twice must not stand
# in for one not applied yet.
sc_effects_distinct() { [ -f "$NF_WORK/effects" ] && sort -u "$NF_WORK/effects" | wc -l || echo 0; }
sc_all_effects() { [ "$(sc_effects_distinct)" -ge "$(sc_sql "SELECT count(*) FROM outbox")" ]; }
sc_log_count() { grep -c -- "$2" "$NF_WORK/$1.log" 2>/dev/null || true; }
sc_log_count_above() { [ "$(sc_log_count "$1" "$2")" -gt "$3" ]; }

# outbox-consume (the consumer group helper under it) with an effect per
# message (a line appended to a file) through the faults of 1-3, then the
# same consumer blocked in XREADGROUP BLOCK while its connection goes
# silent (a black hole): it must notice within --block-ms plus the reply
# timeout the helper gives a blocked read (10 s), reconnect once healed, and
# every effect must be applied exactly once.
sc_consumer() {
    local backlog block_ms n0 t0 t_notice seen fault
    backlog=$(sc_p 2000 10000)
    block_ms=$(sc_p 100 2000)
    SC_ASSERT_TIMING=()
    sc_single_up
    sc_backlog "$backlog"
    sc_writer_start 50
    sc_relay a "$SC_URL"
    nf_spawn consumer "$NF_CONSUME_BIN" --redis "$SC_URL" --stream "$SC_STREAM" --group g --consumer c1 \
        --block-ms "$block_ms" --min-idle-ms 2000 --claim-interval-ms 500 --retry-ms 100 --max-deliveries 1000 \
        --exec "printf '%s\n' \"\$OUTBOX_ID\" >>'$NF_WORK/effects'"
    local consumer=$NF_LAST_PID
    nf_wait 30 sc_effects_at_least $((backlog / 10)) || nf_fail "the consumer applies nothing"
    for fault in "nf_blackhole $SC_RELAY_ADDR 127.0.0.2" "nf_loss $SC_RELAY_ADDR 127.0.0.2 20" \
                 "nf_reset $SC_RELAY_ADDR 127.0.0.2"; do
        $fault || nf_fail "could not inject $fault"
        sleep "$(sc_p 1 8)" # the fault's duration
        nf_heal
        sc_ok "the consumer is still running after: $fault" sc_alive "$consumer"
    done
    # Idle: everything so far applied, the consumer blocked in XREADGROUP.
    sc_writer_stop
    nf_wait 60 sc_none_unpublished || nf_fail "the relay did not catch up"
    nf_wait 60 sc_all_effects || nf_fail "the consumer did not catch up"
    seen=$(sc_log_count consumer "redis connection lost")
    nf_blackhole "$SC_RELAY_ADDR" 127.0.0.2
    t0=$(nf_now_ms)
    local bound=$(( (block_ms + 10000) / 1000 + 5 ))
    if nf_wait "$bound" sc_log_count_above consumer "redis connection lost" "$seen"; then t_notice=$(( $(nf_now_ms) - t0 )); else t_notice=-; fi
    sc_ok "the blocked consumer notices the silent connection within ${bound} s ($t_notice ms)" [ "$t_notice" != - ]
    nf_heal
    n0=$(sc_effects)
    SC_NEXT=$((SC_NEXT + 100000))
    sc_writer --count 20 --start "$SC_NEXT" >/dev/null
    local want=$((n0 + 16)) t1
    t1=$(nf_now_ms)
    sc_ok "after the heal the consumer reconnects and applies new messages" nf_wait 30 sc_effects_at_least "$want"
    SC_EXTRA="silent_notice_ms=$t_notice new_after_heal_ms=$(( $(nf_now_ms) - t1 ))"
    sc_settle 100
    nf_wait 60 sc_all_effects || nf_log "effects missing: $(sc_effects_distinct) distinct"
    sc_check consumer --effects "$NF_WORK/effects"
    sc_ok "every committed message's effect applied (${R[effects_missing]} missing)" [ "${R[effects_missing]}" = 0 ]
    sc_ok "no effect applied twice (${R[effects_duplicated]})" [ "${R[effects_duplicated]}" = 0 ]
    sc_ok "no effect for anything not committed (${R[effects_foreign]})" [ "${R[effects_foreign]}" = 0 ]
}

# The consumer through a Sentinel split brain (4): outbox-consume on the
# sentinel URL, the relay with --wait-replicas 1; the master, which both
# reach, is cut off from its replicas and the sentinels until
# +switch-master, then healed. The consumer's group and dedup keys live in
# Redis too, on the master that is cut off: what it did there is gone once
# that master resynchronises. Every effect must still be applied; how many
# twice is measured (SC_CONSUMER_DUPS_OK=1) or asserted.
sc_consumer_sentinel() {
    local backlog t_switch
    backlog=$(sc_p 2000 10000)
    SC_ASSERT_TIMING=()
    sc_sentinel_up
    sc_backlog "$backlog"
    sc_writer_start 50
    sc_relay a "$SC_URL" --wait-replicas 1 --wait-timeout-ms 500
    nf_spawn consumer "$NF_CONSUME_BIN" --redis "$SC_URL" --stream "$SC_STREAM" --group g --consumer c1 \
        --block-ms 100 --min-idle-ms 2000 --claim-interval-ms 500 --retry-ms 100 --max-deliveries 1000 \
        --exec "printf '%s\n' \"\$OUTBOX_ID\" >>'$NF_WORK/effects'"
    local consumer=$NF_LAST_PID
    nf_wait 30 sc_effects_at_least $((backlog / 10)) || nf_fail "the consumer applies nothing"
    nf_isolate 127.0.0.2 127.0.0.3 127.0.0.4 127.0.0.11 127.0.0.12 127.0.0.13 || nf_fail "the partition"
    sc_ok "the sentinels promote a replica (+switch-master)" nf_wait 30 sc_event_seen +switch-master
    t_switch=$(sc_event_ms +switch-master)
    sleep "$(sc_p 0.5 5)"
    nf_heal
    sc_ok "the old master comes back as a replica" nf_wait 30 sc_role_is m1 slave
    sc_ok "the consumer is still running" sc_alive "$consumer"
    sc_settle 100
    nf_wait 60 sc_all_effects || nf_log "effects missing: $(sc_effects_distinct) distinct"
    SC_EXTRA+=" effects=$(sc_effects)"
    sc_check consumer_sentinel --effects "$NF_WORK/effects" --event "switch=$t_switch"
    SC_EXTRA=""
    sc_ok "every committed message's effect applied (${R[effects_missing]} missing)" [ "${R[effects_missing]}" = 0 ]
    sc_ok "no effect for anything not committed (${R[effects_foreign]})" [ "${R[effects_foreign]}" = 0 ]
    if [ "${SC_CONSUMER_DUPS_OK:-1}" = 1 ]; then
        echo "# effects applied twice: ${R[effects_duplicated]} (the dedup keys written on the cut-off master are lost with it)"
    else
        sc_ok "no effect applied twice (${R[effects_duplicated]})" [ "${R[effects_duplicated]}" = 0 ]
    fi
}
