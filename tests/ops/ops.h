/*
 * ops.h: what the operations tests (idempotent publishing, /metrics,
 * /healthz, the HTTP server's defences, retention, settings) share on top of
 * harness.h: outbox databases in a temp dir, rows by plain SQL, reading a
 * stream back, the outbox-relay daemon started and stopped by pid, a raw
 * HTTP client over plain sockets and a Prometheus text parser.
 *
 * Every child started here and every temp dir made here is recorded; an
 * atexit handler kills the children (by pid) and removes the dirs, so a
 * test that bails out leaves nothing behind. Nothing here prints TAP
 * results; setup failures bail out.
 */
#ifndef OUTBOX_TESTS_OPS_OPS_H
#define OUTBOX_TESTS_OPS_OPS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <hiredis/hiredis.h>
#include <sqlite3.h>

/* A temp dir removed at exit (and by ot_rmdir). */
char *ot_tmpdir(void);
/* Removes a dir made by ot_tmpdir now and frees the path. */
void ot_rmdir(char *dir);

/* <dir>/<name> with the outbox schema; malloc'd path. */
char *ot_make_db(const char *dir, const char *name);
/* A writer-style connection (busy_timeout 5000 ms). */
sqlite3 *ot_open(const char *path);
/* n rows "<prefix>-<i>" (i from first), topic, no key, in one transaction. */
void ot_insert(sqlite3 *db, const char *prefix, int first, int n, const char *topic);
/* Unix ms, the clock of the outbox columns. */
int64_t ot_unix_ms(void);
/* 10 under the valgrind test setup (OUTBOX_UNDER_VALGRIND), else 1: time
 * bounds that wait for the daemon are multiplied by it. */
int ot_slow(void);

/* Reads a whole stream (XRANGE paged). ids[i] is the entry's "id" field
 * (malloc'd; "" when missing), eids[i] the entry id. */
typedef struct ot_stream {
    char **ids, **eids;
    size_t n;
} ot_stream;
ot_stream ot_stream_read(redisContext *c, const char *stream);
void ot_stream_free(ot_stream *s);

/* outbox-relay --db db --redis url plus the given args up to NULL, stdout
 * and stderr appended to log; tracked for clean-up. */
pid_t ot_relay_spawn(const char *log, const char *db, const char *url, ...);
/* Same, run to completion within timeout_ms; *err gets stderr. */
int ot_relay_run(int timeout_ms, char **err, const char *db, const char *url, ...);
/* Sends sig, waits up to timeout_ms (then SIGKILL); returns the status as
 * th_wait, -2 when it had to be killed. */
int ot_stop(pid_t pid, int sig, int timeout_ms);


/* One HTTP exchange over a plain socket to 127.0.0.1:port: sends req (len
 * bytes), reads until the server closes or timeout_ms. Returns the status
 * code of the reply, 0 when the server closed without a reply, -1 on a
 * connect error or timeout. *resp (may be NULL) gets the raw reply. */
int ot_http_raw(int port, const char *req, size_t len, char **resp, int timeout_ms);
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
/* The sum over samples named name (any labels); count in *n (may be NULL). */
double ot_prom_sum(const char *text, const char *name, int *n);

int ot_count(const char *text, const char *needle);
void ot_diag_tail(const char *what, const char *text, int max_lines);

#endif
