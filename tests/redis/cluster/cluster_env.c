/*
 * cluster_env.c: see cluster_env.h.
 */
#include "cluster_env.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include "tap.h"

#define CLI_TIMEOUT_MS 120000

static char *cli_addr(const ce_env *e, int i, char *buf);

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

/* One command on node i; the reply, or NULL (not running, no answer). */
static redisReply *node_cmd(const ce_env *e, int i, const char *fmt, ...)
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

/* node_cmd for a command that must answer +OK; 0, or -1 with a diagnostic. */
static int node_ok(const ce_env *e, int i, const char *fmt, ...)
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
        redisReply *r = node_cmd(e, i, "CLUSTER KEYSLOT %s", key);
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
    redisReply *r = node_cmd(e, i, "CLUSTER SLOTS");
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
    redisReply *r = node_cmd(e, i, "ROLE");
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
        r = node_cmd(e, k, "CLUSTER REPLICAS %s", e->id[m]);
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
    redisReply *r = node_cmd(e, k, "CLUSTER NODES");
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

/* How every running node sees node i: 1 if each has it with flags that
 * contain want and none that contain "fail" (with its link connected
 * unless it is the node itself). */
static int everyone_sees(const ce_env *e, int i, const char *want)
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
        r = node_cmd(e, k, "CLUSTER INFO");
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

/* Runs redis-cli with the given --cluster arguments (NULL-terminated, at
 * most 32), -a when the cluster has a password; 0 on exit status 0, else -1
 * with the output as diagnostics. */
static int run_cli(const ce_env *e, const char *const *args)
{
    char *argv[48], *out = NULL, *err = NULL;
    int n = 0, st;
    argv[n++] = "redis-cli";
    if (e->tls_ca) {
        /* The slot moves of a reshard are MIGRATEs between the nodes, over
         * TLS with tls-cluster yes: redis-cli must see the TLS ports. */
        argv[n++] = "--tls";
        argv[n++] = "--cacert";
        argv[n++] = e->tls_ca;
    }
    if (e->password[0]) {
        argv[n++] = "--no-auth-warning";
        argv[n++] = "-a";
        argv[n++] = (char *)e->password;
    }
    for (int k = 0; args[k] && n < 46; k++)
        argv[n++] = (char *)args[k];
    argv[n] = NULL;
    st = th_run(argv, NULL, &out, &err, CLI_TIMEOUT_MS * th_slow());
    if (st != 0) {
        diag("redis-cli %s %s exited with %d", args[0], args[1] ? args[1] : "", st);
        th_diag_tail("redis-cli", out, 30);
        th_diag_tail("redis-cli", err, 30);
    }
    free(out);
    free(err);
    return st == 0 ? 0 : -1;
}

static int fetch_ids(ce_env *e)
{
    for (int i = 0; i < e->n; i++) {
        redisReply *r = node_cmd(e, i, "CLUSTER MYID");
        int good = r && r->type == REDIS_REPLY_STRING && r->len == 40;
        if (good)
            memcpy(e->id[i], r->str, 41);
        if (r)
            freeReplyObject(r);
        if (!good) {
            diag("node %d does not answer CLUSTER MYID", i);
            return -1;
        }
    }
    return 0;
}

static void find_password(ce_env *e, const char *extra)
{
    const char *p = extra ? strstr(extra, "requirepass ") : NULL;
    size_t n;
    e->password[0] = '\0';
    if (!p || (p != extra && p[-1] != '\n'))
        return;
    p += strlen("requirepass ");
    n = strcspn(p, "\n");
    if (n < sizeof e->password) {
        memcpy(e->password, p, n);
        e->password[n] = '\0';
    }
}

static int start_node(ce_env *e, int i, int appendonly, const char *extra)
{
    for (int attempt = 0; attempt < 3; attempt++) {
        char conf[sizeof e->node[i].extra], tls[320] = "";
        int len;
        e->bus_port[i] = th_free_port();
        if (e->tls_dir) {
            /* The long file paths are in the included file: th_redis keeps
             * 512 bytes of extra configuration. */
            e->tls_port[i] = th_free_port();
            snprintf(tls, sizeof tls, "include %s/tls.conf\ntls-port %d\n", e->tls_dir, e->tls_port[i]);
        }
        len = snprintf(conf, sizeof conf,
                       "cluster-enabled yes\ncluster-config-file nodes.conf\ncluster-node-timeout 2000\n"
                       "cluster-port %d\nappendonly %s\n%s%s%s%s%s",
                       e->bus_port[i], appendonly ? "yes" : "no", e->password[0] ? "masterauth " : "",
                       e->password, e->password[0] ? "\n" : "", tls, extra ? extra : "");
        if (len < 0 || (size_t)len >= sizeof conf) {
            diag("ce_start: extra config too long");
            return -1;
        }
        if (th_redis_start(&e->node[i], 1, conf) == 0)
            return 0;
    }
    return -1;
}

/* Waits until every running replica has its link to its master up (the
 * cluster is ready for WAIT); 1, or 0 with a diagnostic. */
static int replicas_linked(const ce_env *e, int timeout_ms)
{
    int64_t deadline = th_now_ms() + (int64_t)timeout_ms * th_slow();
    for (;;) {
        int linked = 1;
        for (int i = 0; i < e->n && linked; i++) {
            redisReply *r;
            if (e->node[i].pid <= 0)
                continue;
            r = node_cmd(e, i, "INFO replication");
            if (!r || r->type != REDIS_REPLY_STRING ||
                (strstr(r->str, "role:slave") && !strstr(r->str, "master_link_status:up")))
                linked = 0;
            if (r)
                freeReplyObject(r);
        }
        if (linked)
            return 1;
        if (th_now_ms() >= deadline)
            break;
        th_sleep_ms(50);
    }
    diag("the replicas did not link to their masters within %d ms", timeout_ms);
    return 0;
}

/* The TLS lines every node of a ce_start_tls cluster includes. */
static int write_tls_conf(ce_env *e, const ce_tls *tls)
{
    char *path;
    FILE *f;
    e->tls_dir = th_tmpdir();
    path = th_path(e->tls_dir, "tls.conf");
    f = fopen(path, "w");
    free(path);
    if (!f) {
        diag("cannot write the TLS configuration");
        return -1;
    }
    if (!(e->tls_ca = strdup(tls->ca_file)))
        bail("out of memory");
    fprintf(f,
            "tls-cert-file %s\ntls-key-file %s\ntls-ca-cert-file %s\ntls-auth-clients no\ntls-cluster yes\n"
            "tls-replication yes\n",
            tls->cert_file, tls->key_file, tls->ca_file);
    fclose(f);
    return 0;
}

int ce_start(ce_env *e, int masters, int replicas, int appendonly, const char *extra_conf)
{
    return ce_start_tls(e, masters, replicas, appendonly, extra_conf, NULL);
}

int ce_start_tls(ce_env *e, int masters, int replicas, int appendonly, const char *extra_conf, const ce_tls *tls)
{
    const char *args[CE_MAX_NODES + 8];
    char addr[CE_MAX_NODES][32], reps[16];
    int na = 0, len;
    memset(e, 0, sizeof *e);
    e->mig.slot = -1;
    if (masters < 3 || replicas < 0 || masters * (1 + replicas) > CE_MAX_NODES) {
        diag("ce_start: %d masters with %d replicas each is not a cluster this env makes", masters, replicas);
        return -1;
    }
    e->masters = masters;
    e->replicas = replicas;
    e->n = masters * (1 + replicas);
    find_password(e, extra_conf);
    if (tls && write_tls_conf(e, tls) != 0) {
        ce_stop(e);
        return -1;
    }
    for (int i = 0; i < e->n; i++)
        if (start_node(e, i, appendonly, extra_conf) != 0) {
            diag("could not start cluster node %d", i);
            ce_stop(e);
            return -1;
        }
    if (fetch_ids(e) != 0) {
        ce_stop(e);
        return -1;
    }
    args[na++] = "--cluster";
    args[na++] = "create";
    for (int i = 0; i < e->n; i++)
        args[na++] = cli_addr(e, i, addr[i]);
    snprintf(reps, sizeof reps, "%d", replicas);
    args[na++] = "--cluster-replicas";
    args[na++] = reps;
    args[na++] = "--cluster-yes";
    args[na] = NULL;
    if (run_cli(e, args) != 0 || !ce_wait_ok(e, 30000)) {
        ce_stop(e);
        return -1;
    }
    if (!replicas_linked(e, 20000)) {
        ce_stop(e);
        return -1;
    }
    len = snprintf(e->url, sizeof e->url, "%s://%s%s%s", tls ? "rediss-cluster" : "redis-cluster",
                   e->password[0] ? ":" : "", e->password, e->password[0] ? "@" : "");
    for (int i = 0; i < e->n && len > 0 && (size_t)len < sizeof e->url; i++)
        len += snprintf(e->url + len, sizeof e->url - (size_t)len, "%s127.0.0.1:%d", i ? "," : "",
                        tls ? e->tls_port[i] : e->node[i].port);
    return 0;
}

void ce_stop(ce_env *e)
{
    for (int i = 0; i < e->n && i < CE_MAX_NODES; i++)
        th_redis_destroy(&e->node[i]);
    e->n = 0;
    if (e->tls_dir) {
        th_rmtree(e->tls_dir);
        free(e->tls_dir);
        e->tls_dir = NULL;
    }
    free(e->tls_ca);
    e->tls_ca = NULL;
}

/* The address redis-cli is given for node i (its TLS port under TLS). */
static char *cli_addr(const ce_env *e, int i, char *buf)
{
    snprintf(buf, 32, "127.0.0.1:%d", e->tls_dir ? e->tls_port[i] : e->node[i].port);
    return buf;
}

int ce_reshard(ce_env *e, int from, int to, int nslots)
{
    char addr[32], count[16];
    const char *args[] = {"--cluster", "reshard", cli_addr(e, from, addr), "--cluster-from", e->id[from],
                          "--cluster-to", e->id[to], "--cluster-slots", count, "--cluster-yes", NULL};
    snprintf(count, sizeof count, "%d", nslots);
    if (run_cli(e, args) != 0)
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
    if (node_ok(e, to, "CLUSTER SETSLOT %d IMPORTING %s", slot, e->id[from]) != 0 ||
        node_ok(e, from, "CLUSTER SETSLOT %d MIGRATING %s", slot, e->id[to]) != 0)
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
    if (node_ok(e, e->mig.to, "CLUSTER SETSLOT %d NODE %s", slot, e->id[e->mig.to]) != 0 ||
        node_ok(e, e->mig.from, "CLUSTER SETSLOT %d NODE %s", slot, e->id[e->mig.to]) != 0)
        return -1;
    for (int i = 0; i < e->n; i++)
        if (i != e->mig.to && i != e->mig.from && ce_is_master(e, i) &&
            node_ok(e, i, "CLUSTER SETSLOT %d NODE %s", slot, e->id[e->mig.to]) != 0)
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

int ce_failover(ce_env *e, int r)
{
    int64_t deadline;
    if (node_ok(e, r, "CLUSTER FAILOVER") != 0)
        return -1;
    deadline = th_now_ms() + 20000 * th_slow();
    while (!(ce_is_master(e, r) && everyone_sees(e, r, "master")) && th_now_ms() < deadline)
        th_sleep_ms(50);
    if (!everyone_sees(e, r, "master")) {
        diag("node %d is not a master for every node 20 s after CLUSTER FAILOVER", r);
        return -1;
    }
    return ce_wait_ok(e, 20000) ? 0 : -1;
}

void ce_kill(ce_env *e, int i)
{
    th_redis_kill(&e->node[i]);
}

int ce_kill_master(ce_env *e, int m)
{
    int cand[CE_MAX_NODES], nc = 0;
    int64_t deadline;
    redisReply *r = node_cmd(e, m, "CLUSTER REPLICAS %s", e->id[m]);
    if (r && r->type == REDIS_REPLY_ARRAY)
        for (size_t j = 0; j < r->elements; j++)
            for (int i = 0; i < e->n; i++)
                if (r->element[j]->type == REDIS_REPLY_STRING && strncmp(r->element[j]->str, e->id[i], 40) == 0)
                    cand[nc++] = i;
    if (r)
        freeReplyObject(r);
    if (!nc) {
        diag("ce_kill_master: node %d has no replica to promote", m);
        return -1;
    }
    ce_kill(e, m);
    deadline = th_now_ms() + 30000 * th_slow();
    do {
        for (int k = 0; k < nc; k++)
            if (ce_is_master(e, cand[k]) && everyone_sees(e, cand[k], "master"))
                return ce_wait_ok(e, 20000) ? cand[k] : -1;
        th_sleep_ms(50);
    } while (th_now_ms() < deadline);
    diag("no replica of node %d was promoted within 30 s of its kill", m);
    ce_wait_ok(e, 1000);
    return -1;
}

int ce_restart(ce_env *e, int i)
{
    int64_t deadline;
    if (e->node[i].pid > 0) {
        diag("ce_restart: node %d is running", i);
        return -1;
    }
    if (th_redis_restart(&e->node[i]) != 0)
        return -1;
    deadline = th_now_ms() + 30000 * th_slow();
    while (!(everyone_sees(e, i, "master") || everyone_sees(e, i, "slave")) && th_now_ms() < deadline)
        th_sleep_ms(50);
    if (!(everyone_sees(e, i, "master") || everyone_sees(e, i, "slave"))) {
        diag("node %d did not rejoin within 30 s", i);
        return -1;
    }
    return ce_wait_ok(e, 30000) && replicas_linked(e, 30000) ? 0 : -1;
}

void ce_diag_logs(const ce_env *e, int max_lines)
{
    for (int i = 0; i < e->n; i++) {
        char *path, *log, what[64];
        if (!e->node[i].dir)
            continue;
        path = th_path(e->node[i].dir, "redis.log");
        log = th_slurp(path);
        snprintf(what, sizeof what, "node %d :%d pid %d: ", i, e->node[i].port, (int)e->node[i].pid);
        th_diag_tail(what, log, max_lines);
        free(log);
        free(path);
    }
}
