/*
 * outbox-relay: the relay as a daemon, for applications in any language that
 * write outbox rows with plain SQL. A thin layer over liboutbox: options
 * (flags, OUTBOX_* environment variables, an INI file), signals, exit codes.
 */
#include <errno.h>
#include <ini.h>
#include <limits.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <uv.h>

#include "outbox.h"

enum { EXIT_OK = 0, EXIT_FATAL = 1, EXIT_USAGE = 2 };

enum opt_type { T_STR, T_UINT, T_U64, T_SIZE, T_FLAG, T_LEVEL };

typedef struct config {
    outbox_relay_settings s;
    const char *config_path;
    /* Strings given on the command line, in the environment or in the file;
     * owned here so that the settings can point at them. */
    char *owned[32];
    int nowned;
} config;

typedef struct opt {
    const char *name; /* flag without dashes; env OUTBOX_<NAME>; ini key */
    enum opt_type type;
    size_t off;       /* into outbox_relay_settings */
    uint64_t min, max;
    const char *arg, *help;
} opt;

#define S(field) offsetof(outbox_relay_settings, field)
static const opt options[] = {
    {"db", T_STR, S(db_path), 0, 0, "PATH", "SQLite database holding the outbox table (required)"},
    {"redis", T_STR, S(redis_url), 0, 0, "URL",
     "redis://[[user]:password@]host[:port][/db] or unix:///path/to/sock[?db=N] (required)"},
    {"batch", T_UINT, S(batch), 1, 100000, "N", "rows claimed per transaction (default 512)"},
    {"inflight", T_UINT, S(inflight), 1, 1000000, "N",
     "messages claimed and not yet marked, at most; bounds memory (default 8192)"},
    {"lease-ms", T_U64, S(lease_ms), 1000, 86400000, "MS",
     "lease of a claimed row; expired leases are taken over (default 30000)"},
    {"scan-interval-ms", T_U64, S(scan_interval_ms), 1, 3600000, "MS",
     "fallback scan interval when no wake-up arrives (default 1000)"},
    {"max-attempts", T_UINT, S(max_attempts), 1, 1000000, "N",
     "publish attempts before a row becomes dead (default 10)"},
    {"backoff-min-ms", T_U64, S(backoff_min_ms), 1, 86400000, "MS", "first retry delay (default 500)"},
    {"backoff-max-ms", T_U64, S(backoff_max_ms), 1, 86400000, "MS", "largest retry delay (default 60000)"},
    {"stream-prefix", T_STR, S(stream_prefix), 0, 0, "STR", "stream name is PREFIX + topic (default outbox:)"},
    {"maxlen", T_U64, S(maxlen), 0, UINT64_MAX / 2, "N", "trim streams with XADD MAXLEN ~ N; 0 = off (default 0)"},
    {"max-payload", T_SIZE, S(max_payload), 1, OUTBOX_PAYLOAD_HARD_MAX, "BYTES",
     "rows with a larger payload are dead-lettered (default 1048576)"},
    {"worker-id", T_STR, S(worker_id), 0, 0, "ID", "lease owner name (default HOSTNAME:PID)"},
    {"shutdown-timeout-ms", T_U64, S(shutdown_timeout_ms), 0, 3600000, "MS",
     "on SIGTERM, how long to wait for in-flight replies (default 10000)"},
    {"wait-replicas", T_UINT, S(wait_replicas), 0, 100, "N",
     "mark published only after WAIT reports N replicas; 0 = off (default 0)"},
    {"wait-timeout-ms", T_U64, S(wait_timeout_ms), 1, 86400000, "MS", "WAIT timeout (default 1000)"},
    {"connect-timeout-ms", T_U64, S(connect_timeout_ms), 1, 3600000, "MS", "Redis connect timeout (default 5000)"},
    {"reply-timeout-ms", T_U64, S(reply_timeout_ms), 1, 3600000, "MS",
     "Redis reply timeout; below lease-ms (default 10000)"},
    {"log-level", T_LEVEL, S(log_level), 0, 0, "LEVEL", "debug, info, warn or error (default info)"},
    {"drain", T_FLAG, S(drain), 0, 0, NULL,
     "exit 0 once nothing is due, nothing is leased and nothing is in flight"},
    {"idempotent", T_FLAG, S(idempotent), 0, 0, NULL,
     "publish through a script that appends each message once per retention (default off)"},
    {"idempotent-retention-ms", T_U64, S(idempotent_retention_ms), 1000, 2592000000ull, "MS",
     "how long publish markers are kept (default 3600000)"},
    {"metrics-listen", T_STR, S(metrics_listen), 0, 0, "HOST:PORT",
     "serve Prometheus /metrics and /healthz there (default off)"},
    {"health-redis-down-ms", T_U64, S(health_redis_down_ms), 1, 86400000, "MS",
     "/healthz answers 503 once Redis is unreachable this long (default 30000)"},
    {"retention-ms", T_U64, S(retention_ms), 0, 3650ull * 86400000, "MS",
     "delete published rows older than this; 0 keeps them (default 86400000)"},
    {"retention-batch", T_UINT, S(retention_batch), 1, 100000, "N",
     "rows deleted per retention transaction (default 1000)"},
};
#undef S

static const char *prog = "outbox-relay";

static void usage(FILE *f)
{
    size_t i;
    fprintf(f,
            "Usage: %s [run] --db PATH --redis URL [options]\n"
            "       %s init --db PATH\n"
            "       %s --help | --version\n"
            "\n"
            "Publishes the committed rows of the outbox table in PATH to Redis Streams\n"
            "(stream PREFIX+topic, one XADD per message, at least once), marking each row\n"
            "published once Redis accepted it. 'init' creates or migrates the outbox schema.\n"
            "\n"
            "Options (each also as environment variable OUTBOX_<NAME>, e.g. OUTBOX_LEASE_MS,\n"
            "and as key NAME in the --config file; flags win over the environment, which\n"
            "wins over the file):\n",
            prog, prog, prog);
    for (i = 0; i < sizeof options / sizeof options[0]; i++) {
        char left[64];
        snprintf(left, sizeof left, "--%s%s%s", options[i].name, options[i].arg ? " " : "",
                 options[i].arg ? options[i].arg : "");
        fprintf(f, "  %-28s %s\n", left, options[i].help);
    }
    fprintf(f, "  %-28s %s\n", "--config FILE",
            "INI file with NAME = VALUE lines (optionally under [relay])");
    fprintf(f, "  %-28s %s\n", "-h, --help", "show this help");
    fprintf(f, "  %-28s %s\n", "-V, --version", "show the version");
    fprintf(f, "\n"
               "Signals: SIGTERM or SIGINT stop gracefully (in-flight replies are awaited up to\n"
               "--shutdown-timeout-ms, unfinished rows are handed back); a second one exits at once.\n"
               "Exit status: 0 clean stop or drained, 1 fatal runtime error, 2 usage or configuration\n"
               "error. Logs are logfmt lines on stderr.\n");
}

static const opt *find_opt(const char *name)
{
    size_t i;
    for (i = 0; i < sizeof options / sizeof options[0]; i++)
        if (strcmp(options[i].name, name) == 0)
            return &options[i];
    return NULL;
}

/* Sets one option from text; on error prints "<source>: <problem>". */
static int set_opt(config *c, const opt *o, const char *value, const char *source)
{
    char *end;
    unsigned long long v;
    void *field = (char *)&c->s + o->off;

    switch (o->type) {
    case T_STR:
        if (!*value) {
            fprintf(stderr, "%s: %s: empty value\n", prog, source);
            return -1;
        }
        if (c->nowned == (int)(sizeof c->owned / sizeof c->owned[0])) {
            fprintf(stderr, "%s: %s: too many options\n", prog, source);
            return -1;
        }
        c->owned[c->nowned] = strdup(value);
        if (!c->owned[c->nowned])
            return -1;
        *(const char **)field = c->owned[c->nowned++];
        return 0;
    case T_FLAG:
        if (!strcmp(value, "1") || !strcmp(value, "true") || !strcmp(value, "yes") || !strcmp(value, "on"))
            *(int *)field = 1;
        else if (!strcmp(value, "0") || !strcmp(value, "false") || !strcmp(value, "no") || !strcmp(value, "off"))
            *(int *)field = 0;
        else {
            fprintf(stderr, "%s: %s: '%s' is not a boolean (true/false, 1/0, yes/no, on/off)\n", prog, source,
                    value);
            return -1;
        }
        return 0;
    case T_LEVEL:
        if (!strcmp(value, "debug"))
            *(outbox_log_level *)field = OUTBOX_LOG_DEBUG;
        else if (!strcmp(value, "info"))
            *(outbox_log_level *)field = OUTBOX_LOG_INFO;
        else if (!strcmp(value, "warn") || !strcmp(value, "warning"))
            *(outbox_log_level *)field = OUTBOX_LOG_WARN;
        else if (!strcmp(value, "error"))
            *(outbox_log_level *)field = OUTBOX_LOG_ERROR;
        else {
            fprintf(stderr, "%s: %s: unknown log level '%s' (debug, info, warn, error)\n", prog, source, value);
            return -1;
        }
        return 0;
    default:
        break;
    }
    errno = 0;
    if (!*value || *value == '-' || *value == '+' || *value == ' ') {
        fprintf(stderr, "%s: %s: '%s' is not a non-negative whole number\n", prog, source, value);
        return -1;
    }
    v = strtoull(value, &end, 10);
    if (*end != '\0') {
        fprintf(stderr, "%s: %s: '%s' is not a non-negative whole number\n", prog, source, value);
        return -1;
    }
    if (errno == ERANGE || v < o->min || v > o->max) {
        fprintf(stderr, "%s: %s: %s is out of range %llu..%llu\n", prog, source, value, (unsigned long long)o->min,
                (unsigned long long)o->max);
        return -1;
    }
    if (o->type == T_UINT)
        *(unsigned *)field = (unsigned)v;
    else if (o->type == T_SIZE)
        *(size_t *)field = (size_t)v;
    else
        *(uint64_t *)field = (uint64_t)v;
    return 0;
}

typedef struct ini_ctx {
    config *c;
    const char *path;
    int failed;
} ini_ctx;

static int on_ini(void *user, const char *section, const char *name, const char *value)
{
    ini_ctx *x = user;
    const opt *o;
    char source[512];
    if (x->failed)
        return 0;
    snprintf(source, sizeof source, "config file %s: %s", x->path, name);
    if (*section && strcmp(section, "relay") != 0) {
        fprintf(stderr, "%s: config file %s: unknown section [%s] (only [relay])\n", prog, x->path, section);
        x->failed = 1;
        return 0;
    }
    o = find_opt(name);
    if (!o) {
        fprintf(stderr, "%s: config file %s: unknown key '%s'\n", prog, x->path, name);
        x->failed = 1;
        return 0;
    }
    if (set_opt(x->c, o, value, source) != 0) {
        x->failed = 1;
        return 0;
    }
    return 1;
}

static int load_file(config *c)
{
    ini_ctx x = {c, c->config_path, 0};
    FILE *f = fopen(c->config_path, "r");
    int rc;
    if (!f) {
        fprintf(stderr, "%s: --config: cannot open '%s': %s\n", prog, c->config_path, strerror(errno));
        return -1;
    }
    rc = ini_parse_file(f, on_ini, &x);
    fclose(f);
    if (x.failed)
        return -1;
    if (rc > 0) {
        fprintf(stderr, "%s: config file %s line %d: not a NAME = VALUE line\n", prog, c->config_path, rc);
        return -1;
    }
    return rc == 0 ? 0 : -1;
}

static int load_env(config *c)
{
    size_t i, k;
    for (i = 0; i < sizeof options / sizeof options[0]; i++) {
        char name[64] = "OUTBOX_", source[80];
        const char *v;
        for (k = 0; options[i].name[k] && k + 8 < sizeof name; k++) {
            char ch = options[i].name[k];
            name[7 + k] = ch == '-' ? '_' : (char)(ch >= 'a' && ch <= 'z' ? ch - 32 : ch);
            name[8 + k] = '\0';
        }
        v = getenv(name);
        if (!v)
            continue;
        snprintf(source, sizeof source, "environment variable %s", name);
        if (set_opt(c, &options[i], v, source) != 0)
            return -1;
    }
    return 0;
}

/* Parses flags. Pass 1 (apply == 0) only validates names and finds
 * --config; pass 2 applies values. Returns 0, 1 for --help/--version
 * handled, -1 on error. */
static int parse_flags(config *c, int argc, char **argv, int first, int apply)
{
    int i;
    for (i = first; i < argc; i++) {
        const char *a = argv[i], *name, *value = NULL, *eq;
        char namebuf[64], source[96];
        const opt *o;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            if (!apply)
                usage(stdout);
            return 1;
        }
        if (!strcmp(a, "-V") || !strcmp(a, "--version")) {
            if (!apply)
                printf("outbox-relay %s (liboutbox %s)\n", OUTBOX_VERSION_STRING, outbox_version());
            return 1;
        }
        if (strncmp(a, "--", 2) != 0 || !a[2]) {
            fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog, a);
            return -1;
        }
        name = a + 2;
        eq = strchr(name, '=');
        if (eq) {
            size_t n = (size_t)(eq - name);
            if (n >= sizeof namebuf) {
                fprintf(stderr, "%s: unknown option '%s' (see --help)\n", prog, a);
                return -1;
            }
            memcpy(namebuf, name, n);
            namebuf[n] = '\0';
            name = namebuf;
            value = eq + 1;
        }
        if (!strcmp(name, "config")) {
            if (!value) {
                if (i + 1 >= argc) {
                    fprintf(stderr, "%s: --config needs a value\n", prog);
                    return -1;
                }
                value = argv[++i];
            }
            c->config_path = value;
            continue;
        }
        o = find_opt(name);
        if (!o) {
            fprintf(stderr, "%s: unknown option '--%s' (see --help)\n", prog, name);
            return -1;
        }
        if (o->type == T_FLAG && !value) {
            value = "1";
        } else if (!value) {
            if (i + 1 >= argc) {
                fprintf(stderr, "%s: --%s needs a value\n", prog, o->name);
                return -1;
            }
            value = argv[++i];
        }
        snprintf(source, sizeof source, "--%s", o->name);
        if (apply && set_opt(c, o, value, source) != 0)
            return -1;
    }
    return 0;
}

static void config_free(config *c)
{
    for (int i = 0; i < c->nowned; i++)
        free(c->owned[i]);
}

static int cmd_init(int argc, char **argv)
{
    const char *db_path = NULL;
    sqlite3 *db = NULL;
    char err[512];
    int i, e;
    int64_t v = 0;

    for (i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("Usage: %s init --db PATH\n\n"
                   "Creates the database file if needed, switches it to WAL mode and creates or\n"
                   "migrates the outbox schema (idempotent). Refuses a file that is not a SQLite\n"
                   "database, a table named outbox that is not ours, or a newer schema.\n"
                   "Exit status: 0 done, 2 refused or bad arguments.\n",
                   prog);
            return EXIT_OK;
        }
        if (!strcmp(argv[i], "--db") && i + 1 < argc)
            db_path = argv[++i];
        else if (!strncmp(argv[i], "--db=", 5))
            db_path = argv[i] + 5;
        else if (!strcmp(argv[i], "--db")) {
            fprintf(stderr, "%s init: --db needs a value\n", prog);
            return EXIT_USAGE;
        } else {
            fprintf(stderr, "%s init: unexpected argument '%s' (usage: %s init --db PATH)\n", prog, argv[i], prog);
            return EXIT_USAGE;
        }
    }
    if (!db_path || !*db_path) {
        fprintf(stderr, "%s init: --db PATH is required\n", prog);
        return EXIT_USAGE;
    }
    e = outbox_db_open(db_path, OUTBOX_OPEN_CREATE, &db, err, sizeof err);
    if (e == 0)
        e = outbox_schema_apply(db, err, sizeof err);
    if (e != 0) {
        fprintf(stderr, "%s init: %s (%s)\n", prog, err, outbox_err_name(e));
        sqlite3_close_v2(db);
        return EXIT_USAGE;
    }
    sqlite3_exec(db, "SELECT 1", NULL, NULL, NULL);
    {
        sqlite3_stmt *st;
        if (sqlite3_prepare_v2(db, "PRAGMA user_version", -1, &st, NULL) == SQLITE_OK) {
            if (sqlite3_step(st) == SQLITE_ROW)
                v = sqlite3_column_int64(st, 0);
            sqlite3_finalize(st);
        }
    }
    sqlite3_close_v2(db);
    printf("%s: outbox schema version %lld ready (WAL mode)\n", db_path, (long long)v);
    return EXIT_OK;
}

/* ------------------------------------------------------------------ */

typedef struct daemon_state {
    uv_loop_t loop;
    uv_signal_t sigterm, sigint;
    outbox_relay *relay;
    int signals;
    int exit_code;
} daemon_state;

static void on_stopped(outbox_relay *r, void *data)
{
    daemon_state *d = data;
    (void)r;
    uv_close((uv_handle_t *)&d->sigterm, NULL);
    uv_close((uv_handle_t *)&d->sigint, NULL);
}

static void on_signal(uv_signal_t *h, int signum)
{
    daemon_state *d = h->data;
    if (++d->signals > 1) {
        fprintf(stderr, "level=warn msg=\"second signal: exiting at once; unfinished rows are taken over when "
                        "their leases expire\" signal=%d\n",
                signum);
        _exit(EXIT_FATAL);
    }
    outbox_relay_stop(d->relay, on_stopped, d);
}

static void on_drained(outbox_relay *r, void *data)
{
    daemon_state *d = data;
    outbox_relay_stop(r, on_stopped, d);
}

static int cmd_run(int argc, char **argv, int first)
{
    config c;
    daemon_state d;
    char err[512];
    int rc, e;

    memset(&c, 0, sizeof c);
    memset(&d, 0, sizeof d);
    outbox_relay_defaults(&c.s);
    rc = parse_flags(&c, argc, argv, first, 0);
    if (rc != 0)
        return rc > 0 ? EXIT_OK : EXIT_USAGE;
    if ((c.config_path && load_file(&c) != 0) || load_env(&c) != 0 || parse_flags(&c, argc, argv, first, 1) != 0) {
        config_free(&c);
        return EXIT_USAGE;
    }
    if (!c.s.db_path) {
        fprintf(stderr, "%s: --db PATH is required (or OUTBOX_DB, or db in the config file)\n", prog);
        config_free(&c);
        return EXIT_USAGE;
    }
    if (!c.s.redis_url) {
        fprintf(stderr, "%s: --redis URL is required (or OUTBOX_REDIS, or redis in the config file)\n", prog);
        config_free(&c);
        return EXIT_USAGE;
    }
    if (c.s.drain) {
        c.s.on_drained = on_drained;
        c.s.on_drained_data = &d;
    }
    if (uv_loop_init(&d.loop) != 0) {
        fprintf(stderr, "%s: cannot create the event loop\n", prog);
        config_free(&c);
        return EXIT_FATAL;
    }
    e = outbox_relay_create(&d.relay, &d.loop, &c.s, err, sizeof err);
    if (e != 0) {
        fprintf(stderr, "%s: %s (%s)\n", prog, err[0] ? err : outbox_strerror(e), outbox_err_name(e));
        uv_loop_close(&d.loop);
        config_free(&c);
        /* A database that stays locked is a runtime failure, not a usage
         * error: a supervisor should restart us. */
        return e == OUTBOX_ENOMEM || e == OUTBOX_EBUSY ? EXIT_FATAL : EXIT_USAGE;
    }
    uv_signal_init(&d.loop, &d.sigterm);
    uv_signal_init(&d.loop, &d.sigint);
    d.sigterm.data = d.sigint.data = &d;
    uv_signal_start(&d.sigterm, on_signal, SIGTERM);
    uv_signal_start(&d.sigint, on_signal, SIGINT);
    signal(SIGPIPE, SIG_IGN);
    if (outbox_relay_start(d.relay) != 0) {
        fprintf(stderr, "%s: cannot start (see the log above)\n", prog);
        uv_close((uv_handle_t *)&d.sigterm, NULL);
        uv_close((uv_handle_t *)&d.sigint, NULL);
        outbox_relay_destroy(d.relay);
        uv_run(&d.loop, UV_RUN_DEFAULT);
        uv_loop_close(&d.loop);
        config_free(&c);
        return EXIT_USAGE;
    }
    uv_run(&d.loop, UV_RUN_DEFAULT);
    outbox_relay_destroy(d.relay);
    uv_run(&d.loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&d.loop) != 0)
        fprintf(stderr, "level=warn msg=\"event loop closed with handles still open\"\n");
    config_free(&c);
    return d.exit_code;
}

int main(int argc, char **argv)
{
    /* SQLite's memory statistics take a global mutex on every allocation;
     * the daemon does not read them. Must precede any other SQLite call. */
    sqlite3_config(SQLITE_CONFIG_MEMSTATUS, 0);
    /* The relay frees and allocates at the top of the heap on every claim;
     * glibc's default trimming then returns and refetches memory from the
     * kernel constantly, which measured several times slower claims. The
     * relay's memory is bounded by its window, so trimming buys nothing. */
    mallopt(M_TRIM_THRESHOLD, 256 * 1024 * 1024);
    mallopt(M_MMAP_THRESHOLD, 1024 * 1024);
    if (argc < 2) {
        usage(stderr);
        return EXIT_USAGE;
    }
    if (!strcmp(argv[1], "init"))
        return cmd_init(argc, argv);
    if (!strcmp(argv[1], "run"))
        return cmd_run(argc, argv, 2);
    if (!strcmp(argv[1], "help")) {
        usage(stdout);
        return EXIT_OK;
    }
    if (!strcmp(argv[1], "version")) {
        printf("outbox-relay %s (liboutbox %s)\n", OUTBOX_VERSION_STRING, outbox_version());
        return EXIT_OK;
    }
    if (argv[1][0] != '-') {
        fprintf(stderr, "%s: unknown command '%s' (run, init, help, version)\n", prog, argv[1]);
        return EXIT_USAGE;
    }
    return cmd_run(argc, argv, 1);
}
