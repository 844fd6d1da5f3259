/*
 * outbox-relay: the relay as a daemon, for applications in any language that
 * write outbox rows with plain SQL. A thin layer over liboutbox: options
 * (flags, OUTBOX_* environment variables, an INI file), signals, exit codes.
 */
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <uv.h>

#include "config.h"
#include "util/util.h"
#include "outbox.h"

enum { EXIT_OK = 0, EXIT_FATAL = 1, EXIT_USAGE = 2 };

static const char *prog = "outbox-relay";

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
    outbox_relay_group *group; /* --db-dir */
    outbox__logger log; /* the relay's sink, for the daemon's own lines */
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

static void on_group_stopped(outbox_relay_group *g, void *data)
{
    daemon_state *d = data;
    (void)g;
    uv_close((uv_handle_t *)&d->sigterm, NULL);
    uv_close((uv_handle_t *)&d->sigint, NULL);
}

static void on_group_drained(outbox_relay_group *g, void *data)
{
    daemon_state *d = data;
    char failed[1024];
    int e = outbox_relay_group_drain_result(g, failed, sizeof failed);
    /* The group logged each database it could not drain. */
    if (e == OUTBOX_ECONFIG)
        d->exit_code = EXIT_USAGE;
    else if (e != 0)
        d->exit_code = EXIT_FATAL;
    outbox_relay_group_stop(g, on_group_stopped, d);
}

static void on_signal(uv_signal_t *h, int signum);

/* outbox-relay run --db-dir: every database of a directory, one group. */
static int run_group(relay_config *c, daemon_state *d)
{
    char err[512];
    int e = outbox_relay_group_create(&d->group, &d->loop, &c->s, err, sizeof err);
    if (e != 0) {
        char q[600];
        outbox__logfmt_quote(q, sizeof q, err[0] ? err : outbox_strerror(e));
        outbox__log(&d->log, OUTBOX_LOG_ERROR, "msg=\"cannot create the relay\" error=%s err=%s", q,
                    outbox_err_name(e));
        return e == OUTBOX_ENOMEM ? EXIT_FATAL : EXIT_USAGE;
    }
    if (c->s.drain)
        outbox_relay_group_on_drained(d->group, on_group_drained, d);
    uv_signal_init(&d->loop, &d->sigterm);
    uv_signal_init(&d->loop, &d->sigint);
    d->sigterm.data = d->sigint.data = d;
    uv_signal_start(&d->sigterm, on_signal, SIGTERM);
    uv_signal_start(&d->sigint, on_signal, SIGINT);
    signal(SIGPIPE, SIG_IGN);
    if ((e = outbox_relay_group_start(d->group)) != 0) {
        outbox__log(&d->log, OUTBOX_LOG_ERROR, "msg=\"cannot start\" db_dir=%s err=%s", c->s.db_dir,
                    outbox_err_name(e));
        uv_close((uv_handle_t *)&d->sigterm, NULL);
        uv_close((uv_handle_t *)&d->sigint, NULL);
        outbox_relay_group_destroy(d->group);
        uv_run(&d->loop, UV_RUN_DEFAULT);
        return EXIT_FATAL;
    }
    uv_run(&d->loop, UV_RUN_DEFAULT);
    outbox_relay_group_destroy(d->group);
    uv_run(&d->loop, UV_RUN_DEFAULT);
    return d->exit_code;
}

static void on_signal(uv_signal_t *h, int signum)
{
    daemon_state *d = h->data;
    if (++d->signals > 1) {
        outbox__log(&d->log, OUTBOX_LOG_WARN,
                    "msg=\"second signal: exiting at once; unfinished rows are taken over when their leases "
                    "expire\" signal=%d",
                    signum);
        _exit(EXIT_FATAL);
    }
    if (d->group)
        outbox_relay_group_stop(d->group, on_group_stopped, d);
    else
        outbox_relay_stop(d->relay, on_stopped, d);
}

static void on_drained(outbox_relay *r, void *data)
{
    daemon_state *d = data;
    int e = outbox_relay_drain_result(r);
    /* The relay logged the rows left, and for OUTBOX_ECONFIG why Redis
     * cannot be used as configured: a configuration error, like a bad
     * option, which running again as it is would not cure. */
    if (e == OUTBOX_ETIMEDOUT)
        d->exit_code = EXIT_FATAL;
    else if (e == OUTBOX_ECONFIG)
        d->exit_code = EXIT_USAGE;
    outbox_relay_stop(r, on_stopped, d);
}

static int cmd_run(int argc, char **argv, int first)
{
    relay_config c;
    daemon_state d;
    char err[512];
    int rc, e;

    memset(&d, 0, sizeof d);
    relay_config_init(&c);
    rc = relay_config_parse(&c, argc, argv, first, NULL, NULL);
    if (rc != RELAY_CONFIG_OK) {
        if (rc == RELAY_CONFIG_HELP)
            relay_config_usage(stdout, prog);
        else if (rc == RELAY_CONFIG_VERSION)
            printf("outbox-relay %s (liboutbox %s)\n", OUTBOX_VERSION_STRING, outbox_version());
        else
            fprintf(stderr, "%s: %s\n", prog, c.error ? c.error : "out of memory");
        relay_config_finish(&c);
        return rc == RELAY_CONFIG_ERROR ? EXIT_USAGE : EXIT_OK;
    }
    /* From here on problems are log lines, in the format asked for. */
    d.log.fn = c.s.log;
    d.log.min_level = c.s.log_level;
    if (c.s.drain) {
        c.s.on_drained = on_drained;
        c.s.on_drained_data = &d;
    }
    /* A full disk or a lock is waited for like an unreachable Redis (a
     * drain refuses to wait, below, but learns that it would have). */
    c.s.wait_for_db = 1;
    if (uv_loop_init(&d.loop) != 0) {
        outbox__log(&d.log, OUTBOX_LOG_ERROR, "msg=\"cannot create the event loop\"");
        relay_config_finish(&c);
        return EXIT_FATAL;
    }
    if (c.s.db_dir) {
        rc = run_group(&c, &d);
        if (uv_loop_close(&d.loop) != 0)
            outbox__log(&d.log, OUTBOX_LOG_WARN, "msg=\"event loop closed with handles still open\"");
        relay_config_finish(&c);
        return rc;
    }
    e = outbox_relay_create(&d.relay, &d.loop, &c.s, err, sizeof err);
    if (e != 0) {
        char q[600];
        outbox__logfmt_quote(q, sizeof q, err[0] ? err : outbox_strerror(e));
        outbox__log(&d.log, OUTBOX_LOG_ERROR, "msg=\"cannot create the relay\" error=%s err=%s", q,
                    outbox_err_name(e));
        uv_loop_close(&d.loop);
        relay_config_finish(&c);
        /* A database that stays locked is a runtime failure, not a usage
         * error: a supervisor should restart us. */
        return e == OUTBOX_ENOMEM || e == OUTBOX_EBUSY ? EXIT_FATAL : EXIT_USAGE;
    }
    if (c.s.drain && outbox_relay_db_waiting(d.relay, err, sizeof err) == 1) {
        /* A batch job that cannot read its database now fails now: it is
         * a runtime failure (the disk is full, the database is locked), not
         * a configuration error, and running it again later may succeed. */
        char q[600];
        outbox__logfmt_quote(q, sizeof q, err);
        outbox__log(&d.log, OUTBOX_LOG_ERROR, "msg=\"cannot open the database; --drain does not wait\" db=%s error=%s",
                    c.s.db_path, q);
        outbox_relay_destroy(d.relay);
        uv_loop_close(&d.loop);
        relay_config_finish(&c);
        return EXIT_FATAL;
    }
    uv_signal_init(&d.loop, &d.sigterm);
    uv_signal_init(&d.loop, &d.sigint);
    d.sigterm.data = d.sigint.data = &d;
    uv_signal_start(&d.sigterm, on_signal, SIGTERM);
    uv_signal_start(&d.sigint, on_signal, SIGINT);
    signal(SIGPIPE, SIG_IGN);
    if (outbox_relay_start(d.relay) != 0) {
        outbox__log(&d.log, OUTBOX_LOG_ERROR, "msg=\"cannot start (see the log above)\"");
        uv_close((uv_handle_t *)&d.sigterm, NULL);
        uv_close((uv_handle_t *)&d.sigint, NULL);
        outbox_relay_destroy(d.relay);
        uv_run(&d.loop, UV_RUN_DEFAULT);
        uv_loop_close(&d.loop);
        relay_config_finish(&c);
        return EXIT_USAGE;
    }
    uv_run(&d.loop, UV_RUN_DEFAULT);
    outbox_relay_destroy(d.relay);
    uv_run(&d.loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&d.loop) != 0)
        outbox__log(&d.log, OUTBOX_LOG_WARN, "msg=\"event loop closed with handles still open\"");
    relay_config_finish(&c);
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
        relay_config_usage(stderr, prog);
        return EXIT_USAGE;
    }
    if (!strcmp(argv[1], "init"))
        return cmd_init(argc, argv);
    if (!strcmp(argv[1], "run"))
        return cmd_run(argc, argv, 2);
    if (!strcmp(argv[1], "help")) {
        relay_config_usage(stdout, prog);
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
