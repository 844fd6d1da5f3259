/*
 * http_int.h: what the files of the HTTP server share (internal; the
 * contract is http.h).
 *
 *   http.c       the server: listening, the accept policy (the connection
 *                table, which connection a newcomer closes, the bound per
 *                client, accepts per loop turn), the deadlines, closing
 *   http_conn.c  one connection's bytes: reading (through TLS when
 *                configured), the request head, the answers, and parsing
 *                (outbox__http_parse_head, outbox__http_parse_listen)
 *   http_auth.c  Basic authentication: a password is checked against its
 *                bcrypt hash on a libuv worker thread, one check at a time,
 *                and the result kept in a small cache
 *
 * Calls run http.c -> http_conn.c -> http_auth.c, and back up only through
 * the functions declared here. Everything runs on the loop thread except a
 * password check's crypt_rn.
 */
#ifndef OUTBOX_SRC_HTTP_INT_H
#define OUTBOX_SRC_HTTP_INT_H

#include <http_parser.h>
#include <netinet/in.h>

#include "ops/http.h"
#include "tls/tls.h"

#define OUTBOX__HTTP_HEAD_MAX 8192

/* Where a connection is. Only CONN_IDLE and CONN_HEAD may be closed for a
 * newcomer; the others have a complete request and their own deadline. */
enum conn_phase {
    CONN_IDLE,    /* accepted, nothing received */
    CONN_HEAD,    /* receiving the head (or the TLS handshake) */
    CONN_AUTH,    /* waiting for its password check */
    CONN_HANDLER, /* waiting for the handler's answer */
    CONN_WRITING  /* its answer is being written */
};

/* The client's address, the port left out: what the bound per client
 * counts by. */
typedef struct http_peer {
    int family;
    unsigned char addr[16];
} http_peer;

/* Basic authentication's state (http_auth.c). */
#define OUTBOX__HTTP_AUTH_CACHE 64
typedef struct http_auth_entry {
    unsigned char key[32]; /* HMAC-SHA256 of the Authorization value */
    int used, ok;
    uint64_t stamp; /* for least recently used */
} http_auth_entry;

struct http_auth_job;
typedef struct http_auth {
    unsigned char hmac_key[32]; /* random per server: the cache holds no password-derived value usable elsewhere */
    http_auth_entry cache[OUTBOX__HTTP_AUTH_CACHE];
    uint64_t clock;
    struct http_auth_job *running;   /* the one check in progress */
    struct outbox__http_req *queue, *queue_tail; /* waiting for a check, in arrival order */
    unsigned queued;
    uint64_t last_warn_ms;
    unsigned failed_since_warn;
} http_auth;

struct outbox__http {
    uv_loop_t *loop;
    uv_tcp_t listener;
    uv_check_t turn; /* after each turn with accepts: the count reset, a held accept taken */
    outbox__http_handler handler;
    void *data;
    const outbox__logger *log;
    const outbox__web_config *web;
    outbox__http_limits lim;
    /* Open connections, oldest first (accept order). */
    struct outbox__http_req *oldest, *newest;
    unsigned nconns;            /* in the list, closing ones included */
    unsigned nlive;             /* not closing: what the table's bound counts */
    unsigned accepted_this_turn;
    int held;    /* an accept left for the check callback */
    int closing, handles;
    uint64_t last_full_warn_ms, last_emfile_warn_ms;
    unsigned evicted_since_warn;
    http_auth auth;
    char slab[16384]; /* what a read lands in (http_conn.c) */
    void (*close_cb)(void *);
    void *close_data;
};

/* http-parser's state for one head, fed as the bytes come, so that each
 * byte is parsed once however the client splits them (http_conn.c). */
typedef struct http_parse {
    http_parser p;
    outbox__http_head *h;
    int complete, in_field, value_is_auth, field_over;
    char field[16]; /* the current header's name, enough for "Authorization" */
    size_t field_len;
} http_parse;

/* One connection, one request. */
struct outbox__http_req {
    outbox__http *srv;
    struct outbox__http_req *older, *newer; /* the server's list */
    struct outbox__http_req *auth_next;     /* the password queue */
    uv_tcp_t tcp;
    uv_timer_t timer;
    http_peer peer;
    enum conn_phase phase;
    outbox__tls *tls; /* made once the client's hello is complete; NULL before and for plaintext */
    unsigned char *hello; /* TLS: the client's first record, gathered before any TLS state exists */
    size_t hello_len, hello_need;
    int tls_up;       /* handshake done */
    int tls_answered; /* the client's hello was complete and answered */
    int closing, handles, writes, responded, head_only, eof;
    unsigned char auth_key[32];
    size_t head_len; /* bytes of the head received (after TLS) */
    http_parse parse;
    outbox__http_head req;
};

/* http.c */
/* Closes a connection (idempotent); freed once its handles closed and
 * nothing refers to it. */
void outbox__http_conn_close(struct outbox__http_req *c);
/* Frees c if nothing refers to it any more. */
void outbox__http_conn_free_if_done(struct outbox__http_req *c);
/* Restarts c's deadline for its new phase. */
void outbox__http_conn_phase(struct outbox__http_req *c, enum conn_phase p);
/* A warning at most every 30 s per kind (*last is its last time). */
int outbox__http_warn_due(outbox__http *h, uint64_t *last);
/* Frees a closing server once nothing is left (a password check ended). */
void outbox__http_srv_maybe_free(outbox__http *h);

/* http_conn.c */
/* Starts reading a connection just accepted, and reads what already came. */
void outbox__http_conn_start(struct outbox__http_req *c);
/* The answer: status line, extra header lines (may be NULL), then the
 * usual ones and the body; c closes once it is written. */
void outbox__http_conn_send(struct outbox__http_req *c, int status, const char *extra, const char *ctype,
                            const char *body, size_t len);
/* An error answer with a plain text body saying msg. */
void outbox__http_conn_error(struct outbox__http_req *c, int status, const char *msg);
/* Hands an accepted request to the owner's handler. */
void outbox__http_conn_dispatch(struct outbox__http_req *c);

/* http_auth.c */
void outbox__http_auth_init(outbox__http *h);
/* With users configured: checks c's Authorization. Answers 401 (or 503
 * when too many checks wait), dispatches, or queues c for a check. */
void outbox__http_auth_request(struct outbox__http_req *c);
/* c closes: leaves the queue if it waits there. */
void outbox__http_auth_forget(struct outbox__http_req *c);
/* 1 while a check runs on a worker thread (the server's free waits). */
int outbox__http_auth_busy(const outbox__http *h);

#endif
