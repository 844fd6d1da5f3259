/*
 * test_cluster_env.c: the cluster test environment (cluster_env.h) against
 * a real cluster of 3 masters with one replica each, each helper checked
 * with plain hiredis commands:
 *   1. the cluster forms: every node cluster_state:ok, three masters, the
 *      slot map agreed; a key's owner serves it and another master answers
 *      MOVED naming the owner;
 *   2. redis-cli --cluster reshard: keys written before are readable on the
 *      new owner after it, the old one answers MOVED;
 *   3. a manual migration: in the ASK window a moved key gets ASK on the
 *      source, MOVED on the target without ASKING and its value with it; a
 *      key not moved yet is still served by the source; ce_cmd_argv
 *      follows the ASK; after the finish the keys are on the target;
 *   4. CLUSTER FAILOVER: the replica is the master, the old master answers
 *      MOVED;
 *   5. a master SIGKILLed: its replica is promoted, a key written with
 *      WAIT 1 before is there; the killed node restarts as a replica;
 *   6. ce_stop: no node answers any more.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster_env.h"
#include "harness.h"
#include "tap.h"

static ce_env env;

/* GET key on node i (with ASKING first when asking); the reply as text:
 * the value, "(nil)", "ERR-REPLY: <error>", or "NO ANSWER". */
static void get_on(int i, const char *key, int asking, char *out, size_t len)
{
    redisContext *c = ce_client(&env, i);
    redisReply *r;
    if (!c) {
        snprintf(out, len, "NO ANSWER");
        return;
    }
    if (asking) {
        r = redisCommand(c, "ASKING");
        if (r)
            freeReplyObject(r);
    }
    r = redisCommand(c, "GET %s", key);
    if (!r)
        snprintf(out, len, "NO ANSWER");
    else if (r->type == REDIS_REPLY_STRING)
        snprintf(out, len, "%s", r->str);
    else if (r->type == REDIS_REPLY_NIL)
        snprintf(out, len, "(nil)");
    else if (r->type == REDIS_REPLY_ERROR)
        snprintf(out, len, "ERR-REPLY: %s", r->str);
    else
        snprintf(out, len, "type %d", r->type);
    if (r)
        freeReplyObject(r);
    redisFree(c);
}

static int set_on(int i, const char *key, const char *value, int wait_replica)
{
    redisContext *c = ce_client(&env, i);
    redisReply *r;
    int good;
    if (!c)
        return 0;
    r = redisCommand(c, "SET %s %s", key, value);
    good = r && r->type == REDIS_REPLY_STATUS;
    if (r)
        freeReplyObject(r);
    if (good && wait_replica) {
        r = redisCommand(c, "WAIT 1 5000");
        good = r && r->type == REDIS_REPLY_INTEGER && r->integer == 1;
        if (r)
            freeReplyObject(r);
    }
    redisFree(c);
    return good;
}

/* "MOVED <slot> 127.0.0.1:<port of node owner>" */
static void moved_to(int slot, int owner, const char *kind, char *out, size_t len)
{
    snprintf(out, len, "ERR-REPLY: %s %d 127.0.0.1:%d", kind, slot, env.node[owner].port);
}

static int other_master(int not_this, int also_not)
{
    int m[CE_MAX_NODES], n = ce_master_list(&env, m);
    for (int k = 0; k < n; k++)
        if (m[k] != not_this && m[k] != also_not)
            return m[k];
    return -1;
}

static void test_formed(void)
{
    int m[CE_MAX_NODES], n = ce_master_list(&env, m), owner, slot, other;
    char got[256], want[256];
    is_int(env.n, 6, "six nodes");
    is_int(n, 3, "three of them are masters");
    ok(ce_wait_ok(&env, 1000), "every node is cluster_state:ok with the same slot map");
    ok(strncmp(env.url, "redis-cluster://127.0.0.1:", 26) == 0, "the seed URL: %s", env.url);
    for (int k = 0; k < n; k++)
        ok(ce_replica_of(&env, m[k]) >= 0 && !ce_is_master(&env, ce_replica_of(&env, m[k])),
           "master %d has a replica", m[k]);
    slot = ce_slot_of(&env, "ce:k1");
    is_int(slot, 8543, "CLUSTER KEYSLOT ce:k1"); /* CRC16/XMODEM("ce:k1") % 16384 */
    owner = ce_owner(&env, "ce:k1");
    ok(owner >= 0 && ce_is_master(&env, owner), "ce:k1 has an owner, a master (node %d)", owner);
    ok(set_on(owner, "ce:k1", "v1", 1), "SET on the owner, WAIT 1 acknowledged");
    get_on(owner, "ce:k1", 0, got, sizeof got);
    is_str(got, "v1", "the owner serves it");
    other = other_master(owner, -1);
    get_on(other, "ce:k1", 0, got, sizeof got);
    moved_to(slot, owner, "MOVED", want, sizeof want);
    is_str(got, want, "another master answers MOVED to the owner");
    {
        char name[64];
        ok(ce_name_in_slot(&env, 777, "orders-", name, sizeof name) == 0 && ce_slot_of(&env, name) == 777,
           "ce_name_in_slot finds a name in slot 777 (%s)", name);
    }
}

static void test_reshard(void)
{
    int m[CE_MAX_NODES], from, to, slot;
    char key[64], k2[80], got[256], want[256];
    ce_master_list(&env, m);
    from = m[0];
    to = m[1];
    slot = ce_lowest_slot(&env, from);
    ok(slot >= 0 && ce_name_in_slot(&env, slot, "rk", key, sizeof key) == 0, "a key in slot %d of node %d", slot,
       from);
    snprintf(k2, sizeof k2, "{%s}:second", key);
    ok(set_on(from, key, "before", 0) && set_on(from, k2, "before2", 0), "two keys written on the old owner");
    ok(ce_reshard(&env, from, to, 10) == 0, "redis-cli --cluster reshard of 10 slots from node %d to node %d", from,
       to);
    is_int(ce_owner_of_slot(&env, slot), to, "the slot's owner is the target");
    get_on(to, key, 0, got, sizeof got);
    is_str(got, "before", "a key written before is on the new owner");
    get_on(to, k2, 0, got, sizeof got);
    is_str(got, "before2", "so is the other key of the slot");
    get_on(from, key, 0, got, sizeof got);
    moved_to(slot, to, "MOVED", want, sizeof want);
    is_str(got, want, "the old owner answers MOVED to the new one");
}

static void test_ask_window(void)
{
    int m[CE_MAX_NODES], from, to, slot;
    char tag[64], a[96], b[96], got[256], want[256];
    ce_master_list(&env, m);
    from = m[2];
    to = m[0];
    slot = ce_lowest_slot(&env, from);
    ok(ce_name_in_slot(&env, slot, "ask", tag, sizeof tag) == 0, "a name in slot %d", slot);
    snprintf(a, sizeof a, "{%s}:a", tag);
    snprintf(b, sizeof b, "{%s}:b", tag);
    ok(set_on(from, a, "va", 0) && set_on(from, b, "vb", 0), "two keys of the slot on node %d", from);
    ok(ce_migrate_begin(&env, slot, to, 0) == 0, "SETSLOT IMPORTING/MIGRATING, no key moved yet");
    get_on(from, a, 0, got, sizeof got);
    is_str(got, "va", "the source still serves the first key");
    is_int(ce_migrate_named(&env, a), 1, "the first key MIGRATEd by name");
    is_int(ce_migrate_named(&env, a), 0, "MIGRATE of it again: not on the source any more");
    get_on(from, a, 0, got, sizeof got);
    moved_to(slot, to, "ASK", want, sizeof want);
    is_str(got, want, "the moved key gets ASK on the source");
    get_on(from, b, 0, got, sizeof got);
    is_str(got, "vb", "the key not moved yet is served by the source");
    get_on(to, a, 0, got, sizeof got);
    moved_to(slot, from, "MOVED", want, sizeof want);
    is_str(got, want, "the target answers MOVED without ASKING");
    get_on(to, a, 1, got, sizeof got);
    is_str(got, "va", "and serves it after ASKING");
    {
        char c[96];
        const char *argv[3] = {"SET", c, "vc"};
        size_t lens[3];
        redisReply *r;
        snprintf(c, sizeof c, "{%s}:c", tag);
        lens[0] = 3;
        lens[1] = strlen(c);
        lens[2] = 2;
        r = ce_cmd_argv(&env, c, 3, argv, lens, 5000);
        ok(r && r->type == REDIS_REPLY_STATUS, "ce_cmd_argv: SET of a new key of the slot follows the ASK");
        if (r)
            freeReplyObject(r);
        get_on(to, c, 1, got, sizeof got);
        is_str(got, "vc", "the new key is on the target");
        argv[0] = "GET";
        argv[1] = a;
        lens[1] = strlen(a);
        r = ce_cmd_argv(&env, a, 2, argv, lens, 5000);
        ok(r && r->type == REDIS_REPLY_STRING && strcmp(r->str, "va") == 0, "ce_cmd_argv: GET of the moved key");
        if (r)
            freeReplyObject(r);
    }
    is_int(ce_migrate_keys(&env, 10), 1, "ce_migrate_keys moves the other key");
    get_on(from, b, 0, got, sizeof got);
    moved_to(slot, to, "ASK", want, sizeof want);
    is_str(got, want, "now that one gets ASK too");
    ok(ce_migrate_finish(&env) == 0, "SETSLOT NODE on every master, the cluster settles");
    is_int(ce_owner_of_slot(&env, slot), to, "the slot is the target's");
    get_on(to, a, 0, got, sizeof got);
    is_str(got, "va", "first key on the target");
    get_on(to, b, 0, got, sizeof got);
    is_str(got, "vb", "second key on the target");
}

static void test_failover(void)
{
    int owner = ce_owner(&env, "ce:k1"), r = ce_replica_of(&env, owner), slot = ce_slot_of(&env, "ce:k1");
    char got[256], want[256];
    ok(r >= 0, "the owner of ce:k1 (node %d) has a replica (node %d)", owner, r);
    ok(ce_failover(&env, r) == 0, "CLUSTER FAILOVER on node %d", r);
    ok(ce_is_master(&env, r) && !ce_is_master(&env, owner), "node %d is a master, node %d a replica", r, owner);
    is_int(ce_owner(&env, "ce:k1"), r, "the slot map names the promoted node");
    get_on(r, "ce:k1", 0, got, sizeof got);
    is_str(got, "v1", "the key is on it");
    get_on(owner, "ce:k1", 0, got, sizeof got);
    moved_to(slot, r, "MOVED", want, sizeof want);
    is_str(got, want, "the old master answers MOVED");
}

static void test_kill(void)
{
    int m[CE_MAX_NODES], victim, promoted, slot;
    char key[64], got[256];
    pid_t old_pid;
    ce_master_list(&env, m);
    victim = m[1];
    slot = ce_lowest_slot(&env, victim);
    ok(ce_name_in_slot(&env, slot, "kill", key, sizeof key) == 0, "a key of node %d", victim);
    ok(set_on(victim, key, "survives", 1), "written with WAIT 1");
    old_pid = env.node[victim].pid;
    promoted = ce_kill_master(&env, victim);
    ok(promoted >= 0 && promoted != victim, "after SIGKILL of node %d (pid %d), node %d is promoted", victim,
       (int)old_pid, promoted);
    is_int(env.node[victim].pid, 0, "the killed node is not running");
    is_int(ce_owner_of_slot(&env, slot), promoted, "the slot map names the promoted node");
    get_on(promoted, key, 0, got, sizeof got);
    is_str(got, "survives", "the key is there");
    ok(ce_restart(&env, victim) == 0, "the killed node is started again");
    ok(!ce_is_master(&env, victim), "it came back as a replica");
    is_int(ce_replica_of(&env, promoted), victim, "of the promoted node");
}

int main(void)
{
    int ports[CE_MAX_NODES], n;
    if (ce_start(&env, 3, 1, 0, "cluster-require-full-coverage no\n") != 0)
        skip_all("cannot start a cluster of 3 masters with a replica each");
    test_formed();
    test_reshard();
    test_ask_window();
    test_failover();
    test_kill();
    n = env.n;
    for (int i = 0; i < n; i++)
        ports[i] = env.node[i].port;
    ce_stop(&env);
    {
        int answering = 0;
        for (int i = 0; i < n; i++) {
            struct timeval tv = {0, 200000};
            redisContext *c = redisConnectWithTimeout("127.0.0.1", ports[i], tv);
            answering += c && !c->err;
            if (c)
                redisFree(c);
        }
        is_int(answering, 0, "after ce_stop no node listens");
    }
    return tap_done();
}
