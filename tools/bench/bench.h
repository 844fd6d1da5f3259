/*
 * outbox-bench: shared declarations of the benchmark tool's modules.
 *
 * bench.c     command line, scenario table, tables and BENCH lines
 * util.c      clocks, JSON numbers, percentiles, child processes, files, /proc
 * env.c       the private redis-server, hiredis helpers, redis-benchmark
 * dataset.c   the message shape and the databases the scenarios start from
 * sqlpath.c   the relay's SQL without Redis (claim scenario, the drain's and dbdir's floors)
 * peers.c     the drain's peer loops (plain loops publishing the same backlog)
 * drain.c     the relay daemon's drains the scenarios share
 * sc_*.c      one file per group of scenarios (sc_dbdir.c: --db-dir, sc_tls.c: the TLS drain,
 *             sc_cluster.c: the drain into a Redis Cluster, sc_figures.c: the
 *             database figures of /metrics, /healthz and replay stats)
 *
 * Non-static functions are prefixed bench_; scenario entry points sc_.
 */
#ifndef OUTBOX_BENCH_H
#define OUTBOX_BENCH_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/resource.h>
#include <sys/types.h>

#include <hiredis/hiredis.h>
#include <sqlite3.h>

#include "outbox.h"
#include "util/sbuf.h"

#ifndef PATH_MAX
#define PATH_MAX 4096
#endif

/* ------------------------------------------------------------------ */
/* the report of one scenario: a small table and one JSON object */

#define BENCH_MAX_ROWS 64
#define BENCH_MAX_RUNS 20 /* --runs */

typedef struct bench_row {
    char metric[64];
    char value[96];
    char target[32];
    char verdict[8]; /* "pass", "FAIL" or "" */
} bench_row;

typedef struct bench_report {
    const char *scenario;
    char title[512];
    bench_row rows[BENCH_MAX_ROWS];
    int nrows;
    /* Texts grow in outbox__sbuf (the library's); one that ran out of
     * memory ends the run when the report is printed. */
    outbox__sbuf json;  /* the members after "scenario", each starting with ',' */
    outbox__sbuf notes; /* lines printed under the table */
    int failed;      /* the scenario could not run: error says why */
    char error[512];
    int skipped; /* not run on purpose: error says why */
    int has_target, all_pass;
    double load_before, load_after; /* 1-minute load average around the run */
    double seconds;
} bench_report;

void bench_row_add(bench_report *r, const char *metric, const char *target, int verdict, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
void bench_note(bench_report *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void bench_fail(bench_report *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* JSON members, appended in call order. */
void bench_json_int(bench_report *r, const char *key, long long v);
void bench_json_num(bench_report *r, const char *key, double v, int decimals);
void bench_json_str(bench_report *r, const char *key, const char *v);
void bench_json_bool(bench_report *r, const char *key, int v);
/* json: JSON text built by the caller (a buffer out of memory makes the
 * report's own so). */
void bench_json_raw(bench_report *r, const char *key, const outbox__sbuf *json);
/* Appends a JSON number (null when not finite) to s. */
void bench_sbuf_num(outbox__sbuf *s, double v, int decimals);

/* verdicts for bench_row_add */
enum { V_NONE = -1, V_FAIL = 0, V_PASS = 1 };

/* "1,234,567" */
const char *bench_thousands(char *buf, size_t len, double v);

/* ------------------------------------------------------------------ */
/* the run */

typedef struct bench {
    char tmpdir[PATH_MAX];
    char sock[PATH_MAX + 16];
    char redis_url[PATH_MAX + 32];
    char build_dir[PATH_MAX];
    char relay_bin[PATH_MAX + 64];
    char consume_bin[PATH_MAX + 64];
    pid_t redis_pid;
    redisContext *rc; /* control connection */

    int quick, json_only, keep, verbose;
    long messages;   /* drain, loop, idempotent, consume, writer */
    long claim_rows; /* the big backlog of the claim scenario */
    unsigned keys;   /* distinct ordering keys */
    const char *writer_sync; /* PRAGMA synchronous of the latency writer: FULL (default) or NORMAL */
    int latency_runs;        /* how many times latency runs its in-process 10k msg/s case (--runs) */
    int messages_set, claim_rows_set;
    int relay_has_idempotent;
} bench;

/* Progress on stderr (silent with --json-only). */
void bench_progress(const bench *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A path inside the run's temporary directory. */
const char *bench_path(const bench *b, char *buf, size_t len, const char *name);

/* ------------------------------------------------------------------ */
/* util.c */

uint64_t bench_mono_us(void);
/* The 1-minute load average, -1 when unknown. */
double bench_loadavg(void);
uint64_t bench_mono_ns(void);
int64_t bench_wall_us(void);
void bench_sleep_ms(unsigned ms);

/* Sorts v (n values) in place and returns the q-quantile (0..1), nearest
 * rank; 0 when n == 0. */
double bench_quantile_sorted(const double *v, size_t n, double q);
void bench_sort(double *v, size_t n);
double bench_median(double *v, size_t n);

/* Child processes. argv[0] is looked up in PATH when it has no slash.
 * stdout/stderr go to the given files (NULL: /dev/null; "-": inherit). The
 * pid is remembered so that an interrupted run can stop it. */
int bench_spawn(const char *const argv[], const char *out_path, const char *err_path, pid_t *pid);
/* Waits for pid at most timeout_ms (then SIGKILLs it); returns 0 with its
 * wait status and resource usage, or -1. Polls every millisecond. */
int bench_wait(pid_t pid, int *status, struct rusage *ru, unsigned timeout_ms);
/* Peaks of a process's resident memory, sampled from /proc/PID/status. */
typedef struct bench_rss {
    long long hwm_kb; /* VmHWM, the kernel's own peak, as last seen */
    long long rss_kb, anon_kb, file_kb, shmem_kb;
    const char *watch_file; /* in: a file whose size to follow (the WAL), or NULL */
    long long file_bytes;   /* its largest size seen */
} bench_rss;
/* bench_wait that also samples pid's memory every 10 ms into *peak. */
int bench_wait_sampled(pid_t pid, int *status, struct rusage *ru, unsigned timeout_ms, bench_rss *peak);
/* SIGTERM, then the wait; SIGKILL after timeout_ms. */
int bench_stop(pid_t pid, int *status, struct rusage *ru, unsigned timeout_ms);
/* Kills every child still registered (interrupted run). */
void bench_kill_children(void);
/* Describes a wait status: "exit 0", "signal 9". */
const char *bench_status_text(int status, char *buf, size_t len);

/* User plus system CPU seconds of a resource usage. */
double bench_ru_cpu_s(const struct rusage *ru);
/* CPU time of a live process in ns (schedstat, else utime+stime), -1. */
int64_t bench_proc_cpu_ns(pid_t pid);
/* Voluntary plus involuntary context switches of a live process, -1. */
long long bench_proc_ctxsw(pid_t pid);
/* The whole of a file, NUL-terminated (malloc'd), its length in *len (len
 * may be NULL); NULL when it cannot be opened or no memory is left for a
 * first read (when memory runs out later, what was read so far). */
char *bench_read_file(const char *path, size_t *len);
/* The last `lines` lines of a file, for error messages. */
void bench_tail_file(const char *path, char *buf, size_t len, int lines);
int bench_file_exists_x(const char *path);
/* Puts the words of OUTBOX_BENCH_WRAP (a profiler command prefix, split on
 * spaces into buf) at the start of argv (room for 24); returns how many. */
int bench_wrap_argv(const char **argv, char *buf, size_t len);
void bench_unlink_db(const char *path);

/* ------------------------------------------------------------------ */
/* env.c */

int bench_env_start(bench *b, char *err, size_t errlen);
void bench_env_stop(bench *b);

/* A redis-server of the TLS drain's own: a plaintext and a TLS port on
 * 127.0.0.1 (a self-signed certificate for it, made with the openssl
 * command in the temporary directory), and a Unix socket for rc. */
typedef struct bench_tls_server {
    pid_t pid;
    redisContext *rc; /* on the Unix socket */
    int port, tls_port;
    char cert[PATH_MAX + 32], key[PATH_MAX + 32], sock[PATH_MAX + 32];
    char tcp_url[64], tls_url[64];
} bench_tls_server;
int bench_tls_server_start(bench *b, bench_tls_server *t, char *err, size_t errlen);
void bench_tls_server_stop(bench_tls_server *t);
redisContext *bench_redis_connect(const bench *b);

/* The stream reader of the latency and sustained scenarios: a thread (start
 * it with bench_reader_main as its function) in XREAD BLOCK over every bench
 * topic. Each message whose id is <id_prefix><seq>, seq <= n, gets the wall
 * clock (us) when it was first seen in seen_us[seq], and, if entry_ms is not
 * NULL, its entry id's milliseconds in entry_ms[seq]. Set stop (atomically)
 * to end it; err says why it ended early. */
typedef struct bench_reader {
    const bench *b;
    const char *id_prefix;
    uint64_t n;
    unsigned count;    /* XREAD COUNT */
    int64_t *seen_us;  /* n + 1 entries, 0 = not seen */
    int64_t *entry_ms; /* n + 1 entries, or NULL */
    uint64_t seen;     /* atomic: distinct messages seen */
    int stop;          /* atomic */
    char err[256];
} bench_reader;
void *bench_reader_main(void *arg);
/* A command on the control connection; NULL (and err) on failure. */
redisReply *bench_redis(bench *b, const char *fmt, ...);
int bench_redis_flush(bench *b);
/* Sum of XLEN over the 8 bench streams (-1 on error), on connection c. */
long long bench_streams_len(redisContext *c);
/* redis-benchmark pipelined XADD with an entry of the given envelope size;
 * requests per second and p50 latency in ms. */
int bench_redis_benchmark(bench *b, long n, int clients, int pipeline, size_t envelope_len, double *rps,
                          double *p50_ms, char *err, size_t errlen);
/* Where a redis-benchmark run goes: a Unix socket, or host and port
 * (cluster: --cluster, routing by key slot); key is the XADD's stream,
 * with __rand_int__ replaced by one of keyspace numbers when keyspace > 0. */
typedef struct bench_bm_target {
    const char *sock, *host;
    int port, cluster;
    const char *key;
    int keyspace;
    /* The command as a user would time Redis's own XADD ceiling (BENCHMARKS.md):
     * `XADD KEY * id m-0000001 payload <BENCH_USER_PAYLOAD bytes>` instead of the
     * drain's entry shape (id of 36 characters, envelope_len bytes). */
    int user_form;
} bench_bm_target;
#define BENCH_USER_PAYLOAD 192
/* redis-benchmark -c 4 -P 64 of the user form on the private server: the
 * ceiling a user measures (README). */
int bench_redis_benchmark_user(bench *b, long n, double *rps, char *err, size_t errlen);
/* Redis's CPU in microseconds per command over n commands since its CPU
 * read before (bench_proc_cpu_ns of b->redis_pid); -1 if unreadable. */
double bench_redis_us_per(bench *b, int64_t before, long n);
/* The same parameters (-c 4 -P 64) with the drain's own entry: an id of 36
 * characters and an envelope of envelope_len bytes, over BENCH_TOPICS
 * streams (-r): what Redis takes from any producer of the relay's entries
 * (BENCHMARKS.md, "The entry's own ceiling"). *redis_us, unless NULL:
 * Redis's CPU per XADD meanwhile (-1 if unreadable). */
int bench_redis_benchmark_user_shape(bench *b, long n, size_t envelope_len, double *rps, double *redis_us, char *err,
                                     size_t errlen);
int bench_redis_benchmark_to(bench *b, const bench_bm_target *t, long n, int clients, int pipeline,
                             size_t envelope_len, double *rps, double *p50_ms, char *err, size_t errlen);

/* A private Redis Cluster of BENCH_CLUSTER_MASTERS masters, no replicas,
 * on free loopback ports (each also on a Unix socket for its control
 * connection), created with redis-cli --cluster create; up once every node
 * says cluster_state:ok. url is its redis-cluster:// seed list. */
#define BENCH_CLUSTER_MASTERS 3
typedef struct bench_cluster {
    pid_t pid[BENCH_CLUSTER_MASTERS];
    redisContext *rc[BENCH_CLUSTER_MASTERS];
    int port[BENCH_CLUSTER_MASTERS];
    char url[256];
} bench_cluster;
int bench_cluster_start(bench *b, bench_cluster *c, char *err, size_t errlen);
void bench_cluster_stop(bench_cluster *c);
/* FLUSHALL on every master. */
int bench_cluster_flush(bench_cluster *c);
/* Sum of XLEN over the 8 bench streams, each asked of the master that
 * holds it; -1 on error. */
long long bench_cluster_streams_len(bench_cluster *c);

/* A standalone redis-server on a free loopback port (and a Unix socket for
 * rc), for comparisons over the same transport as a cluster's. */
typedef struct bench_tcp_server {
    pid_t pid;
    redisContext *rc;
    int port;
    char sock[PATH_MAX + 32], url[64];
} bench_tcp_server;
int bench_tcp_server_start(bench *b, bench_tcp_server *t, char *err, size_t errlen);
void bench_tcp_server_stop(bench_tcp_server *t);

/* A loopback TCP port nobody listens on right now, or -1. */
int bench_free_port(void);

/* Memory used by Redis in bytes, -1. */
long long bench_redis_used_memory(bench *b);

/* ------------------------------------------------------------------ */
/* dataset.c: the message shape. Topics bench.t0 .. bench.t7 (streams
 * outbox:bench.t0 ...), every second message keyed with one of `keys` keys,
 * payloads of payload_len bytes. */

#define BENCH_TOPICS 8
#define BENCH_PAYLOAD 128

typedef struct bench_shape {
    size_t payload_len;
    unsigned keys;
} bench_shape;

typedef struct bench_msgbuf {
    char topic[32];
    char key[32];
    char id[OUTBOX_ID_MAX + 1];
    unsigned char payload[4096];
    outbox_message m;
} bench_msgbuf;

/* Fills mb->m for message number i (id NULL: the writer generates a
 * UUIDv7). */
void bench_shape_message(const bench_shape *sh, uint64_t i, bench_msgbuf *mb);
/* The average encoded envelope size of the shape (keyed and unkeyed). */
size_t bench_shape_envelope_len(const bench_shape *sh);

/* Creates a fresh database at path with n messages of the shape, written
 * with outbox_enqueue (synchronous=OFF, not measured). rows_per_txn 0 means
 * one transaction. Ends with a TRUNCATE checkpoint. */
int bench_dataset_build(const char *path, uint64_t n, const bench_shape *sh, uint64_t rows_per_txn, char *err,
                        size_t errlen);
/* The same for big backlogs: one transaction of raw prepared INSERTs (ids
 * UUIDv7-shaped, increasing, without outbox_enqueue's validation and random
 * bits), synchronous=OFF, a 512 MiB page cache. */
int bench_dataset_build_fast(const char *path, uint64_t n, const bench_shape *sh, char *err, size_t errlen);
/* Opens a fresh database with the outbox schema (flags for outbox_db_open). */
/* Copies a closed database file (no WAL) to a fresh path. */
int bench_copy_db(const char *from, const char *to, char *err, size_t errlen);
int bench_db_fresh(const char *path, int flags, sqlite3 **db, char *err, size_t errlen);
int bench_exec(sqlite3 *db, const char *sql, char *err, size_t errlen);
/* SELECT count(*) FROM outbox_messages WHERE state = st, -1. */
long long bench_count_state(const char *path, int st);

/* ------------------------------------------------------------------ */
/* sqlpath.c: the relay's per-message statements (src/relay.c) run directly
 * on one connection opened like the relay's, without Redis. */

typedef struct bench_sql bench_sql;
int bench_sql_open(const char *db, bench_sql **out, char *err, size_t errlen);
void bench_sql_close(bench_sql *s);
int bench_sql_exec(bench_sql *s, const char *sql, char *err, size_t errlen);
/* Inside a transaction: the relay's claim of up to batch new rows (the
 * stray update, the walk of waiting rows, the cursor, the walk of new rows
 * with each keyed row's key lookup, the UPDATE ... RETURNING, the cursor
 * moved); their seqs and lease tokens in seq/token, how many in *n. */
int bench_sql_claim(bench_sql *s, int batch, int64_t now, int64_t *seq, int64_t *token, int *n, char *err,
                    size_t errlen);
/* Undoes the claims of bench_sql_claim, in a transaction of its own: their
 * batch records go and the cursor goes back to from, the first seq they
 * claimed (new rows claimed are not written). */
int bench_sql_unclaim(bench_sql *s, int64_t from, char *err, size_t errlen);
/* Drains n rows with one transaction per unit (the previous batch's marks,
 * then the next claim of batch rows) until nothing is left; bare uses the
 * least a per-row lifecycle writes (a range lease with RETURNING, a plain
 * UPDATE per mark) instead of the relay's statements. Checkpoints run
 * between units from 8000 WAL pages, as in the relay, and are not timed. */
int bench_sql_drain(bench_sql *s, int bare, int batch, long n, double *secs, char *err, size_t errlen);
/* The floor of a database of a group: opened as a group's relay opens it
 * (no checkpoint at close), its schema read, the plan, the walk of its new
 * rows reading every column sent, one batch lease with the cursor in one
 * transaction, the batch published in another, closed; no Redis, no
 * encoding. One database (its thread CPU in *cpu_s, rows walked in *rows),
 * or every database of dir (t00000.db ... ndb of them) on nthreads threads
 * at once (their CPU summed, the wall seconds in *wall_s unless NULL).
 * 0, or -1 with err. */
int bench_sql_floor_db(const char *path, double *cpu_s, long *rows, char *err, size_t errlen);
int bench_sql_floor_dir(const char *dir, long ndb, int nthreads, double *cpu_s, double *wall_s, long *rows,
                        char *err, size_t errlen);

/* ------------------------------------------------------------------ */
/* peers.c: plain loops that publish a backlog as references for the relay
 * (no overlap of their SQLite and Redis work): per-row lease and mark;
 * a lease row per batch with a ranged mark; a lease row per batch and no
 * per-row write. */

enum { BENCH_PEER_NAIVE, BENCH_PEER_RANGED, BENCH_PEER_NOROW, BENCH_PEERS };
extern const char *const bench_peer_names[BENCH_PEERS];
/* Publishes every row of db (n rows, all new) to the private Redis with
 * loop kind; its wall time and the CPU it used. Fails when an XADD is not
 * answered with an entry id, a mark does not change the rows it means, or
 * fewer than n rows end up published. */
int bench_peer_drain(bench *b, int kind, const char *db, long n, double *secs, double *cpu_s, char *err,
                     size_t errlen);

/* ------------------------------------------------------------------ */
/* scenarios */

int sc_drain(bench *b, bench_report *r);
int sc_drain_tls(bench *b, bench_report *r);
int sc_drain_cluster(bench *b, bench_report *r);
int sc_idle(bench *b, bench_report *r);
int sc_memory(bench *b, bench_report *r);
int sc_idempotent(bench *b, bench_report *r);
int sc_consume(bench *b, bench_report *r);
int sc_latency(bench *b, bench_report *r);
int sc_sustained(bench *b, bench_report *r);
int sc_writer(bench *b, bench_report *r);
int sc_claim(bench *b, bench_report *r);
int sc_figures(bench *b, bench_report *r);
int sc_loop(bench *b, bench_report *r);
int sc_dbdir(bench *b, bench_report *r);
int sc_dbdir_idle(bench *b, bench_report *r);
int sc_dbdir_fair(bench *b, bench_report *r);

/* ------------------------------------------------------------------ */
/* drain.c: the relay daemon's drains the scenarios share */

/* Runs the relay daemon with --drain over db (extra options appended),
 * returns its wall time in seconds, its resource usage (and, with peak, its
 * sampled memory); fails when it does not exit 0 or leaves rows pending.
 * OUTBOX_BENCH_WRAP (e.g. "perf record -g -o FILE --") prefixes the
 * command, for profiling. tag names its log, relay-<tag>.log. */
int bench_relay_drain(bench *b, const char *db, const char *tag, const char *const *extra, double *secs,
                      struct rusage *ru, bench_rss *peak, char *err, size_t errlen);
/* The same run of the relay daemon with args of the caller's (after the
 * binary: "run", "--db-dir", DIR, ...) and no check of a database after:
 * wall seconds, resource usage, peak memory with peak; fails when it does
 * not exit 0. */
int bench_relay_run(bench *b, const char *const *args, const char *tag, double *secs, struct rusage *ru,
                    bench_rss *peak, char *err, size_t errlen);

/* One of the two places a drain_tls or drain_cluster run compares: a
 * standalone server (rc) or a cluster, and the relay options that reach it. */
typedef struct bench_drain_side {
    const char *name;  /* in errors and log names: "tcp", "cluster" */
    const char *where; /* in progress lines: "over tcp", "into the cluster" */
    /* Options after the main server's --redis (the last --redis given
     * counts), NULL-terminated. */
    const char *const *extra;
    redisContext *rc;       /* a standalone server's control connection, or NULL */
    bench_cluster *cluster; /* or the cluster */
    double best_rate, cpu_us; /* out: msg/s of the best run, relay CPU per message in it */
} bench_drain_side;
/* Drains a copy (at db) of src, n messages, into each side, rounds times,
 * alternating with each round starting at the other side. Every run empties
 * the side's Redis first and checks that its streams hold n entries after;
 * the best run of each side counts (noise only adds time). */
int bench_drain_pair(bench *b, const char *src, const char *db, long n, int rounds, bench_drain_side side[2],
                     char *err, size_t errlen);

#endif
