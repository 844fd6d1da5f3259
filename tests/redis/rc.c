/*
 * rc.c: see rc.h.
 */
#include "rc.h"

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int rc_slow = 1;

int64_t rc_begin(th_redis *srv)
{
    int64_t start = th_now_ms();
    signal(SIGPIPE, SIG_IGN);
    if (getenv("OUTBOX_UNDER_VALGRIND"))
        rc_slow = 5;
    if (th_redis_start(srv, 1, NULL) != 0)
        skip_all("redis-server not available");
    return start;
}

static void wd_cb(uv_timer_t *h)
{
    (void)h;
}

void rc_init(rc_conn *t)
{
    memset(t, 0, sizeof *t);
    if (uv_loop_init(&t->loop) != 0)
        bail("uv_loop_init");
    uv_timer_init(&t->loop, &t->wd);
    uv_timer_start(&t->wd, wd_cb, 10, 10);
    uv_unref((uv_handle_t *)&t->wd);
    t->t0 = th_now_ms();
    for (int i = 0; i < 16; i++) {
        t->rec[i].t = t;
        t->rec[i].type = -1;
    }
}

int rc_run_until(rc_conn *t, const int *flag, int ms)
{
    int64_t deadline = th_now_ms() + (int64_t)ms * rc_slow;
    while (!*flag && th_now_ms() < deadline)
        if (uv_run(&t->loop, UV_RUN_ONCE) == 0 && !*flag && !uv_loop_alive(&t->loop))
            break;
    return *flag;
}

int rc_drain(rc_conn *t)
{
    int64_t deadline = th_now_ms() + 5000 * rc_slow;
    while (uv_loop_alive(&t->loop) && th_now_ms() < deadline)
        uv_run(&t->loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&t->wd, NULL);
    uv_run(&t->loop, UV_RUN_NOWAIT);
    return uv_loop_close(&t->loop);
}

void rc_on_connect(outbox__redis *r, int status, void *data)
{
    rc_conn *t = data;
    t->connects++;
    t->connect_status = status;
    t->connect_seq = ++t->seq;
    t->connect_ms = th_now_ms() - t->t0;
    snprintf(t->connect_err, sizeof t->connect_err, "%s", outbox__redis_errstr(r));
    if (t->issue_in_connect_cb) {
        const char *argv[] = {"PING"};
        t->rec[0].issue_rc = outbox__redis_command_argv(r, 1, argv, NULL, 0, rc_on_reply, &t->rec[0]);
    }
    if (t->close_in_connect_cb) {
        outbox__redis_close(r, NULL, NULL);
        t->r = NULL;
        /* once more, from inside: must be harmless */
        outbox__redis_close(r, NULL, NULL);
    }
}

void rc_on_disconnect(outbox__redis *r, int status, void *data)
{
    rc_conn *t = data;
    t->disconnects++;
    t->disconnect_status = status;
    t->disconnect_seq = ++t->seq;
    t->disconnect_ms = th_now_ms() - t->t0;
    snprintf(t->disconnect_err, sizeof t->disconnect_err, "%s", outbox__redis_errstr(r));
    if (t->close_in_disconnect_cb) {
        outbox__redis_close(r, rc_on_close, t);
        t->r = NULL;
    }
}

void rc_on_close(void *data)
{
    rc_conn *t = data;
    t->closes++;
    t->close_seq = ++t->seq;
}

void rc_on_reply(outbox__redis *r, int status, redisReply *reply, void *data)
{
    rc_rec *c = data;
    rc_conn *t = c->t;
    c->calls++;
    c->status = status;
    c->seq = ++t->seq;
    if (reply) {
        c->type = reply->type;
        c->integer = reply->integer;
        c->elements = reply->elements;
        if (reply->str) {
            size_t n = reply->len < sizeof c->str - 1 ? reply->len : sizeof c->str - 1;
            memcpy(c->str, reply->str, n);
            c->str[n] = '\0';
        }
    }
    if (c->issue_here) {
        const char *argv[] = {"PING"};
        c->issue_rc = outbox__redis_command_argv(r, 1, argv, NULL, 0, rc_on_reply, &t->rec[c->issue_here]);
    }
    if (c->close_here) {
        outbox__redis_close(r, rc_on_close, t);
        t->r = NULL;
    }
}

int rc_cmd(rc_conn *t, int i, uint64_t timeout_ms, const char *a0, ...)
{
    const char *argv[16];
    int argc = 0;
    va_list ap;
    va_start(ap, a0);
    for (const char *a = a0; a && argc < 16; a = va_arg(ap, const char *))
        argv[argc++] = a;
    va_end(ap);
    return outbox__redis_command_argv(t->r, argc, argv, NULL, timeout_ms, rc_on_reply, &t->rec[i]);
}

int rc_connect(rc_conn *t, const char *url, const outbox__redis_options *o)
{
    outbox__redis_url u;
    char err[256];
    int rc;
    if ((rc = outbox__redis_url_parse(url, &u, err, sizeof err)) != 0) {
        diag("bad URL %s: %s", url, err);
        return rc;
    }
    rc = outbox__redis_create(&t->r, &t->loop, &u, o, t);
    outbox__redis_url_free(&u);
    if (rc != 0)
        return rc;
    t->t0 = th_now_ms();
    if ((rc = outbox__redis_connect(t->r, rc_on_connect, rc_on_disconnect)) != 0)
        return rc;
    if (!rc_run_until(t, &t->connects, 10000))
        return -999;
    return t->connect_status;
}

void rc_close(rc_conn *t)
{
    if (t->r) {
        outbox__redis_close(t->r, rc_on_close, t);
        t->r = NULL;
    }
    rc_run_until(t, &t->closes, 5000);
}

int rc_starts_with(const char *s, const char *prefix)
{
    return strncmp(s, prefix, strlen(prefix)) == 0;
}
