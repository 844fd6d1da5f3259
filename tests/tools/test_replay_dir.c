/* outbox-replay stats --db-dir: the backlog of a directory of databases,
 * one per tenant. Three outbox databases with different backlogs, a
 * corrupt file (random bytes), a SQLite file without the outbox table, a
 * file and a subdirectory that do not match: the table (largest backlog
 * first, names without .db, totals over every database, how many were read
 * and could not be), the same as JSON, each database's figures equal to
 * what stats --db says of it, the files that could not be read named on
 * stderr with the reason, exit 1 then and 0 when all were read, --top and
 * --db-glob, every usage error exiting 2, and nothing written to any
 * database. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "outbox.h"
#include "rp.h"

static char *tdir;

/* n pending rows <prefix>-0 ... in path. */
static void add_pending(const char *path, const char *prefix, int n)
{
    for (int i = 0; i < n; i++) {
        char sql[200];
        snprintf(sql, sizeof sql, "INSERT INTO outbox(id, topic, payload) VALUES ('%s-%d', 'orders', 'x')", prefix, i);
        rp_exec_sql(path, sql);
    }
}

static void write_file(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0)
        bail("cannot write %s", path);
}

/* The test's directory: alpha (5 pending), bravo (rp_fixture: 1 pending,
 * 2 sending, 1 published, 3 dead), charlie (12 pending), corrupt.db,
 * plain.db (no outbox table), notes.txt, sub.db/ (a directory), and
 * extra.sqlite (2 pending) and idle.sqlite (empty), outbox databases that
 * only a --db-glob reads. */
static void make_dir(void)
{
    char *p, bytes[8192];
    unsigned seed = 7;
    sqlite3 *db;

    tdir = th_path(rp_dir, "tenants");
    if (mkdir(tdir, 0755) != 0)
        bail("mkdir %s", tdir);
    p = rp_make_db("tenants/alpha.db");
    add_pending(p, "a", 5);
    free(p);
    p = rp_fresh_db("tenants/bravo.db");
    free(p);
    p = rp_make_db("tenants/charlie.db");
    add_pending(p, "c", 12);
    free(p);
    p = rp_make_db("tenants/extra.sqlite");
    add_pending(p, "e", 2);
    free(p);
    free(rp_make_db("tenants/idle.sqlite"));
    for (size_t i = 0; i < sizeof bytes; i++) {
        seed = seed * 1103515245u + 12345u;
        bytes[i] = (char)(seed >> 16);
    }
    p = th_path(tdir, "corrupt.db");
    write_file(p, bytes, sizeof bytes);
    free(p);
    p = th_path(tdir, "plain.db");
    if (sqlite3_open(p, &db) != SQLITE_OK || sqlite3_exec(db, "CREATE TABLE t(x); INSERT INTO t VALUES (1)", NULL,
                                                          NULL, NULL) != SQLITE_OK)
        bail("plain.db: %s", sqlite3_errmsg(db));
    sqlite3_close_v2(db);
    free(p);
    p = th_path(tdir, "notes.txt");
    write_file(p, "not a database\n", 15);
    free(p);
    p = th_path(tdir, "sub.db");
    if (mkdir(p, 0755) != 0)
        bail("mkdir %s", p);
    free(p);
}

/* The line of out that starts with prefix, or "" (static). */
static const char *line_of(const char *out, const char *prefix)
{
    static char buf[512];
    size_t pl = strlen(prefix);
    for (const char *s = out; *s;) {
        size_t n = strcspn(s, "\n");
        if (n >= pl && !strncmp(s, prefix, pl)) {
            snprintf(buf, sizeof buf, "%.*s", (int)n, s);
            return buf;
        }
        s += n + (s[n] == '\n');
    }
    return "";
}

/* The row of out for name, without its last column (the age of the oldest
 * due pending row, which varies), that age in *age (static both). */
static const char *row(const char *out, const char *name, const char **age)
{
    static char buf[512], a[64];
    char prefix[80], *last;
    snprintf(prefix, sizeof prefix, "%s ", name);
    snprintf(buf, sizeof buf, "%s", line_of(out, prefix));
    last = strrchr(buf, ' ');
    snprintf(a, sizeof a, "%s", last ? last + 1 : "");
    if (last)
        *last = '\0';
    *age = a;
    return buf;
}

/* Whether the line's whitespace-separated fields are exactly want. */
static int fields_are(const char *line, const char *want)
{
    char a[512], b[512], *sa, *sb, *pa, *pb;
    snprintf(a, sizeof a, "%s", line);
    snprintf(b, sizeof b, "%s", want);
    pa = strtok_r(a, " ", &sa);
    pb = strtok_r(b, " ", &sb);
    while (pa && pb && !strcmp(pa, pb)) {
        pa = strtok_r(NULL, " ", &sa);
        pb = strtok_r(NULL, " ", &sb);
    }
    return !pa && !pb;
}

static void test_table(void)
{
    rp_res r = RUN("stats", "--db-dir", tdir);
    const char *l, *age;
    char *corrupt = th_path(tdir, "corrupt.db"), *plain = th_path(tdir, "plain.db"), want[1024];

    is_int(r.code, 1, "a directory with files that cannot be read: exit 1");
    l = line_of(r.out, "NAME");
    ok(fields_are(l, "NAME PENDING DUE SENDING PUBLISHED DEAD OLDEST DUE"), "the header (%s)", l);
    ok(strstr(r.out, "NAME") < strstr(r.out, "\ncharlie ") && strstr(r.out, "\ncharlie ") < strstr(r.out, "\nalpha ") &&
           strstr(r.out, "\nalpha ") < strstr(r.out, "\nbravo ") && strstr(r.out, "\nbravo ") < strstr(r.out, "\ntotal "),
       "charlie (12 pending), alpha (5), bravo (1), then the totals: the largest backlog first");
    l = row(r.out, "charlie", &age);
    ok(fields_are(l, "charlie 12 12 0 0 0"), "charlie: 12 pending, all due (%s)", l);
    ok(strlen(age) > 1 && strspn(age, "0123456789.") > 0 && age[strlen(age) - 1] == 's',
       "charlie: the age of its oldest due pending row (%s)", age);
    l = row(r.out, "alpha", &age);
    ok(fields_are(l, "alpha 5 5 0 0 0"), "alpha: 5 pending, all due (%s)", l);
    l = row(r.out, "bravo", &age);
    ok(fields_are(l, "bravo 1 1 2 1 3"), "bravo: 1 pending, 1 due, 2 sending, 1 published, 3 dead (%s)", l);
    l = row(r.out, "total", &age);
    ok(fields_are(l, "total 18 18 2 1 3"), "the totals over the three databases (%s)", l);
    is_str(line_of(r.out, "3 databases"), "3 databases read, 2 could not be read (named on stderr)",
           "how many were read and how many could not be");
    ok(!strstr(r.out, "extra") && !strstr(r.out, "notes") && !strstr(r.out, "sub") && !strstr(r.out, ".db"),
       "only *.db files, not the subdirectory sub.db, names without .db");
    snprintf(want, sizeof want, "outbox-replay: %s: ", corrupt);
    l = line_of(r.err, want);
    ok(strstr(l, "ENOTDB") != NULL, "stderr names the corrupt file with the reason (%s)", l);
    snprintf(want, sizeof want, "outbox-replay: %s: ", plain);
    l = line_of(r.err, want);
    ok(strstr(l, "no outbox schema") && strstr(l, "ENOSCHEMA"), "stderr names the file without the outbox table (%s)",
       l);
    is_int(th_count_lines(r.err), 2, "two lines on stderr, one per file that could not be read");
    rp_res_free(&r);

    r = RUN("stats", "--db-dir", tdir, "--top", "2");
    is_int(r.code, 1, "--top 2: exit 1 still");
    ok(strstr(r.out, "\ncharlie ") && strstr(r.out, "\nalpha ") && !strstr(r.out, "\nbravo "),
       "--top 2: the two largest backlogs");
    l = row(r.out, "total", &age);
    ok(fields_are(l, "total 18 18 2 1 3"), "--top 2: the totals still over all three (%s)", l);
    is_str(line_of(r.out, "3 databases"),
           "3 databases read (the 2 with the most pending rows shown), 2 could not be read (named on stderr)",
           "--top 2: says that 2 of 3 are shown");
    rp_res_free(&r);
    free(corrupt);
    free(plain);
}

static void test_json(void)
{
    const char *names[] = {"alpha", "bravo", "charlie"};
    char *all = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&all, &len);
    rp_res r = RUN("stats", "--db-dir", tdir, "--json", "--top", "2");

    is_int(r.code, 1, "--json: exit 1");
    is_int(th_count_lines(r.out), 1, "--json: one line");
    is_int(th_count_lines(r.err), 2, "--json: the two files still named on stderr");
    /* The directory's object, then stats --db --json of each database. */
    fputs(r.out, m);
    rp_res_free(&r);
    for (int i = 0; i < 3; i++) {
        char file[64], *p;
        snprintf(file, sizeof file, "%s.db", names[i]);
        p = th_path(tdir, file);
        r = RUN("stats", "--db", p, "--json");
        fputs(r.out, m);
        rp_res_free(&r);
        free(p);
    }
    fclose(m);
    if (!rp_has_python()) {
        skip("python3 not available to parse the JSON");
        free(all);
        return;
    }
    is_int(rp_py_check(all, "import json,sys\n"
                            "lines = open(sys.argv[1]).read().splitlines()\n"
                            "d = json.loads(lines[0])\n"
                            "one = dict(zip(['alpha', 'bravo', 'charlie'], map(json.loads, lines[1:])))\n"
                            "assert set(d) >= {'databases', 'totals', 'failed'}, d\n"
                            "assert [x['name'] for x in d['databases']] == ['charlie', 'alpha'], d['databases']\n"
                            "assert [x['file'] for x in d['databases']] == ['charlie.db', 'alpha.db']\n"
                            "for x in d['databases']:\n"
                            "    s = one[x['name']]\n"
                            "    b = s['by_state']\n"
                            "    assert (x['pending'], x['due'], x['sending'], x['published'], x['dead']) == \\\n"
                            "        (b['pending'], s['pending_due'], b['sending'], b['published'], b['dead']), (x, s)\n"
                            "    assert (x['oldest_due_pending_age_ms'] is None) == "
                            "(s['oldest_due_pending'] is None), (x, s)\n"
                            "t = d['totals']\n"
                            "assert t['databases'] == 3 and d['read'] == 3, t\n"
                            "for k, sk in (('pending', 'pending'), ('sending', 'sending'), ('published', "
                            "'published'), ('dead', 'dead')):\n"
                            "    assert t[k] == sum(s['by_state'][sk] for s in one.values()), (k, t)\n"
                            "assert t['due'] == sum(s['pending_due'] for s in one.values()), t\n"
                            "assert (t['pending'], t['sending'], t['published'], t['dead']) == (18, 2, 1, 3), t\n"
                            "assert t['oldest_due_pending_age_ms'] >= 0, t\n"
                            "f = {x['name']: x for x in d['failed']}\n"
                            "assert sorted(f) == ['corrupt', 'plain'], d['failed']\n"
                            "assert f['corrupt']['file'] == 'corrupt.db' and 'ENOTDB' in f['corrupt']['error'], f\n"
                            "assert 'ENOSCHEMA' in f['plain']['error'], f\n"),
           0, "--json: databases (the top 2, each as stats --db says), totals over all three, failed with reasons");
    free(all);
}

static void test_all_read(void)
{
    rp_res r = RUN("stats", "--db-dir", tdir, "--db-glob", "*.sqlite", "--db-glob", "a*");
    const char *l, *age;
    is_int(r.code, 0, "every database read: exit 0");
    ok(strstr(r.out, "\nalpha ") && strstr(r.out, "\nextra.sqlite ") && strstr(r.out, "\nidle.sqlite ") &&
           !strstr(r.out, "charlie") && !strstr(r.out, "-wal") && !strstr(r.out, "-shm"),
       "repeated --db-glob: the files matching any of them (alpha.db, *.sqlite), no others, not alpha.db-wal "
       "nor alpha.db-shm");
    l = row(r.out, "idle.sqlite", &age);
    ok(fields_are(l, "idle.sqlite 0 0 0 0 0") && !strcmp(age, "-"),
       "a database with no due row: zeros and no age (%s %s); a name not ending in .db is kept whole", l, age);
    ok(strstr(r.out, "\nalpha ") < strstr(r.out, "\nextra.sqlite ") &&
           strstr(r.out, "\nextra.sqlite ") < strstr(r.out, "\nidle.sqlite "),
       "5, 2, then 0 pending");
    is_str(line_of(r.out, "3 databases"), "3 databases read, 0 could not be read", "3 read, none failed");
    is_str(r.err, "", "nothing on stderr");
    rp_res_free(&r);
    r = RUN("stats", "--db-dir", tdir, "--db-glob", "*.none");
    is_int(r.code, 0, "no file matches: exit 0");
    is_str(line_of(r.out, "0 databases"), "0 databases read, 0 could not be read", "an empty table");
    rp_res_free(&r);
    r = RUN("stats", "--db-dir", tdir, "--db-glob", "alpha.db", "--json");
    is_int(r.code, 0, "--json, every database read: exit 0");
    ok(strstr(r.out, "\"failed\":[]") != NULL, "--json: failed is empty");
    rp_res_free(&r);
}

static void test_unreadable(void)
{
    char *p = th_path(tdir, "locked.db");
    rp_res r;
    if (geteuid() == 0) {
        skip("running as root: a file without read permission is still readable");
        free(p);
        return;
    }
    free(rp_make_db("tenants/locked.db"));
    chmod(p, 0);
    r = RUN("stats", "--db-dir", tdir, "--db-glob", "locked.db", "--db-glob", "alpha.db");
    is_int(r.code, 1, "an unreadable file: exit 1");
    ok(strstr(r.err, "locked.db") && strstr(r.out, "\nalpha "), "it is named on stderr, the others still read (%s)",
       rp_oneline(r.err));
    rp_res_free(&r);
    chmod(p, 0644);
    unlink(p);
    free(p);
}

/* Each usage error exits 2 and says what is wrong. In the arguments, @DIR
 * stands for the test's directory, @FILE for a database in it, @MISSING
 * for a path that does not exist. */
static void test_usage(void)
{
    static const struct {
        const char *args[7], *needle, *what;
    } cases[] = {
        {{"stats", "--db-dir", "@MISSING"}, "No such file or directory", "a missing directory"},
        {{"stats", "--db-dir", "@FILE"}, "Not a directory", "--db-dir naming a file"},
        {{"stats", "--db-dir", "@DIR", "--db", "@FILE"}, "--db cannot be combined with --db-dir", "--db-dir with --db"},
        {{"stats", "--db-dir", "@DIR", "--top", "0"}, "--top: 0 is out of range", "--top 0"},
        {{"stats", "--db-dir", "@DIR", "--top", "ten"}, "--top: 'ten' is not a whole number", "--top ten"},
        {{"stats", "--db-dir", "@DIR", "--top", "1", "--top", "2"}, "--top given twice", "--top twice"},
        {{"stats", "--db", "@FILE", "--top", "3"}, "--top needs --db-dir", "--top without --db-dir"},
        {{"stats", "--db", "@FILE", "--db-glob", "*.db"}, "--db-glob needs --db-dir", "--db-glob without --db-dir"},
        {{"stats", "--db-dir", "@DIR", "--db-glob", "a/b"}, "--db-glob: 'a/b' is not a pattern of file names",
         "--db-glob with a '/'"},
        {{"stats", "--db-dir", "@DIR", "--state", "dead"}, "--state cannot be combined with --db-dir",
         "--db-dir with a filter"},
        {{"stats", "--db-dir", "@DIR", "--by-topic"}, "--by-topic cannot be combined with --db-dir",
         "--db-dir with --by-topic"},
        {{"list", "--db-dir", "@DIR"}, "--db-dir does not apply to list", "list --db-dir"},
        {{"stats"}, "--db PATH is required (or --db-dir DIR)", "stats without --db or --db-dir"},
    };
    char *file = th_path(tdir, "alpha.db"), *missing = th_path(rp_dir, "no-such-dir");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *argv[9] = {rp_tool};
        rp_res r;
        for (size_t k = 0; k < 7 && cases[i].args[k]; k++) {
            const char *a = cases[i].args[k];
            argv[k + 1] = (char *)(!strcmp(a, "@DIR") ? tdir : !strcmp(a, "@FILE") ? file
                                                     : !strcmp(a, "@MISSING") ? missing : a);
        }
        r = rp_run(argv);
        rp_expect(r, 2, cases[i].needle, cases[i].what);
        rp_res_free(&r);
    }
    free(file);
    free(missing);
}

int main(void)
{
    char *bravo;
    uint64_t before;
    rp_setup();
    make_dir();
    bravo = th_path(tdir, "bravo.db");
    before = rp_table_sum(bravo);

    test_table();
    test_json();
    test_all_read();
    test_unreadable();
    test_usage();
    {
        char *help = NULL;
        rp_res r = RUN("--help");
        help = r.out;
        ok(strstr(help, "--db-dir DIR") && strstr(help, "--db-glob PATTERN") && strstr(help, "--top N"),
           "--help documents --db-dir, --db-glob and --top");
        rp_res_free(&r);
    }
    ok(rp_table_sum(bravo) == before, "the databases are read, never written");

    free(bravo);
    free(tdir);
    rp_teardown();
    return tap_done();
}
