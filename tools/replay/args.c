/*
 * outbox-replay's command line (args.h). Every check of a value happens
 * here, before the database is opened.
 */
#include "args.h"

#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "util/str.h"

const char *const replay_state_names[OUTBOX_STATE_COUNT] = {"pending", "sending", "published", "dead"};
const char *const replay_command_names[CMD_COUNT] = {"list", "show", "stats", "requeue", "purge"};

#define FOR(c) (1u << (c))
#define FOR_FILTERS (FOR(CMD_LIST) | FOR(CMD_STATS) | FOR(CMD_REQUEUE) | FOR(CMD_PURGE))
#define FOR_CHANGES (FOR(CMD_REQUEUE) | FOR(CMD_PURGE))
#define FOR_ALL (FOR_FILTERS | FOR(CMD_SHOW))

static const struct optdef {
    const char *name;
    int takes_value;
    int repeatable;
    unsigned applies; /* FOR() bits of the subcommands that accept it */
} optdefs[O_COUNT] = {
    [O_DB] = {"db", 1, 0, FOR_ALL},
    [O_STATE] = {"state", 1, 1, FOR_FILTERS},
    [O_TOPIC] = {"topic", 1, 0, FOR_FILTERS},
    [O_KEY] = {"key", 1, 0, FOR_FILTERS},
    [O_ID] = {"id", 1, 1, FOR_FILTERS},
    [O_ID_PREFIX] = {"id-prefix", 1, 0, FOR_FILTERS},
    [O_SINCE] = {"since", 1, 0, FOR_FILTERS},
    [O_UNTIL] = {"until", 1, 0, FOR_FILTERS},
    [O_DRY_RUN] = {"dry-run", 0, 0, FOR_CHANGES},
    [O_YES] = {"yes", 0, 0, FOR_CHANGES},
    [O_FORCE] = {"force", 0, 0, FOR(CMD_REQUEUE)},
    [O_REASON] = {"reason", 1, 0, FOR(CMD_REQUEUE)},
    [O_JSON] = {"json", 0, 0, FOR_ALL},
    [O_LIMIT] = {"limit", 1, 0, FOR(CMD_LIST)},
    [O_BATCH] = {"batch", 1, 0, FOR_CHANGES},
    [O_THRESHOLD] = {"threshold", 1, 0, FOR_CHANGES},
    [O_LOG_FORMAT] = {"log-format", 1, 0, FOR_ALL},
    [O_BY_TOPIC] = {"by-topic", 0, 0, FOR(CMD_STATS)},
    [O_DB_DIR] = {"db-dir", 1, 0, FOR(CMD_STATS)},
    [O_DB_GLOB] = {"db-glob", 1, 1, FOR(CMD_STATS)},
    [O_TOP] = {"top", 1, 0, FOR(CMD_STATS)},
};

/* What stats over a directory reads: the figures of each database, so no
 * filter that counts rows, nor --state (the table shows every state). */
static const enum optid dir_excludes[] = {O_DB, O_STATE, O_TOPIC, O_KEY, O_ID, O_ID_PREFIX, O_SINCE, O_UNTIL,
                                          O_BY_TOPIC};

/* Records the message of a usage error; always returns -1. */
static int fail(replay_options *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(replay_options *o, const char *fmt, ...)
{
    va_list ap;
    free(o->error);
    o->error = NULL;
    va_start(ap, fmt);
    if (vasprintf(&o->error, fmt, ap) < 0)
        o->error = NULL;
    va_end(ap);
    return -1;
}

/* ---- times --------------------------------------------------------------- */

/* Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant). */
static int64_t days_from_civil(int64_t y, int m, int d)
{
    int64_t era, yoe, doy, doe;
    y -= m <= 2;
    era = (y >= 0 ? y : y - 399) / 400;
    yoe = y - era * 400;
    doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

static int days_in_month(int64_t y, int m)
{
    static const int days[12] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    int leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    return m == 2 && leap ? 29 : days[m - 1];
}

/* Exactly n decimal digits at *p, advancing it. */
static int digits(const char **p, int n, int *v)
{
    int x = 0;
    for (int i = 0; i < n; i++) {
        char c = (*p)[i];
        if (c < '0' || c > '9')
            return -1;
        x = x * 10 + (c - '0');
    }
    *p += n;
    *v = x;
    return 0;
}

int replay_parse_time(const char *s, int64_t *out, const char **why)
{
    const char *p = s;
    int y, mo, d, h = 0, mi = 0, sec = 0, ms = 0, oh = 0, om = 0, sign = 0;
    size_t n = strlen(s), i;

    *why = "not a time";
    if (n > 0 && strspn(s, "0123456789") == n) {
        if (n > 15) {
            *why = "out of range";
            return -1;
        }
        *out = strtoll(s, NULL, 10);
        return 0;
    }
    if (digits(&p, 4, &y) || *p++ != '-' || digits(&p, 2, &mo) || *p++ != '-' || digits(&p, 2, &d))
        return -1;
    if (mo < 1 || mo > 12 || d < 1 || d > days_in_month(y, mo)) {
        *why = "no such date";
        return -1;
    }
    if (*p) {
        if (*p != 'T' && *p != 't')
            return -1;
        p++;
        if (digits(&p, 2, &h) || *p++ != ':' || digits(&p, 2, &mi))
            return -1;
        if (*p == ':') {
            p++;
            if (digits(&p, 2, &sec))
                return -1;
            if (*p == '.' || *p == ',') {
                p++;
                for (i = 0; p[i] >= '0' && p[i] <= '9'; i++)
                    if (i < 3)
                        ms = ms * 10 + (p[i] - '0');
                if (i == 0 || i > 9)
                    return -1;
                for (; i < 3; i++)
                    ms *= 10;
                p += strspn(p, "0123456789");
            }
        }
        if (h > 23 || mi > 59 || sec > 59) {
            *why = "no such time of day";
            return -1;
        }
        if (*p == 'Z' || *p == 'z') {
            p++;
        } else if (*p == '+' || *p == '-') {
            sign = *p++ == '-' ? -1 : 1;
            if (digits(&p, 2, &oh))
                return -1;
            if (*p == ':')
                p++;
            if (*p && digits(&p, 2, &om))
                return -1;
            if (oh > 23 || om > 59) {
                *why = "no such time zone offset";
                return -1;
            }
        } else if (!*p) {
            *why = "no time zone (add Z or an offset such as +02:00)";
            return -1;
        } else {
            return -1;
        }
        if (*p)
            return -1;
    }
    *out = ((days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + sec) - sign * (oh * 3600 + om * 60)) * 1000 +
           ms;
    return 0;
}

const char *replay_fmt_time(int64_t ms, char buf[96])
{
    int64_t sec = ms >= 0 ? ms / 1000 : -((-ms + 999) / 1000);
    time_t t = (time_t)sec;
    struct tm tm;
    if (!gmtime_r(&t, &tm)) {
        snprintf(buf, 96, "%" PRId64, ms);
        return buf;
    }
    snprintf(buf, 96, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
             tm.tm_hour, tm.tm_min, tm.tm_sec, (int)(ms - sec * 1000));
    return buf;
}

/* ---- arguments ----------------------------------------------------------- */

static int parse_count(replay_options *o, const char *name, const char *v, int64_t min, int64_t max, int64_t *out)
{
    char *end;
    long long x;
    errno = 0;
    if (!*v || strspn(v, "0123456789") != strlen(v)) {
        fail(o, "--%s: '%s' is not a whole number (%" PRId64 "..%" PRId64 ")", name, v, min, max);
        return -1;
    }
    x = strtoll(v, &end, 10);
    if (errno == ERANGE || x < min || x > max) {
        fail(o, "--%s: %s is out of range %" PRId64 "..%" PRId64, name, v, min, max);
        return -1;
    }
    *out = x;
    return 0;
}

static int set_option(replay_options *o, enum optid id, const char *v)
{
    char err[256];
    const char *why;
    const char *name = optdefs[id].name;
    size_t n;
    int s;

    switch (id) {
    case O_DB:
    case O_DB_DIR:
        if (!*v) {
            fail(o, "--%s: empty path", name);
            return -1;
        }
        *(id == O_DB ? &o->db : &o->db_dir) = v;
        return 0;
    case O_STATE:
        for (s = 0; s < OUTBOX_STATE_COUNT; s++)
            if (strcmp(v, replay_state_names[s]) == 0)
                break;
        if (s == OUTBOX_STATE_COUNT) {
            fail(o, "--state: unknown state '%s' (pending, sending, published, dead)", v);
            return -1;
        }
        o->states |= STATE_BIT(s);
        return 0;
    case O_TOPIC:
        if (outbox_validate_topic(v, err, sizeof err) != 0) {
            fail(o, "--topic: %s", err);
            return -1;
        }
        o->topic = v;
        return 0;
    case O_KEY:
        if (!*v || outbox_validate_key(v, strlen(v), err, sizeof err) != 0) {
            fail(o, "--key: %s", *v ? err : "empty key (messages without a key cannot be selected by key)");
            return -1;
        }
        o->key = v;
        return 0;
    case O_ID:
        if (outbox_validate_id(v, err, sizeof err) != 0) {
            fail(o, "--id: %s", err);
            return -1;
        }
        if (o->nids == IDS_MAX) {
            fail(o, "--id: more than %d ids", IDS_MAX);
            return -1;
        }
        o->ids[o->nids++] = v;
        return 0;
    case O_ID_PREFIX:
        n = strlen(v);
        if (n == 0 || n > OUTBOX_ID_MAX) {
            fail(o, "--id-prefix: must be 1..%d characters", OUTBOX_ID_MAX);
            return -1;
        }
        for (size_t i = 0; i < n; i++)
            if (v[i] < '!' || v[i] > '~') {
                fail(o, "--id-prefix: '%s' has a character that no message id has at byte %zu (ids are printable "
                       "ASCII without spaces)",
                       v, i);
                return -1;
            }
        o->id_prefix = v;
        memcpy(o->id_prefix_end, v, n + 1);
        o->id_prefix_end[n - 1]++;
        return 0;
    case O_SINCE:
    case O_UNTIL:
        if (replay_parse_time(v, id == O_SINCE ? &o->since : &o->until, &why) != 0) {
            fail(o, "--%s: '%s': %s; use ISO-8601 like 2026-11-29T10:00:00Z, 2026-11-29T10:00:00.123+02:00 or "
                   "2026-11-29, or unix milliseconds",
                   name, v, why);
            return -1;
        }
        if (id == O_SINCE) {
            o->has_since = 1;
            o->since_arg = v;
        } else {
            o->has_until = 1;
            o->until_arg = v;
        }
        return 0;
    case O_REASON:
        n = strlen(v);
        if (strspn(v, " \t\r\n") == n) {
            fail(o, "--reason: empty; say why these messages are resent (it is recorded in each row)");
            return -1;
        }
        if (n > REASON_MAX) {
            fail(o, "--reason: longer than %d bytes", REASON_MAX);
            return -1;
        }
        if (outbox__utf8_prefix((const unsigned char *)v, n) != n) {
            fail(o, "--reason: not valid UTF-8");
            return -1;
        }
        o->reason = v;
        return 0;
    case O_LIMIT:
        return parse_count(o, name, v, 0, LIMIT_MAX, &o->limit);
    case O_BATCH:
        return parse_count(o, name, v, 1, BATCH_MAX, &o->batch);
    case O_THRESHOLD:
        return parse_count(o, name, v, 0, THRESHOLD_MAX, &o->threshold);
    case O_DRY_RUN:
        o->dry_run = 1;
        return 0;
    case O_YES:
        o->yes = 1;
        return 0;
    case O_FORCE:
        o->force = 1;
        return 0;
    case O_JSON:
        o->json = 1;
        return 0;
    case O_BY_TOPIC:
        o->by_topic = 1;
        return 0;
    case O_DB_GLOB:
        if (!*v || strchr(v, '/')) {
            fail(o, "--db-glob: '%s' is not a pattern of file names (non-empty, without '/')", v);
            return -1;
        }
        o->globs[o->nglobs++] = v;
        return 0;
    case O_TOP:
        return parse_count(o, name, v, 1, TOP_MAX, &o->top);
    case O_LOG_FORMAT:
        o->log = outbox_log_sink(v);
        if (!o->log) {
            fail(o, "--log-format: unknown log format '%s' (logfmt, json)", v);
            return -1;
        }
        return 0;
    case O_COUNT:
        break;
    }
    return -1;
}

static enum replay_args_result positional(replay_options *o, const char *a)
{
    int c;
    if (o->cmd == CMD_NONE) {
        if (!strcmp(a, "help"))
            return REPLAY_ARGS_HELP;
        for (c = 0; c < CMD_COUNT; c++)
            if (!strcmp(a, replay_command_names[c]))
                break;
        if (c == CMD_COUNT) {
            fail(o, "unknown subcommand '%s' (list, show, stats, requeue, purge; see --help)", a);
            return REPLAY_ARGS_ERROR;
        }
        o->cmd = (command)c;
        return REPLAY_ARGS_GO_ON;
    }
    if (o->cmd == CMD_SHOW && !o->show_id) {
        o->show_id = a;
        return REPLAY_ARGS_GO_ON;
    }
    fail(o, "unexpected argument '%s' (see --help)", a);
    return REPLAY_ARGS_ERROR;
}

enum replay_args_result replay_args_parse(replay_options *o, int argc, char **argv)
{
    enum replay_args_result rc;
    int i, only_positional = 0;

    memset(o, 0, sizeof *o);
    o->cmd = CMD_NONE;
    o->limit = 100;
    o->batch = 500;
    o->threshold = 100;
    o->top = 20;
    if (argc < 2)
        return REPLAY_ARGS_NO_ARGS;
    o->ids = calloc((size_t)argc, sizeof *o->ids);
    o->globs = calloc((size_t)argc, sizeof *o->globs);
    if (!o->ids || !o->globs)
        return REPLAY_ARGS_NOMEM;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *value = NULL, *eq;
        char name[32];
        size_t len;
        int id;

        if (only_positional || a[0] != '-' || !a[1]) {
            rc = positional(o, a);
            if (rc != REPLAY_ARGS_GO_ON)
                return rc;
            continue;
        }
        if (!strcmp(a, "--")) {
            only_positional = 1;
            continue;
        }
        if (!strcmp(a, "-h") || !strcmp(a, "--help"))
            return REPLAY_ARGS_HELP;
        if (!strcmp(a, "-V") || !strcmp(a, "--version"))
            return REPLAY_ARGS_VERSION;
        if (a[1] != '-') {
            fail(o, "unknown option '%s' (see --help)", a);
            return REPLAY_ARGS_ERROR;
        }
        eq = strchr(a + 2, '=');
        len = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        for (id = 0; id < O_COUNT; id++)
            if (len < sizeof name && strlen(optdefs[id].name) == len && !strncmp(optdefs[id].name, a + 2, len))
                break;
        if (id == O_COUNT) {
            fail(o, "unknown option '%.*s' (see --help)", (int)(len + 2), a);
            return REPLAY_ARGS_ERROR;
        }
        snprintf(name, sizeof name, "%s", optdefs[id].name);
        if (!optdefs[id].takes_value && eq) {
            fail(o, "--%s takes no value", name);
            return REPLAY_ARGS_ERROR;
        }
        if (optdefs[id].takes_value) {
            if (eq) {
                value = eq + 1;
            } else if (i + 1 < argc) {
                value = argv[++i];
            } else {
                fail(o, "--%s needs a value", name);
                return REPLAY_ARGS_ERROR;
            }
            if (o->seen[id] && !optdefs[id].repeatable) {
                fail(o, "--%s given twice", name);
                return REPLAY_ARGS_ERROR;
            }
        }
        o->seen[id]++;
        if (set_option(o, (enum optid)id, value) != 0)
            return REPLAY_ARGS_ERROR;
    }

    if (o->cmd == CMD_NONE) {
        fail(o, "no subcommand given (list, show, stats, requeue, purge; see --help)");
        return REPLAY_ARGS_ERROR;
    }
    for (i = 0; i < O_COUNT; i++)
        if (o->seen[i] && !(optdefs[i].applies & FOR(o->cmd))) {
            fail(o, "--%s does not apply to %s (see --help)", optdefs[i].name, replay_command_names[o->cmd]);
            return REPLAY_ARGS_ERROR;
        }
    if (o->cmd == CMD_SHOW && !o->show_id) {
        fail(o, "show needs a message id: outbox-replay show ID --db PATH");
        return REPLAY_ARGS_ERROR;
    }
    if (o->db_dir) {
        for (i = 0; i < (int)(sizeof dir_excludes / sizeof dir_excludes[0]); i++)
            if (o->seen[dir_excludes[i]]) {
                fail(o, "--%s cannot be combined with --db-dir (stats over a directory shows every state of each "
                        "database, from its figures)",
                     optdefs[dir_excludes[i]].name);
                return REPLAY_ARGS_ERROR;
            }
    } else if (o->seen[O_DB_GLOB] || o->seen[O_TOP]) {
        fail(o, "--%s needs --db-dir DIR", o->seen[O_DB_GLOB] ? "db-glob" : "top");
        return REPLAY_ARGS_ERROR;
    }
    if (!o->db && !o->db_dir) {
        fail(o, "--db PATH is required%s", o->cmd == CMD_STATS ? " (or --db-dir DIR)" : "");
        return REPLAY_ARGS_ERROR;
    }
    if (o->has_since && o->has_until && o->since >= o->until) {
        fail(o, "--since %s is not before --until %s: nothing could match", o->since_arg, o->until_arg);
        return REPLAY_ARGS_ERROR;
    }
    if (o->cmd == CMD_PURGE && (o->states & ~STATE_BIT(OUTBOX_STATE_DEAD))) {
        for (i = 0; i < OUTBOX_STATE_COUNT; i++)
            if (i != OUTBOX_STATE_DEAD && (o->states & STATE_BIT(i)))
                break;
        fail(o, "purge deletes only dead messages: --state %s is not allowed (leave --state out, or --state dead)",
             replay_state_names[i]);
        return REPLAY_ARGS_ERROR;
    }
    if (o->cmd == CMD_REQUEUE && !o->reason) {
        fail(o, "requeue needs --reason TEXT: it is recorded in every requeued message (replay_reason)");
        return REPLAY_ARGS_ERROR;
    }
    return REPLAY_ARGS_GO_ON;
}

void replay_args_finish(replay_options *o)
{
    free(o->ids);
    o->ids = NULL;
    free(o->globs);
    o->globs = NULL;
    free(o->error);
    o->error = NULL;
}
