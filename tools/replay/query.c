/*
 * outbox-replay's database (replay.h): opening it read-only or read-write,
 * and the SELECTs that the filters narrow, every value a bound parameter.
 */
#include <stdio.h>

#include "replay.h"

/* Whether the configuration, not the moment, is to blame for an open or
 * schema error: a usage error (2) rather than a runtime one (1). */
static int is_config_error(int e)
{
    return e == OUTBOX_EINVAL || e == OUTBOX_EIO || e == OUTBOX_ENOTDB || e == OUTBOX_ENOSCHEMA ||
           e == OUTBOX_ESCHEMANEWER || e == OUTBOX_EFOREIGN;
}

int replay_open_path(const char *path, int writable, sqlite3 **out, char *err, size_t errlen)
{
    sqlite3 *db = NULL;
    int e;
    err[0] = '\0';
    *out = NULL;
    e = outbox_db_open(path, OUTBOX_OPEN_READONLY, &db, err, errlen);
    if (e == 0)
        e = outbox_schema_check(db, err, errlen);
    if (e == 0 && writable) {
        /* Only now that the file holds our schema: a read-write open switches
         * the file to WAL mode, which would change somebody else's database. */
        sqlite3_close_v2(db);
        db = NULL;
        e = outbox_db_open(path, 0, &db, err, errlen);
        if (e == 0)
            e = outbox_schema_check(db, err, errlen);
    }
    if (e != 0) {
        if (!err[0])
            snprintf(err, errlen, "%s", outbox_strerror(e));
        sqlite3_close_v2(db);
        return e;
    }
    *out = db;
    return 0;
}

int replay_open_db(const replay_options *o, int writable, sqlite3 **out)
{
    char err[768];
    int e = replay_open_path(o->db, writable, out, err, sizeof err);
    if (e != 0) {
        replay_errorf("%s (%s)", err, outbox_err_name(e));
        return is_config_error(e) ? EXIT_USAGE : EXIT_FAIL;
    }
    return GO_ON;
}

int replay_db_fail(sqlite3 *db, const char *what)
{
    int code = sqlite3_errcode(db) & 0xff;
    if (code == SQLITE_BUSY || code == SQLITE_LOCKED)
        replay_errorf("%s: the database stayed locked by another connection for more than the 5 s busy wait (%s)",
                      what, sqlite3_errmsg(db));
    else
        replay_errorf("%s: %s", what, sqlite3_errmsg(db));
    return EXIT_FAIL;
}

/* Appends the filters as " AND ..." terms with parameters :f1..:fN, in the
 * order where_bind() binds them. They are named, not numbered, so that they
 * cannot share a slot with the named parameters (:now, ...) of the rest of
 * a statement, which SQLite numbers in order of appearance. states:
 * STATE_BIT()s, 0 for any. */
static void where_sql(outbox__sbuf *b, const replay_options *o, unsigned states)
{
    int n = 0, s;
    size_t i;
    if (states) {
        const char *sep = "";
        outbox__sbuf_printf(b, " AND state IN (");
        for (s = 0; s < OUTBOX_STATE_COUNT; s++)
            if (states & STATE_BIT(s)) {
                outbox__sbuf_printf(b, "%s:f%d", sep, ++n);
                sep = ", ";
            }
        outbox__sbuf_printf(b, ")");
    }
    if (o->topic)
        outbox__sbuf_printf(b, " AND topic = :f%d", ++n);
    if (o->key)
        outbox__sbuf_printf(b, " AND key = :f%d", ++n);
    if (o->id_prefix) {
        outbox__sbuf_printf(b, " AND id >= :f%d AND id < :f%d", n + 1, n + 2);
        n += 2;
    }
    if (o->has_since)
        outbox__sbuf_printf(b, " AND created_at >= :f%d", ++n);
    if (o->has_until)
        outbox__sbuf_printf(b, " AND created_at < :f%d", ++n);
    if (o->nids) {
        outbox__sbuf_printf(b, " AND id IN (");
        for (i = 0; i < o->nids; i++)
            outbox__sbuf_printf(b, "%s:f%d", i ? ", " : "", ++n);
        outbox__sbuf_printf(b, ")");
    }
}

/* Binds value number n (1-based) of the filters. */
static int bind_f_int(sqlite3_stmt *st, int n, int64_t v)
{
    char name[16];
    snprintf(name, sizeof name, ":f%d", n);
    return sqlite3_bind_int64(st, sqlite3_bind_parameter_index(st, name), v);
}

static int bind_f_text(sqlite3_stmt *st, int n, const char *v)
{
    char name[16];
    snprintf(name, sizeof name, ":f%d", n);
    return sqlite3_bind_text(st, sqlite3_bind_parameter_index(st, name), v, -1, SQLITE_STATIC);
}

static int where_bind(sqlite3_stmt *st, const replay_options *o, unsigned states)
{
    int n = 0, s, rc = SQLITE_OK;
    size_t i;
    for (s = 0; s < OUTBOX_STATE_COUNT; s++)
        if (states & STATE_BIT(s))
            rc |= bind_f_int(st, ++n, s);
    if (o->topic)
        rc |= bind_f_text(st, ++n, o->topic);
    if (o->key)
        rc |= bind_f_text(st, ++n, o->key);
    if (o->id_prefix) {
        rc |= bind_f_text(st, ++n, o->id_prefix);
        rc |= bind_f_text(st, ++n, o->id_prefix_end);
    }
    if (o->has_since)
        rc |= bind_f_int(st, ++n, o->since);
    if (o->has_until)
        rc |= bind_f_int(st, ++n, o->until);
    for (i = 0; i < o->nids; i++)
        rc |= bind_f_text(st, ++n, o->ids[i]);
    return rc;
}

int replay_bind_named(sqlite3_stmt *st, const char *name, int64_t v)
{
    int i = sqlite3_bind_parameter_index(st, name);
    return i ? sqlite3_bind_int64(st, i, v) : SQLITE_OK;
}

int replay_prepare_select(sqlite3 *db, const replay_options *o, unsigned states, const char *cols, const char *extra,
                          const char *tail, sqlite3_stmt **out)
{
    outbox__sbuf b = {0};
    int rc;
    *out = NULL;
    outbox__sbuf_printf(&b, "SELECT %s FROM outbox_messages WHERE 1", cols);
    where_sql(&b, o, states);
    outbox__sbuf_printf(&b, "%s%s", extra, tail);
    if (b.oom) {
        outbox__sbuf_free(&b);
        replay_errorf("out of memory");
        return -1;
    }
    rc = sqlite3_prepare_v2(db, b.p, -1, out, NULL);
    outbox__sbuf_free(&b);
    if (rc == SQLITE_OK)
        rc = where_bind(*out, o, states);
    if (rc != SQLITE_OK) {
        replay_db_fail(db, "cannot prepare the query");
        sqlite3_finalize(*out);
        *out = NULL;
        return -1;
    }
    return 0;
}

int replay_col_null(sqlite3_stmt *st, int i)
{
    return sqlite3_column_type(st, i) == SQLITE_NULL;
}

const unsigned char *replay_col_text(sqlite3_stmt *st, int i, size_t *n)
{
    const unsigned char *s;
    if (replay_col_null(st, i)) {
        *n = 0;
        return NULL;
    }
    s = sqlite3_column_text(st, i);
    *n = (size_t)sqlite3_column_bytes(st, i);
    return s ? s : (const unsigned char *)"";
}
