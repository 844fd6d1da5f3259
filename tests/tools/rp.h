/*
 * rp.h: what the outbox-replay tests (test_replay_*.c) share: running the
 * tool, outbox databases in the test's directory with the standard rows in
 * every state, queries and checksums to prove what a run changed (or that
 * it changed nothing), and JSON checked with Python when it is installed.
 * Setup failures bail out.
 */
#ifndef OUTBOX_TESTS_RP_H
#define OUTBOX_TESTS_RP_H

#include <stdint.h>
#include <string.h>

#include <sqlite3.h>

#include "tap.h"

/* Unix milliseconds now, as SQL (the schema's own default expression). */
#define NOW_SQL "CAST(round((julianday('now') - 2440587.5) * 86400000.0) AS INTEGER)"

/* The outbox-replay binary and the test's temporary directory (rp_setup). */
extern char *rp_tool, *rp_dir;

/* Sets rp_tool and rp_dir; bails if the tool is not built. */
void rp_setup(void);
/* Removes rp_dir and frees both. */
void rp_teardown(void);

/* A finished run: exit status as th_run, stdout and stderr ("" if none). */
typedef struct rp_res {
    int code;
    char *out, *err;
} rp_res;

/* Runs argv (argv[0] a path) to its end, at most 30 s. */
rp_res rp_run(char *const *argv);
void rp_res_free(rp_res *r);
/* Runs outbox-replay with the given arguments. */
#define RUN(...)                                                                                   \
    ({                                                                                             \
        char *argv_[] = {rp_tool, __VA_ARGS__, NULL};                                              \
        rp_run(argv_);                                                                             \
    })

/* Creates <rp_dir>/<name> with the outbox schema; returns the malloc'd path. */
char *rp_make_db(const char *name);
/* A plain connection (busy_timeout 5000 ms) to an existing database. */
sqlite3 *rp_open_plain(const char *path);
/* Runs SQL on its own connection; bails on error. */
void rp_exec_sql(const char *path, const char *sql);
/* First column of the first row as an integer (-999 for no row, -998 for
 * NULL). */
long long rp_q_int(const char *path, const char *sql);
/* First column of the first row as a malloc'd string, NULL for NULL. */
char *rp_q_str(const char *path, const char *sql);
/* A checksum of every column of every row of the outbox table, with types. */
uint64_t rp_table_sum(const char *path);
/* A checksum of a file's bytes (0 if it cannot be read). */
uint64_t rp_file_sum(const char *path);

/* The standard rows, one or more in every state:
 *   d1, d2 dead (orders), d3 dead (billing); p1 published (orders);
 *   q1 pending (orders); s-live sending with a live lease (w1, token 7);
 *   s-exp sending with an expired lease (w2, token 3). */
void rp_fixture(const char *path);
/* rp_make_db with rp_fixture's rows. */
char *rp_fresh_db(const char *name);

/* Text made fit for one TAP line (newlines become " | "), truncated; the
 * last four results stay valid. */
const char *rp_oneline(const char *s);
/* Writes text to a file in the test directory and checks it with a Python
 * script (argv[1] is the file): returns the script's exit status. */
int rp_py_check(const char *text, const char *script);
/* Whether python3 runs. */
int rp_has_python(void);

/* Checks a run's exit status and, unless needle is NULL, that its stderr or
 * stdout says needle. Inline here because tap.h's counters are per file:
 * the checks must count in the test's. */
static inline void rp_expect(rp_res r, int code, const char *needle, const char *what)
{
    is_int(r.code, code, "%s: exit %d", what, code);
    if (needle)
        ok(strstr(r.err, needle) != NULL || strstr(r.out, needle) != NULL, "%s: says '%s' (%s)", what, needle,
           rp_oneline(r.err[0] ? r.err : r.out));
}

#endif
