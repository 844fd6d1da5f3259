/*
 * db.c: the relay's own database connection: opening it (the schema checked,
 * an older one migrated), its prepared statements (SQL in sql.h), and the
 * step helpers that map SQLite's codes to OUTBOX_E* while keeping the raw
 * code for the busy retry (r->db.last_rc).
 */
#include <errno.h>
#include <stddef.h>
#include <stdio.h>

#include "relay_int.h"
#include "sql.h"
#include "store/sqlite_util.h"

static const struct {
    size_t off;
    const char *sql;
} statements[] = {
#define STMT(field, sql) {offsetof(outbox_relay, db.field), sql}
    /* The claim's walks (claim.c): columns as add_cand reads them. */
    STMT(q_new, OUTBOX__SQL_NEW),
    STMT(q_cursor, OUTBOX__SQL_CURSOR),
    STMT(q_cursor_set, OUTBOX__SQL_CURSOR_SET),
    STMT(q_top, "SELECT max(seq) FROM outbox"),
    STMT(q_stray, OUTBOX__SQL_STRAY),
    STMT(q_due, OUTBOX__SQL_DUE),
    STMT(q_expired, OUTBOX__SQL_EXPIRED),
    STMT(q_key_prev, OUTBOX__SQL_KEY_PREV),
    STMT(q_key_any, OUTBOX__SQL_KEY_ANY),
    STMT(q_defer, OUTBOX__SQL_DEFER),
    STMT(q_claim, OUTBOX__SQL_CLAIM),
    /* Batch leases (claim.c, marks.c). */
    STMT(q_batch_new, OUTBOX__SQL_BATCH_NEW),
    STMT(q_batch_rows, OUTBOX__SQL_BATCH_ROWS),
    STMT(q_batch_cands, OUTBOX__SQL_BATCH_CANDS),
    STMT(q_batch_expired, OUTBOX__SQL_BATCH_EXPIRED),
    STMT(q_batch_take, OUTBOX__SQL_BATCH_TAKE),
    STMT(q_batch_drop, OUTBOX__SQL_BATCH_DROP),
    STMT(q_batch_leased, OUTBOX__SQL_BATCH_LEASED),
    STMT(q_batch_keys, OUTBOX__SQL_BATCH_KEYS),
    STMT(q_batch_leave, OUTBOX__SQL_BATCH_LEAVE),
    STMT(q_batch_published, OUTBOX__SQL_BATCH_PUBLISHED),
    STMT(q_batch_failed, OUTBOX__SQL_BATCH_FAILED),
    STMT(q_batch_release, OUTBOX__SQL_BATCH_RELEASE),
    STMT(q_batch_row_published, OUTBOX__SQL_BATCH_ROW_PUBLISHED),
    /* Marks (marks.c). */
    STMT(q_published, OUTBOX__SQL_PUBLISHED),
    STMT(q_failed, OUTBOX__SQL_FAILED),
    STMT(q_release, OUTBOX__SQL_RELEASE),
    /* A unit's transaction (sched.c): prepared once, not parsed per unit. */
    STMT(q_begin, "BEGIN IMMEDIATE"),
    STMT(q_commit, "COMMIT"),
    /* Scheduling, wake-ups (retention has a connection of its own). */
    STMT(q_data_version, "PRAGMA data_version"),
    STMT(q_next_due, OUTBOX__SQL_NEXT_DUE),
    STMT(q_next_lease, OUTBOX__SQL_NEXT_LEASE),
    STMT(q_drain, OUTBOX__SQL_DRAIN),
    STMT(q_plan, OUTBOX__SQL_PLAN),
#undef STMT
};

static sqlite3_stmt **stmt_at(outbox_relay *r, size_t i)
{
    return (sqlite3_stmt **)(void *)((char *)r + statements[i].off);
}

sqlite3_stmt *outbox__relay_q(outbox_relay *r, size_t off)
{
    for (size_t i = 0; i < OUTBOX_ARRAY_LEN(statements); i++)
        if (statements[i].off == off) {
            sqlite3_stmt **st = stmt_at(r, i);
            /* A failure leaves it NULL: stepping NULL is SQLITE_MISUSE, an
             * error of the unit like any other, tried again later. */
            if (!*st && r->db.conn)
                sqlite3_prepare_v3(r->db.conn, statements[i].sql, -1, SQLITE_PREPARE_PERSISTENT, st, NULL);
            return *st;
        }
    return NULL;
}

void outbox__relay_db_no_close_ckpt(const outbox_relay *r, sqlite3 *conn)
{
    /* A group's databases open and close as they have work: a checkpoint
     * (and its fsync) at every close would cost more than the work. The
     * WAL keeps what it holds; the next checkpoint folds it in. */
    if (r->redis.shared && conn)
        sqlite3_db_config(conn, SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1, (int *)NULL);
}

int outbox__relay_sqlerr(outbox_relay *r, int rc)
{
    int e = outbox__sqlite_code(rc);
    if (e != 0)
        r->db.last_rc = rc;
    return e;
}

int outbox__relay_step_int(outbox_relay *r, sqlite3_stmt *st, int64_t dflt, int64_t *v)
{
    int rc = sqlite3_step(st);
    *v = rc == SQLITE_ROW && sqlite3_column_type(st, 0) != SQLITE_NULL ? sqlite3_column_int64(st, 0) : dflt;
    sqlite3_reset(st);
    return rc == SQLITE_ROW || rc == SQLITE_DONE ? 0 : outbox__relay_sqlerr(r, rc);
}

int outbox__relay_step_done(outbox_relay *r, sqlite3_stmt *st)
{
    int rc = sqlite3_step(st);
    sqlite3_reset(st);
    return rc == SQLITE_DONE || rc == SQLITE_ROW ? 0 : outbox__relay_sqlerr(r, rc);
}

int outbox__relay_db_prepare(outbox_relay *r, char *err, size_t errlen)
{
    size_t i;
    int rc;
    /* A group's relay prepares each statement when first used (Q): a
     * database with a few rows to publish uses a third of them, and
     * preparing all was half the cost of opening one. */
    if (r->redis.shared)
        return 0;
    for (i = 0; i < OUTBOX_ARRAY_LEN(statements); i++) {
        rc = sqlite3_prepare_v3(r->db.conn, statements[i].sql, -1, SQLITE_PREPARE_PERSISTENT, stmt_at(r, i), NULL);
        if (rc != SQLITE_OK)
            return outbox__errf(err, errlen, outbox__sqlite_code(rc), "cannot prepare a relay statement: %s",
                                sqlite3_errmsg(r->db.conn));
    }
    return 0;
}

int outbox__relay_db_open(outbox_relay *r, int wait_lock, outbox__sqlfail *f, char *err, size_t errlen)
{
    int e, tries;

    /* Reading the schema can meet a lock: another connection's migration,
     * or its WAL recovery after a process crashed mid-commit. That is no
     * reason to refuse to start: with wait_lock this waits for it, on the
     * calling thread, for up to 2 s (relay.h says so; readers never wait
     * for writers in WAL mode, so an ordinary writer does not make create
     * wait). */
    for (tries = 0;; tries++) {
        e = outbox__db_open_rc(r->cfg.db_path, OUTBOX_OPEN_RELAY, &r->db.conn, f, err, errlen);
        if (e == 0 && (e = outbox_schema_check(r->db.conn, err, errlen)) != 0)
            outbox__sqlfail_get(r->db.conn, f);
        if (e == OUTBOX_ENOSCHEMA) {
            int64_t v = 0;
            /* An older schema is migrated; a database without one is refused,
             * so that a mistyped path does not grow a fresh empty outbox. */
            int ve = outbox__sqlite_int(r->db.conn, "PRAGMA user_version", &v);
            if (ve != 0) {
                outbox__sqlfail_get(r->db.conn, f);
                e = outbox__errf(err, errlen, ve, "cannot read the schema version: %s", sqlite3_errmsg(r->db.conn));
            } else if (v > 0) {
                e = outbox__schema_apply_rc(r->db.conn, f, err, errlen);
            }
        }
        if (e != OUTBOX_EBUSY || !wait_lock || tries == 200)
            break;
        sqlite3_close_v2(r->db.conn);
        r->db.conn = NULL;
        sqlite3_sleep(10);
    }
    if (e == 0 && (e = outbox__relay_db_prepare(r, err, errlen)) != 0)
        outbox__sqlfail_get(r->db.conn, f);
    if (e != 0)
        return e;
    /* A drain touches more pages than the default cache holds (the due and
     * key indexes, the rows being claimed and those being marked). */
    sqlite3_exec(r->db.conn, "PRAGMA cache_size=-16384", NULL, NULL, NULL);
    outbox__relay_db_no_close_ckpt(r, r->db.conn);
    return 0;
}

int outbox__relay_db_heals(int e, const outbox__sqlfail *f)
{
    if (e == OUTBOX_EBUSY)
        return 1;
    if (e != OUTBOX_EIO && e != OUTBOX_ESQLITE)
        return 0;
    switch (f->rc & 0xff) {
    case SQLITE_FULL:
    case SQLITE_IOERR:
    case SQLITE_BUSY:
    case SQLITE_LOCKED:
        return 1;
    case SQLITE_CANTOPEN:
        /* A -wal or -shm file that cannot be created for want of space or
         * of file descriptors; not a missing directory or a permission,
         * which an operator has to fix (and READONLY says so too). */
        return f->sys == ENOSPC || f->sys == EDQUOT || f->sys == EMFILE || f->sys == ENFILE || f->sys == EIO;
    default:
        return 0;
    }
}

void outbox__relay_db_close(outbox_relay *r)
{
    size_t i;
    for (i = 0; i < OUTBOX_ARRAY_LEN(statements); i++) {
        sqlite3_finalize(*stmt_at(r, i));
        *stmt_at(r, i) = NULL;
    }
    if (r->db.conn) {
        sqlite3_wal_hook(r->db.conn, NULL, NULL);
        sqlite3_close_v2(r->db.conn);
        r->db.conn = NULL;
    }
}
