/*
 * ct.h: what the consumer-side tests share on top of harness.h: stream
 * entries written by hand (a valid envelope, with or without the database's
 * name, or anything else), looking at
 * consumer groups and dedup keys, effect files written by
 * `outbox-consume --exec`, running the tool, and driving a uv loop until a
 * condition holds.
 *
 * Nothing here prints TAP results (tap.h's counters are per file): helpers
 * return values, the tests make the checks. Setup failures bail out.
 */
#ifndef OUTBOX_TESTS_CONSUMER_CT_H
#define OUTBOX_TESTS_CONSUMER_CT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <hiredis/hiredis.h>
#include <uv.h>

/* Encodes a version 1 envelope (created_at now) into a malloc'd buffer. */
char *ct_envelope(const char *id, const char *topic, const void *payload, size_t payload_len, size_t *len);

/* The same with the database's name db in the envelope (NULL: none). */
char *ct_envelope_db(const char *id, const char *topic, const char *db, const void *payload, size_t payload_len,
                     size_t *len);

/* XADD stream * id <id> envelope <a valid envelope of id, topic, payload>;
 * the new entry id goes to eid (at least 48 bytes; may be NULL). */
void ct_xadd_msg(redisContext *c, const char *stream, const char *id, const char *topic, const void *payload,
                 size_t payload_len, char *eid);
/* The same with a db field <field_db> between id and envelope and the
 * envelope's db <env_db> (each NULL: none). A relay that names its database
 * writes both, the same. */
void ct_xadd_db_msg(redisContext *c, const char *stream, const char *field_db, const char *env_db, const char *id,
                    const char *topic, const void *payload, size_t payload_len, char *eid);
/* XADD stream * with nfields field/value pairs given as (name, value,
 * value_len) triples; eid as above. */
void ct_xadd_fields(redisContext *c, const char *stream, char *eid, int nfields, ...);

/* XGROUP CREATE stream group 0 MKSTREAM (BUSYGROUP is fine). */
void ct_group_create(redisContext *c, const char *stream, const char *group);
/* Entries of the group not acknowledged yet (XPENDING summary); -1 if the
 * group does not exist. */
long long ct_pending(redisContext *c, const char *stream, const char *group);
/* Entries of the group pending for one consumer. */
long long ct_pending_for(redisContext *c, const char *stream, const char *group, const char *consumer);
/* Reads up to count new entries as `consumer` (XREADGROUP ... >) without
 * acknowledging them; returns how many it got. */
int ct_read_as(redisContext *c, const char *stream, const char *group, const char *consumer, int count);

/* GET key as a malloc'd string, NULL for nil. */
char *ct_get(redisContext *c, const char *key);
/* An integer reply of a command (printf-style); bails on another reply. */
long long ct_int(redisContext *c, const char *fmt, ...);

/* The count of lines of s equal to line (th_count_lines counts them all). */
int ct_line_count(const char *s, const char *line);

/* The outbox-consume binary (malloc'd once, kept). */
const char *ct_consume_bin(void);
/* Runs outbox-consume with args (NULL-terminated, without argv[0]) as
 * th_run does. */
int ct_consume_run(const char *const args[], char *const env_add[], char **out, char **err, int timeout_ms);
/* Starts outbox-consume in the background as th_spawn does (stop it with
 * th_stop). */
pid_t ct_consume_spawn(const char *const args[], char *const env_add[], const char *out_path, const char *err_path);

/* Runs the loop until *flag becomes non-zero or timeout_ms passes; returns
 * *flag. A repeating 5 ms timer keeps UV_RUN_ONCE from blocking for long. */
int ct_run_until(uv_loop_t *loop, volatile int *flag, int timeout_ms);
/* Runs the loop for ms milliseconds. */
void ct_run_for(uv_loop_t *loop, int ms);
/* Runs the loop until cond(arg) holds or timeout_ms passes. */
int ct_run_until_cond(uv_loop_t *loop, int (*cond)(void *arg), void *arg, int timeout_ms);
/* Runs the loop until nothing is left on it (at most timeout_ms) and
 * returns uv_loop_close(): 0, or UV_EBUSY with each handle still open
 * printed as a diagnostic. Closes nothing itself. */
int ct_loop_finish(uv_loop_t *loop, int timeout_ms);

#endif
