/*
 * rconn.h: a Redis connection that keeps itself connected (internal).
 *
 * Wraps outbox__redis (one object per connection attempt) with reconnects
 * on a uv timer, exponential backoff with jitter (OUTBOX__RECONNECT_MIN_MS
 * doubling to OUTBOX__RECONNECT_MAX_MS, each wait drawn from its upper
 * half), and log lines that do not flood: one warning when Redis becomes
 * unreachable, a reminder every 30 s, one line when it is back.
 */
#ifndef OUTBOX_SRC_RCONN_H
#define OUTBOX_SRC_RCONN_H

#include "util/util.h"
#include "redis/redis.h"
#include "redis/sentinel.h"

typedef struct outbox__rconn outbox__rconn;

struct outbox__rconn {
    uv_loop_t *loop;
    outbox__redis_url url;
    outbox__redis_options opt;
    char desc[300];
    char what[32];
    const outbox__logger *log;
    outbox__redis *conn;
    int up, running, closing, handles, started;
    unsigned failures;
    uint64_t down_since, last_log;
    uv_timer_t timer;
    /* on_up: usable now; on_down: an established connection was lost (its
     * pending callbacks already ran with errors). */
    void (*on_up)(outbox__rconn *rc, void *data);
    void (*on_down)(outbox__rconn *rc, int status, void *data);
    /* on_refused (may be NULL): a connection attempt failed with an answer
     * that stays the same until Redis or the URL is changed: the
     * credentials refused (status OUTBOX_EAUTH), a command of the
     * handshake forbidden by an ACL, every sentinel refusing the
     * credentials or not knowing the master (outbox__sentinel_refused).
     * why says so, fit for a log line's quoted field. Called after the
     * failure's own log line; reconnecting goes on with its backoff. */
    void (*on_refused)(outbox__rconn *rc, int status, const char *why, void *data);
    void *data;
    void (*close_cb)(void *data);
    void *close_data;
    /* Sentinel URLs: the sentinels (created at the first connect), the node
     * they named last, and the state of asking them (see rc_connect). */
    outbox__sentinel *sentinel;
    outbox__redis_url node;
    int locating, down_pending;
    const char *fail_text; /* the words of the next failure's log line, if not the usual */
};

/* url is copied; opt copied (client_name must stay valid; opt->tls gets a
 * reference of the rconn's own, and a rediss:// URL without opt->tls gets
 * the default TLS configuration, built once here); log borrowed. Returns 0,
 * OUTBOX_EINVAL (opt->tls with a URL that is not rediss://), OUTBOX_ENOMEM.
 * A TLS configuration without verification is logged as a warning at
 * every connect. */
int outbox__rconn_init(outbox__rconn *rc, uv_loop_t *loop, const outbox__redis_url *url,
                       const outbox__redis_options *opt, const outbox__logger *log, const char *what);
/* Creates the timer and starts connecting (and keeps reconnecting). */
void outbox__rconn_start(outbox__rconn *rc);
/* Frees an rconn that was initialised but never started (no handles). */
void outbox__rconn_discard(outbox__rconn *rc);
/* The live connection, or NULL when not connected. */
outbox__redis *outbox__rconn_get(const outbox__rconn *rc);
/* Drops the current connection (its pending callbacks get errors) and
 * reconnects after the backoff. */
void outbox__rconn_reset(outbox__rconn *rc, const char *why);
/*
 * For the owners' reply callbacks: 1 if reply (an error) says that conn no
 * longer talks to the master of a Sentinel URL (READONLY, MASTERDOWN, or
 * UNBLOCKED for a blocked command of a master being demoted). Then
 * the connection is dropped, if it is still rc's: every command pending on
 * it fails, so its outcome is unknown and its message is to be released
 * (sent again later: a duplicate at worst, never a loss), not counted as a
 * failed attempt; on_down follows on a later loop turn, and the sentinels
 * are asked for the master again. 0 for every other reply, and always for
 * a URL without sentinels (there, such an error is the node's answer).
 */
int outbox__rconn_redirect_error(outbox__rconn *rc, const outbox__redis *conn, const redisReply *reply);
/* Stops reconnecting (a stop in progress): a live connection stays until
 * closed or reset; one not up yet is dropped. */
void outbox__rconn_hold(outbox__rconn *rc);
/* Closes everything of a started rconn; cb runs once every handle is
 * closed. The struct's memory is the caller's and must stay valid until
 * then. Does nothing (and never calls cb) on one that was not started. */
void outbox__rconn_close(outbox__rconn *rc, void (*cb)(void *data), void *data);

#endif
