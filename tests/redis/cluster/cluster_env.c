/*
 * cluster_env.c: the cluster's processes (see cluster_env.h): starting the
 * nodes and forming the cluster with redis-cli (also over TLS), stopping
 * them, and the events a test makes happen to a node: a manual failover, a
 * kill, a restart; the nodes' logs as diagnostics.
 */
#include "cluster_env_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tap.h"

#define CLI_TIMEOUT_MS 120000

int ce__run_cli(const ce_env *e, const char *const *args)
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

char *ce__cli_addr(const ce_env *e, int i, char *buf)
{
    snprintf(buf, 32, "127.0.0.1:%d", e->tls_dir ? e->tls_port[i] : e->node[i].port);
    return buf;
}

static int fetch_ids(ce_env *e)
{
    for (int i = 0; i < e->n; i++) {
        redisReply *r = ce__node_cmd(e, i, "CLUSTER MYID");
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
            r = ce__node_cmd(e, i, "INFO replication");
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
        args[na++] = ce__cli_addr(e, i, addr[i]);
    snprintf(reps, sizeof reps, "%d", replicas);
    args[na++] = "--cluster-replicas";
    args[na++] = reps;
    args[na++] = "--cluster-yes";
    args[na] = NULL;
    if (ce__run_cli(e, args) != 0 || !ce_wait_ok(e, 30000)) {
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

int ce_failover(ce_env *e, int r)
{
    int64_t deadline;
    if (ce__node_ok(e, r, "CLUSTER FAILOVER") != 0)
        return -1;
    deadline = th_now_ms() + 20000 * th_slow();
    while (!(ce_is_master(e, r) && ce__everyone_sees(e, r, "master")) && th_now_ms() < deadline)
        th_sleep_ms(50);
    if (!ce__everyone_sees(e, r, "master")) {
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
    redisReply *r = ce__node_cmd(e, m, "CLUSTER REPLICAS %s", e->id[m]);
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
            if (ce_is_master(e, cand[k]) && ce__everyone_sees(e, cand[k], "master"))
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
    while (!(ce__everyone_sees(e, i, "master") || ce__everyone_sees(e, i, "slave")) && th_now_ms() < deadline)
        th_sleep_ms(50);
    if (!(ce__everyone_sees(e, i, "master") || ce__everyone_sees(e, i, "slave"))) {
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
