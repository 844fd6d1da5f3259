/*
 * test_drain_misconfig.c: outbox-relay --drain whose Redis cannot be used as
 * configured exits 2 at once, the log naming the problem, instead of
 * waiting until it is killed:
 *   1. credentials: a wrong password (WRONGPASS), none where Redis wants
 *      one (NOAUTH);
 *   2. an ACL that forbids a command the relay sends: XADD (NOPERM),
 *      CLIENT (the handshake's SETNAME), WAIT with --wait-replicas, and with
 *      --idempotent EVALSHA and EVAL (an ACL that leaves one topic's stream
 *      out is that topic's failure: the others are published);
 *   3. a plain redis:// URL naming a Redis Cluster node (a one-node
 *      cluster), and a cluster URL with a wrong password;
 *   4. a Sentinel URL whose master name no sentinel knows.
 * After each, every row is pending with no attempt counted, and a drain
 * with the right configuration publishes them all. What may heal by
 * itself is not such an error: a drain with Redis down, or with every
 * sentinel down, waits (until --drain-timeout-ms here: exit 1).
 * The daemon (no --drain) under the ACL that forbids XADD: publishing held,
 * one error line, /healthz 503 naming it, no message failed; once the ACL
 * allows XADD it publishes everything by itself.
 * The C API: outbox_relay_drain_result() is OUTBOX_ECONFIG.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "harness.h"
#include "ops.h"
#include "outbox.h"
#include "rt.h"
#include "tap.h"

#define N 300

static th_redis srv;     /* requirepass pass, and users whose ACL forbids commands */
static th_redis cnode;   /* cluster-enabled yes, requirepass cpass */
static redisContext *c;  /* srv, authenticated */
static char *dir;
static int dbs;

/* A new database with N rows of topic; its path in *path. */
static sqlite3 *fresh_db(const char *topic, char **path)
{
    char name[64];
    sqlite3 *db;
    snprintf(name, sizeof name, "%d-%s.db", ++dbs, topic);
    *path = rt_make_db(dir, name);
    db = rt_open(*path);
    rt_insert_rows(db, topic, 0, N, topic, 4);
    return db;
}

static int64_t rows(sqlite3 *db, const char *where)
{
    return th_sql_int(db, "SELECT count(*) FROM outbox_messages WHERE %s", where);
}

/* The drain with url (and one extra flag, or NULL) that Redis refuses:
 * exit 2 well before the bound, the log saying that the drain failed and
 * why (needle), and the rows as they were. */
static void refused(const char *what, sqlite3 *db, const char *path, const char *url, const char *flag,
                    const char *needle)
{
    char *err = NULL;
    int64_t t0 = th_now_ms();
    int st = rt_relay_run(10000 * th_slow(), &err, path, url, "--drain", flag, NULL);
    int64_t ms = th_now_ms() - t0;
    is_int(st, 2, "%s: --drain exits 2 (after %lld ms)", what, (long long)ms);
    ok(err && strstr(err, "level=error msg=\"drain failed: ") && strstr(err, "err=ECONFIG") && strstr(err, needle),
       "%s: the log says the drain failed, and why: %s", what, needle);
    is_int(rt_count_substr(err ? err : "", "publishing held"), 1, "%s: publishing held, said once", what);
    if (st != 2 || !err || !strstr(err, needle))
        th_diag_tail(what, err ? err : "", 12);
    free(err);
    is_int(rows(db, "state = 0 AND attempts = 0"), N, "%s: every row still pending, no attempt counted", what);
}

/* The drain with the right url publishes every row. */
static void healed(const char *what, sqlite3 *db, const char *path, const char *url, const char *flag,
                   redisContext *rc, const char *topic)
{
    char *err = NULL, stream[96];
    int st = rt_relay_run(30000 * th_slow(), &err, path, url, "--drain", flag, NULL);
    is_int(st, 0, "%s, fixed: --drain exits 0", what);
    if (st != 0)
        th_diag_tail(what, err ? err : "", 12);
    free(err);
    is_int(rows(db, "state = 2"), N, "%s, fixed: every row published", what);
    is_int(rows(db, "attempts > 1"), 0, "%s, fixed: no refused attempt was counted", what);
    snprintf(stream, sizeof stream, "outbox:%s", topic);
    if (rc)
        ok(th_xlen(rc, stream) >= N, "%s, fixed: the stream holds them (%lld)", what, th_xlen(rc, stream));
}

static void credentials(void)
{
    char url[128], good[128], *path;
    sqlite3 *db = fresh_db("creds", &path);
    snprintf(url, sizeof url, "redis://:N0tTheOne@127.0.0.1:%d", srv.port);
    refused("wrong password", db, path, url, NULL, "WRONGPASS");
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", srv.port);
    refused("no password", db, path, url, NULL, "NOAUTH");
    snprintf(good, sizeof good, "redis://:pass@127.0.0.1:%d", srv.port);
    healed("credentials", db, path, good, NULL, c, "creds");
    is_int(th_xlen(c, "outbox:creds"), N, "credentials, fixed: once each");
    sqlite3_close_v2(db);
    free(path);
}

static void acl(void)
{
    char url[128], good[128], *path;
    sqlite3 *db = fresh_db("acl", &path);
    snprintf(url, sizeof url, "redis://noxadd:pw@127.0.0.1:%d", srv.port);
    refused("ACL without XADD", db, path, url, NULL, "no permissions to run the 'xadd' command");
    is_int(th_xlen(c, "outbox:acl"), 0, "ACL without XADD: nothing appended");
    snprintf(good, sizeof good, "redis://:pass@127.0.0.1:%d", srv.port);
    healed("ACL without XADD", db, path, good, NULL, c, "acl");
    sqlite3_close_v2(db);
    free(path);

    db = fresh_db("aclclient", &path);
    snprintf(url, sizeof url, "redis://noclient:pw@127.0.0.1:%d", srv.port);
    refused("ACL without CLIENT", db, path, url, NULL, "CLIENT SETNAME: NOPERM");
    healed("ACL without CLIENT", db, path, good, NULL, c, "aclclient");
    sqlite3_close_v2(db);
    free(path);

    /* WAIT refused after the XADDs were accepted: those rows are pending
     * again, published twice at worst. */
    db = fresh_db("aclwait", &path);
    snprintf(url, sizeof url, "redis://nowait:pw@127.0.0.1:%d", srv.port);
    refused("ACL without WAIT, --wait-replicas", db, path, url, "--wait-replicas=1", "run the 'wait' command");
    healed("ACL without WAIT, --wait-replicas", db, path, good, NULL, c, "aclwait");
    sqlite3_close_v2(db);
    free(path);

    db = fresh_db("acleval", &path);
    snprintf(url, sizeof url, "redis://noeval:pw@127.0.0.1:%d", srv.port);
    refused("ACL without EVALSHA, --idempotent", db, path, url, "--idempotent", "no permissions to run the 'eval");
    healed("ACL without EVALSHA, --idempotent", db, path, good, "--idempotent", c, "acleval");
    is_int(th_xlen(c, "outbox:acleval"), N, "ACL without EVALSHA, --idempotent, fixed: once each");
    sqlite3_close_v2(db);
    free(path);
}

/* An ACL that leaves a topic's stream out is that topic's failure, not a
 * configuration error: the other topic is published, the drain ends. */
static void acl_key(void)
{
    char url[128], *path, *err = NULL;
    sqlite3 *db = fresh_db("keyok", &path);
    int st;
    rt_insert_rows(db, "keyno", 0, 20, "keyno", 0);
    snprintf(url, sizeof url, "redis://somekeys:pw@127.0.0.1:%d", srv.port);
    st = rt_relay_run(30000 * th_slow(), &err, path, url, "--drain", "--max-attempts", "1", NULL);
    is_int(st, 0, "ACL without a topic's stream: --drain exits 0");
    ok(err && !strstr(err, "publishing held") && !strstr(err, "drain failed"), "ACL without a topic's stream: not held");
    if (st != 0)
        th_diag_tail("acl key", err ? err : "", 12);
    free(err);
    is_int(rows(db, "topic = 'keyok' AND state = 2"), N, "ACL without a topic's stream: the allowed topic is published");
    is_int(rows(db, "topic = 'keyno' AND state = 3 AND last_error LIKE 'NOPERM%%'"), 20,
           "ACL without a topic's stream: its rows are dead with NOPERM");
    sqlite3_close_v2(db);
    free(path);
}

static int cluster_ok(void *arg)
{
    redisReply *rep = th_cmd(arg, "CLUSTER INFO");
    int ok_ = rep->type == REDIS_REPLY_STRING && strstr(rep->str, "cluster_state:ok") != NULL;
    freeReplyObject(rep);
    return ok_;
}

static void cluster(void)
{
    char url[128], good[128], *path;
    sqlite3 *db = fresh_db("clu", &path);
    redisContext *cc = th_redis_client(&cnode);
    redisReply *rep;

    snprintf(url, sizeof url, "redis://:cpass@127.0.0.1:%d", cnode.port);
    refused("cluster node, plain URL", db, path, url, NULL, "use a cluster URL, redis-cluster://127.0.0.1:");
    snprintf(url, sizeof url, "redis-cluster://:N0tTheOne@127.0.0.1:%d", cnode.port);
    refused("cluster URL, wrong password", db, path, url, NULL, "WRONGPASS");

    rep = th_cmd(cc, "CLUSTER ADDSLOTSRANGE 0 16383");
    ok(rep->type == REDIS_REPLY_STATUS, "a one-node cluster: every slot assigned");
    freeReplyObject(rep);
    ok(th_wait_until(20000 * th_slow(), cluster_ok, cc), "a one-node cluster: cluster_state:ok");
    snprintf(good, sizeof good, "redis-cluster://:cpass@127.0.0.1:%d", cnode.port);
    healed("cluster", db, path, good, NULL, cc, "clu");
    redisFree(cc);
    sqlite3_close_v2(db);
    free(path);
}

/* One sentinel monitoring srv as "mymaster"; its pid, its port in *port. */
static pid_t start_sentinel(int *port)
{
    char *sdir = th_path(dir, "sentinel"), *conf, *out;
    char *argv[4];
    struct timeval tv = {1, 0};
    int64_t end;
    FILE *f;
    pid_t pid;

    *port = th_free_port();
    if (mkdir(sdir, 0700) != 0)
        bail("mkdir %s", sdir);
    conf = th_path(sdir, "sentinel.conf");
    out = th_path(sdir, "sentinel.log");
    if (!(f = fopen(conf, "w")))
        bail("cannot write %s", conf);
    fprintf(f,
            "port %d\nbind 127.0.0.1\ndir %s\n"
            "sentinel monitor mymaster 127.0.0.1 %d 1\nsentinel auth-pass mymaster pass\n",
            *port, sdir, srv.port);
    fclose(f);
    argv[0] = "redis-server";
    argv[1] = conf;
    argv[2] = "--sentinel";
    argv[3] = NULL;
    pid = th_spawn(argv, NULL, out, out);
    if (pid < 0)
        bail("cannot start a sentinel");
    for (end = th_now_ms() + 10000 * th_slow(); th_now_ms() < end; th_sleep_ms(20)) {
        redisContext *sc = redisConnectWithTimeout("127.0.0.1", *port, tv);
        redisReply *rep = sc && !sc->err ? redisCommand(sc, "SENTINEL get-master-addr-by-name mymaster") : NULL;
        int up = rep && rep->type == REDIS_REPLY_ARRAY && rep->elements == 2;
        if (rep)
            freeReplyObject(rep);
        if (sc)
            redisFree(sc);
        if (up)
            break;
    }
    free(sdir);
    free(conf);
    free(out);
    return pid;
}

static void sentinel(void)
{
    char url[160], good[160], *path, *err = NULL;
    sqlite3 *db = fresh_db("sen", &path);
    int port, st;
    pid_t pid = start_sentinel(&port);

    snprintf(url, sizeof url, "redis-sentinel://:pass@127.0.0.1:%d#nosuchmaster", port);
    refused("unknown master name", db, path, url, NULL, "no sentinel of the URL names master 'nosuchmaster'");
    snprintf(good, sizeof good, "redis-sentinel://:pass@127.0.0.1:%d#mymaster", port);
    healed("sentinel", db, path, good, NULL, c, "sen");
    is_int(th_stop(pid, SIGTERM, 10000), 0, "the sentinel stops");

    /* Every sentinel down: they may come back, so the drain waits. */
    rt_insert_rows(db, "sen2", N, 10, "sen2", 0);
    st = rt_relay_run(30000 * th_slow(), &err, path, good, "--drain", "--drain-timeout-ms", "1500", NULL);
    is_int(st, 1, "sentinels down: not a configuration error, the drain waits for its timeout (exit 1)");
    ok(err && !strstr(err, "drain failed") && strstr(err, "drain timeout"), "sentinels down: the drain timed out");
    free(err);
    sqlite3_close_v2(db);
    free(path);
}

static void redis_down(void)
{
    char url[64], *path, *err = NULL;
    sqlite3 *db = fresh_db("down", &path);
    int st, fd, port = th_refused_port(&fd);
    if (port < 0)
        bail("cannot bind a loopback port");
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    st = rt_relay_run(30000 * th_slow(), &err, path, url, "--drain", "--drain-timeout-ms", "1500", NULL);
    close(fd);
    is_int(st, 1, "redis down: not a configuration error, the drain waits for its timeout (exit 1)");
    ok(err && !strstr(err, "drain failed") && !strstr(err, "publishing held"), "redis down: nothing held");
    free(err);
    sqlite3_close_v2(db);
    free(path);
}

typedef struct http_wait {
    int port, status;
    char *body;
} http_wait;

static int healthz_503(void *arg)
{
    http_wait *h = arg;
    free(h->body);
    h->body = NULL;
    h->status = ot_http_get(h->port, "/healthz", &h->body);
    return h->status == 503 && h->body && strstr(h->body, "NOPERM");
}

static sqlite3 *daemon_db;

static int all_handed_back(void *arg)
{
    (void)arg;
    return rows(daemon_db, "state = 0 AND attempts = 0") == N;
}

static int all_published(void *arg)
{
    (void)arg;
    return rows(daemon_db, "state = 2") == N;
}

/* The daemon waits for the ACL to be fixed, failing nothing meanwhile. */
static void daemon_held(void)
{
    char url[128], listen[32], *path, *log = th_path(dir, "daemon.log"), *text;
    http_wait h = {th_free_port(), 0, NULL};
    redisReply *rep;
    pid_t pid;
    int held;

    daemon_db = fresh_db("daemon", &path);
    snprintf(url, sizeof url, "redis://later:pw@127.0.0.1:%d", srv.port);
    snprintf(listen, sizeof listen, "127.0.0.1:%d", h.port);
    pid = rt_relay_spawn(log, path, url, "--metrics-listen", listen, NULL);
    held = th_wait_until(10000 * th_slow(), healthz_503, &h);
    ok(held, "daemon, ACL without XADD: /healthz 503 naming it (%d %s)", h.status, h.body ? h.body : "");
    is_int(th_wait(pid, 0), -2, "daemon, ACL without XADD: keeps running");
    /* The refused batch is handed back a unit after the replies came. */
    ok(th_wait_until(10000 * th_slow(), all_handed_back, NULL),
       "daemon, ACL without XADD: every row pending again, no attempt counted");
    is_int(rows(daemon_db, "state = 2 OR state = 3 OR attempts > 0"), 0,
           "daemon, ACL without XADD: nothing published, nothing failed");
    rep = th_cmd(c, "ACL SETUSER later +xadd");
    ok(rep->type == REDIS_REPLY_STATUS, "daemon: the ACL now allows XADD");
    freeReplyObject(rep);
    ok(th_wait_until(40000 * th_slow(), all_published, NULL), "daemon, ACL fixed: every row published by itself");
    is_int(th_xlen(c, "outbox:daemon"), N, "daemon, ACL fixed: once each");
    is_int(rows(daemon_db, "attempts > 1 OR state = 3"), 0,
           "daemon, ACL fixed: no refused attempt was counted (at most the one that published)");
    is_int(th_stop(pid, SIGTERM, 15000), 0, "daemon: SIGTERM exits 0");
    text = th_slurp(log);
    is_int(rt_count_substr(text, "publishing held"), 1, "daemon: publishing held, said once");
    is_int(rt_count_substr(text, "publishing resumed"), 1, "daemon: publishing resumed, said once");
    ok(!strstr(text, "drain failed"), "daemon: no drain to fail");
    th_diag_tail("daemon", text, 6);
    free(text);
    free(h.body);
    free(log);
    sqlite3_close_v2(daemon_db);
    free(path);
}

typedef struct api_run {
    int calls, result;
} api_run;

static void api_on_drained(outbox_relay *r, void *data)
{
    api_run *x = data;
    x->calls++;
    x->result = outbox_relay_drain_result(r);
    outbox_relay_stop(r, NULL, NULL);
}

static void quiet(void *data, outbox_log_level level, const char *msg)
{
    (void)data;
    (void)level;
    (void)msg;
}

/* The C API: on_drained with OUTBOX_ECONFIG. */
static void api(void)
{
    char url[128], err[512], *path;
    sqlite3 *db = fresh_db("api", &path);
    outbox_relay_settings s;
    outbox_relay *r = NULL;
    uv_loop_t loop;
    api_run x = {0, 0};
    int e;

    snprintf(url, sizeof url, "redis://:N0tTheOne@127.0.0.1:%d", srv.port);
    uv_loop_init(&loop);
    outbox_relay_defaults(&s);
    s.db_path = path;
    s.redis_url = url;
    s.drain = 1;
    s.on_drained = api_on_drained;
    s.on_drained_data = &x;
    s.log = quiet;
    e = outbox_relay_create(&r, &loop, &s, err, sizeof err);
    is_int(e, 0, "api: created (%s)", e ? err : "");
    if (e == 0) {
        outbox_relay_start(r);
        uv_run(&loop, UV_RUN_DEFAULT);
        is_int(x.calls, 1, "api, wrong password: on_drained called once");
        is_int(x.result, OUTBOX_ECONFIG, "api, wrong password: outbox_relay_drain_result() is ECONFIG");
        outbox_relay_destroy(r);
        uv_run(&loop, UV_RUN_DEFAULT);
    }
    is_int(uv_loop_close(&loop), 0, "api: the loop closes cleanly");
    is_int(rows(db, "state = 0 AND attempts = 0"), N, "api: every row still pending");
    is_str(outbox_err_name(OUTBOX_ECONFIG), "ECONFIG", "OUTBOX_ECONFIG has its name");
    sqlite3_close_v2(db);
    free(path);
}

int main(void)
{
    char conf[256];

    if (th_redis_start(&srv, 1,
                       "requirepass pass\n"
                       "user noxadd on >pw ~* &* +@all -xadd\n"
                       "user noeval on >pw ~* &* +@all -evalsha -eval\n"
                       "user noclient on >pw ~* &* +@all -client\n"
                       "user nowait on >pw ~* &* +@all -wait\n"
                       "user somekeys on >pw ~outbox:keyok* &* +@all\n"
                       "user later on >pw ~* &* +@all -xadd\n") != 0)
        skip_all("redis-server not available");
    /* Its own bus port: the default, port + 10000, does not exist for a
     * port above 55535. */
    snprintf(conf, sizeof conf, "cluster-enabled yes\ncluster-config-file nodes.conf\ncluster-port %d\nrequirepass cpass\n",
             th_free_port());
    if (th_redis_start(&cnode, 1, conf) != 0)
        skip_all("redis-server cannot start a cluster node");
    dir = th_tmpdir();
    c = th_redis_client(&srv);

    credentials();
    acl();
    acl_key();
    cluster();
    sentinel();
    redis_down();
    daemon_held();
    api();

    redisFree(c);
    th_redis_destroy(&cnode);
    th_redis_destroy(&srv);
    th_rmtree(dir);
    free(dir);
    return tap_done();
}
