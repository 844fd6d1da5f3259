/*
 * cluster_env.h: a Redis Cluster for one test: `masters` masters with
 * `replicas` replicas each, every node a redis-server of harness.h
 * (th_redis: its own temporary directory, a free loopback TCP port and a
 * Unix socket, stopped by its pid, also when the test bails out) with
 * cluster-enabled yes, cluster-config-file nodes.conf in that directory,
 * cluster-node-timeout 2000 and its cluster bus on a second free port
 * (cluster-port, since a client port above 55535 has no port + 10000).
 * The cluster is formed by `redis-cli --cluster create ... --cluster-replicas
 * R --cluster-yes`: the first `masters` nodes start as the masters and own
 * 0..16383 in that order of ranges.
 *
 * Node indices are positions in e->node[]; they stay with a process (and
 * its port) through failovers, kills and restarts: which index is a master
 * is asked of the cluster (ce_is_master, ce_owner).
 *
 * Every helper speaks to the nodes with hiredis' blocking client and plain
 * cluster commands; none uses the project's own connection layer, so the
 * tests of that layer can check it against what the servers say. The
 * helpers keep no state outside the env and may be called from several
 * threads at once (a writer thread beside one that reshards), except those
 * that change e (start, stop, migrations, kill, restart), which one thread
 * calls. A server started by ce_start or ce_restart gets SIGTERM when the
 * THREAD that started it ends (the harness' PR_SET_PDEATHSIG follows the
 * thread, not the process): call them from a thread that lives until
 * ce_stop, such as the main thread.
 *
 * Where what is: cluster_env.c starts and stops the nodes and forms the
 * cluster, and makes things happen to a node (ce_start, ce_start_tls,
 * ce_stop, ce_failover, ce_kill, ce_kill_master, ce_restart,
 * ce_diag_logs); cluster_query.c asks the nodes (clients, slots and their
 * owners, roles, replicas, ce_cmd_argv, ce_wait_ok); cluster_slots.c moves
 * slots (ce_reshard, ce_migrate_*, ce_move_slot). cluster_env_int.h is what
 * the three share.
 */
#ifndef OUTBOX_TESTS_CLUSTER_ENV_H
#define OUTBOX_TESTS_CLUSTER_ENV_H

#include <sys/types.h>

#include <hiredis/hiredis.h>

#include "harness.h"

#define CE_MAX_NODES 12
#define CE_SLOTS 16384

/* TLS for ce_start_tls: PEM files (borrowed until ce_start_tls returns). */
typedef struct ce_tls {
    const char *ca_file, *cert_file, *key_file;
} ce_tls;

typedef struct ce_env {
    int masters, replicas, n; /* n = masters * (1 + replicas) */
    th_redis node[CE_MAX_NODES];
    int bus_port[CE_MAX_NODES];
    int tls_port[CE_MAX_NODES]; /* ce_start_tls: each node's TLS port; 0 without TLS */
    char *tls_dir;              /* ce_start_tls: the TLS lines every node includes */
    char *tls_ca;               /* ce_start_tls: the CA file, for redis-cli --tls */
    char id[CE_MAX_NODES][41]; /* CLUSTER MYID of each node */
    char password[128];        /* from a requirepass line of extra_conf, or "" */
    /* redis-cluster://127.0.0.1:P0,127.0.0.1:P1,... (every node, masters
     * first; with ":password@" before the first address when password);
     * rediss-cluster:// and the TLS ports after ce_start_tls. */
    char url[1024];
    /* A manual migration left open by ce_migrate_begin (slot -1: none). */
    struct {
        int slot, from, to;
    } mig;
} ce_env;

/*
 * Starts masters * (1 + replicas) nodes (at most CE_MAX_NODES; masters >= 3
 * as redis-cli demands), appendonly yes when appendonly is non-zero, each
 * line of extra_conf (may be NULL; e.g. "cluster-require-full-coverage no\n")
 * appended to every node's configuration, creates the cluster and waits (up
 * to 30 s) until ce_wait_ok. A requirepass line in extra_conf also sets
 * masterauth, redis-cli -a and the helpers' AUTH. Returns 0, or -1 with
 * diagnostics (everything stopped and removed).
 */
int ce_start(ce_env *e, int masters, int replicas, int appendonly, const char *extra_conf);
/*
 * ce_start with TLS as well: every node also listens on a TLS port
 * (tls->cert_file and key_file, tls-auth-clients no, CA tls->ca_file) with
 * tls-cluster yes (the cluster bus over TLS) and tls-replication yes, and
 * e->url is rediss-cluster:// naming the TLS ports. The helpers keep using
 * the plaintext ports: Redis answers CLUSTER SLOTS with the plaintext ports
 * on a plaintext connection and with the TLS ports on a TLS one, and
 * CLUSTER SHARDS gives both (port and tls-port). MIGRATE goes to the
 * target's TLS port (the source speaks TLS to it), and redis-cli --cluster
 * reshard runs with --tls on the TLS ports.
 */
int ce_start_tls(ce_env *e, int masters, int replicas, int appendonly, const char *extra_conf, const ce_tls *tls);
/* Stops every node by pid (SIGTERM, then SIGKILL) and removes their
 * directories; safe on a zeroed or already stopped env. A test that bails
 * out leaves nothing either: the harness kills its servers and removes its
 * temporary directories at exit. */
void ce_stop(ce_env *e);

/* A blocking client on node i's TCP port (authenticated when the cluster
 * has a password), or NULL when it is not running or does not answer. The
 * caller frees it with redisFree. */
redisContext *ce_client(const ce_env *e, int i);
/* The index of the node listening on port, -1 if none. */
int ce_index_of_port(const ce_env *e, int port);
/* "127.0.0.1:<port>" of node i in buf (at least 32 bytes); returns buf. */
char *ce_addr(const ce_env *e, int i, char *buf);

/* CLUSTER KEYSLOT key, asked of a running node; -1 if none answers. */
int ce_slot_of(const ce_env *e, const char *key);
/* Writes into buf (len bytes) the first "<prefix><n>" (n = 0, 1, ...) whose
 * slot is `slot`; such a name used as a stream name also puts its dedup keys
 * (<ns>:{<stream>}:<id>) in that slot. Returns 0, or -1. */
int ce_name_in_slot(const ce_env *e, int slot, const char *prefix, char *buf, size_t len);
/* The node owning slot in the slot map of a running master (CLUSTER SLOTS),
 * -1 if none knows. */
int ce_owner_of_slot(const ce_env *e, int slot);
/* The node owning key's slot; -1 if unknown. Its address is
 * e->node[i].port on 127.0.0.1, its pid e->node[i].pid. */
int ce_owner(const ce_env *e, const char *key);
/* The lowest slot node i owns, -1 if it owns none. */
int ce_lowest_slot(const ce_env *e, int i);
/* 1 if node i is running and says it is a master (ROLE). */
int ce_is_master(const ce_env *e, int i);
/* The running nodes that say they are masters, in out[] (CE_MAX_NODES);
 * returns how many. */
int ce_master_list(const ce_env *e, int *out);
/* A replica of master m (as the cluster says: CLUSTER REPLICAS), running,
 * -1 if none. */
int ce_replica_of(const ce_env *e, int m);

/* A command for key (argv and lens as hiredis' redisCommandArgv; key is
 * the one that decides the slot) sent to the node the slot map
 * names, following MOVED and ASK (ASKING first) and retrying TRYAGAIN,
 * CLUSTERDOWN, LOADING and a connection that fails, for up to timeout_ms:
 * what a test's writer needs while slots move. Returns the last reply (the
 * caller frees it) or NULL when no node answered in time. A reply that is
 * the answer to a command whose connection then failed is not retried; a
 * command whose connection failed before the answer is sent again (a
 * duplicate at worst: the caller's data must tolerate that, as XADD of an
 * outbox message does). */
redisReply *ce_cmd_argv(const ce_env *e, const char *key, int argc, const char **argv, const size_t *lens,
                        int timeout_ms);

/* Waits until every running node says cluster_state:ok and every one of
 * them has the same slot map (the same owner address for every slot) and no
 * slot in migration; 1, or 0 after timeout_ms (with diagnostics when
 * timeout_ms >= 1000). */
int ce_wait_ok(const ce_env *e, int timeout_ms);

/* `redis-cli --cluster reshard <node from> --cluster-from <id of from>
 * --cluster-to <id of to> --cluster-slots nslots --cluster-yes`: moves the
 * nslots lowest slots of master from, with all their keys, to master to,
 * then ce_wait_ok. Returns 0, or -1 with redis-cli's output as
 * diagnostics. */
int ce_reshard(ce_env *e, int from, int to, int nslots);

/*
 * A manual migration of one slot, as `redis-cli --cluster reshard` does it
 * but in steps, so that a test can act while the ASK window is open:
 * ce_migrate_begin sends CLUSTER SETSLOT slot IMPORTING <from> to master
 * `to`, SETSLOT slot MIGRATING <to> to the owner, and MIGRATEs up to nkeys
 * of the slot's keys (0: none). Until ce_migrate_finish, a command for a key
 * of the slot that is no longer on the source gets ASK there; the target
 * serves it after ASKING and answers MOVED without. ce_migrate_keys MIGRATEs
 * up to nkeys more (returns how many moved, -1 on error).
 * ce_migrate_finish MIGRATEs the remaining keys, sends SETSLOT slot NODE
 * <to> to the target, the source and the other masters, and waits for
 * ce_wait_ok. All return 0 (or a count), or -1 with diagnostics.
 */
int ce_migrate_begin(ce_env *e, int slot, int to, int nkeys);
int ce_migrate_keys(ce_env *e, int nkeys);
int ce_migrate_finish(ce_env *e);
/* MIGRATEs the named key of the open migration's slot now (a test that
 * wants, e.g., a stream on the target while its other keys are still on the
 * source). 1 if it moved, 0 if it was not on the source, -1 on error. */
int ce_migrate_named(ce_env *e, const char *key);
/* ce_migrate_begin and ce_migrate_finish in one step. */
int ce_move_slot(ce_env *e, int slot, int to);

/* CLUSTER FAILOVER on replica r, then waits (20 s) until every running node
 * says r is a master, and ce_wait_ok. 0, or -1. */
int ce_failover(ce_env *e, int r);
/* SIGKILL master m by pid, then waits (30 s) until one of its replicas is a
 * master for every running node and ce_wait_ok. Returns the promoted
 * replica's index, or -1. */
int ce_kill_master(ce_env *e, int m);
/* SIGKILL node i by pid, nothing more (the test decides what to wait for). */
void ce_kill(ce_env *e, int i);
/* Starts a killed node i again on its port, configuration and nodes.conf
 * and waits until it rejoined (every running node knows it as connected,
 * ce_wait_ok); a master that was replaced comes back as a replica. 0, or
 * -1. */
int ce_restart(ce_env *e, int i);

/* Prints the last max_lines lines of every node's redis.log as TAP
 * diagnostics, each headed by the node's index, port and pid. */
void ce_diag_logs(const ce_env *e, int max_lines);

#endif
