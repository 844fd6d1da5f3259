/*
 * cluster_slots.c: moving slots (see cluster_env.h): a whole reshard with
 * redis-cli, and one slot's migration in steps (SETSLOT IMPORTING and
 * MIGRATING, MIGRATE of some keys or a named one, SETSLOT NODE), so that a
 * test can act while the ASK window is open.
 */
#include "cluster_env_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tap.h"

int ce_reshard(ce_env *e, int from, int to, int nslots)
{
    char addr[32], count[16];
    const char *args[] = {"--cluster", "reshard", ce__cli_addr(e, from, addr), "--cluster-from", e->id[from],
                          "--cluster-to", e->id[to], "--cluster-slots", count, "--cluster-yes", NULL};
    snprintf(count, sizeof count, "%d", nslots);
    if (ce__run_cli(e, args) != 0)
        return -1;
    return ce_wait_ok(e, 30000) ? 0 : -1;
}

/* The port MIGRATE is to use for node i: with tls-cluster yes the source
 * connects to the target over TLS, so its TLS port. */
static int migrate_port(const ce_env *e, int i)
{
    return e->tls_dir ? e->tls_port[i] : e->node[i].port;
}

int ce_migrate_keys(ce_env *e, int nkeys)
{
    redisContext *c;
    redisReply *r;
    int moved = 0;
    if (e->mig.slot < 0) {
        diag("ce_migrate_keys: no migration open");
        return -1;
    }
    if (nkeys <= 0)
        return 0;
    if (!(c = ce_client(e, e->mig.from))) {
        diag("ce_migrate_keys: the source node does not answer");
        return -1;
    }
    r = redisCommand(c, "CLUSTER GETKEYSINSLOT %d %d", e->mig.slot, nkeys);
    if (r && r->type == REDIS_REPLY_ARRAY && r->elements > 0) {
        const char **argv = calloc(r->elements + 9, sizeof *argv);
        size_t *lens = calloc(r->elements + 9, sizeof *lens);
        char port[16], timeout[16];
        redisReply *m;
        int argc = 0;
        if (!argv || !lens)
            bail("out of memory");
        snprintf(port, sizeof port, "%d", migrate_port(e, e->mig.to));
        snprintf(timeout, sizeof timeout, "%d", 5000);
        argv[argc++] = "MIGRATE";
        argv[argc++] = "127.0.0.1";
        argv[argc++] = port;
        argv[argc++] = "";
        argv[argc++] = "0";
        argv[argc++] = timeout;
        if (e->password[0]) {
            argv[argc++] = "AUTH";
            argv[argc++] = e->password;
        }
        argv[argc++] = "KEYS";
        for (size_t k = 0; k < r->elements; k++)
            argv[argc++] = r->element[k]->str;
        for (int k = 0; k < argc; k++)
            lens[k] = strlen(argv[k]);
        for (size_t k = 0; k < r->elements; k++)
            lens[argc - (int)r->elements + (int)k] = (size_t)r->element[k]->len;
        m = redisCommandArgv(c, argc, argv, lens);
        if (m && m->type == REDIS_REPLY_STATUS)
            moved = (int)r->elements;
        else {
            diag("MIGRATE: %s", m && m->type == REDIS_REPLY_ERROR ? m->str : c->errstr);
            moved = -1;
        }
        if (m)
            freeReplyObject(m);
        free(argv);
        free(lens);
    } else if (!r || r->type != REDIS_REPLY_ARRAY) {
        diag("CLUSTER GETKEYSINSLOT: %s", r && r->type == REDIS_REPLY_ERROR ? r->str : c->errstr);
        moved = -1;
    }
    if (r)
        freeReplyObject(r);
    redisFree(c);
    return moved;
}

int ce_migrate_named(ce_env *e, const char *key)
{
    char port[16];
    const char *argv[9];
    size_t lens[9];
    int argc = 0, moved;
    redisContext *c;
    redisReply *r;
    if (e->mig.slot < 0) {
        diag("ce_migrate_named: no migration open");
        return -1;
    }
    if (!(c = ce_client(e, e->mig.from))) {
        diag("ce_migrate_named: the source node does not answer");
        return -1;
    }
    snprintf(port, sizeof port, "%d", migrate_port(e, e->mig.to));
    argv[argc++] = "MIGRATE";
    argv[argc++] = "127.0.0.1";
    argv[argc++] = port;
    argv[argc++] = key;
    argv[argc++] = "0";
    argv[argc++] = "5000";
    if (e->password[0]) {
        argv[argc++] = "AUTH";
        argv[argc++] = e->password;
    }
    for (int k = 0; k < argc; k++)
        lens[k] = strlen(argv[k]);
    r = redisCommandArgv(c, argc, argv, lens);
    if (r && r->type == REDIS_REPLY_STATUS)
        moved = strcmp(r->str, "NOKEY") != 0;
    else {
        diag("MIGRATE %s: %s", key, r && r->type == REDIS_REPLY_ERROR ? r->str : c->errstr);
        moved = -1;
    }
    if (r)
        freeReplyObject(r);
    redisFree(c);
    return moved;
}

int ce_migrate_begin(ce_env *e, int slot, int to, int nkeys)
{
    int from = ce_owner_of_slot(e, slot);
    if (e->mig.slot >= 0) {
        diag("ce_migrate_begin: slot %d is still in migration", e->mig.slot);
        return -1;
    }
    if (from < 0 || from == to) {
        diag("ce_migrate_begin: slot %d has no owner, or it is node %d already", slot, to);
        return -1;
    }
    if (ce__node_ok(e, to, "CLUSTER SETSLOT %d IMPORTING %s", slot, e->id[from]) != 0 ||
        ce__node_ok(e, from, "CLUSTER SETSLOT %d MIGRATING %s", slot, e->id[to]) != 0)
        return -1;
    e->mig.slot = slot;
    e->mig.from = from;
    e->mig.to = to;
    return ce_migrate_keys(e, nkeys) < 0 ? -1 : 0;
}

int ce_migrate_finish(ce_env *e)
{
    int moved, slot = e->mig.slot;
    if (slot < 0) {
        diag("ce_migrate_finish: no migration open");
        return -1;
    }
    while ((moved = ce_migrate_keys(e, 100)) > 0)
        ;
    if (moved < 0)
        return -1;
    /* The target first, then the source, then the other masters, as the
     * cluster tutorial orders it: the target's epoch bump decides. */
    if (ce__node_ok(e, e->mig.to, "CLUSTER SETSLOT %d NODE %s", slot, e->id[e->mig.to]) != 0 ||
        ce__node_ok(e, e->mig.from, "CLUSTER SETSLOT %d NODE %s", slot, e->id[e->mig.to]) != 0)
        return -1;
    for (int i = 0; i < e->n; i++)
        if (i != e->mig.to && i != e->mig.from && ce_is_master(e, i) &&
            ce__node_ok(e, i, "CLUSTER SETSLOT %d NODE %s", slot, e->id[e->mig.to]) != 0)
            return -1;
    e->mig.slot = -1;
    return ce_wait_ok(e, 30000) ? 0 : -1;
}

int ce_move_slot(ce_env *e, int slot, int to)
{
    if (ce_migrate_begin(e, slot, to, 0) != 0)
        return -1;
    return ce_migrate_finish(e);
}
