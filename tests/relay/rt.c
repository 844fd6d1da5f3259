/*
 * rt.c: see rt.h.
 */
#include "rt.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "outbox.h"
#include "tap.h"

int64_t rt_unix_ms(void)
{
    return outbox_now_ms();
}

void rt_world_start(th_redis *srv, char **dir, char **dbpath, sqlite3 **db, redisContext **c)
{
    if (th_redis_start(srv, 0, NULL) != 0)
        skip_all("redis-server not available");
    *dir = th_tmpdir();
    *dbpath = rt_make_db(*dir, "app.db");
    *db = rt_open(*dbpath);
    *c = th_redis_client(srv);
}

void rt_world_end(th_redis *srv, char *dir, char *dbpath, sqlite3 *db, redisContext *c)
{
    redisFree(c);
    sqlite3_close_v2(db);
    th_redis_destroy(srv);
    th_rmtree(dir);
    free(dbpath);
    free(dir);
}

/* ---- SQLite ----------------------------------------------------------- */

static void on_tick(uv_timer_t *t)
{
    (void)t;
}

int rt_run_until(uv_loop_t *loop, int timeout_ms, int (*fn)(void *), void *arg)
{
    uv_timer_t tick;
    int64_t end = th_now_ms() + (int64_t)timeout_ms * th_slow();
    int held = 0;
    uv_timer_init(loop, &tick);
    uv_timer_start(&tick, on_tick, 5, 5);
    while (!(held = fn(arg)) && th_now_ms() < end)
        uv_run(loop, UV_RUN_ONCE);
    uv_close((uv_handle_t *)&tick, NULL);
    uv_run(loop, UV_RUN_NOWAIT);
    return held;
}

void rt_group_flag(outbox_relay_group *g, void *flag)
{
    (void)g;
    *(int *)flag = 1;
}

int rt_flag(void *flag)
{
    return *(int *)flag;
}

char *rt_make_db(const char *dir, const char *name)
{
    char *path = th_path(dir, name), err[512];
    sqlite3 *db = NULL;
    int e = outbox_db_open(path, OUTBOX_OPEN_CREATE, &db, err, sizeof err);
    if (e == 0)
        e = outbox_schema_apply(db, err, sizeof err);
    if (e != 0)
        bail("cannot create %s: %s (%s)", path, err, outbox_err_name(e));
    sqlite3_close_v2(db);
    return path;
}

sqlite3 *rt_open(const char *path)
{
    char err[512];
    sqlite3 *db = NULL;
    int e = outbox_db_open(path, 0, &db, err, sizeof err);
    if (e != 0)
        bail("cannot open %s: %s (%s)", path, err, outbox_err_name(e));
    return db;
}

void rt_insert_rows(sqlite3 *db, const char *prefix, int first, int n, const char *topic, int nkeys)
{
    th_sql_exec(db, "BEGIN IMMEDIATE");
    rt_insert_rows_in_txn(db, prefix, first, n, topic, nkeys);
    th_sql_exec(db, "COMMIT");
}

void rt_insert_rows_in_txn(sqlite3 *db, const char *prefix, int first, int n, const char *topic, int nkeys)
{
    sqlite3_stmt *st = NULL;
    int i;
    if (sqlite3_prepare_v2(db, "INSERT INTO outbox(id, topic, key, payload) VALUES (?1, ?2, ?3, ?4)", -1, &st,
                           NULL) != SQLITE_OK)
        bail("prepare insert: %s", sqlite3_errmsg(db));
    for (i = first; i < first + n; i++) {
        char id[64], key[32], payload[96];
        snprintf(id, sizeof id, "%s-%06d", prefix, i);
        snprintf(key, sizeof key, "k%d", nkeys ? i % nkeys : 0);
        snprintf(payload, sizeof payload, "{\"message\":\"%s\",\"n\":%d}", id, i);
        sqlite3_bind_text(st, 1, id, -1, SQLITE_TRANSIENT);
        sqlite3_bind_text(st, 2, topic, -1, SQLITE_STATIC);
        if (nkeys)
            sqlite3_bind_text(st, 3, key, -1, SQLITE_TRANSIENT);
        else
            sqlite3_bind_null(st, 3);
        sqlite3_bind_blob(st, 4, payload, (int)strlen(payload), SQLITE_TRANSIENT);
        if (sqlite3_step(st) != SQLITE_DONE)
            bail("insert %s: %s", id, sqlite3_errmsg(db));
        sqlite3_reset(st);
    }
    sqlite3_finalize(st);
}

char *rt_make_db_rows(const char *dir, const char *name, const char *prefix, int first, int n, const char *topic,
                      int nkeys)
{
    char *path = rt_make_db(dir, name);
    sqlite3 *db = rt_open(path);
    rt_insert_rows(db, prefix, first, n, topic, nkeys);
    sqlite3_close_v2(db);
    return path;
}

/* ---- streams ---------------------------------------------------------- */

static char *dup_bytes(const char *p, size_t n)
{
    char *d = malloc(n + 1);
    if (!d)
        bail("out of memory");
    memcpy(d, p, n);
    d[n] = '\0';
    return d;
}

rt_stream rt_stream_read(redisContext *c, const char *stream)
{
    rt_stream s = {NULL, 0};
    size_t cap = 0;
    char start[64] = "-";
    for (;;) {
        redisReply *rep = th_cmd(c, "XRANGE %s %s + COUNT 5000", stream, start);
        size_t i;
        if (rep->type == REDIS_REPLY_ERROR)
            bail("XRANGE %s: %s", stream, rep->str);
        if (rep->type != REDIS_REPLY_ARRAY)
            bail("XRANGE %s: unexpected reply type %d", stream, rep->type);
        if (rep->elements == 0) {
            freeReplyObject(rep);
            break;
        }
        for (i = 0; i < rep->elements; i++) {
            redisReply *en = rep->element[i], *fields;
            rt_entry *e;
            size_t k;
            if (en->type != REDIS_REPLY_ARRAY || en->elements != 2)
                bail("XRANGE %s: malformed entry", stream);
            if (s.n == cap) {
                cap = cap ? cap * 2 : 1024;
                s.e = realloc(s.e, cap * sizeof *s.e);
                if (!s.e)
                    bail("out of memory");
            }
            e = &s.e[s.n++];
            memset(e, 0, sizeof *e);
            snprintf(e->eid, sizeof e->eid, "%s", en->element[0]->str);
            fields = en->element[1];
            e->nfields = (int)(fields->elements / 2);
            e->id_first = fields->elements > 0 && fields->element[0]->len == 2 &&
                          memcmp(fields->element[0]->str, "id", 2) == 0;
            for (k = 0; k + 1 < fields->elements; k += 2) {
                const redisReply *f = fields->element[k], *v = fields->element[k + 1];
                if (f->len == 2 && memcmp(f->str, "id", 2) == 0 && !e->id)
                    e->id = dup_bytes(v->str, v->len);
                else if (f->len == 8 && memcmp(f->str, "envelope", 8) == 0 && !e->env) {
                    e->env = dup_bytes(v->str, v->len);
                    e->envlen = v->len;
                }
            }
        }
        snprintf(start, sizeof start, "(%s", s.e[s.n - 1].eid);
        freeReplyObject(rep);
    }
    return s;
}

void rt_stream_free(rt_stream *s)
{
    size_t i;
    for (i = 0; i < s->n; i++) {
        free(s->e[i].id);
        free(s->e[i].env);
    }
    free(s->e);
    s->e = NULL;
    s->n = 0;
}

/* ---- map -------------------------------------------------------------- */

typedef struct slot {
    char *key;
    int count;
    int64_t v;
} slot;

struct rt_map {
    slot *tab;
    size_t cap, len;
};

static uint64_t hash_str(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return h;
}

rt_map *rt_map_new(void)
{
    rt_map *m = calloc(1, sizeof *m);
    if (!m)
        bail("out of memory");
    m->cap = 1024;
    m->tab = calloc(m->cap, sizeof *m->tab);
    if (!m->tab)
        bail("out of memory");
    return m;
}

void rt_map_free(rt_map *m)
{
    size_t i;
    if (!m)
        return;
    for (i = 0; i < m->cap; i++)
        free(m->tab[i].key);
    free(m->tab);
    free(m);
}

static slot *find(const rt_map *m, const char *key)
{
    size_t i = (size_t)hash_str(key) & (m->cap - 1);
    while (m->tab[i].key && strcmp(m->tab[i].key, key) != 0)
        i = (i + 1) & (m->cap - 1);
    return &m->tab[i];
}

static slot *upsert(rt_map *m, const char *key, int64_t v)
{
    slot *s;
    if ((m->len + 1) * 2 > m->cap) {
        slot *old = m->tab;
        size_t oldcap = m->cap, i;
        m->cap *= 2;
        m->tab = calloc(m->cap, sizeof *m->tab);
        if (!m->tab)
            bail("out of memory");
        for (i = 0; i < oldcap; i++)
            if (old[i].key)
                *find(m, old[i].key) = old[i];
        free(old);
    }
    s = find(m, key);
    if (!s->key) {
        s->key = strdup(key);
        if (!s->key)
            bail("out of memory");
        s->v = v;
        m->len++;
    }
    return s;
}

int rt_map_add(rt_map *m, const char *key, int64_t v)
{
    return ++upsert(m, key, v)->count;
}

void rt_map_set(rt_map *m, const char *key, int64_t v)
{
    upsert(m, key, v)->v = v;
}

int rt_map_get(const rt_map *m, const char *key, int64_t *v)
{
    const slot *s = find(m, key);
    if (v)
        *v = s->key ? s->v : 0;
    return s->key ? s->count : 0;
}

size_t rt_map_size(const rt_map *m)
{
    return m->len;
}

/* ---- audit ------------------------------------------------------------ */

typedef struct row {
    char *id, *key;
    int64_t seq;
    int state;
} row;

rt_audit rt_audit_topic(sqlite3 *db, redisContext *c, const char *prefix, const char *topic)
{
    rt_audit a;
    sqlite3_stmt *st = NULL;
    row *rows = NULL;
    size_t nrows = 0, cap = 0, i;
    rt_map *byid = rt_map_new(), *seen = rt_map_new(), *keylast = rt_map_new();
    char stream[300];
    rt_stream s;
    int shown_missing = 0, shown_foreign = 0, shown_order = 0;

    memset(&a, 0, sizeof a);
    if (sqlite3_prepare_v2(db, "SELECT id, key, seq, state FROM outbox_messages WHERE topic = ?1 ORDER BY seq", -1, &st,
                           NULL) != SQLITE_OK)
        bail("audit: %s", sqlite3_errmsg(db));
    sqlite3_bind_text(st, 1, topic, -1, SQLITE_STATIC);
    while (sqlite3_step(st) == SQLITE_ROW) {
        row *r;
        if (nrows == cap) {
            cap = cap ? cap * 2 : 1024;
            rows = realloc(rows, cap * sizeof *rows);
            if (!rows)
                bail("out of memory");
        }
        r = &rows[nrows];
        r->id = strdup((const char *)sqlite3_column_text(st, 0));
        r->key = sqlite3_column_type(st, 1) == SQLITE_NULL ? NULL : strdup((const char *)sqlite3_column_text(st, 1));
        r->seq = sqlite3_column_int64(st, 2);
        r->state = sqlite3_column_int(st, 3);
        rt_map_set(byid, r->id, (int64_t)nrows);
        nrows++;
    }
    sqlite3_finalize(st);
    a.rows = (long)nrows;

    snprintf(stream, sizeof stream, "%s%s", prefix, topic);
    s = rt_stream_read(c, stream);
    a.entries = (long)s.n;
    for (i = 0; i < s.n; i++) {
        const slot *bs = s.e[i].id ? find(byid, s.e[i].id) : NULL;
        const row *r;
        if (!bs || !bs->key) {
            if (shown_foreign++ < 5)
                diag("%s: entry %s id=%s has no committed row", stream, s.e[i].eid,
                     s.e[i].id ? s.e[i].id : "(none)");
            a.foreign++;
            continue;
        }
        r = &rows[bs->v];
        if (rt_map_add(seen, r->id, 0) > 1) {
            a.dups++;
            continue;
        }
        if (r->key) {
            const slot *ks = find(keylast, r->key);
            if (ks->key && ks->v > r->seq) {
                if (shown_order++ < 5)
                    diag("%s: key %s: %s (seq %lld) first appears after seq %lld", stream, r->key, r->id,
                         (long long)r->seq, (long long)ks->v);
                a.order_violations++;
            } else {
                rt_map_set(keylast, r->key, r->seq);
            }
        }
    }
    for (i = 0; i < nrows; i++) {
        if (rows[i].state == 3)
            a.dead++;
        else if (!rt_map_get(seen, rows[i].id, NULL) && shown_missing++ < 5)
            diag("%s: row %s (seq %lld, state %d) is not in the stream", stream, rows[i].id,
                 (long long)rows[i].seq, rows[i].state);
        if (rows[i].state != 3 && !rt_map_get(seen, rows[i].id, NULL))
            a.missing++;
        if (rows[i].state != 2)
            a.unpublished++;
        free(rows[i].id);
        free(rows[i].key);
    }
    free(rows);
    rt_stream_free(&s);
    rt_map_free(byid);
    rt_map_free(seen);
    rt_map_free(keylast);
    return a;
}

/* ---- the daemon ------------------------------------------------------- */

pid_t rt_relay_spawn(const char *err_path, const char *db, const char *url, ...)
{
    va_list ap;
    char **argv;
    pid_t pid;
    va_start(ap, url);
    argv = th_relay_argv(db, url, ap);
    va_end(ap);
    pid = th_spawn(argv, NULL, err_path, err_path);
    if (pid < 0)
        bail("cannot start %s", argv[0]);
    th_argv_free(argv);
    return pid;
}

int rt_relay_run(int timeout_ms, char **err, const char *db, const char *url, ...)
{
    va_list ap;
    int rc;
    va_start(ap, url);
    rc = th_relay_runv(timeout_ms, err, db, url, ap);
    va_end(ap);
    return rc;
}

/* ---- text ------------------------------------------------------------- */

int rt_count_substr(const char *text, const char *needle)
{
    int n = 0;
    size_t len = strlen(needle);
    const char *p = text;
    while ((p = strstr(p, needle)) != NULL) {
        n++;
        p += len;
    }
    return n;
}

int rt_blocked_clients(redisContext *c)
{
    redisReply *r = redisCommand(c, "CLIENT LIST");
    int n = -1;
    if (r && r->type == REDIS_REPLY_STRING) {
        const char *p = r->str;
        n = 0;
        while ((p = strstr(p, " flags=")) != NULL) {
            size_t len;
            p += 7;
            len = strcspn(p, " \n");
            n += memchr(p, 'b', len) != NULL;
        }
    }
    if (r)
        freeReplyObject(r);
    return n;
}

int rt_wait_blocked(redisContext *c, int timeout_ms)
{
    int64_t deadline = th_now_ms() + timeout_ms;
    int n;
    while ((n = rt_blocked_clients(c)) <= 0 && th_now_ms() < deadline)
        th_sleep_ms(1);
    return n > 0;
}
