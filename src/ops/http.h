/*
 * http.h: a small HTTP/1.1 server on the owner's own loop (internal), for
 * /metrics and /healthz of the relay and of outbox-consume. Requests are
 * parsed with Debian's http-parser.
 *
 * Defensive by construction, so that a crowd of slow, idle or hostile
 * clients cannot lock out the probes that orchestrators and monitoring send
 * (outbox__http_limits gives the numbers):
 * - a connection must send its first byte within idle_ms and its whole
 *   request head (a TLS handshake included) within head_ms of that first
 *   byte: a deadline for the head, not reset by each byte, so trickling
 *   does not keep a slot (408, or a close when nothing usable came);
 * - at most max_conns connections; a newcomer is never refused while an
 *   older connection is still waiting for its head: when the table is full
 *   the oldest connection that has not completed its head and has nothing
 *   unread in its socket is closed instead (a probe that sent its request
 *   is never the one closed);
 * - one client (an IP address) holds at most per_client connections: its
 *   next one closes its own oldest unfinished one;
 * - at most accepts_per_turn accepts per loop turn, so that a flood of
 *   connections takes turns with everything else the loop does;
 * - request head at most 8 KiB (431), no request bodies (413), only GET and
 *   HEAD (405), malformed requests (400); one request per connection, every
 *   response with "Connection: close"; writing the answer must end within
 *   answer_ms.
 * With a web configuration (web_config.h): TLS (plaintext is closed without
 * an answer) and Basic authentication against bcrypt hashes (401 with
 * WWW-Authenticate), verified on a libuv worker thread, one at a time, with
 * a cache of recent results (http_int.h).
 *
 * The handler runs on the loop thread and answers at once or later
 * (outbox__http_respond), so a slow answer never blocks the loop.
 */
#ifndef OUTBOX_SRC_HTTP_H
#define OUTBOX_SRC_HTTP_H

#include <stdint.h>
#include <sys/socket.h>
#include <uv.h>

#include "util/util.h"
#include "ops/web_config.h"

typedef struct outbox__http outbox__http;
typedef struct outbox__http_req outbox__http_req;

/* Called for each well-formed (and, with basic_auth_users, authenticated)
 * GET/HEAD request; must eventually call outbox__http_respond(req, ...)
 * exactly once (now or later). If the client goes away first, respond still
 * must be called (it then only frees). */
typedef void (*outbox__http_handler)(void *data, outbox__http_req *req, const char *path);

/* The accept policy's numbers; outbox__http_limits_default() gives those
 * README.md ("Metrics and health") documents. */
typedef struct outbox__http_limits {
    unsigned max_conns;        /* 256, or fewer for a low open files limit (see outbox__http_start) */
    unsigned per_client;       /* 32 connections per IP address */
    unsigned accepts_per_turn; /* 64 */
    uint64_t idle_ms;          /* 5000: the first byte within this of the accept */
    uint64_t head_ms;          /* 5000: the whole head within this of its first byte */
    uint64_t answer_ms;        /* 10000: the answer written within this of the head */
} outbox__http_limits;

void outbox__http_limits_default(outbox__http_limits *l);

/*
 * Parses "HOST:PORT" ("127.0.0.1:9090", "[::1]:9090", ":9090" for all
 * addresses) and starts listening. web (may be NULL: plain HTTP, no
 * authentication) and log are borrowed and must outlive the server; lim
 * NULL means the defaults. max_conns is lowered to a quarter of the
 * process' open files limit (RLIMIT_NOFILE), and to 32 less than what the
 * descriptors open at start leave free, so that the endpoint cannot take
 * the descriptors the rest of the process needs. Returns 0,
 * OUTBOX_EINVAL (err says why), OUTBOX_EIO (bind/listen failed, err says
 * why), OUTBOX_ENOMEM.
 */
int outbox__http_start(outbox__http **out, uv_loop_t *loop, const char *listen, const outbox__web_config *web,
                       const outbox__http_limits *lim, outbox__http_handler handler, void *data,
                       const outbox__logger *log, char *err, size_t errlen);

/* Sends status, content type and body (copied) and closes the connection. */
void outbox__http_respond(outbox__http_req *req, int status, const char *content_type, const char *body,
                          size_t len);

/* Stops listening, closes every connection; cb runs when all handles are
 * closed and no password check runs any more (requests still waiting for a
 * response are answered then freed when respond is called; the handler
 * must not be called any more). */
void outbox__http_close(outbox__http *h, void (*cb)(void *data), void *data);

/* The limits in force (max_conns as lowered at start). */
const outbox__http_limits *outbox__http_limits_of(const outbox__http *h);

/* The parsed head of one request (also what the fuzzer exercises). */
#define OUTBOX_HTTP_PATH_MAX 1024
#define OUTBOX_HTTP_AUTH_MAX 1024
typedef struct outbox__http_head {
    char path[OUTBOX_HTTP_PATH_MAX + 1]; /* without the query string */
    size_t path_len;
    int path_too_long, method_get, method_head;
    /* The Authorization header's value, if one came. */
    char auth[OUTBOX_HTTP_AUTH_MAX + 1];
    size_t auth_len;
    int auth_count, auth_too_long;
    const char *error; /* the parser's error name for a 400 */
} outbox__http_head;

/* Parses the bytes received so far (at most 8 KiB). Returns 0 while the
 * head is incomplete, 200 for a GET/HEAD request to route, or the error
 * status to answer: 400 malformed (also two Authorization headers), 405
 * method, 413 body, 414 target too long, 431 head (or an Authorization
 * header) too large. */
int outbox__http_parse_head(const char *buf, size_t len, outbox__http_head *out);

/* Checks a listen address without binding (for configuration checks). */
int outbox__http_parse_listen(const char *listen, struct sockaddr_storage *ss, char *err, size_t errlen);

#endif
