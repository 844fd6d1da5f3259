/*
 * shim_vfs.c: a VFS for fault injection in tests. It delegates every call
 * to the default VFS found at registration and, on demand, makes xWrite fail
 * (write_fail_code) or xSync fail (SQLITE_IOERR_FSYNC) for the next K calls,
 * or makes every xSync take sync_delay_us longer (a slow disk).
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "shim_vfs.h"

/* A setup failure: TAP's bail-out line, as tap.h's bail() prints it. */
static void shim_bail(const char *why)
{
    printf("Bail out! %s\n", why);
    fflush(stdout);
    exit(1);
}

static sqlite3_vfs *real_vfs;
static sqlite3_vfs shim_vfs;
static sqlite3_io_methods shim_io;

atomic_long write_fail_left, sync_fail_left;
atomic_int write_fail_code = SQLITE_IOERR_WRITE;
atomic_long writes_failed, syncs_failed, writes_total, syncs_total;
atomic_long sync_delay_us;

#define REAL(f) (((shim_file *)(f))->real)

static int take(atomic_long *left)
{
    long v = atomic_load(left);
    while (v > 0) {
        if (atomic_compare_exchange_weak(left, &v, v - 1))
            return 1;
    }
    return 0;
}

static int s_close(sqlite3_file *f)
{
    sqlite3_file *r = REAL(f);
    return r->pMethods ? r->pMethods->xClose(r) : SQLITE_OK;
}
static int s_read(sqlite3_file *f, void *b, int n, sqlite3_int64 off)
{
    return REAL(f)->pMethods->xRead(REAL(f), b, n, off);
}
static int s_write(sqlite3_file *f, const void *b, int n, sqlite3_int64 off)
{
    atomic_fetch_add(&writes_total, 1);
    if (take(&write_fail_left)) {
        atomic_fetch_add(&writes_failed, 1);
        return atomic_load(&write_fail_code);
    }
    return REAL(f)->pMethods->xWrite(REAL(f), b, n, off);
}
static int s_forward_write(sqlite3_file *f, const void *b, int n, sqlite3_int64 off)
{
    return REAL(f)->pMethods->xWrite(REAL(f), b, n, off);
}
static int s_forward_sync(sqlite3_file *f, int flags)
{
    return REAL(f)->pMethods->xSync(REAL(f), flags);
}
static int s_truncate(sqlite3_file *f, sqlite3_int64 size)
{
    return REAL(f)->pMethods->xTruncate(REAL(f), size);
}
static int s_sync(sqlite3_file *f, int flags)
{
    long delay = atomic_load(&sync_delay_us);
    atomic_fetch_add(&syncs_total, 1);
    if (take(&sync_fail_left)) {
        atomic_fetch_add(&syncs_failed, 1);
        return SQLITE_IOERR_FSYNC;
    }
    if (delay > 0) {
        struct timespec ts = {delay / 1000000, (delay % 1000000) * 1000};
        nanosleep(&ts, NULL);
    }
    return REAL(f)->pMethods->xSync(REAL(f), flags);
}
static int s_filesize(sqlite3_file *f, sqlite3_int64 *size)
{
    return REAL(f)->pMethods->xFileSize(REAL(f), size);
}
static int s_lock(sqlite3_file *f, int l)
{
    return REAL(f)->pMethods->xLock(REAL(f), l);
}
static int s_unlock(sqlite3_file *f, int l)
{
    return REAL(f)->pMethods->xUnlock(REAL(f), l);
}
static int s_check(sqlite3_file *f, int *out)
{
    return REAL(f)->pMethods->xCheckReservedLock(REAL(f), out);
}
static int s_fcntl(sqlite3_file *f, int op, void *arg)
{
    return REAL(f)->pMethods->xFileControl(REAL(f), op, arg);
}
static int s_sector(sqlite3_file *f)
{
    return REAL(f)->pMethods->xSectorSize(REAL(f));
}
static int s_devchar(sqlite3_file *f)
{
    return REAL(f)->pMethods->xDeviceCharacteristics(REAL(f));
}
static int s_shmmap(sqlite3_file *f, int pg, int pgsz, int extend, void volatile **pp)
{
    return REAL(f)->pMethods->xShmMap(REAL(f), pg, pgsz, extend, pp);
}
static int s_shmlock(sqlite3_file *f, int off, int n, int flags)
{
    return REAL(f)->pMethods->xShmLock(REAL(f), off, n, flags);
}
static void s_shmbarrier(sqlite3_file *f)
{
    REAL(f)->pMethods->xShmBarrier(REAL(f));
}
static int s_shmunmap(sqlite3_file *f, int del)
{
    return REAL(f)->pMethods->xShmUnmap(REAL(f), del);
}
static int s_fetch(sqlite3_file *f, sqlite3_int64 off, int n, void **pp)
{
    return REAL(f)->pMethods->xFetch(REAL(f), off, n, pp);
}
static int s_unfetch(sqlite3_file *f, sqlite3_int64 off, void *p)
{
    return REAL(f)->pMethods->xUnfetch(REAL(f), off, p);
}

void shim_io_forward(sqlite3_io_methods *io)
{
    *io = (sqlite3_io_methods){3,          s_close,  s_read,    s_forward_write, s_truncate, s_forward_sync,
                               s_filesize, s_lock,   s_unlock,  s_check,         s_fcntl,    s_sector,
                               s_devchar,  s_shmmap, s_shmlock, s_shmbarrier,    s_shmunmap, s_fetch,
                               s_unfetch};
}

static int s_open(sqlite3_vfs *vfs, const char *name, sqlite3_file *f, int flags, int *out_flags)
{
    shim_file *sf = (shim_file *)f;
    int rc;
    (void)vfs;
    sf->real = (sqlite3_file *)(sf + 1);
    sf->base.pMethods = NULL;
    rc = real_vfs->xOpen(real_vfs, name, sf->real, flags, out_flags);
    if (sf->real->pMethods) {
        shim_io.iVersion = sf->real->pMethods->iVersion < 3 ? sf->real->pMethods->iVersion : 3;
        sf->base.pMethods = &shim_io;
    }
    return rc;
}

void shim_register(const char *name, int make_default)
{
    real_vfs = sqlite3_vfs_find(NULL);
    if (!real_vfs)
        shim_bail("no default VFS");
    shim_vfs = *real_vfs;
    shim_vfs.zName = name;
    shim_vfs.pNext = NULL;
    shim_vfs.szOsFile = (int)sizeof(shim_file) + real_vfs->szOsFile;
    shim_vfs.xOpen = s_open;
    shim_io_forward(&shim_io);
    shim_io.xWrite = s_write; /* counted, and failed on demand */
    shim_io.xSync = s_sync;   /* the same, and slowed down on demand */
    if (sqlite3_vfs_register(&shim_vfs, make_default) != SQLITE_OK)
        shim_bail("sqlite3_vfs_register failed");
}

void faults_off(void)
{
    atomic_store(&write_fail_left, 0);
    atomic_store(&sync_fail_left, 0);
}

/* ---- the relay's log --------------------------------------------------- */
