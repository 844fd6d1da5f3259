/*
 * replay.h: what the parts of outbox-replay share (internal to the tool).
 *
 * main.c parses the command line (args.c) and runs one subcommand:
 * rows.c (list, and the rows of every --dry-run), show.c, stats.c,
 * stats_dir.c (stats over a directory of databases) and change.c (requeue
 * and purge). query.c opens the database and builds the
 * filtered SELECTs; output.c holds the messages and the text for humans;
 * tools/common/json.h writes the JSON.
 */
#ifndef OUTBOX_TOOLS_REPLAY_REPLAY_H
#define OUTBOX_TOOLS_REPLAY_REPLAY_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <sqlite3.h>

#include "args.h"
#include "outbox.h"
#include "util/sbuf.h"

#define REPLAY_PROG "outbox-replay"

enum { EXIT_OK = 0, EXIT_FAIL = 1, EXIT_USAGE = 2 };

/* replay_open_db() returns this to mean "go on". */
#define GO_ON (-1)

/* ---- output.c: messages and text for humans ------------------------------ */

/* "outbox-replay: <message>" on stderr, or with --log-format a log line
 * (level error, or warn for a message that starts with "warning: ") through
 * replay_log. */
void replay_errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* The sink of --log-format; NULL for plain lines. Set once by main(). */
extern outbox_log_fn replay_log;
/* Flushes stdout. Returns EXIT_OK, or EXIT_FAIL after a message when the
 * output could not be written. */
int replay_finish_output(void);
/* Writes what b holds to stdout and empties it. Returns 0, or -1 after a
 * message when b ran out of memory while it was built. */
int replay_emit(outbox__sbuf *b);
/* Text for a human on a terminal: valid UTF-8 as is; control characters
 * (other than newline and tab when keep_lines), C1 controls and invalid bytes
 * as \xNN, so a message cannot send escape sequences to the terminal. */
void replay_print_clean(FILE *f, const unsigned char *s, size_t n, int keep_lines);
/* A short duration: 250ms, 12.3s, 5m03s, 2h07m, 3d04h. */
const char *replay_fmt_dur(int64_t ms, char buf[32]);
const char *replay_plural(int64_t n, const char *one, const char *many);

/* ---- query.c: the database ----------------------------------------------- */

/* Opens path (read-only unless writable) and checks the schema. Returns 0
 * with *out set, or an OUTBOX_E* code with the reason in err (never empty)
 * and *out NULL; prints nothing. */
int replay_open_path(const char *path, int writable, sqlite3 **out, char *err, size_t errlen);
/* Opens --db and checks the schema. Returns GO_ON with *out set, or an exit
 * status after a message. */
int replay_open_db(const replay_options *o, int writable, sqlite3 **out);
/* Reports the connection's last error as the reason `what` failed; returns
 * EXIT_FAIL. */
int replay_db_fail(sqlite3 *db, const char *what);
/* Prepares "SELECT cols FROM outbox_messages WHERE <filters><extra><tail>"
 * (every row's state as derived from the table and its batch records, see
 * proto/schema.md) with the
 * filters bound. extra and tail are fixed text from this tool whose values
 * are named parameters (:now, :last, :max, :lim) bound by the caller.
 * states: STATE_BIT()s, 0 for any. Returns 0, or -1 after a message. */
int replay_prepare_select(sqlite3 *db, const replay_options *o, unsigned states, const char *cols, const char *extra,
                          const char *tail, sqlite3_stmt **out);
/* Binds a named parameter if the statement has it. */
int replay_bind_named(sqlite3_stmt *st, const char *name, int64_t v);
int replay_col_null(sqlite3_stmt *st, int i);
/* A text column's bytes and length; NULL (length 0) for SQL NULL. */
const unsigned char *replay_col_text(sqlite3_stmt *st, int i, size_t *n);

/* ---- rows.c: one message per row ----------------------------------------- */

/* The columns of a message, in the order of the C_ indexes; show adds
 * payload and headers. */
#define ROW_COLS                                                                                            \
    "seq, id, state, topic, key, attempts, last_error, lease_owner, lease_token, lease_until, created_at, " \
    "available_at, published_at, stream_id, replay_count, replayed_at, replay_reason, batch"
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
    C_BATCH, /* the batch record (its first seq) whose state the row has, or NULL */
    C_PAYLOAD,
    C_HEADERS
};

/* What a requeue or purge does to one row. */
typedef enum action { ACT_NONE, ACT_REQUEUE, ACT_SKIP, ACT_TAKE, ACT_DELETE, ACT_COUNT } action;

const char *replay_state_name(int64_t s);
/* The fields of one message as JSON members, from the opening brace on but
 * without the closing one: the caller may add more. */
void replay_json_row_fields(outbox__sbuf *b, sqlite3_stmt *st, int64_t now);

#define CELL_CAP (OUTBOX_ID_MAX * 4 + 8)

typedef struct cell {
    char s[CELL_CAP];
    size_t width; /* in characters */
} cell;

/* One table cell from arbitrary bytes: one line, at most maxw characters;
 * control characters, C1 controls and invalid UTF-8 show as '?', so the
 * width is the number of characters written. */
void replay_cell_set(cell *c, const unsigned char *s, size_t n, size_t maxw);

/* What replay_print_rows() prints. */
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
 * of rows) or as a JSON array. The caller holds a read transaction.
 * Returns 0, or -1 after a message. */
int replay_print_rows(sqlite3 *db, const replay_options *o, const rowsel *rs, int64_t now, rowcount *count);

/* ---- the subcommands; each returns the exit status ----------------------- */

int replay_cmd_list(const replay_options *o);   /* rows.c */
int replay_cmd_show(const replay_options *o);   /* show.c */
int replay_cmd_stats(const replay_options *o);  /* stats.c */
int replay_cmd_stats_dir(const replay_options *o); /* stats_dir.c: stats --db-dir */
int replay_cmd_change(const replay_options *o); /* change.c: requeue and purge */

#endif
