#!/usr/bin/env python3
"""The scenarios' writer: commits outbox rows with plain SQL, as an
application in another language would, and rolls some transactions back.

Each transaction inserts one message (id PREFIX-N, topic TOPIC, key
k<N mod KEYS>) and either commits or, every ROLLBACK_EVERY-th one, rolls
back after the insert. The id of every transaction that did not commit
(rolled back on purpose, or failed, e.g. SQLITE_FULL) is appended to the
side file --rolled-back before the next transaction starts: the only
evidence a rollback leaves, since the database forgets it. The checker
reports any of them found in a stream.

  writer.py --db PATH --count N           N transactions as fast as possible, then exit
  writer.py --db PATH --until FILE        until FILE exists, --rate per second
  --backlog N                             first N rows committed in one transaction

Prints one line at exit: committed=C rolled_back=R failed=F.
"""
import argparse
import os
import sqlite3
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", required=True)
    ap.add_argument("--prefix", default="w")
    ap.add_argument("--topic", default="nf")
    ap.add_argument("--keys", type=int, default=8)
    ap.add_argument("--rollback-every", type=int, default=5)
    ap.add_argument("--payload-bytes", type=int, default=100)
    ap.add_argument("--rolled-back", required=True)
    ap.add_argument("--count", type=int, default=0)
    ap.add_argument("--until")
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--backlog", type=int, default=0)
    ap.add_argument("--start", type=int, default=0, help="first N (ids stay unique across writers)")
    a = ap.parse_args()
    if not a.count and not a.until and not a.backlog:
        ap.error("need --count, --until or --backlog")

    # Autocommit mode: the transactions below are the script's own.
    db = sqlite3.connect(a.db, timeout=30, isolation_level=None)
    db.execute("PRAGMA busy_timeout = 30000")
    side = open(a.rolled_back, "a")
    pad = os.urandom(a.payload_bytes // 2 + 1).hex().encode()
    n = a.start
    committed = rolled_back = failed = 0

    def row(i):
        # Exactly --payload-bytes (at least the number itself): the relay's
        # --max-payload is a bound on exactly this.
        head = b"%d:" % i
        return ("%s-%d" % (a.prefix, i), a.topic, "k%d" % (i % a.keys), head + pad[: max(a.payload_bytes - len(head), 0)])

    if a.backlog:
        # One transaction: the backlog exists all at once, as after an outage.
        try:
            db.execute("BEGIN IMMEDIATE")
            db.executemany("INSERT INTO outbox(id, topic, key, payload) VALUES (?, ?, ?, ?)",
                           [row(i) for i in range(n, n + a.backlog)])
            db.execute("COMMIT")
            committed += a.backlog
        except sqlite3.Error as e:
            print("writer: backlog failed: %s" % e, file=sys.stderr)
            return 1
        n += a.backlog

    period = 1.0 / a.rate if a.rate > 0 else 0
    next_at = time.monotonic()
    done = 0
    while (a.count and done < a.count) or (a.until and not os.path.exists(a.until)):
        done += 1
        i = n
        n += 1
        ok = False
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("INSERT INTO outbox(id, topic, key, payload) VALUES (?, ?, ?, ?)", row(i))
            if a.rollback_every and i % a.rollback_every == 0:
                db.execute("ROLLBACK")
                rolled_back += 1
            else:
                db.execute("COMMIT")
                committed += 1
                ok = True
        except sqlite3.Error as e:
            failed += 1
            if failed <= 3:
                print("writer: %s-%d failed: %s" % (a.prefix, i, e), file=sys.stderr)
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
        if not ok:
            side.write("%s-%d\n" % (a.prefix, i))
            side.flush()
        if a.until and period:
            next_at += period
            delay = next_at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                next_at = time.monotonic()
    side.close()
    db.close()
    print("committed=%d rolled_back=%d failed=%d" % (committed, rolled_back, failed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
