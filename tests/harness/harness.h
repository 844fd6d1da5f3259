/*
 * harness.h: what the tests share: temporary directories, a real
 * redis-server started on a Unix socket (and optionally a loopback TCP port)
 * in a temporary directory and stopped by its pid, a synchronous hiredis
 * client for looking at streams, and helpers to run the project's binaries.
 * Nothing here kills processes by name.
 */
#ifndef OUTBOX_TESTS_HARNESS_H
#define OUTBOX_TESTS_HARNESS_H

#include <limits.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <hiredis/hiredis.h>
#include <sqlite3.h>

/*
 * Clean-up that also happens when a test bails out: directories made by
 * th_tmpdir are removed at exit unless th_rmtree removed them before, and
 * children started by th_spawn (or th_redis_start) are killed by pid
 * (SIGKILL) and reaped at exit unless th_wait reaped them before. Reap a
 * child through th_wait (or th_stop) only, so that its pid is never
 * signalled after the system could reuse it.
 */

/* Creates a fresh directory under $TMPDIR (default /tmp) named
 * outbox-test-XXXXXX; returns a malloc'd path; bails out on failure. */
char *th_tmpdir(void);
/* Removes a directory tree (rm -rf semantics, no shell); NULL is a no-op. */
void th_rmtree(const char *path);
/* Joins dir and name into a malloc'd path. */
char *th_path(const char *dir, const char *name);

typedef struct th_redis {
    pid_t pid;          /* 0 when not running */
    char *dir;          /* the server's private directory (owned) */
    char sock[256];     /* Unix socket path */
    int port;           /* loopback TCP port, 0 when TCP is off */
    char url[300];      /* "unix://<sock>" */
    char tcp_url[64];   /* "redis://127.0.0.1:<port>" or "" */
    char extra[512];    /* extra config lines given to start, kept for restart */
} th_redis;

/*
 * Starts `redis-server` with a config file written into a new temp dir:
 * unixsocket, port 0 unless with_tcp (then a free loopback port is chosen),
 * no persistence (save "", appendonly no) unless extra_conf says otherwise,
 * and each line of extra_conf (may be NULL) appended, e.g.
 * "requirepass s3cret\n". Waits until PING answers (up to 5 s). Returns 0, or
 * -1 with a diagnostic printed (as a TAP comment) if redis-server is missing
 * or did not come up.
 */
int th_redis_start(th_redis *r, int with_tcp, const char *extra_conf);
/* SIGTERM by pid, waits up to 5 s, then SIGKILL; reaps. Keeps dir. */
void th_redis_stop(th_redis *r);
/* SIGKILL by pid and reap (a crash). Keeps dir. */
void th_redis_kill(th_redis *r);
/* Starts again on the same socket/port/config after stop or kill. */
int th_redis_restart(th_redis *r);
/* Stops if running and removes the directory. */
void th_redis_destroy(th_redis *r);

/* A synchronous hiredis client on the server's Unix socket; bails on error.
 * Free with redisFree(). */
redisContext *th_redis_client(const th_redis *r);
/* Runs a command (printf-style, hiredis format) and returns the reply
 * (caller frees with freeReplyObject), bails if the connection failed. */
redisReply *th_cmd(redisContext *c, const char *fmt, ...);
/* XLEN of a stream, -1 on error. */
long long th_xlen(redisContext *c, const char *stream);

/* The build directory's binaries: the value of the environment variable
 * OUTBOX_BUILD_DIR (set by meson for every test) joined with rel, e.g.
 * th_bin("tools/relay/outbox-relay"); malloc'd. */
char *th_bin(const char *rel);

/* Runs argv (argv[0] a path) with an optional environment addition
 * (NULL-terminated "K=V" list, may be NULL), captures stdout and stderr into
 * malloc'd NUL-terminated strings (either out pointer may be NULL), waits at
 * most timeout_ms (then SIGKILL), returns the exit status (0..255), 128+sig if
 * killed by a signal, or -1 if it could not be started. */
int th_run(char *const argv[], char *const env_add[], char **out, char **err, int timeout_ms);

/* outbox-relay's argv: the build's binary, --db db --redis url, then the
 * NULL-terminated extra arguments in ap; free it with th_argv_free. */
char **th_relay_argv(const char *db, const char *url, va_list ap);
void th_argv_free(char **argv);
/* Runs outbox-relay (th_relay_argv) to its end as th_run; stdout dropped,
 * stderr in *err (malloc'd, may be NULL). */
int th_relay_runv(int timeout_ms, char **err, const char *db, const char *url, va_list ap);

/* A loopback TCP port nobody listens on right now (-1 on error). */
int th_free_port(void);
/* A loopback port where a connect is refused for as long as *fd stays open
 * (bound, not listening): nobody else can take it meanwhile, as a port
 * from th_free_port can be by another test running beside. close(*fd)
 * when done. -1 on failure. */
int th_refused_port(int *fd);

/* Starts argv in the background (stdout/stderr appended to the given file
 * paths, which may be the same, or inherited when NULL); returns the pid or
 * -1. */
pid_t th_spawn(char *const argv[], char *const env_add[], const char *out_path, const char *err_path);
/* Waits for pid up to timeout_ms (-1: no limit); returns the exit status as
 * th_run, or -2 on timeout (the process is left running). */
int th_wait(pid_t pid, int timeout_ms);
/* Sends sig to pid and waits up to timeout_ms; returns the status as
 * th_wait: on -2 the process did not stop in time, and was then SIGKILLed
 * and reaped. -1 for a pid <= 0 (nothing is signalled). */
int th_stop(pid_t pid, int sig, int timeout_ms);

/* Runs SQL (printf-style through sqlite3_vmprintf: %q, %Q, %lld ...);
 * bails on error. */
void th_sql_exec(sqlite3 *db, const char *fmt, ...);
/* The first column of the first row as an integer (NULL or no row: 0);
 * bails on error. */
int64_t th_sql_int(sqlite3 *db, const char *fmt, ...);
/* Runs sql on db while a connection of its own to path holds the write lock
 * for hold_ms (taken before sql starts, on a thread; sql waits for it); returns sql's
 * result code, with how long it ran in *took_ms and how long after the
 * lock's release it ended in *late_ms (negative: before it). Bails if the
 * lock cannot be taken. */
int th_sql_while_locked(sqlite3 *db, const char *path, int hold_ms, const char *sql, double *took_ms,
                        double *late_ms);
/* A file's contents, malloc'd and NUL-terminated ("" when missing). */
char *th_slurp(const char *path);

/* Monotonic milliseconds. */
int64_t th_now_ms(void);
/* A factor for waits: 10 under the valgrind test setup (it sets
 * OUTBOX_UNDER_VALGRIND), else 1. */
int th_slow(void);
/* Sleeps ms milliseconds. */
void th_sleep_ms(int ms);

/* Polls fn(arg) every 5 ms until it returns non-zero or timeout_ms pass;
 * returns the last result. */
int th_wait_until(int timeout_ms, int (*fn)(void *arg), void *arg);
/* Lines in text (newlines). */
int th_count_lines(const char *text);
/* Prints the last max_lines lines of text (may be NULL) as diagnostics,
 * each prefixed by what (INT_MAX: all of them). */
void th_diag_tail(const char *what, const char *text, int max_lines);

#endif
