/*
 * outbox-replay stats --db-dir (replay.h): the backlog of every database of
 * a directory, one per tenant, as one relay over the directory publishes
 * them. Each file of the directory (not of its subdirectories) whose name
 * matches a --db-glob (default *.db) is opened read-only as stats opens
 * --db, and its figures are read in one read transaction from the batch
 * records, the cursor and the indexes (src/figures.h): no pass over any
 * table, so a directory of large databases costs what their count does.
 * The table shows the --top databases with the most pending rows, then the
 * totals over all of them; a file that cannot be read (not a database,
 * corrupt, without the outbox schema, unreadable) is named on stderr with
 * the reason and the others are still read.
 */
#include <dirent.h>
#include <errno.h>
#include <fnmatch.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "store/figures.h"
#include "util/array.h"
#include "json.h"
#include "replay.h"

/* The figures of one database, or why it could not be read. */
typedef struct dbstat {
    char *file;  /* the file's name in the directory */
    char *name;  /* the same without ".db" */
    char *error; /* NULL when read */
    int64_t pending, due, sending, published, dead;
    int64_t oldest_age; /* of the oldest due pending row, -1 when none is due */
} dbstat;

typedef struct dirstats {
    dbstat *dbs;
    size_t n, cap;
    size_t nread, nfailed;
    dbstat total; /* sums over the databases read; the oldest age is their largest */
} dirstats;

static const char default_glob[] = "*.db";

/* SQLite's own files beside a database: never databases themselves, and
 * a pattern such as tenant-* would match them. */
static int companion(const char *name)
{
    static const char *const suffixes[] = {"-wal", "-shm", "-journal"};
    size_t n = strlen(name);
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++) {
        size_t sl = strlen(suffixes[i]);
        if (n > sl && !strcmp(name + n - sl, suffixes[i]))
            return 1;
    }
    return 0;
}

static int matches(const replay_options *o, const char *name)
{
    if (companion(name))
        return 0;
    if (!o->nglobs)
        return fnmatch(default_glob, name, FNM_PERIOD) == 0;
    for (size_t i = 0; i < o->nglobs; i++)
        if (fnmatch(o->globs[i], name, FNM_PERIOD) == 0)
            return 1;
    return 0;
}

static char *join(const char *dir, const char *name)
{
    size_t dl = strlen(dir);
    char *p;
    if (asprintf(&p, "%s%s%s", dir, dl && dir[dl - 1] == '/' ? "" : "/", name) < 0)
        return NULL;
    return p;
}

static int by_file(const void *a, const void *b)
{
    return strcmp(((const dbstat *)a)->file, ((const dbstat *)b)->file);
}

/* Largest backlog first; the read ones before the others; then by name. */
static int by_backlog(const void *a, const void *b)
{
    const dbstat *x = a, *y = b;
    if (!x->error != !y->error)
        return x->error ? 1 : -1;
    if (x->pending != y->pending)
        return x->pending > y->pending ? -1 : 1;
    return strcmp(x->file, y->file);
}

/* The matching regular files of the directory, sorted by name. Returns
 * GO_ON, or an exit status after a message. */
static int list_files(const replay_options *o, dirstats *ds)
{
    DIR *d = opendir(o->db_dir);
    struct dirent *de;
    int rc = GO_ON;
    if (!d) {
        replay_errorf("--db-dir %s: %s", o->db_dir, strerror(errno));
        return EXIT_USAGE;
    }
    for (;;) {
        struct stat st;
        char *path;
        errno = 0;
        if (!(de = readdir(d)))
            break;
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..") || !matches(o, de->d_name))
            continue;
        if (!(path = join(o->db_dir, de->d_name)))
            goto oom;
        /* Subdirectories and the like are not databases; a symbolic link to
         * a file is. A file that cannot even be looked at is reported when
         * it cannot be opened. */
        if (stat(path, &st) == 0 && !S_ISREG(st.st_mode)) {
            free(path);
            continue;
        }
        free(path);
        if (OUTBOX__GROW(ds->dbs, &ds->cap, ds->n, 1, 64) != 0)
            goto oom;
        memset(&ds->dbs[ds->n], 0, sizeof ds->dbs[ds->n]);
        if (!(ds->dbs[ds->n].file = strdup(de->d_name)))
            goto oom;
        ds->n++;
    }
    if (errno) {
        replay_errorf("--db-dir %s: cannot read the directory: %s", o->db_dir, strerror(errno));
        rc = EXIT_FAIL;
    }
    closedir(d);
    if (ds->n)
        qsort(ds->dbs, ds->n, sizeof *ds->dbs, by_file);
    return rc;
oom:
    closedir(d);
    replay_errorf("out of memory");
    return EXIT_FAIL;
}

/* Reads one database's figures into s, or its error. Returns 0, or -1 when
 * memory ran out. */
static int read_one(const replay_options *o, int64_t now, dbstat *s)
{
    char err[768], *path = join(o->db_dir, s->file), oldest_id[OUTBOX_ID_MAX + 1];
    size_t fl = strlen(s->file);
    sqlite3 *db = NULL;
    outbox__figures f;
    int64_t created;
    int e;

    s->oldest_age = -1;
    if (!path)
        return -1;
    s->name = fl > 3 && !strcmp(s->file + fl - 3, ".db") ? strndup(s->file, fl - 3) : strdup(s->file);
    if (!s->name) {
        free(path);
        return -1;
    }
    e = replay_open_path(path, 0, &db, err, sizeof err);
    if (e == 0) {
        /* One read transaction: the figures and the oldest row agree. */
        sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
        e = outbox__figures_read(db, now, &f);
        if (e == 0) {
            e = outbox__figures_oldest(db, now, oldest_id, sizeof oldest_id, &created);
            if (e >= 0) {
                s->oldest_age = e ? now - created : -1;
                e = 0;
            }
        }
        if (e != 0)
            snprintf(err, sizeof err, "cannot read the outbox figures: %s", sqlite3_errmsg(db));
        sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
        sqlite3_close_v2(db);
    }
    if (e != 0) {
        if (asprintf(&s->error, "%s (%s)", err, outbox_err_name(e)) < 0) {
            s->error = NULL;
            free(path);
            return -1;
        }
        replay_errorf("%s: %s", path, s->error);
    } else {
        s->pending = f.by_state[OUTBOX_STATE_PENDING];
        s->due = f.due;
        s->sending = f.by_state[OUTBOX_STATE_SENDING];
        s->published = f.by_state[OUTBOX_STATE_PUBLISHED];
        s->dead = f.by_state[OUTBOX_STATE_DEAD];
    }
    free(path);
    return 0;
}

static void add_total(dbstat *t, const dbstat *s)
{
    t->pending += s->pending;
    t->due += s->due;
    t->sending += s->sending;
    t->published += s->published;
    t->dead += s->dead;
    if (s->oldest_age > t->oldest_age)
        t->oldest_age = s->oldest_age;
}

static void json_counts(outbox__sbuf *b, const dbstat *s)
{
    outbox__sbuf_printf(b,
                        "\"pending\":%" PRId64 ",\"due\":%" PRId64 ",\"sending\":%" PRId64 ",\"published\":%" PRId64
                        ",\"dead\":%" PRId64 ",\"oldest_due_pending_age_ms\":",
                        s->pending, s->due, s->sending, s->published, s->dead);
    if (s->oldest_age >= 0)
        outbox__sbuf_printf(b, "%" PRId64, s->oldest_age);
    else
        outbox__sbuf_puts(b, "null");
}

static int print_json(const replay_options *o, const dirstats *ds, size_t shown, int64_t now)
{
    outbox__sbuf b = {0};
    char buf[96];
    size_t i, k;
    outbox__sbuf_printf(&b, "{\"now\":\"%s\",\"now_ms\":%" PRId64 ",\"db_dir\":", replay_fmt_time(now, buf), now);
    tools_json_cstr(&b, o->db_dir);
    outbox__sbuf_puts(&b, ",\"databases\":[");
    for (i = 0; i < shown; i++) {
        outbox__sbuf_puts(&b, i ? ",{\"name\":" : "{\"name\":");
        tools_json_cstr(&b, ds->dbs[i].name);
        outbox__sbuf_puts(&b, ",\"file\":");
        tools_json_cstr(&b, ds->dbs[i].file);
        outbox__sbuf_puts(&b, ",");
        json_counts(&b, &ds->dbs[i]);
        outbox__sbuf_puts(&b, "}");
    }
    outbox__sbuf_printf(&b, "],\"totals\":{\"databases\":%zu,", ds->nread);
    json_counts(&b, &ds->total);
    outbox__sbuf_printf(&b, "},\"read\":%zu,\"failed\":[", ds->nread);
    for (i = ds->nread, k = 0; i < ds->n; i++, k++) {
        outbox__sbuf_puts(&b, k ? ",{\"name\":" : "{\"name\":");
        tools_json_cstr(&b, ds->dbs[i].name);
        outbox__sbuf_puts(&b, ",\"file\":");
        tools_json_cstr(&b, ds->dbs[i].file);
        outbox__sbuf_puts(&b, ",\"error\":");
        tools_json_cstr(&b, ds->dbs[i].error);
        outbox__sbuf_puts(&b, "}");
    }
    outbox__sbuf_puts(&b, "]}\n");
    i = replay_emit(&b) == 0;
    outbox__sbuf_free(&b);
    return i ? 0 : -1;
}

static void print_line(const cell *name, size_t w, const dbstat *s)
{
    char d[32];
    fputs(name->s, stdout);
    printf("%*s  %10" PRId64 " %10" PRId64 " %10" PRId64 " %10" PRId64 " %10" PRId64 "  %s\n", (int)(w - name->width),
           "", s->pending, s->due, s->sending, s->published, s->dead,
           s->oldest_age >= 0 ? replay_fmt_dur(s->oldest_age, d) : "-");
}

static void print_table(const dirstats *ds, size_t shown)
{
    cell c;
    size_t w = strlen("total"), i;
    for (i = 0; i < shown; i++) {
        replay_cell_set(&c, (const unsigned char *)ds->dbs[i].name, strlen(ds->dbs[i].name), 64);
        if (c.width > w)
            w = c.width;
    }
    printf("%-*s  %10s %10s %10s %10s %10s  %s\n", (int)w, "NAME", "PENDING", "DUE", "SENDING", "PUBLISHED", "DEAD",
           "OLDEST DUE");
    for (i = 0; i < shown; i++) {
        replay_cell_set(&c, (const unsigned char *)ds->dbs[i].name, strlen(ds->dbs[i].name), 64);
        print_line(&c, w, &ds->dbs[i]);
    }
    replay_cell_set(&c, (const unsigned char *)"total", 5, 64);
    print_line(&c, w, &ds->total);
    printf("%zu %s read", ds->nread, replay_plural((int64_t)ds->nread, "database", "databases"));
    if (shown < ds->nread)
        printf(" (the %zu with the most pending rows shown)", shown);
    printf(", %zu could not be read%s\n", ds->nfailed, ds->nfailed ? " (named on stderr)" : "");
}

int replay_cmd_stats_dir(const replay_options *o)
{
    dirstats ds;
    int64_t now = outbox_now_ms();
    size_t shown, i;
    int rc;

    memset(&ds, 0, sizeof ds);
    ds.total.oldest_age = -1;
    rc = list_files(o, &ds);
    if (rc != GO_ON)
        goto done;
    for (i = 0; i < ds.n; i++) {
        if (read_one(o, now, &ds.dbs[i]) != 0) {
            replay_errorf("out of memory");
            rc = EXIT_FAIL;
            goto done;
        }
        if (ds.dbs[i].error) {
            ds.nfailed++;
        } else {
            ds.nread++;
            add_total(&ds.total, &ds.dbs[i]);
        }
    }
    if (ds.n)
        qsort(ds.dbs, ds.n, sizeof *ds.dbs, by_backlog);
    shown = ds.nread < (size_t)o->top ? ds.nread : (size_t)o->top;
    if (o->json) {
        if (print_json(o, &ds, shown, now) != 0) {
            rc = EXIT_FAIL;
            goto done;
        }
    } else {
        print_table(&ds, shown);
    }
    rc = replay_finish_output();
    if (rc == EXIT_OK && ds.nfailed)
        rc = EXIT_FAIL;
done:
    for (i = 0; i < ds.n; i++) {
        free(ds.dbs[i].file);
        free(ds.dbs[i].name);
        free(ds.dbs[i].error);
    }
    free(ds.dbs);
    return rc;
}
