#!/usr/bin/env python3
"""An order service that announces each order through the transactional outbox.

The order row and its outbox message are written in ONE SQLite transaction:
both commit or neither does. `outbox-relay` (running beside this service)
publishes committed messages to the Redis stream `outbox:orders`; it never
sees a message whose transaction rolled back.

Standard library only. Usage:

    outbox-relay init --db shop.db              # creates the outbox table (once)
    python3 order_service.py --db shop.db --orders 10 [--fail-every 3]

Prints the id of every committed message on stdout, one per line, and
"rolled-back <id> <reason>" on stderr for every order that was rolled back.
"""
import argparse
import json
import os
import sqlite3
import sys
import time
import uuid


def uuid7() -> str:
    """A UUIDv7 (RFC 9562): 48 bits of Unix milliseconds, then random bits.

    Time-ordered ids keep the outbox's unique index compact. uuid.uuid4()
    is fine too: any unique 1..128 printable-ASCII string is a valid id.
    """
    ms = time.time_ns() // 1_000_000
    value = (ms & ((1 << 48) - 1)) << 80 | int.from_bytes(os.urandom(10), "big")
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # variant 10
    return str(uuid.UUID(int=value))


class PaymentDeclined(Exception):
    """A business failure after the writes: the whole transaction rolls back."""


def open_db(path: str) -> sqlite3.Connection:
    # isolation_level=None: we issue BEGIN/COMMIT/ROLLBACK ourselves, so the
    # transaction boundaries are exactly the ones you read below.
    # timeout: wait up to 10 s for the write lock (the relay takes it briefly).
    conn = sqlite3.connect(path, timeout=10, isolation_level=None)
    # Durable commits: with WAL and synchronous=NORMAL a power cut can undo a
    # commit whose message the relay already published (proto/schema.md).
    conn.execute("PRAGMA synchronous=FULL")
    (version,) = conn.execute("PRAGMA user_version").fetchone()
    if version < 1:
        sys.exit(f"{path}: no outbox table; run `outbox-relay init --db {path}` first")
    # The business table is ours; the outbox table belongs to outbox-relay.
    conn.execute(
        "CREATE TABLE IF NOT EXISTS orders("
        " id INTEGER PRIMARY KEY, customer TEXT NOT NULL, amount_cents INTEGER NOT NULL)"
    )
    return conn


def place_order(conn, message_id, customer, amount_cents, decline=False):
    """Inserts the order and its outbox message in one transaction."""
    # IMMEDIATE takes the write lock up front: no lock upgrade can fail later.
    conn.execute("BEGIN IMMEDIATE")
    try:
        order_id = conn.execute(
            "INSERT INTO orders(customer, amount_cents) VALUES (?, ?)",
            (customer, amount_cents),
        ).lastrowid
        payload = json.dumps(
            {"order_id": order_id, "customer": customer, "amount_cents": amount_cents},
            ensure_ascii=False,
        ).encode("utf-8")  # bytes bind as a BLOB: published exactly as written
        conn.execute(
            # topic -> stream outbox:orders; key -> this customer's messages
            # are published in commit order. headers, created_at and
            # available_at are optional; headers stay NULL here.
            "INSERT INTO outbox(id, topic, key, payload) VALUES (?, ?, ?, ?)",
            (message_id, "orders", f"customer-{customer}", payload),
        )
        if decline:
            raise PaymentDeclined(f"payment declined for order {order_id}")
        conn.execute("COMMIT")  # the order and its message, together
    except BaseException:
        conn.execute("ROLLBACK")  # neither the order nor its message exists
        raise


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", required=True, help="SQLite database (after outbox-relay init)")
    ap.add_argument("--orders", type=int, default=1, help="how many orders to place")
    ap.add_argument("--fail-every", type=int, default=0, metavar="K",
                    help="decline every K-th order (its transaction rolls back)")
    args = ap.parse_args()

    conn = open_db(args.db)
    customers = ["ada", "zoë", "björn", "李雷"]  # UTF-8 travels byte for byte
    for n in range(1, args.orders + 1):
        message_id = uuid7()
        decline = args.fail_every > 0 and n % args.fail_every == 0
        try:
            place_order(conn, message_id, customers[n % len(customers)], 100 * n + 99, decline)
        except PaymentDeclined as e:
            print(f"rolled-back {message_id} {e}", file=sys.stderr)
            continue
        print(message_id, flush=True)
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
