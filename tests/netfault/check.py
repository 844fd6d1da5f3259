#!/usr/bin/env python3
"""The network-fault checker: conservation of messages, from the outbox
databases and every Redis node's streams alone, in the spirit of Jepsen's
total-queue check.

Inputs:
  --db PATH            an outbox database (repeatable): the committed rows are
                       what it holds (rows of rolled-back transactions are not
                       there); their seq is the commit order
  --node NAME=SOCKET   a Redis node, read through its Unix socket (repeatable);
                       the streams of the nodes that say they are masters
                       (ROLE) are what consumers read and are what counts
  --rolled-back FILE   ids of transactions that did not commit (repeatable)
  --effects FILE       ids of effects a consumer applied, one a line (optional)
  --heal-ms T          the moment a fault was healed (Unix ms, the clock Redis
                       stamps stream entry ids with)
  --event NAME=T       another moment (e.g. Sentinel's +switch-master): prints
                       NAME_resume_ms, the first entry at or after T minus T
  --baseline PREFIX    ids with this prefix are the undisturbed backlog,
                       committed at once (at --baseline-ms T, or else at its
                       rows' latest created_at)
  --json               one JSON object instead of the key=value line

Counts (and fractions of committed):
  committed            rows in the databases
  found                committed ids present in a master's stream
  lost                 committed ids in no master's stream
  lost_marked          of those, rows the relay marked published (state 2): a
                       loss the relay does not know about
  duplicates           entries beyond the first of an id
  rolled_back_published ids of rolled-back transactions found in a stream
  foreign              entries whose id is neither committed nor rolled back
  order_violations     per topic and key, first appearances not in seq order
  dead, unpublished    rows dead-lettered / not marked published (state < 2)
Timing (from stream entry ids, whose ms part is Redis's wall clock):
  resume_ms            first entry at or after --heal-ms, minus it
  catchup_s            the backlog at the heal (rows created before it and
                       first published after it): heal to its last first entry
  baseline_s           the undisturbed backlog: --baseline-ms to its last first entry
  catchup_ratio        catchup_s / baseline_s
Exit status 0 when it could read everything (the scenario decides what to
assert), 2 when an input could not be read.
"""
import argparse
import collections
import json
import socket
import sqlite3
import sys


class Resp:
    """A minimal RESP2 client over a Unix socket (no dependency but Python)."""

    def __init__(self, path, timeout=30):
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(timeout)
        self.s.connect(path)
        self.buf = b""

    def close(self):
        self.s.close()

    def _fill(self):
        chunk = self.s.recv(1 << 20)
        if not chunk:
            raise IOError("connection closed")
        self.buf += chunk

    def _line(self):
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _reply(self):
        line = self._line()
        t, rest = line[:1], line[1:]
        if t == b"+":
            return rest.decode()
        if t == b"-":
            raise RuntimeError(rest.decode(errors="replace"))
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self._fill()
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise IOError("bad reply %r" % line[:40])

    def cmd(self, *args):
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            a = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(a), a))
        self.s.sendall(b"".join(out))
        return self._reply()


def stream_entries(r, key):
    """[(ms, seq, id)] of a stream in order, paged."""
    out = []
    start = b"-"
    while True:
        page = r.cmd("XRANGE", key, start, "+", "COUNT", 2000)
        if not page:
            return out
        for eid, fields in page:
            ms, sq = eid.split(b"-")
            mid = None
            for i in range(0, len(fields) - 1, 2):
                if fields[i] == b"id":
                    mid = fields[i + 1].decode(errors="replace")
                    break
            out.append((int(ms), int(sq), mid))
        last = page[-1][0]
        ms, sq = last.split(b"-")
        start = b"%s-%d" % (ms, int(sq) + 1)


def read_node(path, prefix):
    r = Resp(path)
    try:
        role = r.cmd("ROLE")[0].decode()
        streams = {}
        if role != "master":
            # A replica's copy is not what consumers read (and a cluster
            # replica answers MOVED): only its role is reported.
            return role, streams
        cursor = b"0"
        while True:
            cursor, keys = r.cmd("SCAN", cursor, "MATCH", prefix + "*", "TYPE", "stream", "COUNT", 1000)
            for k in keys:
                streams[k.decode()] = stream_entries(r, k)
            if cursor == b"0":
                break
        return role, streams
    finally:
        r.close()


def read_db(path):
    db = sqlite3.connect("file:%s?mode=ro" % path, uri=True, timeout=30)
    try:
        return db.execute("SELECT id, seq, topic, key, state, created_at FROM outbox_messages").fetchall()
    finally:
        db.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--db", action="append", default=[])
    ap.add_argument("--node", action="append", default=[])
    ap.add_argument("--prefix", default="outbox:")
    ap.add_argument("--rolled-back", action="append", default=[])
    ap.add_argument("--effects")
    ap.add_argument("--heal-ms", type=int)
    ap.add_argument("--event", action="append", default=[])
    ap.add_argument("--baseline")
    ap.add_argument("--baseline-ms", type=int)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not a.db or not a.node:
        ap.error("need at least one --db and one --node")

    try:
        rows = {}
        for i, path in enumerate(a.db):
            for mid, seq, topic, key, state, created in read_db(path):
                # Several databases: seqs are per database, so order is too.
                rows[mid] = (i, seq, topic, key, state, created)
        rolled = set()
        for path in a.rolled_back:
            with open(path) as f:
                rolled.update(line.strip() for line in f if line.strip())
        masters, replicas = {}, {}
        for spec in a.node:
            name, path = spec.split("=", 1)
            role, streams = read_node(path, a.prefix)
            (masters if role == "master" else replicas)[name] = streams
    except (OSError, sqlite3.Error, RuntimeError, ValueError) as e:
        print("check: cannot read the inputs: %s" % e, file=sys.stderr)
        return 2

    # Every master's entries, each stream in its own order.
    entries = []
    for streams in masters.values():
        for key, es in streams.items():
            for ms, sq, mid in es:
                entries.append((key, ms, sq, mid))
    counts = collections.Counter(e[3] for e in entries)
    first = {}
    for key, ms, sq, mid in entries:
        if mid not in first or (ms, sq) < first[mid]:
            first[mid] = (ms, sq)

    committed = len(rows)
    found = sum(1 for m in rows if m in counts)
    lost_ids = [m for m in rows if m not in counts]
    lost_marked = sum(1 for m in lost_ids if rows[m][4] == 2)
    dups = sum(c - 1 for c in counts.values())
    rb_pub = sum(1 for m in rolled if m in counts and m not in rows)
    rb_committed = sum(1 for m in rolled if m in rows)
    foreign = sum(1 for m in counts if m not in rows and m not in rolled)
    dead = sum(1 for r in rows.values() if r[4] == 3)
    unpublished = sum(1 for r in rows.values() if r[4] < 2)

    # Per (database, topic, key): the first appearance of each id, in stream
    # order, must follow the commit order (seq).
    violations = 0
    seen = set()
    last = {}
    by_stream = collections.defaultdict(list)
    for key, ms, sq, mid in entries:
        by_stream[key].append((ms, sq, mid))
    for key in by_stream:
        for ms, sq, mid in sorted(by_stream[key]):
            if mid in seen or mid not in rows:
                continue
            seen.add(mid)
            dbi, seq, topic, k, _, _ = rows[mid]
            if k is None:
                continue
            g = (dbi, topic, k)
            if last.get(g, -1) > seq:
                violations += 1
            last[g] = max(seq, last.get(g, -1))

    out = collections.OrderedDict()
    out["committed"] = committed
    out["found"] = found
    out["lost"] = len(lost_ids)
    out["lost_marked"] = lost_marked
    out["duplicates"] = dups
    out["rolled_back"] = len(rolled)
    out["rolled_back_published"] = rb_pub
    out["rolled_back_but_committed"] = rb_committed
    out["foreign"] = foreign
    out["order_violations"] = violations
    out["dead"] = dead
    out["unpublished"] = unpublished
    out["masters"] = ",".join(sorted(masters))
    frac = (lambda n: round(n / committed, 6)) if committed else (lambda n: 0.0)
    out["lost_fraction"] = frac(len(lost_ids))
    out["duplicate_fraction"] = frac(dups)

    if a.heal_ms is not None:
        after = [ms for ms, _ in first.values() if ms >= a.heal_ms]
        out["resume_ms"] = (min(after) - a.heal_ms) if after else None
        backlog = [first[m][0] for m, r in rows.items()
                   if r[5] < a.heal_ms and m in first and first[m][0] >= a.heal_ms]
        out["backlog_at_heal"] = len(backlog)
        out["catchup_s"] = round((max(backlog) - a.heal_ms) / 1000.0, 3) if backlog else 0.0
    for spec in a.event:
        # Another moment than the heal, e.g. Sentinel's +switch-master.
        name, t = spec.split("=", 1)
        after = [ms for ms, _ in first.values() if ms >= int(t)]
        out["%s_resume_ms" % name] = (min(after) - int(t)) if after else None
    if a.baseline:
        # Without --baseline-ms the backlog's own commit: its rows' latest
        # created_at (they were committed in one transaction).
        mine = [m for m in rows if m.startswith(a.baseline)]
        start = a.baseline_ms if a.baseline_ms is not None else max((rows[m][5] for m in mine), default=0)
        b = [first[m][0] for m in mine if m in first]
        out["baseline_rows"] = len(mine)
        out["baseline_s"] = round(max(0, max(b) - start) / 1000.0, 3) if b else None
        if out.get("catchup_s") is not None and out["baseline_s"]:
            out["catchup_ratio"] = round(out["catchup_s"] / out["baseline_s"], 2)
    if a.effects:
        try:
            with open(a.effects) as f:
                eff = collections.Counter(line.strip() for line in f if line.strip())
        except OSError as e:
            print("check: cannot read the effects: %s" % e, file=sys.stderr)
            return 2
        out["effects_missing"] = sum(1 for m in rows if m not in eff)
        out["effects_duplicated"] = sum(c - 1 for c in eff.values())
        out["effects_foreign"] = sum(1 for m in eff if m not in rows)

    if a.json:
        print(json.dumps(out))
    else:
        print(" ".join("%s=%s" % (k, "-" if v is None else v) for k, v in out.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
