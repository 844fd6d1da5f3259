/*
 * cluster_query.c: asking the cluster (see cluster_env.h): clients on the
 * nodes, slots and their owners, roles and replicas, how the nodes see one
 * another, a command sent where the slot map says (following redirections),
 * and waiting until every node agrees on one slot map.
 */
#include "cluster_env_int.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include "tap.h"

redisContext *ce_client(const ce_env *e, int i)
{
    struct timeval tv = {2, 0};
    redisContext *c;
    if (i < 0 || i >= e->n || e->node[i].pid <= 0)
        return NULL;
    c = redisConnectWithTimeout("127.0.0.1", e->node[i].port, tv);
    if (!c)
        return NULL;
    if (c->err) {
        redisFree(c);
        return NULL;
    }
    redisSetTimeout(c, tv);
    if (e->password[0]) {
        redisReply *r = redisCommand(c, "AUTH %s", e->password);
        int ok_ = r && r->type == REDIS_REPLY_STATUS;
        if (r)
            freeReplyObject(r);
        if (!ok_) {
            redisFree(c);
            return NULL;
        }
    }
    return c;
}

int ce_index_of_port(const ce_env *e, int port)
{
    for (int i = 0; i < e->n; i++)
        if (e->node[i].port == port)
            return i;
    return -1;
}

char *ce_addr(const ce_env *e, int i, char *buf)
{
    snprintf(buf, 32, "127.0.0.1:%d", i >= 0 && i < e->n ? e->node[i].port : 0);
    return buf;
}

redisReply *ce__node_cmd(const ce_env *e, int i, const char *fmt, ...)
{
    redisContext *c = ce_client(e, i);
    redisReply *r;
    va_list ap;
    if (!c)
        return NULL;
    va_start(ap, fmt);
    r = redisvCommand(c, fmt, ap);
    va_end(ap);
    redisFree(c);
    return r;
}

int ce__node_ok(const ce_env *e, int i, const char *fmt, ...)
{
    redisContext *c = ce_client(e, i);
    redisReply *r;
    va_list ap;
    int rc = -1;
    if (!c) {
        diag("node %d (port %d) does not answer", i, e->node[i].port);
        return -1;
    }
    va_start(ap, fmt);
    r = redisvCommand(c, fmt, ap);
    va_end(ap);
    if (r && r->type == REDIS_REPLY_STATUS)
        rc = 0;
    else
        diag("node %d: %s: %s", i, fmt, r && r->type == REDIS_REPLY_ERROR ? r->str : c->errstr);
    if (r)
        freeReplyObject(r);
    redisFree(c);
    return rc;
}

int ce_slot_of(const ce_env *e, const char *key)
{
    for (int i = 0; i < e->n; i++) {
        redisReply *r = ce__node_cmd(e, i, "CLUSTER KEYSLOT %s", key);
        int slot = r && r->type == REDIS_REPLY_INTEGER ? (int)r->integer : -1;
        if (r)
            freeReplyObject(r);
        if (slot >= 0)
            return slot;
    }
    return -1;
}

int ce_name_in_slot(const ce_env *e, int slot, const char *prefix, char *buf, size_t len)
{
    enum { BATCH = 1024 };
    redisContext *c = NULL;
    int rc = -1;
    for (int i = 0; i < e->n && !c; i++)
        c = ce_client(e, i);
    if (!c)
        return -1;
    /* CLUSTER KEYSLOT pipelined a batch at a time: the server's hash is the
     * one that counts, and one slot in 16384 needs that many names on
     * average. */
    for (int base = 0; base < 64 * CE_SLOTS && rc < 0; base += BATCH) {
        char name[256];
        for (int k = 0; k < BATCH; k++) {
            snprintf(name, sizeof name, "%s%d", prefix, base + k);
            redisAppendCommand(c, "CLUSTER KEYSLOT %s", name);
        }
        for (int k = 0; k < BATCH; k++) {
            redisReply *r;
            if (redisGetReply(c, (void **)&r) != REDIS_OK || !r) {
                redisFree(c);
                return -1;
            }
            if (rc < 0 && r->type == REDIS_REPLY_INTEGER && r->integer == slot) {
                snprintf(name, sizeof name, "%s%d", prefix, base + k);
                if (strlen(name) < len) {
                    memcpy(buf, name, strlen(name) + 1);
                    rc = 0;
                }
            }
            freeReplyObject(r);
        }
    }
    redisFree(c);
    return rc;
}

/* The slot map of node i (CLUSTER SLOTS): owner[slot] = the owner's port,
 * 0 for a slot nobody serves. 0, or -1 when i does not answer. */
static int slot_map(const ce_env *e, int i, int *owner)
{
    redisReply *r = ce__node_cmd(e, i, "CLUSTER SLOTS");
    if (!r || r->type != REDIS_REPLY_ARRAY) {
        if (r)
            freeReplyObject(r);
        return -1;
    }
    memset(owner, 0, sizeof(int) * CE_SLOTS);
    for (size_t k = 0; k < r->elements; k++) {
        redisReply *range = r->element[k];
        long long lo, hi;
        int port;
        if (range->type != REDIS_REPLY_ARRAY || range->elements < 3 || range->element[2]->type != REDIS_REPLY_ARRAY ||
            range->element[2]->elements < 2)
            continue;
        lo = range->element[0]->integer;
        hi = range->element[1]->integer;
        port = (int)range->element[2]->element[1]->integer;
        for (long long s = lo; s <= hi && s < CE_SLOTS; s++)
            if (s >= 0)
                owner[s] = port;
    }
    freeReplyObject(r);
    return 0;
}

int ce_is_master(const ce_env *e, int i)
{
    redisReply *r = ce__node_cmd(e, i, "ROLE");
    int yes = r && r->type == REDIS_REPLY_ARRAY && r->elements > 0 && r->element[0]->type == REDIS_REPLY_STRING &&
              strcmp(r->element[0]->str, "master") == 0;
    if (r)
        freeReplyObject(r);
    return yes;
}

int ce_master_list(const ce_env *e, int *out)
{
    int n = 0;
    for (int i = 0; i < e->n; i++)
        if (ce_is_master(e, i))
            out[n++] = i;
    return n;
}

static int *new_map(void)
{
    int *m = malloc(sizeof(int) * CE_SLOTS);
    if (!m)
        bail("out of memory");
    return m;
}

int ce_owner_of_slot(const ce_env *e, int slot)
{
    int *owner, found = -1;
    if (slot < 0 || slot >= CE_SLOTS)
        return -1;
    owner = new_map();
    for (int i = 0; i < e->n && found < 0; i++)
        if (ce_is_master(e, i) && slot_map(e, i, owner) == 0 && owner[slot])
            found = ce_index_of_port(e, owner[slot]);
    free(owner);
    return found;
}

int ce_owner(const ce_env *e, const char *key)
{
    return ce_owner_of_slot(e, ce_slot_of(e, key));
}

int ce_lowest_slot(const ce_env *e, int i)
{
    int *owner = new_map(), found = -1;
    for (int k = 0; k < e->n; k++)
        if (ce_is_master(e, k) && slot_map(e, k, owner) == 0) {
            for (int s = 0; s < CE_SLOTS && found < 0; s++)
                if (owner[s] == e->node[i].port)
                    found = s;
            break;
        }
    free(owner);
    return found;
}

int ce_replica_of(const ce_env *e, int m)
{
    for (int k = 0; k < e->n; k++) {
        redisReply *r;
        int found = -1;
        if (k == m && e->node[m].pid <= 0)
            continue;
        r = ce__node_cmd(e, k, "CLUSTER REPLICAS %s", e->id[m]);
        if (r && r->type == REDIS_REPLY_ARRAY)
            for (size_t j = 0; j < r->elements && found < 0; j++) {
                const char *line = r->element[j]->type == REDIS_REPLY_STRING ? r->element[j]->str : "";
                for (int i = 0; i < e->n; i++)
                    if (i != m && e->node[i].pid > 0 && strncmp(line, e->id[i], 40) == 0 &&
                        !strstr(line, "fail"))
                        found = i;
            }
        if (r)
            freeReplyObject(r);
        if (found >= 0)
            return found;
    }
    return -1;
}

/* CLUSTER NODES of node k, or NULL; the caller frees. */
static redisReply *nodes_of(const ce_env *e, int k)
{
    redisReply *r = ce__node_cmd(e, k, "CLUSTER NODES");
    if (r && r->type != REDIS_REPLY_STRING) {
        freeReplyObject(r);
        r = NULL;
    }
    return r;
}

/* The line of node i in a CLUSTER NODES text, copied into line. */
static int node_line(const char *text, const char *id, char *line, size_t len)
{
    for (const char *p = text; p && *p;) {
        const char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);
        if (n > 40 && strncmp(p, id, 40) == 0) {
            if (n >= len)
                n = len - 1;
            memcpy(line, p, n);
            line[n] = '\0';
            return 1;
        }
        p = nl ? nl + 1 : NULL;
    }
    return 0;
}

/* The flags field (third) of a CLUSTER NODES line, in flags. */
static void line_flags(const char *line, char *flags, size_t len)
{
    const char *p = strchr(line, ' ');
    size_t n;
    flags[0] = '\0';
    if (!p || !(p = strchr(p + 1, ' ')))
        return;
    p++;
    n = strcspn(p, " ");
    if (n >= len)
        n = len - 1;
    memcpy(flags, p, n);
    flags[n] = '\0';
}

int ce__everyone_sees(const ce_env *e, int i, const char *want)
{
    int running = 0;
    for (int k = 0; k < e->n; k++) {
        redisReply *r;
        char line[4096], flags[128];
        int good;
        if (e->node[k].pid <= 0)
            continue;
        running++;
        if (!(r = nodes_of(e, k)))
            return 0;
        good = node_line(r->str, e->id[i], line, sizeof line);
        freeReplyObject(r);
        if (!good)
            return 0;
        line_flags(line, flags, sizeof flags);
        if (!strstr(flags, want) || strstr(flags, "fail") || (!strstr(flags, "myself") && !strstr(line, " connected")))
            return 0;
    }
    return running > 0;
}

/* The node named by a MOVED/ASK error ("MOVED 3999 127.0.0.1:6381"), -1
 * if it names none of ours. */
static int redirect_target(const ce_env *e, const char *err)
{
    const char *colon = strrchr(err, ':');
    return colon ? ce_index_of_port(e, atoi(colon + 1)) : -1;
}

static int starts(const char *s, const char *word)
{
    return strncmp(s, word, strlen(word)) == 0;
}

redisReply *ce_cmd_argv(const ce_env *e, const char *key, int argc, const char **argv, const size_t *lens,
                        int timeout_ms)
{
    int64_t deadline = th_now_ms() + (int64_t)timeout_ms * th_slow();
    int node = ce_owner(e, key), asking = 0;
    redisReply *last = NULL;
    do {
        redisContext *c = node >= 0 ? ce_client(e, node) : NULL;
        redisReply *r = NULL;
        if (c && asking) {
            r = redisCommand(c, "ASKING");
            if (r)
                freeReplyObject(r);
        }
        r = c ? redisCommandArgv(c, argc, argv, lens) : NULL;
        if (c)
            redisFree(c);
        asking = 0;
        if (r && r->type == REDIS_REPLY_ERROR && (starts(r->str, "MOVED ") || starts(r->str, "ASK "))) {
            asking = starts(r->str, "ASK ");
            node = redirect_target(e, r->str);
            freeReplyObject(r);
            continue;
        }
        if (r && !(r->type == REDIS_REPLY_ERROR && (starts(r->str, "TRYAGAIN") || starts(r->str, "CLUSTERDOWN") ||
                                                   starts(r->str, "LOADING")))) {
            if (last)
                freeReplyObject(last);
            return r;
        }
        if (last)
            freeReplyObject(last);
        last = r;
        th_sleep_ms(50);
        node = ce_owner(e, key);
    } while (th_now_ms() < deadline);
    return last;
}

static void check_agreement(const ce_env *e, int *first, int *other, char *why, size_t len);

/* Why ce_wait_ok is not satisfied, for the diagnostics; "" when it is. */
static void not_ok_reason(const ce_env *e, char *why, size_t len)
{
    int *first = new_map(), *other = new_map();
    why[0] = '\0';
    check_agreement(e, first, other, why, len);
    free(first);
    free(other);
}

static void check_agreement(const ce_env *e, int *first, int *other, char *why, size_t len)
{
    int have_first = -1;
    for (int k = 0; k < e->n; k++) {
        redisReply *r;
        if (e->node[k].pid <= 0)
            continue;
        r = ce__node_cmd(e, k, "CLUSTER INFO");
        if (!r || r->type != REDIS_REPLY_STRING || !strstr(r->str, "cluster_state:ok")) {
            snprintf(why, len, "node %d (port %d) is not cluster_state:ok", k, e->node[k].port);
            if (r)
                freeReplyObject(r);
            return;
        }
        freeReplyObject(r);
        if ((r = nodes_of(e, k)) == NULL) {
            snprintf(why, len, "node %d does not answer CLUSTER NODES", k);
            return;
        }
        if (strstr(r->str, "->-") || strstr(r->str, "-<-")) {
            snprintf(why, len, "node %d has a slot in migration", k);
            freeReplyObject(r);
            return;
        }
        freeReplyObject(r);
        if (slot_map(e, k, have_first < 0 ? first : other) != 0) {
            snprintf(why, len, "node %d does not answer CLUSTER SLOTS", k);
            return;
        }
        if (have_first < 0) {
            have_first = k;
            continue;
        }
        for (int s = 0; s < CE_SLOTS; s++)
            if (first[s] != other[s]) {
                snprintf(why, len, "slot %d: node %d names port %d, node %d names port %d", s, have_first, first[s],
                         k, other[s]);
                return;
            }
    }
    if (have_first < 0)
        snprintf(why, len, "no node is running");
}

int ce_wait_ok(const ce_env *e, int timeout_ms)
{
    int64_t deadline = th_now_ms() + (int64_t)timeout_ms * th_slow();
    char why[256];
    for (;;) {
        not_ok_reason(e, why, sizeof why);
        if (!why[0])
            return 1;
        if (th_now_ms() >= deadline)
            break;
        th_sleep_ms(50);
    }
    if (timeout_ms >= 1000)
        diag("the cluster did not settle in %d ms: %s", timeout_ms, why);
    return 0;
}
