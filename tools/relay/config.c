/*
 * outbox-relay's options (config.h): one table of every option, applied from
 * flags, the environment and an INI file. Messages name the source of a
 * value: the flag, the environment variable or the file and key.
 */
#include "config.h"

#include <errno.h>
#include <ini.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum opt_type { T_STR, T_UINT, T_U64, T_SIZE, T_FLAG, T_LEVEL };

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
     "redis://[[user]:password@]host[:port][/db], unix:///path/to/sock[?db=N] or "
     "redis-sentinel://[[user]:password@]host[:port][,host[:port]...][/db]#master (required)"},
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

void relay_config_usage(FILE *f, const char *prog)
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

static int fail(relay_config *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(relay_config *c, const char *fmt, ...)
{
    va_list ap;
    free(c->error);
    c->error = NULL;
    va_start(ap, fmt);
    if (vasprintf(&c->error, fmt, ap) < 0)
        c->error = NULL;
    va_end(ap);
    return RELAY_CONFIG_ERROR;
}

static const opt *find_opt(const char *name)
{
    size_t i;
    for (i = 0; i < sizeof options / sizeof options[0]; i++)
        if (strcmp(options[i].name, name) == 0)
            return &options[i];
    return NULL;
}

/* Sets one option from text; on error the message is "<source>: <problem>". */
static int set_opt(relay_config *c, const opt *o, const char *value, const char *source)
{
    char *end;
    unsigned long long v;
    void *field = (char *)&c->s + o->off;

    switch (o->type) {
    case T_STR:
        if (!*value)
            return fail(c, "%s: empty value", source);
        if (c->nowned == RELAY_CONFIG_OWNED_MAX)
            return fail(c, "%s: too many options", source);
        c->owned[c->nowned] = strdup(value);
        if (!c->owned[c->nowned])
            return fail(c, "%s: out of memory", source);
        *(const char **)field = c->owned[c->nowned++];
        return 0;
    case T_FLAG:
        if (!strcmp(value, "1") || !strcmp(value, "true") || !strcmp(value, "yes") || !strcmp(value, "on"))
            *(int *)field = 1;
        else if (!strcmp(value, "0") || !strcmp(value, "false") || !strcmp(value, "no") || !strcmp(value, "off"))
            *(int *)field = 0;
        else
            return fail(c, "%s: '%s' is not a boolean (true/false, 1/0, yes/no, on/off)", source, value);
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
        else
            return fail(c, "%s: unknown log level '%s' (debug, info, warn, error)", source, value);
        return 0;
    default:
        break;
    }
    errno = 0;
    if (!*value || *value == '-' || *value == '+' || *value == ' ')
        return fail(c, "%s: '%s' is not a non-negative whole number", source, value);
    v = strtoull(value, &end, 10);
    if (*end != '\0')
        return fail(c, "%s: '%s' is not a non-negative whole number", source, value);
    if (errno == ERANGE || v < o->min || v > o->max)
        return fail(c, "%s: %s is out of range %llu..%llu", source, value, (unsigned long long)o->min,
                    (unsigned long long)o->max);
    if (o->type == T_UINT)
        *(unsigned *)field = (unsigned)v;
    else if (o->type == T_SIZE)
        *(size_t *)field = (size_t)v;
    else
        *(uint64_t *)field = (uint64_t)v;
    return 0;
}

typedef struct ini_ctx {
    relay_config *c;
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
        fail(x->c, "config file %s: unknown section [%s] (only [relay])", x->path, section);
        x->failed = 1;
        return 0;
    }
    o = find_opt(name);
    if (!o) {
        fail(x->c, "config file %s: unknown key '%s'", x->path, name);
        x->failed = 1;
        return 0;
    }
    if (set_opt(x->c, o, value, source) != 0) {
        x->failed = 1;
        return 0;
    }
    return 1;
}

int relay_config_ini(relay_config *c, FILE *f, const char *path)
{
    ini_ctx x = {c, path, 0};
    int rc = ini_parse_file(f, on_ini, &x);
    if (x.failed)
        return RELAY_CONFIG_ERROR;
    if (rc > 0)
        return fail(c, "config file %s line %d: not a NAME = VALUE line", path, rc);
    if (rc < 0)
        return fail(c, "config file %s: cannot read it", path);
    return RELAY_CONFIG_OK;
}

static int load_file(relay_config *c)
{
    FILE *f = fopen(c->config_path, "r");
    int rc;
    if (!f)
        return fail(c, "--config: cannot open '%s': %s", c->config_path, strerror(errno));
    rc = relay_config_ini(c, f, c->config_path);
    fclose(f);
    return rc;
}

static const char *env_lookup(const char *name, void *data)
{
    (void)data;
    return getenv(name);
}

int relay_config_env(relay_config *c, relay_config_getenv_fn *getenv_fn, void *env_data)
{
    size_t i, k;
    if (!getenv_fn)
        getenv_fn = env_lookup;
    for (i = 0; i < sizeof options / sizeof options[0]; i++) {
        char name[64] = "OUTBOX_", source[80];
        const char *v;
        for (k = 0; options[i].name[k] && k + 8 < sizeof name; k++) {
            char ch = options[i].name[k];
            name[7 + k] = ch == '-' ? '_' : (char)(ch >= 'a' && ch <= 'z' ? ch - 32 : ch);
            name[8 + k] = '\0';
        }
        v = getenv_fn(name, env_data);
        if (!v)
            continue;
        snprintf(source, sizeof source, "environment variable %s", name);
        if (set_opt(c, &options[i], v, source) != 0)
            return RELAY_CONFIG_ERROR;
    }
    return RELAY_CONFIG_OK;
}

int relay_config_flags(relay_config *c, int argc, char **argv, int first, int apply)
{
    int i;
    for (i = first; i < argc; i++) {
        const char *a = argv[i], *name, *value = NULL, *eq;
        char namebuf[64], source[96];
        const opt *o;
        if (!strcmp(a, "-h") || !strcmp(a, "--help"))
            return RELAY_CONFIG_HELP;
        if (!strcmp(a, "-V") || !strcmp(a, "--version"))
            return RELAY_CONFIG_VERSION;
        if (strncmp(a, "--", 2) != 0 || !a[2])
            return fail(c, "unexpected argument '%s' (see --help)", a);
        name = a + 2;
        eq = strchr(name, '=');
        if (eq) {
            size_t n = (size_t)(eq - name);
            if (n >= sizeof namebuf)
                return fail(c, "unknown option '%s' (see --help)", a);
            memcpy(namebuf, name, n);
            namebuf[n] = '\0';
            name = namebuf;
            value = eq + 1;
        }
        if (!strcmp(name, "config")) {
            if (!value) {
                if (i + 1 >= argc)
                    return fail(c, "--config needs a value");
                value = argv[++i];
            }
            c->config_path = value;
            continue;
        }
        o = find_opt(name);
        if (!o)
            return fail(c, "unknown option '--%s' (see --help)", name);
        if (o->type == T_FLAG && !value) {
            value = "1";
        } else if (!value) {
            if (i + 1 >= argc)
                return fail(c, "--%s needs a value", o->name);
            value = argv[++i];
        }
        snprintf(source, sizeof source, "--%s", o->name);
        if (apply && set_opt(c, o, value, source) != 0)
            return RELAY_CONFIG_ERROR;
    }
    return RELAY_CONFIG_OK;
}

int relay_config_require(relay_config *c)
{
    if (!c->s.db_path)
        return fail(c, "--db PATH is required (or OUTBOX_DB, or db in the config file)");
    if (!c->s.redis_url)
        return fail(c, "--redis URL is required (or OUTBOX_REDIS, or redis in the config file)");
    return RELAY_CONFIG_OK;
}

int relay_config_parse(relay_config *c, int argc, char **argv, int first, relay_config_getenv_fn *getenv_fn,
                       void *env_data)
{
    int rc = relay_config_flags(c, argc, argv, first, 0);
    if (rc != RELAY_CONFIG_OK)
        return rc;
    if ((c->config_path && load_file(c) != 0) || relay_config_env(c, getenv_fn, env_data) != 0 ||
        relay_config_flags(c, argc, argv, first, 1) != 0)
        return RELAY_CONFIG_ERROR;
    return relay_config_require(c);
}

void relay_config_init(relay_config *c)
{
    memset(c, 0, sizeof *c);
    outbox_relay_defaults(&c->s);
}

void relay_config_finish(relay_config *c)
{
    for (int i = 0; i < c->nowned; i++)
        free(c->owned[i]);
    c->nowned = 0;
    free(c->error);
    c->error = NULL;
}
