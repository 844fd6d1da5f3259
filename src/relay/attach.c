/*
 * attach.c: application connections attached to a relay
 * (outbox_relay_attach). Each has a record in a process-wide registry, so
 * that outbox_relay_detach(db), which is given only the connection, finds
 * its relay, the busy timeout and the auto-checkpoint to restore without
 * trusting whatever argument the connection's WAL hook has now: PRAGMA
 * wal_autocheckpoint or another sqlite3_wal_hook() replaces the relay's
 * hook. The hooks run on the application's threads; the registry is guarded
 * by a mutex of its own.
 */
#include <stdlib.h>

#include "relay_int.h"
#include "store/sqlite_util.h"

/* One attached connection. Its address is the WAL hook's and the busy
 * handler's argument, so records are never moved while attached. */
typedef struct attachment {
    struct attachment *next;
    sqlite3 *db;
    outbox_relay *r;
    int busy_ms;  /* its busy wait at attach, restored by detach; 0: it never waited */
    int naps;     /* that wait was outbox_db_busy_wait's, not a busy timeout */
    int autockpt; /* its PRAGMA wal_autocheckpoint at attach, restored by detach; 0: off */
} attachment;

static uv_once_t registry_once = UV_ONCE_INIT;
static uv_mutex_t registry_mutex;
static int registry_ok;
static attachment *registry;

static void registry_init(void)
{
    registry_ok = uv_mutex_init(&registry_mutex) == 0;
}

/* The record of db, with the registry locked: the link that points at it,
 * or at the NULL that ends the registry if there is none. */
static attachment **find(sqlite3 *db)
{
    attachment **l = &registry;
    while (*l && (*l)->db != db)
        l = &(*l)->next;
    return l;
}

/* Runs on the application's thread, right after its commit. */
static int attach_wal_hook(void *arg, sqlite3 *db, const char *name, int pages)
{
    attachment *a = arg;
    (void)db;
    (void)name;
    __atomic_store_n(&a->r->ckpt.pages, pages, __ATOMIC_RELAXED);
    outbox__wake_send(a->r);
    return SQLITE_OK;
}

/*
 * The attached connection's busy handler, in place of its busy timeout (same
 * total wait). SQLite's own handler sleeps 1, 2, 5, 10, 15, 20, 25 ms ...
 * between tries, so a writer that met the relay's transaction usually slept
 * well past its end, and on the application's loop thread that sleep held up
 * everything, the relay's Redis traffic too. This one wakes the moment the
 * relay's transaction ends; a lock held by anyone else is polled every ms.
 */
static int attach_busy(void *arg, int count)
{
    static __thread uint64_t start;
    attachment *a = arg;
    outbox_relay *r = a->r;
    uint64_t now = uv_hrtime(), total = (uint64_t)a->busy_ms * 1000000u, left;
    if (count == 0)
        start = now;
    if (now - start >= total)
        return 0;
    left = total - (now - start);
    uv_mutex_lock(&r->lock.mutex);
    if (r->lock.txn_open) {
        /* Ask the unit to commit what it has and let go. */
        __atomic_store_n(&r->lock.yield, 1, __ATOMIC_RELAXED);
        uv_cond_timedwait(&r->lock.cond, &r->lock.mutex, left < 5000000u ? left : 5000000u);
        uv_mutex_unlock(&r->lock.mutex);
        return 1;
    }
    uv_mutex_unlock(&r->lock.mutex);
    uv_sleep(1);
    return 1;
}

/* A one-integer PRAGMA of db (busy_timeout, wal_autocheckpoint); 0 if it
 * cannot be read. */
static int pragma_int(sqlite3 *db, const char *sql)
{
    sqlite3_stmt *st = NULL;
    int v = 0;
    if (sqlite3_prepare_v2(db, sql, -1, &st, NULL) == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW)
        v = sqlite3_column_int(st, 0);
    sqlite3_finalize(st);
    return v;
}

int outbox_relay_attach(outbox_relay *r, sqlite3 *db)
{
    attachment *a, **l;
    if (!r || !db)
        return OUTBOX_EINVAL;
    uv_once(&registry_once, registry_init);
    if (!registry_ok)
        return OUTBOX_ENOMEM;
    uv_mutex_lock(&registry_mutex);
    l = find(db);
    if (*l) {
        int same = (*l)->r == r;
        uv_mutex_unlock(&registry_mutex);
        return same ? 0 : OUTBOX_ESTATE; /* attached already: to this relay, or to another */
    }
    a = calloc(1, sizeof *a);
    if (!a) {
        uv_mutex_unlock(&registry_mutex);
        return OUTBOX_ENOMEM;
    }
    a->db = db;
    a->r = r;
    a->busy_ms = outbox__busy_ms(db, &a->naps);
    a->autockpt = pragma_int(db, "PRAGMA wal_autocheckpoint");
    if (!r->lock.sync_ok)
        a->busy_ms = 0; /* no way to wait for the relay's transaction: the timeout stays */
    a->next = registry;
    registry = a;
    uv_mutex_unlock(&registry_mutex);
    sqlite3_wal_hook(db, attach_wal_hook, a);
    /* A connection that does not wait for locks keeps not waiting. */
    if (a->busy_ms > 0) {
        sqlite3_busy_handler(db, attach_busy, a);
        __atomic_add_fetch(&r->lock.attached, 1, __ATOMIC_RELAXED);
    }
    return 0;
}

void outbox_relay_detach(sqlite3 *db)
{
    attachment *a, **l;
    if (!db)
        return;
    uv_once(&registry_once, registry_init);
    if (!registry_ok)
        return;
    uv_mutex_lock(&registry_mutex);
    l = find(db);
    a = *l;
    if (a)
        *l = a->next;
    uv_mutex_unlock(&registry_mutex);
    if (!a)
        return; /* not attached: its hooks are someone else's */
    /* PRAGMA wal_autocheckpoint reads N > 0 only while SQLite's own
     * checkpointing hook is installed: then the application replaced the
     * relay's hook with it, and it stays. Otherwise the hook is the relay's,
     * or one the application set since (SQLite cannot tell whose): it goes,
     * and the auto-checkpoint db had at attach comes back. */
    if (pragma_int(db, "PRAGMA wal_autocheckpoint") <= 0) {
        sqlite3_wal_hook(db, NULL, NULL);
        if (a->autockpt > 0)
            sqlite3_wal_autocheckpoint(db, a->autockpt);
    }
    if (a->busy_ms > 0) {
        /* The busy wait it had at attach, unless the application set a
         * busy timeout since (PRAGMA busy_timeout reads 0 while the relay's
         * handler is installed). */
        if (pragma_int(db, "PRAGMA busy_timeout") == 0) {
            if (a->naps)
                outbox__busy_naps_set(db, a->busy_ms);
            else
                sqlite3_busy_timeout(db, a->busy_ms);
        }
        __atomic_sub_fetch(&a->r->lock.attached, 1, __ATOMIC_RELAXED);
    }
    free(a);
}
