/*
 * http.h: a small HTTP/1.1 server on the relay's own loop (internal), for
 * /metrics and /healthz. Requests are parsed with Debian's http-parser.
 *
 * Defensive by construction: at most `max_conns` connections (more are
 * closed at once), request head at most 8 KiB (431), no request bodies
 * (413), only GET and HEAD (405), malformed requests (400), an idle or slow
 * client is dropped after `idle_timeout_ms`. One request per connection:
 * every response carries "Connection: close". The handler runs on the loop
 * thread and answers at once or later (outbox__http_respond), so a slow
 * answer never blocks the loop.
 */
#ifndef OUTBOX_SRC_HTTP_H
#define OUTBOX_SRC_HTTP_H

#include <uv.h>
#include <sys/socket.h>

#include "util/util.h"

typedef struct outbox__http outbox__http;
typedef struct outbox__http_req outbox__http_req;

/* Called for each well-formed GET/HEAD request; must eventually call
 * outbox__http_respond(req, ...) exactly once (now or later). If the
 * client goes away first, respond still must be called (it then only frees). */
typedef void (*outbox__http_handler)(void *data, outbox__http_req *req, const char *path);

/* Parses "HOST:PORT" ("127.0.0.1:9090", "[::1]:9090", ":9090" for all
 * addresses) and starts listening. Returns 0, OUTBOX_EINVAL (err says why),
 * OUTBOX_EIO (bind/listen failed, err says why), OUTBOX_ENOMEM. */
int outbox__http_start(outbox__http **out, uv_loop_t *loop, const char *listen, outbox__http_handler handler,
                       void *data, const outbox__logger *log, char *err, size_t errlen);

/* Sends status, content type and body (copied) and closes the connection. */
void outbox__http_respond(outbox__http_req *req, int status, const char *content_type, const char *body,
                          size_t len);

/* Stops listening, closes every connection; cb runs when all handles are
 * closed (requests still waiting for a response are answered then freed
 * when respond is called; the handler must not be called any more). */
void outbox__http_close(outbox__http *h, void (*cb)(void *data), void *data);

/* The parsed head of one request (also what the fuzzer exercises). */
#define OUTBOX_HTTP_PATH_MAX 1024
typedef struct outbox__http_head {
    char path[OUTBOX_HTTP_PATH_MAX + 1]; /* without the query string */
    size_t path_len;
    int path_too_long, method_get, method_head;
    const char *error; /* the parser's error name for a 400 */
} outbox__http_head;

/* Parses the bytes received so far (at most 8 KiB). Returns 0 while the
 * head is incomplete, 200 for a GET/HEAD request to route, or the error
 * status to answer: 400 malformed, 405 method, 413 body, 414 target too
 * long, 431 head too large. */
int outbox__http_parse_head(const char *buf, size_t len, outbox__http_head *out);

/* Checks a listen address without binding (for configuration checks). */
int outbox__http_parse_listen(const char *listen, struct sockaddr_storage *ss, char *err, size_t errlen);

#endif
