/*
 * outbox-replay: inspection of the outbox table, and audited manual resends
 * (requeue) and deletions (purge), safe beside a running relay.
 *
 * Everything is plain SQL on the application's database, opened with the
 * library's outbox_db_open() and checked with outbox_schema_check(). The
 * read-only subcommands and every --dry-run use a read-only connection, so
 * they cannot change the file even by mistake. Changes run in short
 * BEGIN IMMEDIATE transactions of --batch rows, walked in seq order with a
 * cursor: the relay and the application get the write lock between batches,
 * and the whole run is one pass over the table whatever the number of
 * batches. Every filter value is a bound parameter.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <msgpack.h>
#include <sqlite3.h>

#include "args.h"
#include "msgpack_check.h"
#include "outbox.h"

enum { EXIT_OK = 0, EXIT_FAIL = 1, EXIT_USAGE = 2 };

/* open_db() returns this to mean "go on". */
#define GO_ON (-1)

static const char *const prog = "outbox-replay";

/* ---- messages ------------------------------------------------------------ */

static void errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void errorf(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "%s: ", prog);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: %s SUBCOMMAND --db PATH [filters] [options]\n"
            "       %s --help | --version\n"
            "\n"
            "Inspects the outbox table, resends messages by hand (requeue, audited in the row)\n"
            "and deletes dead ones (purge), safely beside a running relay.\n"
            "\n"
            "Subcommands:\n"
            "  list          Messages matching the filters, in commit (seq) order: id, state,\n"
            "                topic, key, attempts, last error, lease owner and expiry, created\n"
            "                and published times, replay count. Read-only. Exits 0 also when\n"
            "                nothing matches (prints nothing, or [] with --json).\n"
            "  show ID       One message in full: the columns above plus available/replay times,\n"
            "                replay reason, stream id, headers decoded from msgpack to JSON, and\n"
            "                the payload as text if it is valid UTF-8, else as base64 (a field\n"
            "                says which). Read-only. Exit 1 with \"no message with id ID\" if none.\n"
            "                An ID that starts with '-' goes after '--': show --db PATH -- -ID\n"
            "  stats         Counts by state and by topic x state, due and waiting pending rows,\n"
            "                the age of the oldest due pending row, live and expired leases,\n"
            "                dead count. Read-only; the filters narrow what is counted.\n"
            "  requeue       Puts the selected messages back to pending, due now: state 0,\n"
            "                available_at now, attempts 0, last_error and lease cleared,\n"
            "                replay_count + 1, replayed_at now, replay_reason = --reason\n"
            "                (required). Without --state it selects dead, published and sending\n"
            "                messages; pending ones only with --state pending (they become due\n"
            "                now with attempts 0). A sending message whose lease has not expired\n"
            "                is skipped and counted unless --force, which takes it and\n"
            "                increments lease_token, so the old holder's late marks (fenced on\n"
            "                owner and token) are refused; sending messages with an expired lease\n"
            "                are taken without --force (also with lease_token + 1).\n"
            "  purge         Deletes dead messages (state 3) matching the filters; never any other.\n"
            "\n"
            "Filters (every filter given must match; repeated --state or --id match any of\n"
            "their values; values are bound SQL parameters):\n"
            "  --state STATE       pending, sending, published or dead (purge: only dead)\n"
            "  --topic T           exact topic\n"
            "  --key K             exact ordering key\n"
            "  --id ID             exact message id (repeatable, up to %d)\n"
            "  --id-prefix P       ids that start with P\n"
            "  --since TIME        created_at >= TIME\n"
            "  --until TIME        created_at < TIME (must be after --since)\n"
            "  TIME is ISO-8601 with a zone, 2026-11-29T10:00:00Z or\n"
            "  2026-11-29T10:00:00.123+02:00; a date, 2026-11-29 (midnight UTC); or unix\n"
            "  milliseconds, 1795946400000 (= 2026-11-29T10:00:00Z).\n"
            "\n"
            "Options:\n"
            "  --db PATH           SQLite database holding the outbox table (required)\n"
            "  --json              machine-readable output on stdout: list prints one JSON array of\n"
            "                      message objects; show, stats, requeue and purge print one JSON\n"
            "                      object (with --dry-run it holds the array \"rows\"). Times are\n"
            "                      ISO-8601 UTC strings plus *_ms unix milliseconds; strings are\n"
            "                      escaped, invalid UTF-8 bytes become U+FFFD.\n"
            "  --limit N           list: show at most N messages, 0 for all (default 100)\n"
            "  --reason TEXT       requeue: why (required, 1..%d bytes of UTF-8); stored in\n"
            "                      replay_reason and visible in show\n"
            "  --dry-run           requeue, purge: print exactly the rows that would change and what\n"
            "                      would happen to each, change nothing\n"
            "  --yes               requeue, purge: confirm touching more than --threshold messages\n"
            "  --threshold N       requeue, purge: messages that may be touched without --yes\n"
            "                      (default 100)\n"
            "  --force             requeue: also take sending messages whose lease is live\n"
            "  --batch N           requeue, purge: messages per transaction (BEGIN IMMEDIATE ...\n"
            "                      COMMIT, in seq order), 1..%d (default 500)\n"
            "  -h, --help          show this help\n"
            "  -V, --version       show the version\n"
            "\n"
            "Beside a live relay: list, show, stats and --dry-run open the database read-only;\n"
            "requeue and purge hold the write lock for one batch at a time (waiting up to 5 s for\n"
            "it), show progress on stderr when it is a terminal, and stop after the current batch\n"
            "on SIGINT or SIGTERM (committed batches stay; run again to continue).\n"
            "\n"
            "Exit status: 0 done; 1 nothing matches (requeue, purge), no such message (show),\n"
            "interrupted, or a runtime error such as a database locked for too long; 2 usage or\n"
            "configuration error: unknown subcommand or option, bad value, missing --db, a file\n"
            "that is not a SQLite database or has no outbox schema (run 'outbox-relay init'),\n"
            "more than --threshold messages without --yes. Nothing is changed on any error\n"
            "found before the first batch.\n",
            prog, prog, IDS_MAX, REASON_MAX, BATCH_MAX);
}

/* ---- UTF-8, JSON, base64 ------------------------------------------------- */

/* The length (1..4) of the valid UTF-8 sequence at s, its code point in
 * *cp; 0 if the bytes there are not valid UTF-8 (overlong forms, surrogates
 * and values above U+10FFFF are invalid). */
static size_t utf8_seq(const unsigned char *s, size_t n, uint32_t *cp)
{
    uint32_t c;
    size_t len, i;
    if (n == 0)
        return 0;
    if (s[0] < 0x80) {
        *cp = s[0];
        return 1;
    }
    if (s[0] >= 0xc2 && s[0] <= 0xdf) {
        len = 2;
        c = s[0] & 0x1f;
    } else if (s[0] >= 0xe0 && s[0] <= 0xef) {
        len = 3;
        c = s[0] & 0x0f;
    } else if (s[0] >= 0xf0 && s[0] <= 0xf4) {
        len = 4;
        c = s[0] & 0x07;
    } else {
        return 0;
    }
    if (n < len)
        return 0;
    for (i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80)
            return 0;
        c = (c << 6) | (s[i] & 0x3f);
    }
    if ((len == 3 && c < 0x800) || (len == 4 && (c < 0x10000 || c > 0x10ffff)) || (c >= 0xd800 && c <= 0xdfff))
        return 0;
    *cp = c;
    return len;
}

static int utf8_valid(const unsigned char *s, size_t n)
{
    size_t i = 0, l;
    uint32_t cp;
    while (i < n) {
        l = utf8_seq(s + i, n - i, &cp);
        if (l == 0)
            return 0;
        i += l;
    }
    return 1;
}

/* A JSON string: quotes, backslashes and control characters escaped,
 * U+2028/U+2029 escaped for JavaScript consumers, every byte that is not
 * part of valid UTF-8 replaced by U+FFFD, so the output is always valid
 * JSON in valid UTF-8. */
static void json_str(FILE *f, const unsigned char *s, size_t n)
{
    size_t i = 0;
    putc('"', f);
    while (i < n) {
        unsigned char c = s[i];
        uint32_t cp;
        size_t l;
        if (c < 0x80) {
            switch (c) {
            case '"':
                fputs("\\\"", f);
                break;
            case '\\':
                fputs("\\\\", f);
                break;
            case '\n':
                fputs("\\n", f);
                break;
            case '\r':
                fputs("\\r", f);
                break;
            case '\t':
                fputs("\\t", f);
                break;
            case '\b':
                fputs("\\b", f);
                break;
            case '\f':
                fputs("\\f", f);
                break;
            default:
                if (c < 0x20 || c == 0x7f)
                    fprintf(f, "\\u%04x", c);
                else
                    putc(c, f);
            }
            i++;
            continue;
        }
        l = utf8_seq(s + i, n - i, &cp);
        if (l == 0) {
            fputs("\\ufffd", f);
            i++;
        } else if (cp == 0x2028 || cp == 0x2029) {
            fprintf(f, "\\u%04" PRIx32, cp);
            i += l;
        } else {
            fwrite(s + i, 1, l, f);
            i += l;
        }
    }
    putc('"', f);
}

static void json_cstr(FILE *f, const char *s)
{
    if (s)
        json_str(f, (const unsigned char *)s, strlen(s));
    else
        fputs("null", f);
}

static void base64(FILE *f, const unsigned char *s, size_t n)
{
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    size_t i;
    for (i = 0; i + 2 < n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8 | s[i + 2];
        putc(tab[v >> 18], f);
        putc(tab[(v >> 12) & 63], f);
        putc(tab[(v >> 6) & 63], f);
        putc(tab[v & 63], f);
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)s[i] << 16;
        putc(tab[v >> 18], f);
        putc(tab[(v >> 12) & 63], f);
        fputs("==", f);
    } else if (n - i == 2) {
        uint32_t v = (uint32_t)s[i] << 16 | (uint32_t)s[i + 1] << 8;
        putc(tab[v >> 18], f);
        putc(tab[(v >> 12) & 63], f);
        putc(tab[(v >> 6) & 63], f);
        putc('=', f);
    }
}

/* Text for a human on a terminal: valid UTF-8 as is; control characters
 * (other than newline and tab when keep_lines), C1 controls and invalid bytes
 * as \xNN, so a message cannot send escape sequences to the terminal. */
static void print_clean(FILE *f, const unsigned char *s, size_t n, int keep_lines)
{
    size_t i = 0;
    while (i < n) {
        uint32_t cp = 0;
        size_t l = utf8_seq(s + i, n - i, &cp);
        if (l == 0 || cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp < 0xa0) || cp == '\\') {
            if (l != 0 && keep_lines && (cp == '\n' || cp == '\t'))
                putc((int)cp, f);
            else if (cp == '\\' && l == 1)
                fputs("\\\\", f);
            else if (l == 0)
                fprintf(f, "\\x%02x", s[i]);
            else
                for (size_t k = 0; k < l; k++)
                    fprintf(f, "\\x%02x", s[i + k]);
            i += l ? l : 1;
            continue;
        }
        fwrite(s + i, 1, l, f);
        i += l;
    }
}

/* ---- times --------------------------------------------------------------- */

/* A short duration: 250ms, 12.3s, 5m03s, 2h07m, 3d04h. */
static const char *fmt_dur(int64_t ms, char buf[32])
{
    int64_t s;
    if (ms < 0)
        ms = -ms;
    s = ms / 1000;
    if (ms < 1000)
        snprintf(buf, 32, "%" PRId64 "ms", ms);
    else if (s < 60)
        snprintf(buf, 32, "%.1fs", (double)ms / 1000.0);
    else if (s < 3600)
        snprintf(buf, 32, "%" PRId64 "m%02" PRId64 "s", s / 60, s % 60);
    else if (s < 86400)
        snprintf(buf, 32, "%" PRId64 "h%02" PRId64 "m", s / 3600, s % 3600 / 60);
    else
        snprintf(buf, 32, "%" PRId64 "d%02" PRId64 "h", s / 86400, s % 86400 / 3600);
    return buf;
}

/* ---- database ------------------------------------------------------------ */

/* A growing string for SQL text; on allocation failure it remembers it. */
typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_addf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_addf(sbuf *b, const char *fmt, ...)
{
    va_list ap;
    int n;
    if (b->oom)
        return;
    for (;;) {
        size_t room = b->cap - b->len;
        va_start(ap, fmt);
        n = vsnprintf(b->p ? b->p + b->len : NULL, room, fmt, ap);
        va_end(ap);
        if (n < 0) {
            b->oom = 1;
            return;
        }
        if ((size_t)n < room) {
            b->len += (size_t)n;
            return;
        }
        {
            size_t cap = (b->cap ? b->cap * 2 : 256) + (size_t)n;
            char *q = realloc(b->p, cap);
            if (!q) {
                b->oom = 1;
                return;
            }
            b->p = q;
            b->cap = cap;
        }
    }
}

/* Whether the configuration, not the moment, is to blame for an open or
 * schema error: a usage error (2) rather than a runtime one (1). */
static int is_config_error(int e)
{
    return e == OUTBOX_EINVAL || e == OUTBOX_EIO || e == OUTBOX_ENOTDB || e == OUTBOX_ENOSCHEMA ||
           e == OUTBOX_ESCHEMANEWER || e == OUTBOX_EFOREIGN;
}

/* Opens --db and checks the schema. Returns GO_ON with *out set, or an exit
 * status after a message. */
static int open_db(const replay_options *o, int writable, sqlite3 **out)
{
    char err[768] = "";
    sqlite3 *db = NULL;
    int e = outbox_db_open(o->db, OUTBOX_OPEN_READONLY, &db, err, sizeof err);
    if (e == 0)
        e = outbox_schema_check(db, err, sizeof err);
    if (e == 0 && writable) {
        /* Only now that the file holds our schema: a read-write open switches
         * the file to WAL mode, which would change somebody else's database. */
        sqlite3_close_v2(db);
        db = NULL;
        e = outbox_db_open(o->db, 0, &db, err, sizeof err);
        if (e == 0)
            e = outbox_schema_check(db, err, sizeof err);
    }
    if (e != 0) {
        errorf("%s (%s)", err[0] ? err : outbox_strerror(e), outbox_err_name(e));
        sqlite3_close_v2(db);
        return is_config_error(e) ? EXIT_USAGE : EXIT_FAIL;
    }
    *out = db;
    return GO_ON;
}

static int db_fail(sqlite3 *db, const char *what)
{
    int code = sqlite3_errcode(db) & 0xff;
    if (code == SQLITE_BUSY || code == SQLITE_LOCKED)
        errorf("%s: the database stayed locked by another connection for more than the 5 s busy timeout (%s)",
               what, sqlite3_errmsg(db));
    else
        errorf("%s: %s", what, sqlite3_errmsg(db));
    return EXIT_FAIL;
}

/* Appends the filters as " AND ..." terms with parameters :f1..:fN, in the
 * order where_bind() binds them. They are named, not numbered, so that they
 * cannot share a slot with the named parameters (:now, ...) of the rest of
 * a statement, which SQLite numbers in order of appearance. states:
 * STATE_BIT()s, 0 for any. */
static void where_sql(sbuf *b, const replay_options *o, unsigned states)
{
    int n = 0, s;
    size_t i;
    if (states) {
        const char *sep = "";
        sb_addf(b, " AND state IN (");
        for (s = 0; s < ST_COUNT; s++)
            if (states & STATE_BIT(s)) {
                sb_addf(b, "%s:f%d", sep, ++n);
                sep = ", ";
            }
        sb_addf(b, ")");
    }
    if (o->topic)
        sb_addf(b, " AND topic = :f%d", ++n);
    if (o->key)
        sb_addf(b, " AND key = :f%d", ++n);
    if (o->id_prefix) {
        sb_addf(b, " AND id >= :f%d AND id < :f%d", n + 1, n + 2);
        n += 2;
    }
    if (o->has_since)
        sb_addf(b, " AND created_at >= :f%d", ++n);
    if (o->has_until)
        sb_addf(b, " AND created_at < :f%d", ++n);
    if (o->nids) {
        sb_addf(b, " AND id IN (");
        for (i = 0; i < o->nids; i++)
            sb_addf(b, "%s:f%d", i ? ", " : "", ++n);
        sb_addf(b, ")");
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
    for (s = 0; s < ST_COUNT; s++)
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

/* Binds a named parameter if the statement has it. */
static int bind_named(sqlite3_stmt *st, const char *name, int64_t v)
{
    int i = sqlite3_bind_parameter_index(st, name);
    return i ? sqlite3_bind_int64(st, i, v) : SQLITE_OK;
}

/* Prepares "SELECT cols FROM outbox WHERE <filters><extra><tail>" with the
 * filters bound. extra and tail are fixed text from this file whose values
 * are named parameters (:now, :last, :max, :lim) bound by the caller. */
static int prepare_select(sqlite3 *db, const replay_options *o, unsigned states, const char *cols, const char *extra,
                          const char *tail, sqlite3_stmt **out)
{
    sbuf b = {0};
    int rc;
    *out = NULL;
    sb_addf(&b, "SELECT %s FROM outbox WHERE 1", cols);
    where_sql(&b, o, states);
    sb_addf(&b, "%s%s", extra, tail);
    if (b.oom) {
        free(b.p);
        errorf("out of memory");
        return -1;
    }
    rc = sqlite3_prepare_v2(db, b.p, -1, out, NULL);
    free(b.p);
    if (rc == SQLITE_OK)
        rc = where_bind(*out, o, states);
    if (rc != SQLITE_OK) {
        db_fail(db, "cannot prepare the query");
        sqlite3_finalize(*out);
        *out = NULL;
        return -1;
    }
    return 0;
}

static int finish_output(void)
{
    if (fflush(stdout) != 0 || ferror(stdout)) {
        errorf("cannot write the output: %s", strerror(errno));
        return EXIT_FAIL;
    }
    return EXIT_OK;
}

/* ---- rows ---------------------------------------------------------------- */

#define ROW_COLS                                                                                            \
    "seq, id, state, topic, key, attempts, last_error, lease_owner, lease_token, lease_until, created_at, " \
    "available_at, published_at, stream_id, replay_count, replayed_at, replay_reason"
enum {
    C_SEQ,
    C_ID,
    C_STATE,
    C_TOPIC,
    C_KEY,
    C_ATTEMPTS,
    C_LAST_ERROR,
    C_LEASE_OWNER,
    C_LEASE_TOKEN,
    C_LEASE_UNTIL,
    C_CREATED,
    C_AVAILABLE,
    C_PUBLISHED,
    C_STREAM_ID,
    C_REPLAY_COUNT,
    C_REPLAYED_AT,
    C_REPLAY_REASON,
    C_PAYLOAD,
    C_HEADERS
};

static int col_null(sqlite3_stmt *st, int i)
{
    return sqlite3_column_type(st, i) == SQLITE_NULL;
}

static const unsigned char *col_text(sqlite3_stmt *st, int i, size_t *n)
{
    const unsigned char *s;
    if (col_null(st, i)) {
        *n = 0;
        return NULL;
    }
    s = sqlite3_column_text(st, i);
    *n = (size_t)sqlite3_column_bytes(st, i);
    return s ? s : (const unsigned char *)"";
}

static const char *state_name(int64_t s)
{
    return s >= 0 && s < ST_COUNT ? replay_state_names[s] : "unknown";
}

/* What a requeue or purge does to one row. */
typedef enum action { ACT_NONE, ACT_REQUEUE, ACT_SKIP, ACT_TAKE, ACT_DELETE, ACT_COUNT } action;
static const char *const action_text[ACT_COUNT] = {"", "requeue", "skip: live lease", "take: live lease",
                                                   "delete"};
static const char *const action_json[ACT_COUNT] = {"", "requeue", "skip_live_lease", "take_live_lease", "delete"};

static int lease_live(sqlite3_stmt *st, int64_t now)
{
    return sqlite3_column_int64(st, C_STATE) == ST_SENDING && !col_null(st, C_LEASE_UNTIL) &&
           sqlite3_column_int64(st, C_LEASE_UNTIL) > now;
}

static action row_action(sqlite3_stmt *st, command cmd, int force, int64_t now)
{
    if (cmd == CMD_PURGE)
        return ACT_DELETE;
    if (cmd != CMD_REQUEUE)
        return ACT_NONE;
    if (lease_live(st, now))
        return force ? ACT_TAKE : ACT_SKIP;
    return ACT_REQUEUE;
}

static void json_key(FILE *f, const char *k)
{
    fprintf(f, ",\"%s\":", k);
}

static void json_text_col(FILE *f, sqlite3_stmt *st, const char *k, int i)
{
    size_t n;
    const unsigned char *s = col_text(st, i, &n);
    json_key(f, k);
    if (s)
        json_str(f, s, n);
    else
        fputs("null", f);
}

static void json_int_col(FILE *f, sqlite3_stmt *st, const char *k, int i)
{
    json_key(f, k);
    if (col_null(st, i))
        fputs("null", f);
    else
        fprintf(f, "%" PRId64, (int64_t)sqlite3_column_int64(st, i));
}

/* "k": "ISO", "k_ms": n (both null for NULL). */
static void json_time_col(FILE *f, sqlite3_stmt *st, const char *k, int i)
{
    char buf[96];
    json_key(f, k);
    if (col_null(st, i)) {
        fprintf(f, "null,\"%s_ms\":null", k);
        return;
    }
    fprintf(f, "\"%s\",\"%s_ms\":%" PRId64, replay_fmt_time(sqlite3_column_int64(st, i), buf), k,
            (int64_t)sqlite3_column_int64(st, i));
}

/* The fields of one message as JSON members, without the braces' closing
 * one: the caller may add more. */
static void json_row_fields(FILE *f, sqlite3_stmt *st, int64_t now)
{
    int64_t state = sqlite3_column_int64(st, C_STATE);
    fprintf(f, "{\"seq\":%" PRId64, (int64_t)sqlite3_column_int64(st, C_SEQ));
    json_text_col(f, st, "id", C_ID);
    fprintf(f, ",\"state\":\"%s\",\"state_code\":%" PRId64, state_name(state), state);
    json_text_col(f, st, "topic", C_TOPIC);
    json_text_col(f, st, "key", C_KEY);
    json_int_col(f, st, "attempts", C_ATTEMPTS);
    json_text_col(f, st, "last_error", C_LAST_ERROR);
    json_text_col(f, st, "lease_owner", C_LEASE_OWNER);
    json_int_col(f, st, "lease_token", C_LEASE_TOKEN);
    json_time_col(f, st, "lease_until", C_LEASE_UNTIL);
    json_key(f, "lease_expires_in_ms");
    if (state == ST_SENDING && !col_null(st, C_LEASE_UNTIL))
        fprintf(f, "%" PRId64, (int64_t)sqlite3_column_int64(st, C_LEASE_UNTIL) - now);
    else
        fputs("null", f);
    fprintf(f, ",\"lease_live\":%s", lease_live(st, now) ? "true" : "false");
    json_time_col(f, st, "created_at", C_CREATED);
    json_time_col(f, st, "available_at", C_AVAILABLE);
    json_time_col(f, st, "published_at", C_PUBLISHED);
    json_text_col(f, st, "stream_id", C_STREAM_ID);
    json_int_col(f, st, "replay_count", C_REPLAY_COUNT);
    json_time_col(f, st, "replayed_at", C_REPLAYED_AT);
    json_text_col(f, st, "replay_reason", C_REPLAY_REASON);
}

/* ---- the human table ----------------------------------------------------- */

enum { T_ACTION, T_ID, T_STATE, T_TOPIC, T_KEY, T_ATTEMPTS, T_ERROR, T_LEASE, T_CREATED, T_PUBLISHED, T_REPLAYS, T_COUNT };
static const char *const table_heads[T_COUNT] = {"ACTION", "ID",    "STATE",   "TOPIC",     "KEY",    "ATTEMPTS",
                                                 "LAST ERROR", "LEASE", "CREATED", "PUBLISHED", "REPLAYS"};
/* Widest cell of each column, in characters; longer text is cut with "...".
 * Ids and topics (at most 128) are never cut. */
static const size_t table_max[T_COUNT] = {16, OUTBOX_ID_MAX, 9, OUTBOX_TOPIC_MAX, 32, 8, 48, 48, 24, 24, 7};
#define CELL_CAP (OUTBOX_ID_MAX * 4 + 8)

typedef struct cell {
    char s[CELL_CAP];
    size_t width; /* in characters */
} cell;

/* One table cell from arbitrary bytes: one line, at most maxw characters;
 * control characters, C1 controls and invalid UTF-8 show as '?', so the
 * width is the number of characters written. */
static void cell_set(cell *c, const unsigned char *s, size_t n, size_t maxw)
{
    size_t i = 0, chars = 0, out = 0, limit, l;
    uint32_t cp;
    for (i = 0; i < n; i += l ? l : 1, chars++)
        l = utf8_seq(s + i, n - i, &cp);
    limit = chars > maxw ? maxw - 3 : chars;
    chars = 0;
    for (i = 0; i < n && chars < limit; chars++) {
        l = utf8_seq(s + i, n - i, &cp);
        if (l == 0 || cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp < 0xa0)) {
            c->s[out++] = (l != 0 && (cp == '\n' || cp == '\t' || cp == '\r')) ? ' ' : '?';
            i += l ? l : 1;
        } else {
            memcpy(c->s + out, s + i, l);
            out += l;
            i += l;
        }
    }
    if (limit < chars || i < n) {
        memcpy(c->s + out, "...", 3);
        out += 3;
        chars += 3;
    }
    c->s[out] = '\0';
    c->width = chars;
}

static void cell_str(cell *c, const char *s)
{
    cell_set(c, (const unsigned char *)s, strlen(s), CELL_CAP / 4);
}

static void cell_col(cell *c, sqlite3_stmt *st, int i, size_t maxw)
{
    size_t n;
    const unsigned char *s = col_text(st, i, &n);
    if (s && n)
        cell_set(c, s, n, maxw);
    else
        cell_str(c, "-");
}

static void cell_time(cell *c, sqlite3_stmt *st, int i)
{
    char buf[96];
    cell_str(c, col_null(st, i) ? "-" : replay_fmt_time(sqlite3_column_int64(st, i), buf));
}

static void row_cells(cell *cells, sqlite3_stmt *st, action act, int64_t now)
{
    char buf[64], d[32];
    cell_str(&cells[T_ACTION], action_text[act]);
    cell_col(&cells[T_ID], st, C_ID, table_max[T_ID]);
    cell_str(&cells[T_STATE], state_name(sqlite3_column_int64(st, C_STATE)));
    cell_col(&cells[T_TOPIC], st, C_TOPIC, table_max[T_TOPIC]);
    cell_col(&cells[T_KEY], st, C_KEY, table_max[T_KEY]);
    cell_col(&cells[T_ATTEMPTS], st, C_ATTEMPTS, table_max[T_ATTEMPTS]);
    cell_col(&cells[T_ERROR], st, C_LAST_ERROR, table_max[T_ERROR]);
    if (sqlite3_column_int64(st, C_STATE) == ST_SENDING || !col_null(st, C_LEASE_OWNER)) {
        cell *c = &cells[T_LEASE];
        int64_t until = sqlite3_column_int64(st, C_LEASE_UNTIL);
        cell_col(c, st, C_LEASE_OWNER, 24);
        if (col_null(st, C_LEASE_UNTIL))
            snprintf(buf, sizeof buf, " (no expiry)");
        else if (until > now)
            snprintf(buf, sizeof buf, " (expires in %s)", fmt_dur(until - now, d));
        else
            snprintf(buf, sizeof buf, " (expired %s ago)", fmt_dur(now - until, d));
        snprintf(c->s + strlen(c->s), sizeof c->s - strlen(c->s), "%s", buf);
        c->width += strlen(buf);
    } else {
        cell_str(&cells[T_LEASE], "-");
    }
    cell_time(&cells[T_CREATED], st, C_CREATED);
    cell_time(&cells[T_PUBLISHED], st, C_PUBLISHED);
    cell_col(&cells[T_REPLAYS], st, C_REPLAY_COUNT, table_max[T_REPLAYS]);
}

static void print_line(FILE *f, const cell *cells, const size_t *widths, int first)
{
    for (int i = first; i < T_COUNT; i++) {
        fputs(cells[i].s, f);
        if (i + 1 < T_COUNT)
            for (size_t k = cells[i].width; k < widths[i] + 2; k++)
                putc(' ', f);
    }
    putc('\n', f);
}

/* What print_rows() prints. */
typedef struct rowsel {
    unsigned states;
    int64_t max_seq; /* only rows with seq <= max_seq; 0 for all */
    int64_t limit;   /* at most this many; 0 for all */
    command cmd;     /* CMD_REQUEUE or CMD_PURGE adds the action of each row */
} rowsel;

typedef struct rowcount {
    int64_t rows;
    int64_t by_action[ACT_COUNT];
    int more; /* rows beyond the limit exist */
} rowcount;

/* Prints the selected rows as a table (two passes over the same read
 * transaction: widths, then lines; memory stays bounded whatever the number
 * of rows) or as a JSON array. The caller holds a read transaction. */
static int print_rows(sqlite3 *db, const replay_options *o, const rowsel *rs, int64_t now, rowcount *count)
{
    sqlite3_stmt *st;
    size_t widths[T_COUNT];
    cell *cells;
    int pass, rc = 0, first = rs->cmd == CMD_REQUEUE || rs->cmd == CMD_PURGE ? T_ACTION : T_ID;

    memset(count, 0, sizeof *count);
    if (prepare_select(db, o, rs->states, ROW_COLS, rs->max_seq ? " AND seq <= :max" : "",
                       rs->limit ? " ORDER BY seq LIMIT :lim" : " ORDER BY seq", &st) != 0)
        return -1;
    bind_named(st, ":max", rs->max_seq);
    bind_named(st, ":lim", rs->limit + 1);
    cells = malloc(sizeof *cells * T_COUNT);
    if (!cells) {
        sqlite3_finalize(st);
        errorf("out of memory");
        return -1;
    }
    for (int i = 0; i < T_COUNT; i++)
        widths[i] = strlen(table_heads[i]);

    for (pass = o->json ? 1 : 0; pass < 2 && rc == 0; pass++) {
        int64_t n = 0;
        if (pass == 1 && o->json)
            fputs("[", stdout);
        else if (pass == 1 && count->rows) {
            for (int i = 0; i < T_COUNT; i++)
                cell_str(&cells[i], table_heads[i]);
            print_line(stdout, cells, widths, first);
        }
        sqlite3_reset(st);
        while ((rc = sqlite3_step(st)) == SQLITE_ROW) {
            action act;
            if (rs->limit && n == rs->limit) {
                count->more = 1;
                break;
            }
            n++;
            act = row_action(st, rs->cmd, o->force, now);
            if (pass == 0) {
                row_cells(cells, st, act, now);
                for (int i = 0; i < T_COUNT; i++)
                    if (cells[i].width > widths[i])
                        widths[i] = cells[i].width;
                continue;
            }
            count->by_action[act]++;
            if (o->json) {
                fputs(n > 1 ? ",\n" : "\n", stdout);
                json_row_fields(stdout, st, now);
                if (act != ACT_NONE)
                    fprintf(stdout, ",\"action\":\"%s\"", action_json[act]);
                fputs("}", stdout);
            } else {
                row_cells(cells, st, act, now);
                print_line(stdout, cells, widths, first);
            }
        }
        rc = rc == SQLITE_ROW || rc == SQLITE_DONE ? 0 : rc;
        count->rows = n;
        if (pass == 1 && o->json)
            fputs(n ? "\n]" : "]", stdout);
    }
    free(cells);
    if (rc != 0)
        db_fail(db, "cannot read the outbox table");
    sqlite3_finalize(st);
    return rc ? -1 : 0;
}

/* ---- list ---------------------------------------------------------------- */

static int cmd_list(const replay_options *o)
{
    sqlite3 *db;
    rowsel rs = {o->states, 0, o->limit, CMD_LIST};
    rowcount count;
    int rc = open_db(o, 0, &db);
    if (rc != GO_ON)
        return rc;
    /* One read transaction: both passes of the table see the same rows. */
    sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
    rc = print_rows(db, o, &rs, outbox_now_ms(), &count);
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    sqlite3_close_v2(db);
    if (rc != 0)
        return EXIT_FAIL;
    if (o->json)
        putchar('\n');
    if (count.rows == 0 && !o->json)
        errorf("no messages match");
    if (count.more)
        errorf("showing the first %" PRId64 " matching messages; more match (raise --limit, 0 for all)", o->limit);
    return finish_output();
}

/* ---- show ---------------------------------------------------------------- */

static void msgpack_json(FILE *f, const msgpack_object *ob);

static void msgpack_key_json(FILE *f, const msgpack_object *k)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *m;
    if (k->type == MSGPACK_OBJECT_STR) {
        json_str(f, (const unsigned char *)k->via.str.ptr, k->via.str.size);
        return;
    }
    /* JSON keys are strings: another key type becomes its JSON text. */
    m = open_memstream(&buf, &len);
    if (!m) {
        fputs("\"?\"", f);
        return;
    }
    msgpack_json(m, k);
    fclose(m);
    json_str(f, (const unsigned char *)buf, len);
    free(buf);
}

/* One msgpack object as JSON: bin as {"base64": ...}, ext as
 * {"ext_type": n, "base64": ...}, non-finite floats as null. The depth is
 * bounded by outbox__msgpack_check(). */
static void msgpack_json(FILE *f, const msgpack_object *ob)
{
    uint32_t i;
    switch (ob->type) {
    case MSGPACK_OBJECT_NIL:
        fputs("null", f);
        break;
    case MSGPACK_OBJECT_BOOLEAN:
        fputs(ob->via.boolean ? "true" : "false", f);
        break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        fprintf(f, "%" PRIu64, ob->via.u64);
        break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER:
        fprintf(f, "%" PRId64, ob->via.i64);
        break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        if (isfinite(ob->via.f64))
            fprintf(f, "%.17g", ob->via.f64);
        else
            fputs("null", f);
        break;
    case MSGPACK_OBJECT_STR:
        json_str(f, (const unsigned char *)ob->via.str.ptr, ob->via.str.size);
        break;
    case MSGPACK_OBJECT_BIN:
        fputs("{\"base64\":\"", f);
        base64(f, (const unsigned char *)ob->via.bin.ptr, ob->via.bin.size);
        fputs("\"}", f);
        break;
    case MSGPACK_OBJECT_EXT:
        fprintf(f, "{\"ext_type\":%d,\"base64\":\"", (int)ob->via.ext.type);
        base64(f, (const unsigned char *)ob->via.ext.ptr, ob->via.ext.size);
        fputs("\"}", f);
        break;
    case MSGPACK_OBJECT_ARRAY:
        putc('[', f);
        for (i = 0; i < ob->via.array.size; i++) {
            if (i)
                putc(',', f);
            msgpack_json(f, &ob->via.array.ptr[i]);
        }
        putc(']', f);
        break;
    case MSGPACK_OBJECT_MAP:
        putc('{', f);
        for (i = 0; i < ob->via.map.size; i++) {
            if (i)
                putc(',', f);
            msgpack_key_json(f, &ob->via.map.ptr[i].key);
            putc(':', f);
            msgpack_json(f, &ob->via.map.ptr[i].val);
        }
        putc('}', f);
        break;
    default:
        fputs("null", f);
    }
}

/* Decodes headers for show. Returns 0 with u holding exactly one object,
 * or -1 with *why (u is then empty). Bounds are checked before msgpack-c
 * allocates anything (see src/msgpack_check.h). */
static int decode_headers(const void *data, size_t len, msgpack_unpacked *u, const char **why)
{
    size_t used = 0, off = 0;
    int e = outbox__msgpack_check(data, len, &used);
    msgpack_unpacked_init(u);
    if (e == OUTBOX_ETRUNCATED) {
        *why = "truncated msgpack";
        return -1;
    }
    if (e != 0) {
        *why = "not valid msgpack";
        return -1;
    }
    if (used != len) {
        *why = "trailing bytes after one msgpack object";
        return -1;
    }
    if (msgpack_unpack_next(u, data, len, &off) != MSGPACK_UNPACK_SUCCESS) {
        *why = "not valid msgpack";
        return -1;
    }
    return 0;
}

static void show_json(sqlite3_stmt *st, int64_t now)
{
    const unsigned char *payload = sqlite3_column_blob(st, C_PAYLOAD);
    size_t plen = (size_t)sqlite3_column_bytes(st, C_PAYLOAD);
    int text = utf8_valid(payload, plen);

    json_row_fields(stdout, st, now);
    printf(",\"payload_size\":%zu,\"payload_encoding\":\"%s\",\"payload\":", plen, text ? "utf8" : "base64");
    if (text) {
        json_str(stdout, payload, plen);
    } else {
        putchar('"');
        base64(stdout, payload, plen);
        putchar('"');
    }
    fputs(",\"headers\":", stdout);
    if (col_null(st, C_HEADERS)) {
        fputs("null", stdout);
    } else {
        const void *h = sqlite3_column_blob(st, C_HEADERS);
        size_t hlen = (size_t)sqlite3_column_bytes(st, C_HEADERS);
        msgpack_unpacked u;
        const char *why = NULL;
        if (decode_headers(h, hlen, &u, &why) == 0) {
            msgpack_json(stdout, &u.data);
            if (u.data.type != MSGPACK_OBJECT_MAP)
                fputs(",\"headers_error\":\"not a msgpack map\"", stdout);
        } else {
            fputs("null,\"headers_error\":", stdout);
            json_cstr(stdout, why);
            fputs(",\"headers_base64\":\"", stdout);
            base64(stdout, h, hlen);
            putchar('"');
        }
        msgpack_unpacked_destroy(&u);
    }
    fputs("}\n", stdout);
}

static void show_field(const char *label, sqlite3_stmt *st, int i)
{
    size_t n;
    const unsigned char *s = col_text(st, i, &n);
    printf("%-14s ", label);
    if (s)
        print_clean(stdout, s, n, 0);
    else
        fputs("-", stdout);
    putchar('\n');
}

static void show_time(const char *label, sqlite3_stmt *st, int i, int64_t now)
{
    char buf[96], d[32];
    int64_t t = sqlite3_column_int64(st, i);
    printf("%-14s ", label);
    if (col_null(st, i))
        puts("-");
    else
        printf("%s (%s %s)\n", replay_fmt_time(t, buf), fmt_dur(now - t, d), t <= now ? "ago" : "from now");
}

static void show_human(sqlite3_stmt *st, int64_t now)
{
    const unsigned char *payload = sqlite3_column_blob(st, C_PAYLOAD);
    size_t plen = (size_t)sqlite3_column_bytes(st, C_PAYLOAD);
    int64_t state = sqlite3_column_int64(st, C_STATE), replays = sqlite3_column_int64(st, C_REPLAY_COUNT);
    char buf[96], d[32];

    show_field("id:", st, C_ID);
    printf("%-14s %" PRId64 "\n", "seq:", (int64_t)sqlite3_column_int64(st, C_SEQ));
    printf("%-14s %s\n", "state:", state_name(state));
    show_field("topic:", st, C_TOPIC);
    show_field("key:", st, C_KEY);
    printf("%-14s %" PRId64 "\n", "attempts:", (int64_t)sqlite3_column_int64(st, C_ATTEMPTS));
    show_field("last error:", st, C_LAST_ERROR);
    printf("%-14s ", "lease:");
    if (state == ST_SENDING || !col_null(st, C_LEASE_OWNER)) {
        size_t n;
        const unsigned char *owner = col_text(st, C_LEASE_OWNER, &n);
        int64_t until = sqlite3_column_int64(st, C_LEASE_UNTIL);
        fputs("owner ", stdout);
        if (owner)
            print_clean(stdout, owner, n, 0);
        else
            fputs("-", stdout);
        printf(", token %" PRId64, (int64_t)sqlite3_column_int64(st, C_LEASE_TOKEN));
        if (col_null(st, C_LEASE_UNTIL))
            puts(", no expiry");
        else
            printf(", until %s (%s %s)\n", replay_fmt_time(until, buf), until > now ? "live, expires in" : "expired",
                   fmt_dur(until - now, d));
    } else {
        printf("- (token %" PRId64 ")\n", (int64_t)sqlite3_column_int64(st, C_LEASE_TOKEN));
    }
    show_time("created:", st, C_CREATED, now);
    show_time("available:", st, C_AVAILABLE, now);
    show_time("published:", st, C_PUBLISHED, now);
    show_field("stream id:", st, C_STREAM_ID);
    printf("%-14s %" PRId64 "\n", "replays:", replays);
    if (replays > 0 || !col_null(st, C_REPLAYED_AT)) {
        show_time("replayed:", st, C_REPLAYED_AT, now);
        show_field("replay reason:", st, C_REPLAY_REASON);
    }
    printf("%-14s ", "headers:");
    if (col_null(st, C_HEADERS)) {
        puts("-");
    } else {
        const void *h = sqlite3_column_blob(st, C_HEADERS);
        size_t hlen = (size_t)sqlite3_column_bytes(st, C_HEADERS);
        msgpack_unpacked u;
        const char *why = NULL;
        if (decode_headers(h, hlen, &u, &why) == 0) {
            msgpack_json(stdout, &u.data);
            puts(u.data.type == MSGPACK_OBJECT_MAP ? "" : " (not a msgpack map)");
        } else {
            printf("undecodable (%s), base64 ", why);
            base64(stdout, h, hlen);
            putchar('\n');
        }
        msgpack_unpacked_destroy(&u);
    }
    if (utf8_valid(payload, plen)) {
        printf("%-14s %zu bytes, utf8 text:\n", "payload:", plen);
        print_clean(stdout, payload, plen, 1);
    } else {
        printf("%-14s %zu bytes, not UTF-8, base64:\n", "payload:", plen);
        base64(stdout, payload, plen);
    }
    putchar('\n');
}

static int cmd_show(const replay_options *o)
{
    sqlite3 *db;
    sqlite3_stmt *st = NULL;
    int rc = open_db(o, 0, &db);
    if (rc != GO_ON)
        return rc;
    if (sqlite3_prepare_v2(db, "SELECT " ROW_COLS ", payload, headers FROM outbox WHERE id = ?1", -1, &st, NULL) !=
            SQLITE_OK ||
        sqlite3_bind_text(st, 1, o->show_id, -1, SQLITE_STATIC) != SQLITE_OK) {
        rc = db_fail(db, "cannot prepare the query");
        goto done;
    }
    rc = sqlite3_step(st);
    if (rc == SQLITE_DONE) {
        errorf("no message with id %s", o->show_id);
        rc = EXIT_FAIL;
    } else if (rc != SQLITE_ROW) {
        rc = db_fail(db, "cannot read the message");
    } else {
        if (o->json)
            show_json(st, outbox_now_ms());
        else
            show_human(st, outbox_now_ms());
        rc = finish_output();
    }
done:
    sqlite3_finalize(st);
    sqlite3_close_v2(db);
    return rc;
}

/* ---- stats --------------------------------------------------------------- */

static int cmd_stats(const replay_options *o)
{
    sqlite3 *db;
    sqlite3_stmt *by_topic = NULL, *due = NULL, *oldest = NULL, *leases = NULL;
    int64_t now = outbox_now_ms(), total[ST_COUNT] = {0}, all = 0, due_n = 0, live = 0, expired = 0;
    int64_t oldest_created = 0;
    char *oldest_id = NULL;
    size_t topic_w = strlen("TOPIC");
    int rc = open_db(o, 0, &db), pass;
    char buf[96], d[32];

    if (rc != GO_ON)
        return rc;
    sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
    if (prepare_select(db, o, o->states, "topic, state, count(*)", "", " GROUP BY topic, state ORDER BY topic, state",
                       &by_topic) != 0 ||
        prepare_select(db, o, o->states, "count(*)", " AND state = 0 AND available_at <= :now", "", &due) != 0 ||
        prepare_select(db, o, o->states, "id, created_at", " AND state = 0 AND available_at <= :now",
                       " ORDER BY created_at, seq LIMIT 1", &oldest) != 0 ||
        prepare_select(db, o, o->states, "coalesce(sum(lease_until > :now), 0), count(*)", " AND state = 1", "",
                       &leases) != 0) {
        rc = EXIT_FAIL;
        goto done;
    }
    bind_named(due, ":now", now);
    bind_named(oldest, ":now", now);
    bind_named(leases, ":now", now);

    while ((rc = sqlite3_step(by_topic)) == SQLITE_ROW) {
        int64_t s = sqlite3_column_int64(by_topic, 1), n = sqlite3_column_int64(by_topic, 2);
        size_t tn;
        col_text(by_topic, 0, &tn);
        if (s >= 0 && s < ST_COUNT)
            total[s] += n;
        all += n;
        if (tn > topic_w)
            topic_w = tn;
    }
    if (rc != SQLITE_DONE)
        goto sql_fail;
    if ((rc = sqlite3_step(due)) != SQLITE_ROW)
        goto sql_fail;
    due_n = sqlite3_column_int64(due, 0);
    rc = sqlite3_step(oldest);
    if (rc == SQLITE_ROW) {
        size_t n;
        const unsigned char *id = col_text(oldest, 0, &n);
        oldest_id = strndup(id ? (const char *)id : "", n);
        oldest_created = sqlite3_column_int64(oldest, 1);
    } else if (rc != SQLITE_DONE) {
        goto sql_fail;
    }
    if ((rc = sqlite3_step(leases)) != SQLITE_ROW)
        goto sql_fail;
    live = sqlite3_column_int64(leases, 0);
    expired = sqlite3_column_int64(leases, 1) - live;

    if (o->json) {
        printf("{\"now\":\"%s\",\"now_ms\":%" PRId64 ",\"total\":%" PRId64 ",\"by_state\":{", replay_fmt_time(now, buf), now,
               all);
        for (int s = 0; s < ST_COUNT; s++)
            printf("%s\"%s\":%" PRId64, s ? "," : "", replay_state_names[s], total[s]);
        printf("},\"dead\":%" PRId64 ",\"pending_due\":%" PRId64 ",\"pending_waiting\":%" PRId64
               ",\"leases_live\":%" PRId64 ",\"leases_expired\":%" PRId64 ",\"oldest_due_pending\":",
               total[ST_DEAD], due_n, total[ST_PENDING] - due_n, live, expired);
        if (oldest_id) {
            fputs("{\"id\":", stdout);
            json_cstr(stdout, oldest_id);
            printf(",\"created_at\":\"%s\",\"created_at_ms\":%" PRId64 ",\"age_ms\":%" PRId64 "}",
                   replay_fmt_time(oldest_created, buf), oldest_created, now - oldest_created);
        } else {
            fputs("null", stdout);
        }
        fputs(",\"by_topic\":[", stdout);
    } else {
        printf("%-10s %12" PRId64 "\n", "total", all);
        printf("%-10s %12" PRId64 "  (due %" PRId64 ", waiting for available_at/backoff %" PRId64 ")\n", "pending",
               total[ST_PENDING], due_n, total[ST_PENDING] - due_n);
        printf("%-10s %12" PRId64 "  (live leases %" PRId64 ", expired %" PRId64 ")\n", "sending", total[ST_SENDING],
               live, expired);
        printf("%-10s %12" PRId64 "\n", "published", total[ST_PUBLISHED]);
        printf("%-10s %12" PRId64 "\n", "dead", total[ST_DEAD]);
        if (oldest_id) {
            printf("oldest due pending: %s ago, created %s, id ", fmt_dur(now - oldest_created, d),
                   replay_fmt_time(oldest_created, buf));
            print_clean(stdout, (const unsigned char *)oldest_id, strlen(oldest_id), 0);
            putchar('\n');
        } else {
            puts("oldest due pending: - (none due)");
        }
        if (all)
            printf("\n%-*s  %10s %10s %10s %10s %10s\n", (int)topic_w, "TOPIC", "PENDING", "SENDING", "PUBLISHED",
                   "DEAD", "TOTAL");
    }

    /* Second pass over the groups (same read transaction), one line or
     * object per topic; rows arrive ordered by topic. */
    sqlite3_reset(by_topic);
    {
        int64_t cur[ST_COUNT] = {0};
        char *topic = NULL;
        int ntopics = 0;
        for (pass = 1;; pass++) {
            size_t tn = 0;
            const unsigned char *t = NULL;
            int64_t s = 0, n = 0;
            rc = sqlite3_step(by_topic);
            if (rc == SQLITE_ROW) {
                t = col_text(by_topic, 0, &tn);
                s = sqlite3_column_int64(by_topic, 1);
                n = sqlite3_column_int64(by_topic, 2);
            } else if (rc != SQLITE_DONE) {
                free(topic);
                goto sql_fail;
            }
            if (topic && (rc == SQLITE_DONE || strlen(topic) != tn || memcmp(topic, t, tn) != 0)) {
                int64_t sum = cur[0] + cur[1] + cur[2] + cur[3];
                if (o->json) {
                    fputs(ntopics ? ",{\"topic\":" : "{\"topic\":", stdout);
                    json_cstr(stdout, topic);
                    for (int k = 0; k < ST_COUNT; k++)
                        printf(",\"%s\":%" PRId64, replay_state_names[k], cur[k]);
                    printf(",\"total\":%" PRId64 "}", sum);
                } else {
                    cell c;
                    cell_set(&c, (const unsigned char *)topic, strlen(topic), OUTBOX_TOPIC_MAX);
                    fputs(c.s, stdout);
                    printf("%*s  %10" PRId64 " %10" PRId64 " %10" PRId64 " %10" PRId64 " %10" PRId64 "\n",
                           (int)(topic_w - c.width), "", cur[0], cur[1], cur[2], cur[3], sum);
                }
                ntopics++;
                free(topic);
                topic = NULL;
                memset(cur, 0, sizeof cur);
            }
            if (rc == SQLITE_DONE)
                break;
            if (!topic) {
                topic = strndup(t ? (const char *)t : "", tn);
                if (!topic) {
                    errorf("out of memory");
                    rc = EXIT_FAIL;
                    goto done;
                }
            }
            if (s >= 0 && s < ST_COUNT)
                cur[s] += n;
        }
    }
    if (o->json)
        fputs("]}\n", stdout);
    rc = finish_output();
    goto done;
sql_fail:
    rc = db_fail(db, "cannot read the outbox table");
done:
    free(oldest_id);
    sqlite3_finalize(by_topic);
    sqlite3_finalize(due);
    sqlite3_finalize(oldest);
    sqlite3_finalize(leases);
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    sqlite3_close_v2(db);
    return rc;
}

/* ---- requeue and purge --------------------------------------------------- */

static volatile sig_atomic_t interrupted;

static void on_interrupt(int sig)
{
    (void)sig;
    interrupted = 1;
}

/* Warns (stderr) about --id values that name no message at all, so a typo
 * in a list of ids does not go unnoticed. */
static void warn_missing_ids(sqlite3 *db, const replay_options *o)
{
    sqlite3_stmt *st;
    size_t i, missing = 0;
    if (!o->nids || sqlite3_prepare_v2(db, "SELECT 1 FROM outbox WHERE id = ?1", -1, &st, NULL) != SQLITE_OK)
        return;
    for (i = 0; i < o->nids; i++) {
        sqlite3_reset(st);
        sqlite3_bind_text(st, 1, o->ids[i], -1, SQLITE_STATIC);
        if (sqlite3_step(st) == SQLITE_DONE && ++missing <= 20)
            errorf("warning: no message with id %s", o->ids[i]);
    }
    if (missing > 20)
        errorf("warning: %zu more ids name no message", missing - 20);
    sqlite3_finalize(st);
}

static const char *plural(int64_t n, const char *one, const char *many)
{
    return n == 1 ? one : many;
}

/* The dry run: the rows, what would happen to each, and a summary, from one
 * read transaction (the caller's). */
static int dry_run(sqlite3 *db, const replay_options *o, unsigned states, int64_t max_seq, int64_t now)
{
    int purge = o->cmd == CMD_PURGE;
    rowsel rs = {states, max_seq, 0, o->cmd};
    rowcount c;
    int64_t touch;

    if (o->json)
        printf("{\"command\":\"%s\",\"dry_run\":true,\"rows\":", replay_command_names[o->cmd]);
    if (print_rows(db, o, &rs, now, &c) != 0)
        return EXIT_FAIL;
    touch = c.by_action[ACT_REQUEUE] + c.by_action[ACT_TAKE] + c.by_action[ACT_DELETE];
    if (o->json) {
        if (purge)
            printf(",\"would_delete\":%" PRId64, touch);
        else
            printf(",\"would_requeue\":%" PRId64 ",\"would_take_live_lease\":%" PRId64
                   ",\"would_skip_live_lease\":%" PRId64 ",\"reason\":",
                   touch, c.by_action[ACT_TAKE], c.by_action[ACT_SKIP]);
        if (!purge)
            json_cstr(stdout, o->reason);
        printf(",\"threshold\":%" PRId64 ",\"needs_yes\":%s,\"changed\":0}\n", o->threshold,
               touch > o->threshold ? "true" : "false");
        return finish_output();
    }
    if (purge) {
        printf("dry run: would delete %" PRId64 " dead %s; nothing was changed\n", touch,
               plural(touch, "message", "messages"));
    } else {
        printf("dry run: would requeue %" PRId64 " %s (state pending, available_at now, attempts 0, last_error and "
               "lease cleared, replay_count + 1, replayed_at now, replay_reason \"",
               touch, plural(touch, "message", "messages"));
        print_clean(stdout, (const unsigned char *)o->reason, strlen(o->reason), 0);
        printf("\"); nothing was changed\n");
        if (c.by_action[ACT_TAKE])
            printf("dry run: %" PRId64 " of them %s sending under a live lease: --force would take %s and increment "
                   "lease_token\n",
                   c.by_action[ACT_TAKE], plural(c.by_action[ACT_TAKE], "is", "are"),
                   plural(c.by_action[ACT_TAKE], "it", "them"));
        if (c.by_action[ACT_SKIP])
            printf("dry run: would skip %" PRId64 " sending %s with a live lease (pass --force to take %s)\n",
                   c.by_action[ACT_SKIP], plural(c.by_action[ACT_SKIP], "message", "messages"),
                   plural(c.by_action[ACT_SKIP], "it", "them"));
    }
    if (touch > o->threshold)
        printf("dry run: that is more than --threshold %" PRId64 ": the real run needs --yes\n", o->threshold);
    return finish_output();
}

typedef struct progress {
    int on;
    int64_t done, total;
} progress;

static void progress_show(const progress *p, const char *verb)
{
    if (p->on)
        fprintf(stderr, "\r%s: %s %" PRId64 "/%" PRId64 " (%d%%)", prog, verb, p->done, p->total,
                p->total ? (int)(p->done * 100 / p->total) : 100);
}

static int cmd_change(const replay_options *o)
{
    const int purge = o->cmd == CMD_PURGE;
    const char *verb = purge ? "purge" : "requeue";
    unsigned states = purge ? STATE_BIT(ST_DEAD)
                            : (o->states ? o->states
                                         : STATE_BIT(ST_SENDING) | STATE_BIT(ST_PUBLISHED) | STATE_BIT(ST_DEAD));
    sqlite3 *db;
    sqlite3_stmt *count = NULL, *sel = NULL, *change = NULL;
    int64_t now, matched, live, max_seq, touch, last = 0, done = 0, skipped = 0, taken = 0, ntx = 0;
    int64_t by_state[ST_COUNT] = {0};
    int64_t *seqs = NULL, *prev = NULL;
    int *lives = NULL;
    progress pg = {0, 0, 0};
    struct sigaction sa, old_int, old_term;
    int rc = open_db(o, !o->dry_run, &db);

    if (rc != GO_ON)
        return rc;

    /* What matches, in one read transaction; max_seq bounds the run so that
     * rows committed while it runs (new dead letters) are not swept up
     * beyond what was counted against --threshold. */
    sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
    now = outbox_now_ms();
    if (prepare_select(db, o, states, "count(*), coalesce(sum(state = 1 AND lease_until > :now), 0), "
                                      "coalesce(max(seq), 0)",
                       "", "", &count) != 0) {
        rc = EXIT_FAIL;
        goto done;
    }
    bind_named(count, ":now", now);
    if (sqlite3_step(count) != SQLITE_ROW) {
        rc = db_fail(db, "cannot read the outbox table");
        goto done;
    }
    matched = sqlite3_column_int64(count, 0);
    live = purge ? 0 : sqlite3_column_int64(count, 1);
    max_seq = sqlite3_column_int64(count, 2);
    warn_missing_ids(db, o);
    if (matched == 0) {
        if (purge)
            errorf("nothing matches: no dead message matches the filters; nothing was changed");
        else if (!o->states)
            errorf("nothing matches: no dead, published or sending message matches the filters (pending ones only "
                   "with --state pending); nothing was changed");
        else
            errorf("nothing matches the filters; nothing was changed");
        rc = EXIT_FAIL;
        goto done;
    }
    if (o->dry_run) {
        rc = dry_run(db, o, states, max_seq, now);
        goto done;
    }
    /* End the read transaction for good: a statement left open would keep
     * it, and SQLite runs the busy handler only for a connection without an
     * open transaction, so BEGIN IMMEDIATE would fail at once instead of
     * waiting busy_timeout for the relay or the application. */
    sqlite3_finalize(count);
    count = NULL;
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    touch = o->force ? matched : matched - live;
    if (touch == 0) {
        errorf("nothing to requeue: the %" PRId64 " matching %s %s being sent under a live lease (pass --force to "
               "take %s: the holder's late marks will be refused); nothing was changed",
               matched, plural(matched, "message", "messages"), plural(matched, "is", "are"),
               plural(matched, "it", "them"));
        rc = EXIT_FAIL;
        goto done;
    }
    if (touch > o->threshold && !o->yes) {
        errorf("%s would touch %" PRId64 " messages, more than --threshold %" PRId64
               ": pass --yes to confirm (see them with --dry-run); nothing was changed",
               verb, touch, o->threshold);
        rc = EXIT_USAGE;
        goto done;
    }

    if (prepare_select(db, o, states, "seq, state, (state = 1 AND lease_until > :now)",
                       " AND seq > :last AND seq <= :max", " ORDER BY seq LIMIT :lim", &sel) != 0) {
        rc = EXIT_FAIL;
        goto done;
    }
    rc = sqlite3_prepare_v2(db,
                            purge ? "DELETE FROM outbox WHERE seq = :seq AND state = 3"
                                  /* available_at after created_at: a waiting row, as every row
                                   * that was claimed before (proto/schema.sql, outbox_due). */
                                  : "UPDATE outbox SET state = 0, available_at = max(:now, created_at + 1), attempts = 0, "
                                    "last_error = NULL, lease_owner = NULL, lease_until = NULL, "
                                    "lease_token = lease_token + (state = 1), replay_count = replay_count + 1, "
                                    "replayed_at = :now, replay_reason = :reason WHERE seq = :seq AND state = :state",
                            -1, &change, NULL);
    if (rc != SQLITE_OK) {
        rc = db_fail(db, "cannot prepare the change");
        goto done;
    }
    if (!purge)
        sqlite3_bind_text(change, sqlite3_bind_parameter_index(change, ":reason"), o->reason, -1, SQLITE_STATIC);
    bind_named(sel, ":max", max_seq);
    bind_named(sel, ":lim", o->batch);
    seqs = malloc(sizeof *seqs * (size_t)o->batch);
    prev = malloc(sizeof *prev * (size_t)o->batch);
    lives = malloc(sizeof *lives * (size_t)o->batch);
    if (!seqs || !prev || !lives) {
        errorf("out of memory");
        rc = EXIT_FAIL;
        goto done;
    }

    /* Stop between batches on SIGINT/SIGTERM: what is committed stays. */
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_interrupt;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);

    pg.on = isatty(STDERR_FILENO) && touch > o->batch;
    pg.total = touch;
    rc = EXIT_OK;
    while (!interrupted) {
        int64_t n = 0, i, b_done = 0, b_skipped = 0, b_taken = 0, b_by_state[ST_COUNT] = {0};
        const char *failed = NULL;
        int step = SQLITE_DONE;
        if (sqlite3_exec(db, "BEGIN IMMEDIATE", NULL, NULL, NULL) != SQLITE_OK) {
            rc = db_fail(db, "cannot take the write lock");
            break;
        }
        now = outbox_now_ms();
        bind_named(sel, ":now", now);
        bind_named(sel, ":last", last);
        bind_named(change, ":now", now);
        /* Read the batch first, then change it: changing rows under a
         * running scan of the same table is not well defined. */
        sqlite3_reset(sel);
        while (n < o->batch && (step = sqlite3_step(sel)) == SQLITE_ROW) {
            seqs[n] = sqlite3_column_int64(sel, 0);
            prev[n] = sqlite3_column_int64(sel, 1);
            lives[n] = sqlite3_column_int(sel, 2);
            n++;
        }
        if (n < o->batch && step != SQLITE_DONE)
            failed = "cannot read the batch";
        sqlite3_reset(sel);
        for (i = 0; i < n && !failed; i++) {
            if (!purge && lives[i] && !o->force) {
                b_skipped++;
                continue;
            }
            sqlite3_reset(change);
            bind_named(change, ":seq", seqs[i]);
            bind_named(change, ":state", prev[i]);
            if (sqlite3_step(change) != SQLITE_DONE) {
                failed = purge ? "cannot delete" : "cannot requeue";
                break;
            }
            if (sqlite3_changes(db) == 1) {
                b_done++;
                if (prev[i] >= 0 && prev[i] < ST_COUNT)
                    b_by_state[prev[i]]++;
                b_taken += !purge && lives[i];
            }
        }
        sqlite3_reset(change);
        if (!failed && sqlite3_exec(db, "COMMIT", NULL, NULL, NULL) != SQLITE_OK)
            failed = "cannot commit";
        if (failed) {
            /* This batch is rolled back; the totals hold what is committed. */
            rc = db_fail(db, failed);
            sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
            break;
        }
        if (n == 0)
            break;
        ntx++;
        done += b_done;
        skipped += b_skipped;
        taken += b_taken;
        for (i = 0; i < ST_COUNT; i++)
            by_state[i] += b_by_state[i];
        last = seqs[n - 1];
        pg.done = done;
        progress_show(&pg, verb);
        if (n < o->batch)
            break;
        /* Let waiting writers (the application, the relay) have the lock
         * before the next batch. */
        usleep(1000);
    }
    if (pg.on)
        fputc('\n', stderr);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);

    if (rc != EXIT_OK && ntx == 0) {
        /* Nothing was committed: the error said it all. */
    } else if (o->json) {
        printf("{\"command\":\"%s\",\"dry_run\":false,\"%s\":%" PRId64, verb, purge ? "deleted" : "requeued", done);
        if (!purge) {
            fputs(",\"by_state\":{", stdout);
            for (int s = 0; s < ST_COUNT; s++)
                printf("%s\"%s\":%" PRId64, s ? "," : "", replay_state_names[s], by_state[s]);
            printf("},\"took_live_lease\":%" PRId64 ",\"skipped_live_lease\":%" PRId64 ",\"reason\":", taken,
                   skipped);
            json_cstr(stdout, o->reason);
        }
        printf(",\"transactions\":%" PRId64 ",\"interrupted\":%s,\"complete\":%s}\n", ntx,
               interrupted ? "true" : "false", rc == EXIT_OK && !interrupted ? "true" : "false");
    } else if (purge) {
        printf("purged %" PRId64 " dead %s in %" PRId64 " %s\n", done, plural(done, "message", "messages"), ntx,
               plural(ntx, "transaction", "transactions"));
    } else {
        const char *sep = " (";
        printf("requeued %" PRId64 " %s", done, plural(done, "message", "messages"));
        for (int s = ST_COUNT - 1; s >= 0; s--)
            if (by_state[s]) {
                printf("%s%s %" PRId64, sep, replay_state_names[s], by_state[s]);
                sep = ", ";
            }
        printf("%s in %" PRId64 " %s, reason \"", done ? ")" : "", ntx, plural(ntx, "transaction", "transactions"));
        print_clean(stdout, (const unsigned char *)o->reason, strlen(o->reason), 0);
        puts("\"");
        if (taken)
            printf("took %" PRId64 " live %s (--force): lease_token incremented, the old holder's marks will be "
                   "refused\n",
                   taken, plural(taken, "lease", "leases"));
        printf("skipped %" PRId64 " sending %s with a live lease%s\n", skipped,
               plural(skipped, "message", "messages"), skipped ? " (pass --force to take them)" : "");
    }
    if (interrupted) {
        errorf("interrupted: %" PRId64 " of %" PRId64 " done and committed; run again to continue", done, touch);
        rc = EXIT_FAIL;
    } else if (rc != EXIT_OK) {
        errorf("stopped: %" PRId64 " of %" PRId64 " done and committed before the error; run again to continue",
               done, touch);
    }
    if (finish_output() != EXIT_OK)
        rc = EXIT_FAIL;
done:
    free(seqs);
    free(prev);
    free(lives);
    sqlite3_finalize(count);
    sqlite3_finalize(sel);
    sqlite3_finalize(change);
    if (!sqlite3_get_autocommit(db))
        sqlite3_exec(db, "ROLLBACK", NULL, NULL, NULL);
    sqlite3_close_v2(db);
    return rc;
}

int main(int argc, char **argv)
{
    replay_options o;
    int rc;

    switch (replay_args_parse(&o, argc, argv)) {
    case REPLAY_ARGS_GO_ON:
        break;
    case REPLAY_ARGS_HELP:
        usage(stdout);
        replay_args_finish(&o);
        return EXIT_OK;
    case REPLAY_ARGS_NO_ARGS:
        usage(stderr);
        replay_args_finish(&o);
        return EXIT_USAGE;
    case REPLAY_ARGS_VERSION:
        printf("%s %s (liboutbox %s)\n", prog, OUTBOX_VERSION_STRING, outbox_version());
        replay_args_finish(&o);
        return EXIT_OK;
    case REPLAY_ARGS_NOMEM:
        errorf("out of memory");
        replay_args_finish(&o);
        return EXIT_FAIL;
    case REPLAY_ARGS_ERROR:
    default:
        errorf("%s", o.error ? o.error : "out of memory");
        replay_args_finish(&o);
        return EXIT_USAGE;
    }
    switch (o.cmd) {
    case CMD_LIST:
        rc = cmd_list(&o);
        break;
    case CMD_SHOW:
        rc = cmd_show(&o);
        break;
    case CMD_STATS:
        rc = cmd_stats(&o);
        break;
    case CMD_REQUEUE:
    case CMD_PURGE:
        rc = cmd_change(&o);
        break;
    default:
        rc = EXIT_USAGE;
    }
    replay_args_finish(&o);
    return rc;
}
