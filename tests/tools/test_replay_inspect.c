/* outbox-replay's inspection: --help and --version, list, show and stats,
 * JSON output (checked with Python when it is installed) and the time
 * filters. Real SQLite files made with outbox_db_open() +
 * outbox_schema_apply(), rows inserted by SQL in every state; helpers in
 * rp.h. */
#include <stdlib.h>
#include <string.h>

#include <msgpack.h>

#include "harness.h"
#include "outbox.h"
#include "rp.h"
#include "tap.h"

static void test_help(void)
{
    const char *must[] = {"list",       "show ID",  "stats",    "requeue",     "purge",    "--db",      "--state",
                          "pending",    "sending",  "published", "dead",       "--topic",  "--key",     "--id ",
                          "--id-prefix", "--since", "--until",   "--dry-run",  "--yes",    "--force",   "--reason",
                          "--json",     "--limit",  "--by-topic", "--batch",   "--threshold", "default 100", "default 500",
                          "JSON array", "base64",   "Exit status", "outbox-relay init"};
    rp_res r = RUN("--help");
    int all = 1;
    is_int(r.code, 0, "--help exits 0");
    for (size_t i = 0; i < sizeof must / sizeof must[0]; i++)
        if (!strstr(r.out, must[i])) {
            diag("--help lacks '%s'", must[i]);
            all = 0;
        }
    ok(all, "--help documents every subcommand, filter and option");
    rp_res_free(&r);
    r = RUN("requeue", "--help");
    is_int(r.code, 0, "SUBCOMMAND --help exits 0");
    rp_res_free(&r);
    r = RUN("--version");
    ok(r.code == 0 && strstr(r.out, OUTBOX_VERSION_STRING), "--version");
    rp_res_free(&r);
    {
        char *argv[] = {rp_tool, NULL};
        r = rp_run(argv);
        ok(r.code == 2 && strstr(r.err, "Usage"), "no arguments: usage on stderr, exit 2");
        rp_res_free(&r);
    }
}

static void test_json(int py)
{
    char *db = rp_fresh_db("json.db");
    rp_res r;

    /* Quotes, backslashes, control characters, an escape sequence, invalid
     * UTF-8 and non-ASCII text in text columns. */
    rp_exec_sql(db, "INSERT INTO outbox(id, topic, key, payload, state, last_error, lease_owner) VALUES"
                 " ('j1', 'odd', 'ключ', 'x', 3, CAST(X'71226222205c6e0a01091b5b33316dff41c3a9' AS TEXT), 'a\"b');");
    r = RUN("list", "--db", db, "--json", "--limit", "0");
    is_int(r.code, 0, "list --json");
    if (py) {
        is_int(rp_py_check(r.out, "import json,sys\n"
                               "d = json.load(open(sys.argv[1], encoding='utf-8'))\n"
                               "assert isinstance(d, list) and len(d) == 8, len(d)\n"
                               "r = {x['id']: x for x in d}\n"
                               "j = r['j1']\n"
                               "assert j['last_error'] == 'q\"b\" \\\\n\\n\\x01\\t\\x1b[31m\\ufffdA\\u00e9', "
                               "repr(j['last_error'])\n"
                               "assert j['key'] == '\\u043a\\u043b\\u044e\\u0447', repr(j['key'])\n"
                               "assert j['lease_owner'] == 'a\"b'\n"
                               "assert j['state'] == 'dead' and j['state_code'] == 3\n"
                               "assert r['s-live']['lease_live'] is True and r['s-live']['lease_expires_in_ms'] > 0\n"
                               "assert r['s-exp']['lease_live'] is False\n"
                               "assert r['p1']['published_at'].endswith('Z') and r['p1']['stream_id'] == '1-0'\n"
                               "assert r['q1']['key'] is None and r['q1']['replay_count'] == 0\n"),
               0, "list --json parses; escapes (quotes, \\, controls, invalid UTF-8 -> U+FFFD) are right");
    }
    rp_res_free(&r);

    r = RUN("list", "--db", db, "--json", "--topic", "nosuch");
    ok(r.code == 0 && strstr(r.out, "[]"), "list --json with nothing matching: [] and exit 0");
    rp_res_free(&r);

    r = RUN("list", "--db", db);
    ok(r.code == 0 && !strchr(r.out, '\x1b'), "human table never prints an escape character");
    ok(strstr(r.out, "ID") && strstr(r.out, "STATE") && strstr(r.out, "LAST ERROR") && strstr(r.out, "REPLAYS"),
       "human table has headers");
    rp_res_free(&r);

    r = RUN("stats", "--db", db, "--json");
    is_int(r.code, 0, "stats --json");
    if (py)
        is_int(rp_py_check(r.out, "import json,sys\n"
                               "d = json.load(open(sys.argv[1]))\n"
                               "assert d['total'] == 8, d\n"
                               "assert d['by_state'] == {'pending': 1, 'sending': 2, 'published': 1, 'dead': 4}, d\n"
                               "assert d['dead'] == 4 and d['pending_due'] == 1 and d['pending_waiting'] == 0\n"
                               "assert d['leases_live'] == 1 and d['leases_expired'] == 1\n"
                               "assert d['oldest_due_pending']['id'] == 'q1'\n"
                               "assert 'by_topic' not in d, d\n"),
               0, "stats --json without --by-topic: the same figures, no counts by topic");
    rp_res_free(&r);
    r = RUN("stats", "--db", db, "--json", "--by-topic");
    is_int(r.code, 0, "stats --json --by-topic");
    if (py)
        is_int(rp_py_check(r.out, "import json,sys\n"
                               "d = json.load(open(sys.argv[1]))\n"
                               "assert d['total'] == 8, d\n"
                               "assert d['by_state'] == {'pending': 1, 'sending': 2, 'published': 1, 'dead': 4}, d\n"
                               "assert d['dead'] == 4 and d['pending_due'] == 1 and d['pending_waiting'] == 0\n"
                               "assert d['leases_live'] == 1 and d['leases_expired'] == 1\n"
                               "assert d['oldest_due_pending']['id'] == 'q1' and "
                               "d['oldest_due_pending']['age_ms'] >= 0\n"
                               "t = {x['topic']: x for x in d['by_topic']}\n"
                               "assert t['orders']['dead'] == 2 and t['orders']['sending'] == 2, t\n"
                               "assert t['billing']['dead'] == 1 and t['billing']['total'] == 1\n"),
               0, "stats --json: counts by state, by topic x state, due, leases, oldest due pending");
    rp_res_free(&r);
    r = RUN("stats", "--db", db, "--by-topic");
    ok(r.code == 0 && strstr(r.out, "dead") && strstr(r.out, "oldest due pending") && strstr(r.out, "billing"),
       "stats --by-topic human output");
    rp_res_free(&r);
    r = RUN("stats", "--db", db);
    ok(r.code == 0 && strstr(r.out, "oldest due pending") && !strstr(r.out, "TOPIC"),
       "stats human output, without the table by topic");
    rp_res_free(&r);

    r = RUN("requeue", "--db", db, "--state", "dead", "--reason", "json \"quoted\"\\", "--dry-run", "--json");
    is_int(r.code, 0, "requeue --dry-run --json");
    if (py)
        is_int(rp_py_check(r.out, "import json,sys\n"
                               "d = json.load(open(sys.argv[1]))\n"
                               "assert d['dry_run'] is True and d['would_requeue'] == 4, d\n"
                               "assert sorted(x['id'] for x in d['rows']) == ['d1', 'd2', 'd3', 'j1']\n"
                               "assert all(x['action'] == 'requeue' for x in d['rows'])\n"
                               "assert d['reason'] == 'json \"quoted\"\\\\'\n"),
               0, "dry-run JSON parses and lists the rows with their action");
    rp_res_free(&r);
    r = RUN("requeue", "--db", db, "--state", "dead", "--topic", "odd", "--reason", "r", "--json");
    is_int(r.code, 0, "requeue --json");
    if (py)
        is_int(rp_py_check(r.out, "import json,sys\n"
                               "d = json.load(open(sys.argv[1]))\n"
                               "assert d['requeued'] == 1 and d['by_state']['dead'] == 1 and d['complete'], d\n"),
               0, "requeue JSON summary parses");
    rp_res_free(&r);
    free(db);
}

static void test_show(int py)
{
    char *db = rp_make_db("show.db");
    msgpack_sbuffer sb;
    msgpack_packer pk;
    sqlite3 *h;
    sqlite3_stmt *st;
    rp_res r;

    /* Headers {"trace": "abc", "n": 5, "bin": <bin 01 02>}. */
    msgpack_sbuffer_init(&sb);
    msgpack_packer_init(&pk, &sb, msgpack_sbuffer_write);
    msgpack_pack_map(&pk, 3);
    msgpack_pack_str(&pk, 5);
    msgpack_pack_str_body(&pk, "trace", 5);
    msgpack_pack_str(&pk, 3);
    msgpack_pack_str_body(&pk, "abc", 3);
    msgpack_pack_str(&pk, 1);
    msgpack_pack_str_body(&pk, "n", 1);
    msgpack_pack_int(&pk, 5);
    msgpack_pack_str(&pk, 3);
    msgpack_pack_str_body(&pk, "bin", 3);
    msgpack_pack_bin(&pk, 2);
    msgpack_pack_bin_body(&pk, "\x01\x02", 2);
    h = rp_open_plain(db);
    sqlite3_prepare_v2(h, "INSERT INTO outbox(id, topic, payload, headers) VALUES ('text-1', 'orders', ?1, ?2)", -1,
                       &st, NULL);
    sqlite3_bind_blob(st, 1, "h\xc3\xa9llo \"world\"\n", 15, SQLITE_STATIC);
    sqlite3_bind_blob(st, 2, sb.data, (int)sb.size, SQLITE_STATIC);
    ok(sqlite3_step(st) == SQLITE_DONE, "inserted a message with msgpack headers");
    sqlite3_finalize(st);
    sqlite3_close_v2(h);
    msgpack_sbuffer_destroy(&sb);
    rp_exec_sql(db, "INSERT INTO outbox(id, topic, payload, headers, state) VALUES "
                 "('bin-1', 'orders', X'00ff80', X'81a1', 3)");

    r = RUN("show", "bin-1", "--db", db, "--json");
    is_int(r.code, 0, "show --json of a binary payload");
    ok(strstr(r.out, "\"payload_encoding\":\"base64\"") && strstr(r.out, "\"payload\":\"AP+A\""),
       "binary payload shown as base64 with its encoding: %s", rp_oneline(r.out));
    if (py)
        is_int(rp_py_check(r.out, "import json,sys,base64\n"
                               "d = json.load(open(sys.argv[1]))\n"
                               "assert base64.b64decode(d['payload']) == b'\\x00\\xff\\x80'\n"
                               "assert d['headers'] is None and d['headers_error'] == 'truncated msgpack', d\n"
                               "assert base64.b64decode(d['headers_base64']) == b'\\x81\\xa1'\n"
                               "assert d['payload_size'] == 3 and d['state'] == 'dead'\n"),
               0, "show JSON parses; undecodable headers reported with their bytes");
    rp_res_free(&r);
    r = RUN("show", "bin-1", "--db", db);
    ok(r.code == 0 && strstr(r.out, "base64") && strstr(r.out, "AP+A") && strstr(r.out, "undecodable"),
       "human show of a binary payload: base64");
    rp_res_free(&r);

    r = RUN("show", "text-1", "--db", db, "--json");
    is_int(r.code, 0, "show --json of a text payload");
    if (py)
        is_int(rp_py_check(r.out, "import json,sys\n"
                               "d = json.load(open(sys.argv[1], encoding='utf-8'))\n"
                               "assert d['payload_encoding'] == 'utf8'\n"
                               "assert d['payload'] == 'h\\u00e9llo \"world\"\\n', repr(d['payload'])\n"
                               "assert d['headers'] == {'trace': 'abc', 'n': 5, 'bin': {'base64': 'AQI='}}, "
                               "d['headers']\n"),
               0, "text payload as utf8 text; headers decoded from msgpack to JSON");
    rp_res_free(&r);
    r = RUN("show", "text-1", "--db", db);
    ok(r.code == 0 && strstr(r.out, "utf8") && strstr(r.out, "\"trace\":\"abc\""), "human show: text and headers");
    rp_res_free(&r);

    r = RUN("show", "nope", "--db", db);
    rp_expect(r, 1, "no message with id nope", "show of a missing id");
    rp_res_free(&r);
    r = RUN("show", "--db", db);
    rp_expect(r, 2, "show needs a message id", "show without an id");
    rp_res_free(&r);
    free(db);
}

/* Does the list output name exactly the wanted ids among t-early, t-mid,
 * t-late? */
static int selects(rp_res r, int early, int mid, int late)
{
    return r.code == 0 && !!strstr(r.out, "t-early") == early && !!strstr(r.out, "t-mid") == mid &&
           !!strstr(r.out, "t-late") == late;
}

static void test_time_filters(void)
{
    char *db = rp_make_db("time.db");
    rp_res r;

    /* 2026-11-29T09:00:00Z, 2026-11-29T10:30:00Z, 2026-11-30T00:00:00.500Z */
    rp_exec_sql(db, "INSERT INTO outbox(id, topic, payload, created_at, state) VALUES"
                 " ('t-early', 'orders', 'x', 1795942800000, 3),"
                 " ('t-mid', 'orders', 'x', 1795948200000, 3),"
                 " ('t-late', 'orders', 'x', 1795996800500, 3)");
    r = RUN("list", "--db", db, "--since", "2026-11-29T10:00:00Z");
    ok(selects(r, 0, 1, 1), "--since ISO Z");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--since", "2026-11-29T11:00:00+01:00");
    ok(selects(r, 0, 1, 1), "--since ISO with an offset");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--until", "2026-11-29T12:00:00.000+02:00");
    ok(selects(r, 1, 0, 0), "--until ISO with milliseconds and an offset");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--since", "2026-11-29", "--until", "2026-11-30");
    ok(selects(r, 1, 1, 0), "--since/--until dates (until exclusive)");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--since", "2026-11-30T00:00:00.5Z");
    ok(selects(r, 0, 0, 1), "fractional seconds");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--since", "1795946400000");
    ok(selects(r, 0, 1, 1), "--since unix ms");
    rp_res_free(&r);
    r = RUN("list", "--db", db, "--until", "1795996800500");
    ok(selects(r, 1, 1, 0), "--until unix ms (exclusive)");
    rp_res_free(&r);
    r = RUN("requeue", "--db", db, "--since", "2026-11-29T10:00:00Z", "--until", "1795996800000", "--reason", "t");
    is_int(r.code, 0, "requeue by a time window, ISO and unix ms mixed (%s)", rp_oneline(r.err));
    {
        char *ids = rp_q_str(db, "SELECT group_concat(id) FROM outbox_messages WHERE state = 0");
        is_str(ids, "t-mid", "only the row inside the window was requeued");
        free(ids);
    }
    rp_res_free(&r);
    free(db);
}

int main(void)
{
    int py;
    rp_setup();
    py = rp_has_python();
    if (!py)
        diag("python3 not found: JSON is checked by substring only");
    test_help();
    test_json(py);
    test_show(py);
    test_time_filters();
    rp_teardown();
    return tap_done();
}
