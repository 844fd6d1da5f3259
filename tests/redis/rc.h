/*
 * rc.h: what the tests of the libuv Redis connection (src/redis/redis.c,
 * test_redis_conn_*.c) share: a connection on its own loop whose callbacks
 * record what they saw (how often, with which status, in which order), so
 * that the checks come after the loop ran and a missing or doubled callback
 * is counted, not assumed.
 *
 * Every test runs on its own loop, closes everything it opened and checks
 * that uv_loop_close() succeeds (rc_finish).
 */
#ifndef OUTBOX_TESTS_RC_H
#define OUTBOX_TESTS_RC_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "harness.h"
#include "redis/redis.h"
#include "tap.h"

/* Timing bounds are multiplied by this under valgrind (rc_setup). */
extern int rc_slow;

typedef struct rc_conn rc_conn;

/* What one command's callback saw. */
typedef struct rc_rec {
    rc_conn *t;
    int calls;
    int status;
    int type; /* -1 when no reply */
    long long integer;
    size_t elements;
    char str[128];
    int seq; /* event order */
    int close_here; /* call close() from this callback */
    int issue_here; /* issue another command from this callback */
    int issue_rc;
} rc_rec;

struct rc_conn {
    uv_loop_t loop;
    uv_timer_t wd; /* wakes the loop so rc_run_until can check its deadline */
    outbox__redis *r;
    int seq;
    int connects, connect_status, connect_seq;
    int disconnects, disconnect_status, disconnect_seq;
    int closes, close_seq;
    int close_in_connect_cb;
    int issue_in_connect_cb;
    int close_in_disconnect_cb;
    int64_t t0, connect_ms, disconnect_ms;
    char connect_err[256], disconnect_err[256];
    rc_rec rec[16];
    int done; /* general purpose flag */
};

/* What every test file starts with: SIGPIPE ignored (libuv writes with
 * write(2): a peer that went away raises it, and the process using the
 * library must ignore it), rc_slow set, and a redis-server on a Unix socket
 * and a loopback TCP port (the whole file is skipped without one). Returns
 * the start time for rc_end. */
int64_t rc_begin(th_redis *srv);

/* A new loop for t, with its watchdog timer; bails on failure. */
void rc_init(rc_conn *t);
/* Runs the loop until *flag becomes non-zero, the loop has nothing left, or
 * ms milliseconds passed. Returns *flag. */
int rc_run_until(rc_conn *t, const int *flag, int ms);
/* Runs the loop until nothing is left on it (at most 5 s), closes the
 * watchdog and returns uv_loop_close(). */
int rc_drain(rc_conn *t);

/* The callbacks, recording into t (connect, disconnect, close) or into the
 * rc_rec given as data (replies). */
void rc_on_connect(outbox__redis *r, int status, void *data);
void rc_on_disconnect(outbox__redis *r, int status, void *data);
void rc_on_close(void *data);
void rc_on_reply(outbox__redis *r, int status, redisReply *reply, void *data);

/* Issues a command from NULL-terminated arguments, recording into rec[i]. */
int rc_cmd(rc_conn *t, int i, uint64_t timeout_ms, const char *a0, ...);
/* Creates t->r for url and connects; returns connect_cb's status (or -999
 * if it never came). */
int rc_connect(rc_conn *t, const char *url, const outbox__redis_options *o);
/* Closes t->r (if still open) and runs the loop until close_cb came. */
void rc_close(rc_conn *t);
int rc_starts_with(const char *s, const char *prefix);

/* Drains the loop and checks that it closes cleanly. Inline here because
 * tap.h's counters are per file: the check must count in the test's. */
static inline void rc_finish(rc_conn *t, const char *name)
{
    is_int(rc_drain(t), 0, "%s: loop closed cleanly", name);
}

/* Destroys the server, prints the file's total time and ends the TAP output
 * (inline for the same reason as rc_finish). */
static inline int rc_end(th_redis *srv, int64_t start)
{
    th_redis_destroy(srv);
    diag("total %lld ms", (long long)(th_now_ms() - start));
    return tap_done();
}

#endif
