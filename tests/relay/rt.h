/*
 * rt.h: what the relay integration tests share on top of harness.h: outbox
 * databases in temp dirs, rows written by plain SQL, reading a whole stream
 * back, an id -> count map for "every committed id at least once" checks,
 * and running the outbox-relay daemon.
 *
 * Nothing here prints TAP results (tap.h's counters are per file): helpers
 * return numbers, the tests make the checks. Setup failures bail out.
 */
#ifndef OUTBOX_TESTS_RELAY_RT_H
#define OUTBOX_TESTS_RELAY_RT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <hiredis/hiredis.h>
#include <sqlite3.h>
#include <uv.h>

#include "harness.h"
#include "outbox.h"

/* What most tests start with: a redis-server on a Unix socket (the whole
 * test is skipped without one), a temp dir with app.db (the outbox schema),
 * a writer connection to it and a Redis client. rt_world_end closes and
 * frees all of it (the test still ends with its own tap_done(): the TAP
 * counters are per file). */
void rt_world_start(th_redis *srv, char **dir, char **dbpath, sqlite3 **db, redisContext **c);
void rt_world_end(th_redis *srv, char *dir, char *dbpath, sqlite3 *db, redisContext *c);

/* Runs loop until fn(arg) holds, or timeout_ms (times th_slow()) passed, a
 * 5 ms timer keeping it turning; 1 if it held. */
int rt_run_until(uv_loop_t *loop, int timeout_ms, int (*fn)(void *), void *arg);

/* A group's stop (or drain) callback that sets the int flag points to, and
 * the predicate for rt_run_until that reads it. */
void rt_group_flag(outbox_relay_group *g, void *flag);
int rt_flag(void *flag);

/* Creates <dir>/<name> with the outbox schema; returns the malloc'd path. */
char *rt_make_db(const char *dir, const char *name);
/* A writer-style connection (busy_timeout 5000 ms); bails on error. */
sqlite3 *rt_open(const char *path);
/* Unix milliseconds, the clock of created_at / available_at / lease_until. */
int64_t rt_unix_ms(void);

/* Inserts n rows by plain SQL in one transaction: id "<prefix>-<i>" with i
 * from first to first+n-1 (zero-padded to 6 digits), the topic, key
 * "k<i % nkeys>" (NULL when nkeys is 0) and a small payload naming the id. */
void rt_insert_rows(sqlite3 *db, const char *prefix, int first, int n, const char *topic, int nkeys);
/* The same inside a transaction the caller holds (e.g. BEGIN IMMEDIATE,
 * to keep the write lock from the relay while the rows go in). */
void rt_insert_rows_in_txn(sqlite3 *db, const char *prefix, int first, int n, const char *topic, int nkeys);
/* <dir>/<name> made with the outbox schema and rt_insert_rows' rows,
 * closed (its -wal and -shm go with its last connection); the malloc'd
 * path. */
char *rt_make_db_rows(const char *dir, const char *name, const char *prefix, int first, int n, const char *topic,
                      int nkeys);

/* One stream entry. */
typedef struct rt_entry {
    char eid[48];   /* the stream entry id */
    char *id;       /* field "id", NULL if missing */
    char *env;      /* field "envelope", NULL if missing */
    size_t envlen;
    int nfields;    /* fields in the entry (pairs) */
    int id_first;   /* the first field is "id" */
} rt_entry;

typedef struct rt_stream {
    rt_entry *e;
    size_t n;
} rt_stream;

/* Reads a whole stream with paged XRANGE (on the client's selected db);
 * an absent key reads as empty. Bails on a Redis error. */
rt_stream rt_stream_read(redisContext *c, const char *stream);
void rt_stream_free(rt_stream *s);

/* A string -> (count, value) hash map. */
typedef struct rt_map rt_map;
rt_map *rt_map_new(void);
void rt_map_free(rt_map *m);
/* Adds 1 to the key's count (creating it with value v); returns the new count. */
int rt_map_add(rt_map *m, const char *key, int64_t v);
/* Sets the key's value (creating it with count 0). */
void rt_map_set(rt_map *m, const char *key, int64_t v);
/* The count of key (0 if absent); *v (may be NULL) gets its value. */
int rt_map_get(const rt_map *m, const char *key, int64_t *v);
size_t rt_map_size(const rt_map *m);

/*
 * Compares a database's rows of `topic` (every committed row) with the
 * entries of its stream. Counts: rows not dead (state 3) with no entry
 * (missing), dead rows (dead), entries with no row (foreign), entries beyond the first per id (dups), rows not in
 * state 2 (unpublished), and keyed messages whose first appearance in the
 * stream comes before that of an earlier (lower seq) message of the same
 * key (order_violations). Prints up to a few examples as diagnostics.
 */
typedef struct rt_audit {
    long rows, entries, missing, foreign, dups, unpublished, dead, order_violations;
} rt_audit;
rt_audit rt_audit_topic(sqlite3 *db, redisContext *c, const char *prefix, const char *topic);

/* The daemon: argv built from db, url and extra "--flag", "value" pairs up
 * to a NULL. rt_relay_spawn starts it with th_spawn, stderr (and stdout)
 * appended to err_path, and bails if it cannot start. */
pid_t rt_relay_spawn(const char *err_path, const char *db, const char *url, ...);
/* Runs it to completion (e.g. with --drain); returns the exit status as
 * th_run; *err (may be NULL) gets stderr. */
int rt_relay_run(int timeout_ms, char **err, const char *db, const char *url, ...);

/* Clients of c's server blocked on a command (CLIENT LIST flag b): with
 * CLIENT PAUSE ... WRITE in force, the relay's XADDs waiting in Redis (the
 * relay still had rows to send when Redis was paused). -1 on error. */
int rt_blocked_clients(redisContext *c);
/* Polls rt_blocked_clients until it is above 0; 1, or 0 after timeout_ms. */
int rt_wait_blocked(redisContext *c, int timeout_ms);

/* Occurrences of needle in text. */
int rt_count_substr(const char *text, const char *needle);

#endif
