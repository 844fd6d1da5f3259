/*
 * outbox-replay's rows (replay.h): a message as JSON members or as a line
 * of the table, the table of list and of every --dry-run, and list itself.
 */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "util/str.h"
#include "json.h"
#include "replay.h"

const char *replay_state_name(int64_t s)
{
    return s >= 0 && s < OUTBOX_STATE_COUNT ? replay_state_names[s] : "unknown";
}

static const char *const action_text[ACT_COUNT] = {"", "requeue", "skip: live lease", "take: live lease",
                                                   "delete"};
static const char *const action_json[ACT_COUNT] = {"", "requeue", "skip_live_lease", "take_live_lease", "delete"};

static int lease_live(sqlite3_stmt *st, int64_t now)
{
    return sqlite3_column_int64(st, C_STATE) == OUTBOX_STATE_SENDING && !replay_col_null(st, C_LEASE_UNTIL) &&
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

static void json_key(outbox__sbuf *b, const char *k)
{
    outbox__sbuf_printf(b, ",\"%s\":", k);
}

static void json_text_col(outbox__sbuf *b, sqlite3_stmt *st, const char *k, int i)
{
    size_t n;
    const unsigned char *s = replay_col_text(st, i, &n);
    json_key(b, k);
    if (s)
        tools_json_str(b, s, n);
    else
        outbox__sbuf_puts(b, "null");
}

static void json_int_col(outbox__sbuf *b, sqlite3_stmt *st, const char *k, int i)
{
    json_key(b, k);
    if (replay_col_null(st, i))
        outbox__sbuf_puts(b, "null");
    else
        outbox__sbuf_printf(b, "%" PRId64, (int64_t)sqlite3_column_int64(st, i));
}

/* "k": "ISO", "k_ms": n (both null for NULL). */
static void json_time_col(outbox__sbuf *b, sqlite3_stmt *st, const char *k, int i)
{
    char buf[96];
    json_key(b, k);
    if (replay_col_null(st, i)) {
        outbox__sbuf_printf(b, "null,\"%s_ms\":null", k);
        return;
    }
    outbox__sbuf_printf(b, "\"%s\",\"%s_ms\":%" PRId64, replay_fmt_time(sqlite3_column_int64(st, i), buf), k,
                        (int64_t)sqlite3_column_int64(st, i));
}

void replay_json_row_fields(outbox__sbuf *b, sqlite3_stmt *st, int64_t now)
{
    int64_t state = sqlite3_column_int64(st, C_STATE);
    outbox__sbuf_printf(b, "{\"seq\":%" PRId64, (int64_t)sqlite3_column_int64(st, C_SEQ));
    json_text_col(b, st, "id", C_ID);
    outbox__sbuf_printf(b, ",\"state\":\"%s\",\"state_code\":%" PRId64, replay_state_name(state), state);
    json_text_col(b, st, "topic", C_TOPIC);
    json_text_col(b, st, "key", C_KEY);
    json_int_col(b, st, "attempts", C_ATTEMPTS);
    json_text_col(b, st, "last_error", C_LAST_ERROR);
    json_text_col(b, st, "lease_owner", C_LEASE_OWNER);
    json_int_col(b, st, "lease_token", C_LEASE_TOKEN);
    json_time_col(b, st, "lease_until", C_LEASE_UNTIL);
    json_key(b, "lease_expires_in_ms");
    if (state == OUTBOX_STATE_SENDING && !replay_col_null(st, C_LEASE_UNTIL))
        outbox__sbuf_printf(b, "%" PRId64, (int64_t)sqlite3_column_int64(st, C_LEASE_UNTIL) - now);
    else
        outbox__sbuf_puts(b, "null");
    outbox__sbuf_printf(b, ",\"lease_live\":%s", lease_live(st, now) ? "true" : "false");
    json_time_col(b, st, "created_at", C_CREATED);
    json_time_col(b, st, "available_at", C_AVAILABLE);
    json_time_col(b, st, "published_at", C_PUBLISHED);
    json_text_col(b, st, "stream_id", C_STREAM_ID);
    json_int_col(b, st, "replay_count", C_REPLAY_COUNT);
    json_time_col(b, st, "replayed_at", C_REPLAYED_AT);
    json_text_col(b, st, "replay_reason", C_REPLAY_REASON);
    json_int_col(b, st, "batch", C_BATCH);
}

/* ---- the human table ----------------------------------------------------- */

enum { T_ACTION, T_ID, T_STATE, T_TOPIC, T_KEY, T_ATTEMPTS, T_ERROR, T_LEASE, T_CREATED, T_PUBLISHED, T_REPLAYS, T_COUNT };
static const char *const table_heads[T_COUNT] = {"ACTION", "ID",    "STATE",   "TOPIC",     "KEY",    "ATTEMPTS",
                                                 "LAST ERROR", "LEASE", "CREATED", "PUBLISHED", "REPLAYS"};
/* Widest cell of each column, in characters; longer text is cut with "...".
 * Ids and topics (at most 128) are never cut. */
static const size_t table_max[T_COUNT] = {16, OUTBOX_ID_MAX, 9, OUTBOX_TOPIC_MAX, 32, 8, 48, 48, 24, 24, 7};
void replay_cell_set(cell *c, const unsigned char *s, size_t n, size_t maxw)
{
    size_t i = 0, chars = 0, out = 0, limit, l;
    uint32_t cp;
    for (i = 0; i < n; i += l ? l : 1, chars++)
        l = outbox__utf8_seq(s + i, n - i, &cp);
    limit = chars > maxw ? maxw - 3 : chars;
    chars = 0;
    for (i = 0; i < n && chars < limit; chars++) {
        l = outbox__utf8_seq(s + i, n - i, &cp);
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
    replay_cell_set(c, (const unsigned char *)s, strlen(s), CELL_CAP / 4);
}

static void cell_col(cell *c, sqlite3_stmt *st, int i, size_t maxw)
{
    size_t n;
    const unsigned char *s = replay_col_text(st, i, &n);
    if (s && n)
        replay_cell_set(c, s, n, maxw);
    else
        cell_str(c, "-");
}

static void cell_time(cell *c, sqlite3_stmt *st, int i)
{
    char buf[96];
    cell_str(c, replay_col_null(st, i) ? "-" : replay_fmt_time(sqlite3_column_int64(st, i), buf));
}

static void row_cells(cell *cells, sqlite3_stmt *st, action act, int64_t now)
{
    char buf[64], d[32];
    cell_str(&cells[T_ACTION], action_text[act]);
    cell_col(&cells[T_ID], st, C_ID, table_max[T_ID]);
    cell_str(&cells[T_STATE], replay_state_name(sqlite3_column_int64(st, C_STATE)));
    cell_col(&cells[T_TOPIC], st, C_TOPIC, table_max[T_TOPIC]);
    cell_col(&cells[T_KEY], st, C_KEY, table_max[T_KEY]);
    cell_col(&cells[T_ATTEMPTS], st, C_ATTEMPTS, table_max[T_ATTEMPTS]);
    cell_col(&cells[T_ERROR], st, C_LAST_ERROR, table_max[T_ERROR]);
    if (sqlite3_column_int64(st, C_STATE) == OUTBOX_STATE_SENDING || !replay_col_null(st, C_LEASE_OWNER)) {
        cell *c = &cells[T_LEASE];
        int64_t until = sqlite3_column_int64(st, C_LEASE_UNTIL);
        cell_col(c, st, C_LEASE_OWNER, 24);
        if (replay_col_null(st, C_LEASE_UNTIL))
            snprintf(buf, sizeof buf, " (no expiry)");
        else if (until > now)
            snprintf(buf, sizeof buf, " (expires in %s)", replay_fmt_dur(until - now, d));
        else
            snprintf(buf, sizeof buf, " (expired %s ago)", replay_fmt_dur(now - until, d));
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

int replay_print_rows(sqlite3 *db, const replay_options *o, const rowsel *rs, int64_t now, rowcount *count)
{
    sqlite3_stmt *st;
    size_t widths[T_COUNT];
    cell *cells;
    outbox__sbuf out = {0};
    int oom = 0;
    int pass, rc = 0, first = rs->cmd == CMD_REQUEUE || rs->cmd == CMD_PURGE ? T_ACTION : T_ID;

    memset(count, 0, sizeof *count);
    if (replay_prepare_select(db, o, rs->states, ROW_COLS, rs->max_seq ? " AND seq <= :max" : "",
                              rs->limit ? " ORDER BY seq LIMIT :lim" : " ORDER BY seq", &st) != 0)
        return -1;
    replay_bind_named(st, ":max", rs->max_seq);
    replay_bind_named(st, ":lim", rs->limit + 1);
    cells = malloc(sizeof *cells * T_COUNT);
    if (!cells) {
        sqlite3_finalize(st);
        replay_errorf("out of memory");
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
                outbox__sbuf_puts(&out, n > 1 ? ",\n" : "\n");
                replay_json_row_fields(&out, st, now);
                if (act != ACT_NONE)
                    outbox__sbuf_printf(&out, ",\"action\":\"%s\"", action_json[act]);
                outbox__sbuf_puts(&out, "}");
                if (replay_emit(&out) != 0) {
                    oom = 1;
                    break;
                }
            } else {
                row_cells(cells, st, act, now);
                print_line(stdout, cells, widths, first);
            }
        }
        rc = rc == SQLITE_ROW || rc == SQLITE_DONE || oom ? 0 : rc;
        if (oom)
            break;
        count->rows = n;
        if (pass == 1 && o->json)
            fputs(n ? "\n]" : "]", stdout);
    }
    free(cells);
    outbox__sbuf_free(&out);
    if (rc != 0)
        replay_db_fail(db, "cannot read the outbox table");
    sqlite3_finalize(st);
    return rc || oom ? -1 : 0;
}

/* ---- list ---------------------------------------------------------------- */

int replay_cmd_list(const replay_options *o)
{
    sqlite3 *db;
    rowsel rs = {o->states, 0, o->limit, CMD_LIST};
    rowcount count;
    int rc = replay_open_db(o, 0, &db);
    if (rc != GO_ON)
        return rc;
    /* One read transaction: both passes of the table see the same rows. */
    sqlite3_exec(db, "BEGIN", NULL, NULL, NULL);
    rc = replay_print_rows(db, o, &rs, outbox_now_ms(), &count);
    sqlite3_exec(db, "COMMIT", NULL, NULL, NULL);
    sqlite3_close_v2(db);
    if (rc != 0)
        return EXIT_FAIL;
    if (o->json)
        putchar('\n');
    if (count.rows == 0 && !o->json)
        replay_errorf("no messages match");
    if (count.more)
        replay_errorf("showing the first %" PRId64 " matching messages; more match (raise --limit, 0 for all)",
                      o->limit);
    return replay_finish_output();
}
