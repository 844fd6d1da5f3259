/*
 * redis_int.h: what the files of the Redis connection share (internal; the
 * module's contract is redis.h).
 *
 *   redis.c       the object: create, close and freeing; the re-entrancy
 *                 guard; failure; the pending queue, commands and deadlines
 *   redis_conn.c  connecting: resolving, TCP or Unix socket, the TLS
 *                 handshake, the Redis handshake (AUTH, SELECT, SETNAME)
 *   redis_io.c    bytes in and out: the output buffer and its writes,
 *                 reads, reply parsing, and the TLS session's data
 *
 * docs/ARCHITECTURE.md ("The Redis connection") says what each may call.
 * Everything runs on the loop thread.
 */
#ifndef OUTBOX_SRC_REDIS_INT_H
#define OUTBOX_SRC_REDIS_INT_H

#include <netdb.h>
#include <stddef.h>
#include <stdint.h>

#include "redis/redis.h"

#define READ_BUF_SIZE (64 * 1024)
/* Replies handed to callbacks per loop turn: a long pipeline of replies
 * would otherwise hold the loop for tens of milliseconds. The rest stays
 * parsed-later in the reader and goes out at the next turn (idle handle). */
#define REPLIES_PER_TURN 1024
/* The longest string a reply may have to be built in the connection itself
 * (an XADD's entry id is about 15 bytes). */
#define FLAT_STR_MAX 127

enum state {
    ST_NEW,        /* created, connect() not called */
    ST_RESOLVING,  /* uv_getaddrinfo in flight */
    ST_CONNECTING, /* uv_tcp_connect / uv_pipe_connect in flight */
    ST_TLS,        /* connected, TLS handshake in progress (rediss://) */
    ST_HANDSHAKE,  /* connected, waiting for AUTH/SELECT/SETNAME replies */
    ST_CONNECTED,  /* usable */
    ST_FAILED,     /* connect or connection failed; waiting for close() */
    ST_CLOSING     /* close() done its part; waiting for handles to close */
};

enum kind { K_USER = 0, K_AUTH, K_SELECT, K_SETNAME, K_PING, K_NUDGE /* the stall watch's PING (conn.c) */ };

typedef struct pending {
    outbox__redis_reply_cb cb;
    void *data;
    uint64_t deadline;   /* non-zero: it has a reply timeout (counted as redis.c's top says) */
    uint64_t timeout_ms; /* for the error message */
    int kind;
    int blocking; /* may wait in the server (a timeout above the reply timeout: BLOCK, WAIT) */
} pending;

struct outbox__redis {
    uv_loop_t *loop;
    outbox__redis_url url;
    uint64_t connect_timeout_ms;
    uint64_t reply_timeout_ms;
    char *client_name;
    outbox__tls_config *tls_cfg; /* a reference; NULL without TLS */
    void *data;

    outbox__redis_connect_cb connect_cb;
    outbox__redis_disconnect_cb disconnect_cb;
    outbox__redis_close_cb close_cb;
    void *close_data;

    enum state state;
    int connect_cb_called;
    int close_requested;
    int in_callback; /* depth of entries from libuv */
    int refs;        /* handles not yet closed + outstanding getaddrinfo */

    uv_timer_t timer;
    int timer_armed; /* reply deadline timer armed (connected state) */
    uint64_t timer_due;
    int deferred_status; /* a failure to report from the timer, see outbox__redis_fail_soon() */

    uv_idle_t idle; /* flushes output once per loop turn; resumes paused reads */
    uv_check_t check; /* flushes what I/O callbacks queued, in the same turn */
    unsigned turn_budget; /* replies still to hand out in this loop turn */
    int more_replies;     /* parsed input waits for the next turn */

    uv_getaddrinfo_t gai;
    int gai_active;
    struct addrinfo *ai_head, *ai_next;

    uv_stream_t *stream; /* malloc'd uv_tcp_t or uv_pipe_t; NULL when none */
    uv_connect_t creq;

    uv_write_t wreq;
    int write_active;
    char *obuf; /* queued output */
    size_t olen, ocap;
    size_t osent; /* TLS: bytes of obuf already encrypted */
    char *wbuf; /* the write in flight */
    size_t wlen, wcap;

    char *rbuf; /* READ_BUF_SIZE, reused by every read */
    redisReader *reader; /* built with outbox__redis_io_reader_fns, privdata = this */
    /* A top-level reply that is a short string, status, error, integer or
     * nil is built here instead of in two allocations (io.c, flat_*): it
     * lives until process_replies hands it back after its callback. */
    redisReply flat;
    int flat_busy;
    char flat_str[FLAT_STR_MAX + 1];
    int got_input; /* plaintext: a byte arrived (else a reset hints at a TLS port) */
    outbox__tls *tls; /* the TLS session while connected */

    pending *ring;
    size_t ring_cap; /* a power of two */
    size_t ring_head;
    size_t ring_count;
    int hs_remaining;

    char errstr[256];

    outbox__redis_push_cb push_cb; /* pub/sub messages, see is_push() */
    void *push_data;

    /* The stall watch (conn.c): while commands wait for replies on a TCP
     * connection, a look at its socket every few hundred ms; while the
     * peer acknowledges none of the bytes sent, a probe connect to the same
     * address (NULL when none). */
    uv_timer_t stall_timer; /* also the connects' redial ticks while connecting (conn.c) */
    struct stall_probe *probe;
    struct redial *redials[4]; /* connects to dial_addr started again (conn.c, MAX_REDIALS) */
    int nredials;
    struct sockaddr_storage dial_addr;
    uint64_t last_rx;    /* loop ms of the last bytes read */
    size_t nblocking;    /* pending commands that may wait in the server */
    uint64_t head_since; /* loop ms the oldest pending command became the oldest */
    uint64_t stall_quiet;  /* the silence the watch's PING was sent for (since then) */
    uint64_t stall_nudged; /* loop ms that PING was queued; 0: none */
};

/* ---- redis.c ------------------------------------------------------------- */

void outbox__redis_set_err(outbox__redis *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Every entry from libuv runs between these two; outbox__redis_leave()
 * returns 1 if the object was freed. */
void outbox__redis_enter(outbox__redis *r);
int outbox__redis_leave(outbox__redis *r);
void outbox__redis_close_stream(outbox__redis *r);
void outbox__redis_fail_conn(outbox__redis *r, int status);
void outbox__redis_fail_soon(outbox__redis *r, int status);
pending outbox__redis_ring_pop(outbox__redis *r);
void outbox__redis_call_reply(outbox__redis *r, const pending *p, int status, redisReply *reply);
int outbox__redis_queue_argv(outbox__redis *r, int argc, const char **argv, const size_t *argvlen,
                             uint64_t timeout_ms, outbox__redis_reply_cb cb, void *data, int kind);
/* Queues a formatted command of the connection's own (kind not K_USER: no
 * callback, no deadline). 0 or OUTBOX_ENOMEM. */
int outbox__redis_queue_raw(outbox__redis *r, const char *cmd, size_t len, int kind);
void outbox__redis_arm_timer(outbox__redis *r, uint64_t deadline);
void outbox__redis_stop_timer(outbox__redis *r);
void outbox__redis_on_timer(uv_timer_t *t);

/* ---- redis_conn.c -------------------------------------------------------- */

void outbox__redis_conn_handshake_reply(outbox__redis *r, const pending *p, redisReply *reply);
void outbox__redis_conn_tls_step(outbox__redis *r);
/* Starts the stall watch, if not running, on a connected TCP connection
 * (a command was queued); stop ends it and closes its probe. */
void outbox__redis_conn_stall_watch(outbox__redis *r);
void outbox__redis_conn_stall_stop(outbox__redis *r);

/* ---- redis_io.c ---------------------------------------------------------- */

extern redisReplyObjectFunctions outbox__redis_io_reader_fns;
int outbox__redis_io_obuf_reserve(outbox__redis *r, size_t extra);
void outbox__redis_io_schedule_flush(outbox__redis *r);
void outbox__redis_io_flush(outbox__redis *r);
void outbox__redis_io_fail_tls(outbox__redis *r);
void outbox__redis_io_on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
void outbox__redis_io_on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);

#endif
