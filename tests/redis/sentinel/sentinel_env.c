/*
 * sentinel_env.c: see sentinel_env.h.
 */
#include "sentinel_env.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/wait.h>

#include "rt.h"
#include "tap.h"

static redisContext *tcp_client(int port, int timeout_ms)
{
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (!c)
        return NULL;
    if (c->err) {
        redisFree(c);
        return NULL;
    }
    redisSetTimeout(c, tv);
    return c;
}

redisContext *se_sentinel_client(const se_env *e, int i)
{
    return e->spid[i] > 0 ? tcp_client(e->sport[i], 2000) : NULL;
}

/* The port the sentinels know node n by. */
static int node_port(const se_env *e, int n)
{
    return e->certs ? e->tport[n] : e->node[n].port;
}

static int write_sentinel_conf(se_env *e, int i)
{
    char *path = th_path(e->sdir[i], "sentinel.conf");
    FILE *f = fopen(path, "w");
    if (!f) {
        diag("cannot write %s: %s", path, strerror(errno));
        free(path);
        return -1;
    }
    fprintf(f,
            "port %d\n"
            "bind 127.0.0.1\n"
            "dir %s\n"
            "logfile %s/sentinel.log\n"
            "daemonize no\n"
            "sentinel monitor " SE_MASTER_NAME " 127.0.0.1 %d 2\n"
            "sentinel down-after-milliseconds " SE_MASTER_NAME " 1000\n"
            "sentinel failover-timeout " SE_MASTER_NAME " 5000\n"
            "sentinel parallel-syncs " SE_MASTER_NAME " 1\n",
            e->sport[i], e->sdir[i], e->sdir[i], node_port(e, 0));
    if (e->certs)
        fprintf(f,
                "tls-port %d\ntls-replication yes\ntls-cert-file %s\ntls-key-file %s\ntls-ca-cert-file %s\n"
                "tls-auth-clients no\n",
                e->stport[i], tls_cert(e->certs, "server.crt"), tls_cert(e->certs, "server.key"),
                tls_cert(e->certs, "ca.crt"));
    fclose(f);
    free(path);
    return 0;
}

/* Starts sentinel i on its port and configuration; waits until it answers
 * PING (5 s). Returns 0, or -1 (not running). */
static int launch_sentinel(se_env *e, int i)
{
    char *conf = th_path(e->sdir[i], "sentinel.conf");
    char *out = th_path(e->sdir[i], "sentinel.stdout");
    char *argv[] = {"redis-server", conf, "--sentinel", NULL};
    int64_t deadline;
    e->spid[i] = th_spawn(argv, NULL, out, out);
    free(conf);
    free(out);
    if (e->spid[i] < 0) {
        e->spid[i] = 0;
        return -1;
    }
    deadline = th_now_ms() + 5000;
    while (th_now_ms() < deadline) {
        redisContext *c;
        if (th_wait(e->spid[i], 0) != -2) {
            e->spid[i] = 0;
            return -1;
        }
        if ((c = tcp_client(e->sport[i], 500)) != NULL) {
            redisReply *r = redisCommand(c, "PING");
            int up = r && r->type == REDIS_REPLY_STATUS;
            if (r)
                freeReplyObject(r);
            redisFree(c);
            if (up)
                return 0;
        }
        th_sleep_ms(20);
    }
    se_sentinel_kill(e, i);
    return -1;
}

void se_sentinel_kill(se_env *e, int i)
{
    if (e->spid[i] <= 0)
        return;
    kill(e->spid[i], SIGKILL);
    th_wait(e->spid[i], -1);
    e->spid[i] = 0;
}

int se_sentinel_restart(se_env *e, int i)
{
    se_sentinel_kill(e, i);
    return launch_sentinel(e, i);
}

/* A field of SENTINEL MASTER mymaster (a flat name/value array), as a
 * number; -1 if missing. */
static long long master_field(redisContext *c, const char *name)
{
    redisReply *r = redisCommand(c, "SENTINEL MASTER " SE_MASTER_NAME);
    long long v = -1;
    if (r && r->type == REDIS_REPLY_ARRAY)
        for (size_t k = 0; k + 1 < r->elements; k += 2)
            if (r->element[k]->type == REDIS_REPLY_STRING && strcmp(r->element[k]->str, name) == 0 &&
                r->element[k + 1]->type == REDIS_REPLY_STRING)
                v = atoll(r->element[k + 1]->str);
    if (r)
        freeReplyObject(r);
    return v;
}

int se_named_master(const se_env *e, int i)
{
    redisContext *c = se_sentinel_client(e, i);
    redisReply *r;
    int who = -1;
    if (!c)
        return -1;
    r = redisCommand(c, "SENTINEL get-master-addr-by-name " SE_MASTER_NAME);
    if (r && r->type == REDIS_REPLY_ARRAY && r->elements == 2 && r->element[1]->type == REDIS_REPLY_STRING) {
        int port = atoi(r->element[1]->str);
        for (int n = 0; n < 2; n++)
            if (node_port(e, n) == port)
                who = n;
    }
    if (r)
        freeReplyObject(r);
    redisFree(c);
    return who;
}

static int node_role_is(const th_redis *n, const char *role)
{
    redisContext *c;
    redisReply *r;
    int yes;
    if (n->pid <= 0)
        return 0;
    c = tcp_client(n->port, 1000);
    if (!c)
        return 0;
    r = redisCommand(c, "ROLE");
    yes = r && r->type == REDIS_REPLY_ARRAY && r->elements > 0 && r->element[0]->type == REDIS_REPLY_STRING &&
          strcmp(r->element[0]->str, role) == 0;
    if (r)
        freeReplyObject(r);
    redisFree(c);
    return yes;
}

/* Waits until enough running sentinels name node want as the master: more
 * than half (all = 0) or every one (all = 1); the node must also say it is
 * master when all is 0. */
static int wait_named(const se_env *e, int want, int all, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    do {
        int running = 0, naming = 0;
        for (int i = 0; i < SE_SENTINELS; i++)
            if (e->spid[i] > 0) {
                running++;
                naming += se_named_master(e, i) == want;
            }
        if (running && (all ? naming == running : naming * 2 > running && node_role_is(&e->node[want], "master")))
            return 1;
        th_sleep_ms(50);
    } while (th_now_ms() < deadline);
    return 0;
}

int se_wait_master(const se_env *e, int want, int timeout_ms)
{
    return wait_named(e, want, 0, timeout_ms);
}

int se_wait_all_named(const se_env *e, int want, int timeout_ms)
{
    return wait_named(e, want, 1, timeout_ms);
}

int se_wait_replica(const se_env *e, int i, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    const th_redis *m = &e->node[1 - i];
    do {
        if (node_role_is(&e->node[i], "slave") && m->pid > 0) {
            redisContext *c = tcp_client(m->port, 1000);
            if (c) {
                redisReply *r = redisCommand(c, "SET se:probe x");
                int acked = 0;
                if (r)
                    freeReplyObject(r);
                r = redisCommand(c, "WAIT 1 200");
                acked = r && r->type == REDIS_REPLY_INTEGER && r->integer >= 1;
                if (r)
                    freeReplyObject(r);
                redisFree(c);
                if (acked)
                    return 1;
            }
        }
        th_sleep_ms(50);
    } while (th_now_ms() < deadline);
    if (timeout_ms >= 1000) {
        redisContext *c = e->node[i].pid > 0 ? tcp_client(e->node[i].port, 1000) : NULL;
        redisReply *r = c ? redisCommand(c, "INFO replication") : NULL;
        diag("node %d is not a linked replica: %s", i, r && r->type == REDIS_REPLY_STRING ? r->str : "no answer");
        if (r)
            freeReplyObject(r);
        if (c)
            redisFree(c);
        for (int n = 0; n < 2; n++) {
            char *path = th_path(e->node[n].dir, "redis.log"), *log = th_slurp(path);
            char what[32];
            snprintf(what, sizeof what, "node %d", n);
            th_diag_tail(what, log, 12);
            free(log);
            free(path);
        }
        for (int k = 0; k < SE_SENTINELS; k++) {
            char *path = th_path(e->sdir[k], "sentinel.log"), *log = th_slurp(path);
            char what[32];
            snprintf(what, sizeof what, "sentinel %d", k);
            th_diag_tail(what, log, 25);
            free(log);
            free(path);
        }
    }
    return 0;
}

int se_failover(const se_env *e, int i)
{
    redisContext *c = se_sentinel_client(e, i);
    redisReply *r;
    int ok_ = -1;
    if (!c)
        return -1;
    r = redisCommand(c, "SENTINEL FAILOVER " SE_MASTER_NAME);
    if (r && r->type == REDIS_REPLY_STATUS)
        ok_ = 0;
    else if (r && r->type == REDIS_REPLY_ERROR)
        diag("SENTINEL FAILOVER: %s", r->str);
    if (r)
        freeReplyObject(r);
    redisFree(c);
    return ok_;
}

/* The value of field name in a flat name/value array reply, or NULL. */
static const char *field(const redisReply *r, const char *name)
{
    if (!r || r->type != REDIS_REPLY_ARRAY)
        return NULL;
    for (size_t k = 0; k + 1 < r->elements; k += 2)
        if (r->element[k]->type == REDIS_REPLY_STRING && strcmp(r->element[k]->str, name) == 0 &&
            r->element[k + 1]->type == REDIS_REPLY_STRING)
            return r->element[k + 1]->str;
    return NULL;
}

/* Whether sentinel i (on client c) would promote node want: it names the
 * other node as the master with no failover in progress, and knows node
 * want as a replica fit for it (no down or disconnected flag, INFO seen in
 * the last 30 s reporting the slave role and its link to that master up,
 * a non-zero priority), as its SENTINEL FAILOVER chooses. *why gets what
 * is missing. */
static int replica_fit(const se_env *e, redisContext *c, int want, char *why, size_t len)
{
    redisReply *m = redisCommand(c, "SENTINEL MASTER " SE_MASTER_NAME), *r;
    const char *flags = field(m, "flags"), *port = field(m, "port");
    int fit = 0;
    if (!flags || !port || atoi(port) != node_port(e, 1 - want) || strstr(flags, "failover_in_progress")) {
        snprintf(why, len, "master %s flags %s", port ? port : "?", flags ? flags : "?");
        if (m)
            freeReplyObject(m);
        return 0;
    }
    freeReplyObject(m);
    r = redisCommand(c, "SENTINEL REPLICAS " SE_MASTER_NAME);
    snprintf(why, len, "node %d is not among its replicas", want);
    for (size_t k = 0; r && r->type == REDIS_REPLY_ARRAY && k < r->elements; k++) {
        const redisReply *s = r->element[k];
        const char *p = field(s, "port"), *f = field(s, "flags"), *link = field(s, "master-link-status"),
                   *down = field(s, "master-link-down-time"), *prio = field(s, "slave-priority"),
                   *refresh = field(s, "info-refresh"), *role = field(s, "role-reported"),
                   *mport = field(s, "master-port");
        if (!p || atoi(p) != node_port(e, want))
            continue;
        fit = f && !strcmp(f, "slave") && role && !strcmp(role, "slave") && link && !strcmp(link, "ok") && down &&
              atoll(down) == 0 && prio && atoi(prio) != 0 && refresh && atoll(refresh) < 30000 && mport &&
              atoi(mport) == node_port(e, 1 - want);
        snprintf(why, len, "node %d: flags %s, role %s, link %s, link down %s ms, priority %s, info %s ms old, master "
                 "port %s", want, f ? f : "?", role ? role : "?", link ? link : "?", down ? down : "?",
                 prio ? prio : "?", refresh ? refresh : "?", mport ? mport : "?");
    }
    if (r)
        freeReplyObject(r);
    return fit;
}

int se_failover_ready(const se_env *e, int i, int want, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    char why[512] = "";
    for (;;) {
        redisContext *c = se_sentinel_client(e, i);
        int fit = c && replica_fit(e, c, want, why, sizeof why);
        if (c)
            redisFree(c);
        if (fit)
            return 1;
        if (th_now_ms() >= deadline) {
            diag("sentinel %d is not ready to promote node %d: %s", i, want, c ? why : "no answer");
            return 0;
        }
        th_sleep_ms(50);
    }
}

int se_failover_to(const se_env *e, int i, int want, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    char why[512] = "", last[512] = "";
    for (;;) {
        redisContext *c = se_sentinel_client(e, i);
        redisReply *r = NULL;
        int fit = c && replica_fit(e, c, want, why, sizeof why);
        if (fit) {
            r = redisCommand(c, "SENTINEL FAILOVER " SE_MASTER_NAME);
            if (r && r->type == REDIS_REPLY_STATUS) {
                freeReplyObject(r);
                redisFree(c);
                return 0;
            }
            /* -INPROG (one still running) or -NOGOODSLAVE (its view of the
             * replica changed since): ask again. */
            snprintf(why, sizeof why, "SENTINEL FAILOVER: %s",
                     r && r->type == REDIS_REPLY_ERROR ? r->str : "no answer");
            if (strcmp(why, last) != 0)
                diag("sentinel %d: %s", i, why);
        }
        if (r)
            freeReplyObject(r);
        if (c)
            redisFree(c);
        snprintf(last, sizeof last, "%s", why);
        if (th_now_ms() >= deadline) {
            diag("sentinel %d did not take a failover to node %d: %s", i, want, why);
            return -1;
        }
        th_sleep_ms(50);
    }
}

int se_failover_aborted(const se_env *e, int i, int from)
{
    redisContext *c = se_sentinel_client(e, i);
    redisReply *m = c ? redisCommand(c, "SENTINEL MASTER " SE_MASTER_NAME) : NULL;
    const char *flags = field(m, "flags"), *port = field(m, "port");
    int aborted = flags && port && atoi(port) == node_port(e, from) && !strstr(flags, "failover_in_progress");
    if (m)
        freeReplyObject(m);
    if (c)
        redisFree(c);
    return aborted;
}

int se_switch_to(const se_env *e, int i, int want, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    if (se_failover_to(e, i, want, timeout_ms) != 0)
        return 0;
    while (!se_wait_master(e, want, 0)) {
        if (th_now_ms() >= deadline)
            return 0;
        if (se_failover_aborted(e, i, 1 - want)) {
            diag("sentinel %d's failover to node %d ended without a switch: asking again", i, want);
            if (se_failover_to(e, i, want, (int)(deadline - th_now_ms())) != 0)
                return 0;
        }
        th_sleep_ms(50);
    }
    return 1;
}

/* Every sentinel knows the replica and the two other sentinels. */
static int sentinels_settled(const se_env *e)
{
    for (int i = 0; i < SE_SENTINELS; i++) {
        redisContext *c = se_sentinel_client(e, i);
        long long slaves, others;
        if (!c)
            return 0;
        slaves = master_field(c, "num-slaves");
        others = master_field(c, "num-other-sentinels");
        redisFree(c);
        if (slaves < 1 || others < SE_SENTINELS - 1)
            return 0;
    }
    return 1;
}

/* Node n: a replica of node 0 unless n is 0. */
static int start_node(se_env *e, int n)
{
    char conf[128] = "";
    if (n)
        snprintf(conf, sizeof conf, "replicaof 127.0.0.1 %d\n", node_port(e, 0));
    if (!e->certs)
        return th_redis_start(&e->node[n], 1, conf);
    strcat(conf, "tls-replication yes\n");
    e->tport[n] = tls_redis_start(&e->node[n], e->certs, "server.crt", "server.key", 0, 1, conf);
    return e->tport[n] > 0 ? 0 : -1;
}

int se_start_tls(se_env *e, tls_certs *certs)
{
    int64_t deadline;
    memset(e, 0, sizeof *e);
    e->certs = certs;
    if (start_node(e, 0) != 0)
        return -1;
    if (start_node(e, 1) != 0) {
        th_redis_destroy(&e->node[0]);
        return -1;
    }
    for (int i = 0; i < SE_SENTINELS; i++) {
        int attempt;
        e->sdir[i] = th_tmpdir();
        for (attempt = 0; attempt < 5; attempt++) {
            e->sport[i] = th_free_port();
            e->stport[i] = certs ? th_free_port() : 0;
            if (e->sport[i] > 0 && write_sentinel_conf(e, i) == 0 && launch_sentinel(e, i) == 0)
                break;
        }
        if (attempt == 5) {
            diag("could not start sentinel %d", i);
            se_stop(e);
            return -1;
        }
    }
    snprintf(e->url, sizeof e->url, "%s://127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d#" SE_MASTER_NAME,
             certs ? "rediss-sentinel" : "redis-sentinel", certs ? e->stport[0] : e->sport[0],
             certs ? e->stport[1] : e->sport[1], certs ? e->stport[2] : e->sport[2]);
    deadline = th_now_ms() + 30000 * th_slow();
    while (!(se_wait_replica(e, 1, 100) && sentinels_settled(e)) && th_now_ms() < deadline)
        th_sleep_ms(100);
    if (!sentinels_settled(e)) {
        diag("the sentinels did not learn of each other and the replica in time");
        se_stop(e);
        return -1;
    }
    return 0;
}

int se_start(se_env *e)
{
    return se_start_tls(e, NULL);
}

void se_stop(se_env *e)
{
    for (int i = 0; i < SE_SENTINELS; i++) {
        se_sentinel_kill(e, i);
        if (e->sdir[i]) {
            th_rmtree(e->sdir[i]);
            free(e->sdir[i]);
            e->sdir[i] = NULL;
        }
    }
    th_redis_destroy(&e->node[1]);
    th_redis_destroy(&e->node[0]);
}

void se_world_start(se_env *e, tls_certs *certs, char **dir, char **dbpath, sqlite3 **db)
{
    if (se_start_tls(e, certs) != 0)
        skip_all("cannot start a master, a replica and three sentinels%s", certs ? " with TLS" : "");
    *dir = th_tmpdir();
    *dbpath = rt_make_db(*dir, "app.db");
    *db = rt_open(*dbpath);
}

void se_world_end(se_env *e, char *dir, char *dbpath, sqlite3 *db)
{
    sqlite3_close_v2(db);
    se_stop(e);
    free(dbpath);
    th_rmtree(dir);
    free(dir);
}
