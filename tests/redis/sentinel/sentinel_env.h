/*
 * sentinel_env.h: a Redis Sentinel deployment for one test: two data nodes
 * (node 0 starts as the master, node 1 as its replica, both on 127.0.0.1
 * TCP ports and Unix sockets, harness.h's th_redis) and three sentinels
 * (`redis-server sentinel.conf --sentinel` on 127.0.0.1, each in its own
 * temporary directory) monitoring them as "mymaster" with a quorum of 2,
 * down-after 1000 ms and failover-timeout 5000 ms. Ports are free loopback
 * ports; a sentinel that cannot bind its port is started again on another.
 * Every process is stopped by its pid, also when the test bails out (the
 * harness kills what th_spawn started and th_wait did not reap).
 */
#ifndef OUTBOX_TESTS_SENTINEL_ENV_H
#define OUTBOX_TESTS_SENTINEL_ENV_H

#include <sys/types.h>

#include <hiredis/hiredis.h>
#include <sqlite3.h>

#include "harness.h"
#include "tls_certs.h"

#define SE_SENTINELS 3
#define SE_MASTER_NAME "mymaster"

typedef struct se_env {
    th_redis node[2];
    pid_t spid[SE_SENTINELS]; /* 0 while stopped */
    int sport[SE_SENTINELS];
    char *sdir[SE_SENTINELS];
    char url[512]; /* redis-sentinel://127.0.0.1:P0,127.0.0.1:P1,127.0.0.1:P2#mymaster */
    /* TLS (se_start_tls): the TLS ports of the nodes and the sentinels,
     * which the sentinels announce and the URL (rediss-sentinel://) names;
     * the plaintext ports above stay for the test's own checks. */
    tls_certs *certs;
    int tport[2], stport[SE_SENTINELS];
} se_env;

/* Starts everything and waits (up to 30 s) until the replica acknowledges
 * writes and every sentinel knows the replica and the two other
 * sentinels. Returns 0, or -1 with diagnostics (everything stopped). */
int se_start(se_env *e);
/* The same over TLS (server.crt of certs, no client certificates,
 * tls-replication yes), with a rediss-sentinel:// URL. certs is borrowed. */
int se_start_tls(se_env *e, tls_certs *certs);
/* Stops every process and removes the directories. */
void se_stop(se_env *e);

/* What the relay tests start with: se_start (or se_start_tls when certs
 * is not NULL; the whole test is skipped when it fails), a temp dir with
 * app.db (the outbox schema) and a writer connection to it. se_world_end
 * closes and frees all of it and stops e. */
void se_world_start(se_env *e, tls_certs *certs, char **dir, char **dbpath, sqlite3 **db);
void se_world_end(se_env *e, char *dir, char *dbpath, sqlite3 *db);

/* The node the sentinel i names as the master (0 or 1), -1 if it names
 * none or another address, or does not answer. */
int se_named_master(const se_env *e, int i);
/* Waits until a majority of the running sentinels name node `want` and it
 * says ROLE master; returns 1, or 0 after timeout_ms. */
int se_wait_master(const se_env *e, int want, int timeout_ms);
/* Waits until node i is a replica of the other one with its link up and
 * the master's WAIT 1 succeeds; returns 1, or 0 after timeout_ms. */
int se_wait_replica(const se_env *e, int i, int timeout_ms);
/* Waits until every running sentinel names node want as the master (the
 * failover has reached all of them); 1, or 0 on timeout. */
int se_wait_all_named(const se_env *e, int want, int timeout_ms);

/* SIGKILL sentinel i (by pid); start it again on the same port and
 * configuration (which it rewrote with what it learnt). */
void se_sentinel_kill(se_env *e, int i);
int se_sentinel_restart(se_env *e, int i);
/* A client connected to sentinel i over TCP, or NULL. */
redisContext *se_sentinel_client(const se_env *e, int i);
/* SENTINEL FAILOVER mymaster through sentinel i; 0 if it accepted. */
int se_failover(const se_env *e, int i);
/* SENTINEL FAILOVER mymaster through sentinel i once it would promote
 * node want: it names the other node as the master, has no failover in
 * progress, and its view of node want (refreshed by INFO every 10 s) is a
 * replica fit for promotion, linked to that master. An answer of -INPROG or
 * -NOGOODSLAVE is asked again. 0 once accepted; -1 after timeout_ms, with
 * what was missing as a diagnostic. */
int se_failover_to(const se_env *e, int i, int want, int timeout_ms);
/* Waits until sentinel i would promote node want (as se_failover_to
 * requires); 1, or 0 after timeout_ms with what was missing. */
int se_failover_ready(const se_env *e, int i, int want, int timeout_ms);
/* Whether sentinel i names node from as the master with no failover in
 * progress: a failover it accepted ended without a switch (it aborts one
 * whose promotion does not show within failover-timeout). */
int se_failover_aborted(const se_env *e, int i, int from);
/* se_failover_to, then waits until a majority names node want and it is
 * master (se_wait_master), asking again whenever sentinel i's failover
 * aborted; 1, or 0 after timeout_ms. */
int se_switch_to(const se_env *e, int i, int want, int timeout_ms);

#endif
