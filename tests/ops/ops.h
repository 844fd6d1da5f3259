/*
 * ops.h: what the operations tests (idempotent publishing, /metrics,
 * /healthz, the HTTP server's defences, retention, settings) share on top of
 * harness.h and the relay tests' helpers (relay/rt.h: databases in temp
 * dirs, rows by plain SQL, reading a stream back, the outbox-relay daemon
 * started by pid): a raw HTTP client over plain sockets and a Prometheus
 * text parser. Nothing here prints TAP results.
 */
#ifndef OUTBOX_TESTS_OPS_OPS_H
#define OUTBOX_TESTS_OPS_OPS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <hiredis/hiredis.h>
#include <sqlite3.h>

#include "relay/rt.h"

/* One HTTP exchange over a plain socket to 127.0.0.1:port: sends req (len
 * bytes), reads until the server closes or timeout_ms. Returns the status
 * code of the reply, 0 when the server closed without a reply, -1 on a
 * connect error or timeout. *resp (may be NULL) gets the raw reply. */
int ot_http_raw(int port, const char *req, size_t len, char **resp, int timeout_ms);
/* A TCP socket connected to 127.0.0.1:port from the address from
 * ("127.0.0.2": every 127.0.0.x is on lo, so each may play another client),
 * blocking unless nonblock (then the connect may still be in progress).
 * Bails on an error. */
int ot_connect(int port, const char *from, int nonblock);
/* GET (or HEAD when head) path; *body (may be NULL) gets the body. */
int ot_http_get(int port, const char *path, char **body);
/* The body of a raw reply (after the blank line), or NULL. */
const char *ot_http_body(const char *resp);
/* The value of a header in a raw reply (malloc'd) or NULL. */
char *ot_http_header(const char *resp, const char *name);

/* Checks Prometheus text format: every line a comment, empty, or
 * "name value" / "name{labels} value" with a valid name, well-formed
 * labels and a number. Returns 0, or the 1-based number of the first bad
 * line (why in *why). */
int ot_prom_check(const char *text, const char **why);
/* The value of the sample whose "name{labels}" part is exactly series;
 * returns 1 if found. */
int ot_prom_get(const char *text, const char *series, double *v);
/* The value of series, or -1 when text is NULL or has no such sample. */
double ot_prom_val(const char *text, const char *series);
/* The sum over samples named name (any labels); count in *n (may be NULL).
 * A NULL text has no samples. */
double ot_prom_sum(const char *text, const char *name, int *n);

/* Holding a draining relay, whatever its speed (ops tests that must look
 * at it mid-drain). ot_redis_pause holds Redis's writes (CLIENT PAUSE ms
 * WRITE: the relay's XADDs wait in Redis while it keeps its claims; a
 * pause ends by itself after ms, keep it below the relay's reply timeout),
 * ms 0 lets them go (CLIENT UNPAUSE); bails on an error reply.
 * ot_wait_gauges polls the relay's /metrics (plain socket, 1 ms naps)
 * until outbox_awaiting_replies is above 0 (want_sent: XADDs wait in
 * Redis) or at 0 with outbox_inflight above 0 (replies in, marks still to
 * write: with the test holding the write lock, the relay can neither mark
 * nor claim, so its progress is bounded by its --inflight); 1, or 0 with a
 * diagnostic once deadline (th_now_ms) passed. */
void ot_redis_pause(redisContext *c, int ms);
int ot_wait_gauges(int port, int want_sent, int64_t deadline);

#endif
