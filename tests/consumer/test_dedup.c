/*
 * test_dedup.c: the Redis dedup module (outbox_dedup) on the test's own
 * loop against a real redis-server: the three results of begin, complete
 * and abandon with their owner check, the exact key layout, values and TTLs
 * of proto/dedup.md, a race between two objects, NOSCRIPT recovery, Redis
 * errors and Redis going away, and the argument checks.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ct.h"
#include "harness.h"
#include "outbox.h"
#include "tap.h"

#define STREAM "outbox:orders"
#define LEASE_MS 20000
#define RETENTION_MS 600000

static uv_loop_t loop;
static th_redis srv;
static redisContext *rc;

typedef struct res {
    int done, calls, status;
    outbox_dedup_result r;
} res;

static void on_res(outbox_dedup *d, int status, outbox_dedup_result r, void *data)
{
    res *x = data;
    (void)d;
    x->calls++;
    x->done = 1;
    x->status = status;
    x->r = r;
}

enum { BEGIN, COMPLETE, ABANDON };

/* Runs one operation to its callback; returns the callback's status, or the
 * synchronous error (then *r is 0). */
static int op(outbox_dedup *d, int kind, const char *id, outbox_dedup_result *r)
{
    res x = {0};
    int e = kind == BEGIN      ? outbox_dedup_begin(d, STREAM, id, on_res, &x)
            : kind == COMPLETE ? outbox_dedup_complete(d, STREAM, id, on_res, &x)
                               : outbox_dedup_abandon(d, STREAM, id, on_res, &x);
    *r = 0;
    if (e != 0)
        return e;
    if (!ct_run_until(&loop, &x.done, 10000 * th_slow()))
        bail("dedup callback for %s did not come", id);
    *r = x.r;
    return x.status;
}

static outbox_dedup *make(const char *owner, uint64_t lease_ms, uint64_t reply_timeout_ms)
{
    outbox_dedup_settings s;
    outbox_dedup *d;
    char err[300];
    outbox_dedup_defaults(&s);
    s.redis_url = srv.url;
    s.owner = owner;
    s.lease_ms = lease_ms;
    s.retention_ms = RETENTION_MS;
    s.log_level = OUTBOX_LOG_ERROR;
    if (reply_timeout_ms)
        s.reply_timeout_ms = reply_timeout_ms;
    if (outbox_dedup_create(&d, &loop, &s, err, sizeof err) != 0)
        bail("outbox_dedup_create: %s", err);
    return d;
}

static int connected_cond(void *arg)
{
    return outbox_dedup_connected(arg);
}

static void wait_connected(outbox_dedup *d)
{
    if (!ct_run_until_cond(&loop, connected_cond, d, 10000 * th_slow()))
        bail("dedup did not connect");
}

static char *key_of(const char *id)
{
    static char k[512];
    snprintf(k, sizeof k, "dedup:{%s}:%s", STREAM, id);
    return k;
}

static void destroyed(void *data)
{
    (*(int *)data)++;
}

static void destroy(outbox_dedup *d)
{
    int n = 0;
    outbox_dedup_destroy(d, destroyed, &n);
    if (!ct_run_until(&loop, &n, 10000 * th_slow()))
        bail("dedup destroy callback did not come");
}

static void test_settings(void)
{
    outbox_dedup_settings s;
    outbox_dedup *d = (outbox_dedup *)&s;
    char err[300];

    outbox_dedup_defaults(&s);
    is_int(s.lease_ms, 30000, "default lease 30 s");
    is_int(s.retention_ms, 7ll * 24 * 3600 * 1000, "default retention 7 days");
    is_str(s.key_namespace, "dedup", "default namespace");
    is_int(outbox_dedup_create(&d, &loop, &s, err, sizeof err), OUTBOX_EINVAL, "create without a URL: EINVAL");
    ok(d == NULL, "create failure leaves *out NULL");
    s.redis_url = srv.url;
    s.key_namespace = "a{b}";
    is_int(outbox_dedup_create(&d, &loop, &s, err, sizeof err), OUTBOX_EINVAL, "namespace with braces: EINVAL");
    s.key_namespace = "dedup";
    s.lease_ms = 0;
    is_int(outbox_dedup_create(&d, &loop, &s, err, sizeof err), OUTBOX_EINVAL, "lease 0: EINVAL");
    s.lease_ms = 1000;
    s.owner = "";
    is_int(outbox_dedup_create(&d, &loop, &s, err, sizeof err), OUTBOX_EINVAL, "empty owner: EINVAL");
    s.owner = NULL;
    s.redis_url = "http://nope";
    is_int(outbox_dedup_create(&d, &loop, &s, err, sizeof err), OUTBOX_EURL, "bad URL: EURL");
    ok(strstr(err, "scheme") != NULL, "bad URL: err says why (%s)", err);
    is_int(outbox_dedup_create(NULL, &loop, &s, err, sizeof err), OUTBOX_EINVAL, "NULL out: EINVAL");
    {
        int n = 0, alive = uv_loop_alive(&loop);
        outbox_dedup_destroy(NULL, destroyed, &n);
        uv_run(&loop, UV_RUN_NOWAIT);
        ok(n == 0 && uv_loop_alive(&loop) == alive,
           "destroy(NULL) is a no-op: its callback never runs, nothing is added to the loop");
    }
}

static void test_before_connect(void)
{
    res x = {0};
    outbox_dedup *d = make("early", LEASE_MS, 0);
    int e = outbox_dedup_begin(d, STREAM, "early-1", on_res, &x);
    is_int(e, OUTBOX_ECONNECT, "begin before the connection is up: ECONNECT, synchronously");
    ok(!outbox_dedup_connected(d), "not connected yet");
    wait_connected(d);
    is_int(x.calls, 0, "no callback after a synchronous error");
    is_int(ct_int(rc, "EXISTS %s", key_of("early-1")), 0, "the refused begin wrote no key");
    destroy(d);
}

static void test_args(outbox_dedup *d)
{
    res x = {0};
    char longid[1200];
    memset(longid, 'x', sizeof longid - 1);
    longid[sizeof longid - 1] = '\0';
    is_int(outbox_dedup_begin(d, NULL, "a", on_res, &x), OUTBOX_EINVAL, "NULL stream: EINVAL");
    is_int(outbox_dedup_begin(d, "", "a", on_res, &x), OUTBOX_EINVAL, "empty stream: EINVAL");
    is_int(outbox_dedup_begin(d, STREAM, "", on_res, &x), OUTBOX_EINVAL, "empty id: EINVAL");
    is_int(outbox_dedup_begin(d, STREAM, NULL, on_res, &x), OUTBOX_EINVAL, "NULL id: EINVAL");
    is_int(outbox_dedup_begin(d, STREAM, "a", NULL, &x), OUTBOX_EINVAL, "NULL callback: EINVAL");
    is_int(outbox_dedup_begin(d, STREAM, longid, on_res, &x), OUTBOX_EINVAL, "id too long: EINVAL");
    is_int(outbox_dedup_complete(d, STREAM, "", on_res, &x), OUTBOX_EINVAL, "complete, empty id: EINVAL");
    is_int(outbox_dedup_abandon(d, "", "a", on_res, &x), OUTBOX_EINVAL, "abandon, empty stream: EINVAL");
    is_int(outbox_dedup_begin(NULL, STREAM, "a", on_res, &x), OUTBOX_EINVAL, "NULL dedup: EINVAL");
    ct_run_for(&loop, 20);
    is_int(x.calls, 0, "no callback for rejected calls");
    is_int(ct_int(rc, "DBSIZE"), 0, "rejected calls wrote nothing");
}

static void test_lifecycle(outbox_dedup *a, outbox_dedup *b)
{
    outbox_dedup_result r;
    char *v;
    long long ttl;

    is_int(op(a, BEGIN, "m1", &r), 0, "begin: status 0");
    is_int(r, OUTBOX_DEDUP_FIRST, "begin: FIRST");
    v = ct_get(rc, key_of("m1"));
    is_str(v, "P:alpha", "processing key %s holds P:<owner>", key_of("m1"));
    free(v);
    ttl = ct_int(rc, "PTTL %s", key_of("m1"));
    ok(ttl > LEASE_MS - 5000 && ttl <= LEASE_MS, "processing key expires after the lease (PTTL %lld)", ttl);
    is_int(ct_int(rc, "DBSIZE"), 1, "exactly one key written");

    is_int(op(a, BEGIN, "m1", &r), 0, "begin again, same owner: status 0");
    is_int(r, OUTBOX_DEDUP_BUSY, "begin again, same owner: BUSY");
    is_int(op(b, BEGIN, "m1", &r), 0, "begin from another object: status 0");
    is_int(r, OUTBOX_DEDUP_BUSY, "begin from another object: BUSY");
    v = ct_get(rc, key_of("m1"));
    is_str(v, "P:alpha", "BUSY begins leave the owner's key alone");
    free(v);

    is_int(op(b, COMPLETE, "m1", &r), OUTBOX_ELEASE, "complete by a non-owner: ELEASE");
    is_int(op(b, ABANDON, "m1", &r), OUTBOX_ELEASE, "abandon by a non-owner: ELEASE");
    v = ct_get(rc, key_of("m1"));
    is_str(v, "P:alpha", "a non-owner's complete/abandon changes nothing");
    free(v);

    is_int(op(a, COMPLETE, "m1", &r), 0, "complete by the owner: 0");
    is_int(r, 0, "complete: result 0");
    v = ct_get(rc, key_of("m1"));
    is_str(v, "D", "after complete the key holds D");
    free(v);
    ttl = ct_int(rc, "PTTL %s", key_of("m1"));
    ok(ttl > RETENTION_MS - 10000 && ttl <= RETENTION_MS, "done marker expires after the retention (PTTL %lld)",
       ttl);

    is_int(op(b, BEGIN, "m1", &r), 0, "begin from another object after complete: status 0");
    is_int(r, OUTBOX_DEDUP_DONE, "begin after complete: DONE");
    is_int(op(a, BEGIN, "m1", &r), 0, "begin by the owner after complete: status 0");
    is_int(r, OUTBOX_DEDUP_DONE, "begin by the owner after complete: DONE");
    is_int(op(a, COMPLETE, "m1", &r), OUTBOX_ELEASE, "complete twice: ELEASE (the key is D, not ours)");

    is_int(op(a, BEGIN, "m2", &r), 0, "begin m2");
    is_int(r, OUTBOX_DEDUP_FIRST, "begin m2: FIRST");
    is_int(op(a, ABANDON, "m2", &r), 0, "abandon by the owner: 0");
    is_int(ct_int(rc, "EXISTS %s", key_of("m2")), 0, "abandon deletes the processing key");
    is_int(op(b, BEGIN, "m2", &r), 0, "begin after abandon: status 0");
    is_int(r, OUTBOX_DEDUP_FIRST, "begin after abandon: FIRST again (for the other object)");
    v = ct_get(rc, key_of("m2"));
    is_str(v, "P:beta", "the new owner holds the key");
    free(v);
    is_int(op(b, COMPLETE, "m2", &r), 0, "the new owner completes");
    is_int(op(a, ABANDON, "m2", &r), OUTBOX_ELEASE, "abandon of a done key: ELEASE");
    v = ct_get(rc, key_of("m2"));
    is_str(v, "D", "a late abandon does not delete a done marker");
    free(v);
}

static void test_lease_expiry(void)
{
    outbox_dedup *s = make("short", 150, 0), *o = make("other", LEASE_MS, 0);
    outbox_dedup_result r;
    wait_connected(s);
    wait_connected(o);
    is_int(op(s, BEGIN, "m-lease", &r), 0, "short lease: begin");
    is_int(r, OUTBOX_DEDUP_FIRST, "short lease: FIRST");
    is_int(op(o, BEGIN, "m-lease", &r), 0, "before the lease ends");
    is_int(r, OUTBOX_DEDUP_BUSY, "before the lease ends: BUSY");
    ct_run_for(&loop, 300);
    is_int(op(o, BEGIN, "m-lease", &r), 0, "after the lease ends (the owner died)");
    is_int(r, OUTBOX_DEDUP_FIRST, "after the lease ends: FIRST for someone else");
    is_int(op(s, COMPLETE, "m-lease", &r), OUTBOX_ELEASE, "the late owner's complete: ELEASE");
    is_int(op(o, COMPLETE, "m-lease", &r), 0, "the new owner completes");
    destroy(s);
    destroy(o);
}

typedef struct race {
    res x[2];
} race;

static void test_race(outbox_dedup *a, outbox_dedup *b)
{
    int bad = 0, firsts = 0;
    for (int i = 0; i < 200; i++) {
        race rr;
        char id[32];
        outbox_dedup *first = i % 2 ? a : b, *second = i % 2 ? b : a;
        memset(&rr, 0, sizeof rr);
        snprintf(id, sizeof id, "race-%d", i);
        if (outbox_dedup_begin(first, STREAM, id, on_res, &rr.x[0]) != 0 ||
            outbox_dedup_begin(second, STREAM, id, on_res, &rr.x[1]) != 0)
            bail("race: begin refused");
        {
            int both = 0;
            int64_t deadline = th_now_ms() + 10000 * th_slow();
            while (!(rr.x[0].done && rr.x[1].done) && th_now_ms() < deadline)
                ct_run_until(&loop, &rr.x[rr.x[0].done ? 1 : 0].done, 100);
            both = rr.x[0].done && rr.x[1].done;
            if (!both)
                bail("race: callbacks missing");
        }
        {
            int f = (rr.x[0].r == OUTBOX_DEDUP_FIRST) + (rr.x[1].r == OUTBOX_DEDUP_FIRST);
            int busy = (rr.x[0].r == OUTBOX_DEDUP_BUSY) + (rr.x[1].r == OUTBOX_DEDUP_BUSY);
            if (f != 1 || busy != 1 || rr.x[0].status || rr.x[1].status) {
                if (bad++ < 5)
                    diag("race %d: results %d/%d status %d/%d", i, rr.x[0].r, rr.x[1].r, rr.x[0].status,
                         rr.x[1].status);
            }
            firsts += f;
        }
    }
    is_int(bad, 0, "200 races between two objects: exactly one FIRST and one BUSY each time");
    is_int(firsts, 200, "200 FIRST results in all");
}

static long long info_count(const char *section, const char *field)
{
    redisReply *r = th_cmd(rc, "INFO %s", section);
    long long n = 0;
    const char *p = r->type == REDIS_REPLY_STRING ? strstr(r->str, field) : NULL;
    if (p) {
        p = strstr(p, "count=");
        if (!p)
            p = strstr(r->str, field) + strlen(field);
        p = strpbrk(p, "0123456789");
        if (p)
            n = atoll(p);
    }
    freeReplyObject(r);
    return n;
}

static void test_noscript(outbox_dedup *a)
{
    outbox_dedup_result r;
    char *v;
    long long before;

    /* Load the scripts (a complete), then make the server forget them. */
    is_int(op(a, BEGIN, "ns-0", &r), 0, "noscript: warm-up begin");
    is_int(op(a, COMPLETE, "ns-0", &r), 0, "noscript: warm-up complete");
    before = info_count("errorstats", "errorstat_NOSCRIPT:");
    is_int(op(a, BEGIN, "ns-1", &r), 0, "noscript: begin");
    is_int(r, OUTBOX_DEDUP_FIRST, "noscript: FIRST");
    freeReplyObject(th_cmd(rc, "SCRIPT FLUSH"));
    is_int(op(a, COMPLETE, "ns-1", &r), 0, "complete after SCRIPT FLUSH still works");
    v = ct_get(rc, key_of("ns-1"));
    is_str(v, "D", "complete after SCRIPT FLUSH wrote D");
    free(v);
    ok(info_count("errorstats", "errorstat_NOSCRIPT:") > before,
       "the server did answer NOSCRIPT (EVALSHA was tried first)");
    is_int(op(a, BEGIN, "ns-2", &r), 0, "noscript: begin ns-2");
    freeReplyObject(th_cmd(rc, "SCRIPT FLUSH"));
    is_int(op(a, ABANDON, "ns-2", &r), 0, "abandon after SCRIPT FLUSH still works");
    is_int(ct_int(rc, "EXISTS %s", key_of("ns-2")), 0, "abandon after SCRIPT FLUSH deleted the key");
    is_int(op(a, BEGIN, "ns-3", &r), 0, "noscript: begin ns-3");
    is_int(op(a, COMPLETE, "ns-3", &r), 0, "a later complete works too");
}

static void test_wrongtype(outbox_dedup *a)
{
    outbox_dedup_result r;
    freeReplyObject(th_cmd(rc, "HSET %s f v", key_of("wt")));
    is_int(op(a, BEGIN, "wt", &r), OUTBOX_EREDIS, "begin on a hash: EREDIS");
    ok(r != OUTBOX_DEDUP_FIRST, "begin on a hash: not FIRST");
    ok(strstr(outbox_dedup_errstr(a), "WRONGTYPE") != NULL, "errstr names WRONGTYPE (%s)", outbox_dedup_errstr(a));
    is_int(op(a, COMPLETE, "wt", &r), OUTBOX_EREDIS, "complete on a hash: EREDIS");
    ok(strstr(outbox_dedup_errstr(a), "WRONGTYPE") != NULL, "complete: errstr names WRONGTYPE (%s)",
       outbox_dedup_errstr(a));
    is_int(op(a, ABANDON, "wt", &r), OUTBOX_EREDIS, "abandon on a hash: EREDIS");
    is_int(ct_int(rc, "EXISTS %s", key_of("wt")), 1, "the hash is untouched");
}

static int down_status(int st)
{
    return st == OUTBOX_ECLOSED || st == OUTBOX_ECONNECT || st == OUTBOX_ETIMEDOUT;
}

static void test_redis_down(outbox_dedup *a)
{
    outbox_dedup *t = make("timeouts", LEASE_MS, 300 * th_slow());
    res x = {0}, y = {0}, z = {0};
    outbox_dedup_result r;
    int st;

    wait_connected(t);
    is_int(op(t, BEGIN, "down-0", &r), 0, "down: begin before the trouble");

    /* A server that stops answering: the reply timeout ends the wait. */
    kill(srv.pid, SIGSTOP);
    st = op(t, BEGIN, "down-1", &r);
    ok(st == OUTBOX_ETIMEDOUT, "begin against a hung server: ETIMEDOUT (got %s)", outbox_err_name(st));
    ok(r != OUTBOX_DEDUP_FIRST, "begin against a hung server: not FIRST");
    kill(srv.pid, SIGCONT);
    wait_connected(t);
    destroy(t);

    /* Commands on the wire when the server dies. */
    kill(srv.pid, SIGSTOP);
    if (outbox_dedup_begin(a, STREAM, "down-2", on_res, &x) != 0 ||
        outbox_dedup_complete(a, STREAM, "down-0", on_res, &y) != 0 ||
        outbox_dedup_abandon(a, STREAM, "down-3", on_res, &z) != 0)
        bail("down: calls refused while connected");
    ct_run_for(&loop, 50);
    th_redis_kill(&srv);
    ct_run_until(&loop, &z.done, 5000 * th_slow());
    ok(x.done && down_status(x.status), "begin while Redis dies: %s", outbox_err_name(x.status));
    ok(x.r != OUTBOX_DEDUP_FIRST, "begin while Redis dies: never FIRST");
    ok(y.done && down_status(y.status), "complete while Redis dies: %s", outbox_err_name(y.status));
    ok(z.done && down_status(z.status), "abandon while Redis dies: %s", outbox_err_name(z.status));
    is_int(x.calls + y.calls + z.calls, 3, "each callback exactly once");
    ok(!outbox_dedup_connected(a), "not connected while Redis is down");
    memset(&x, 0, sizeof x);
    is_int(outbox_dedup_begin(a, STREAM, "down-4", on_res, &x), OUTBOX_ECONNECT,
           "begin while Redis is down: ECONNECT at once");
    is_int(outbox_dedup_complete(a, STREAM, "down-4", on_res, &x), OUTBOX_ECONNECT,
           "complete while Redis is down: ECONNECT at once");
    ct_run_for(&loop, 30);
    is_int(x.calls, 0, "no callback for them");

    if (th_redis_restart(&srv) != 0)
        bail("redis restart failed");
    redisFree(rc);
    rc = th_redis_client(&srv);
    wait_connected(a);
    is_int(op(a, BEGIN, "down-5", &r), 0, "after Redis is back: begin works");
    is_int(r, OUTBOX_DEDUP_FIRST, "after Redis is back: FIRST");
    is_int(op(a, COMPLETE, "down-5", &r), 0, "after Redis is back: complete works (scripts reloaded)");
}

/* Defaults and other settings: a UUIDv7 owner per object, a custom
 * namespace in the key, a TCP connection. */
static void test_variants(void)
{
    outbox_dedup_settings s;
    outbox_dedup *d, *e;
    outbox_dedup_result r;
    char err[300], *v, *w;

    outbox_dedup_defaults(&s);
    s.redis_url = srv.tcp_url;
    s.key_namespace = "svc";
    s.log_level = OUTBOX_LOG_ERROR;
    if (outbox_dedup_create(&d, &loop, &s, err, sizeof err) != 0 ||
        outbox_dedup_create(&e, &loop, &s, err, sizeof err) != 0)
        bail("create: %s", err);
    wait_connected(d);
    wait_connected(e);
    is_int(op(d, BEGIN, "v-1", &r), 0, "over TCP: begin");
    is_int(r, OUTBOX_DEDUP_FIRST, "over TCP: FIRST");
    is_int(op(e, BEGIN, "v-2", &r), 0, "second object: begin");
    v = ct_get(rc, "svc:{" STREAM "}:v-1");
    w = ct_get(rc, "svc:{" STREAM "}:v-2");
    ok(v && strlen(v) == 38 && strncmp(v, "P:", 2) == 0 && v[2 + 14] == '7',
       "the namespace is the key's prefix; the default owner is a UUIDv7 (%s)", v ? v : "nil");
    ok(v && w && strcmp(v, w) != 0, "each object has its own owner");
    free(v);
    free(w);
    is_int(op(d, COMPLETE, "v-1", &r), 0, "over TCP: complete");
    is_int(op(e, BEGIN, "v-1", &r), 0, "begin v-1 from the other object");
    is_int(r, OUTBOX_DEDUP_DONE, "DONE");
    destroy(d);
    destroy(e);
}

static void destroy_in_cb(outbox_dedup *d, int status, outbox_dedup_result r, void *data)
{
    res *x = data;
    on_res(d, status, r, data);
    outbox_dedup_destroy(d, destroyed, &x[1].calls);
}

static void test_destroy(void)
{
    outbox_dedup *d = make("doomed", LEASE_MS, 0);
    res x = {0}, y[2];
    int n = 0;
    wait_connected(d);
    if (outbox_dedup_begin(d, STREAM, "doomed-1", on_res, &x) != 0)
        bail("destroy: begin refused");
    outbox_dedup_destroy(d, destroyed, &n);
    ct_run_until(&loop, &n, 5000);
    is_int(n, 1, "destroy with an operation in flight: destroy callback once");
    is_int(x.calls, 1, "the pending operation got its callback once");
    ok(x.status != 0 && x.r != OUTBOX_DEDUP_FIRST, "the pending operation failed (%s)", outbox_err_name(x.status));

    memset(y, 0, sizeof y);
    d = make("doomed2", LEASE_MS, 0);
    wait_connected(d);
    if (outbox_dedup_begin(d, STREAM, "doomed-2", destroy_in_cb, y) != 0)
        bail("destroy: begin refused");
    ct_run_until(&loop, &y[1].calls, 5000);
    is_int(y[0].calls, 1, "destroy from inside a callback: the callback ran once");
    is_int(y[1].calls, 1, "destroy from inside a callback: destroy callback once");
}

int main(void)
{
    outbox_dedup *a, *b;

    if (th_redis_start(&srv, 1, NULL) != 0)
        skip_all("redis-server not available");
    if (uv_loop_init(&loop) != 0)
        bail("uv_loop_init");
    rc = th_redis_client(&srv);

    test_settings();
    test_before_connect();
    a = make("alpha", LEASE_MS, 0);
    b = make("beta", LEASE_MS, 0);
    wait_connected(a);
    wait_connected(b);
    freeReplyObject(th_cmd(rc, "FLUSHALL"));
    test_args(a);
    test_lifecycle(a, b);
    test_lease_expiry();
    test_race(a, b);
    test_variants();
    test_noscript(a);
    test_wrongtype(a);
    destroy(b);
    test_redis_down(a);
    destroy(a);
    test_destroy();

    is_int(ct_loop_finish(&loop, 5000), 0, "uv_loop_close() == 0: every handle closed");
    redisFree(rc);
    th_redis_destroy(&srv);
    return tap_done();
}
