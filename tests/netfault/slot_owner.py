#!/usr/bin/env python3
"""slot_owner.py SOCKET KEY: the address of the cluster master serving KEY's
slot and of its replica, "MASTER_IP REPLICA_IP", from CLUSTER NODES as the
node at SOCKET sees it. Exit 1 when no master (or no replica) is found."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check import Resp  # noqa: E402


def main():
    r = Resp(sys.argv[1])
    slot = r.cmd("CLUSTER", "KEYSLOT", sys.argv[2])
    nodes = r.cmd("CLUSTER", "NODES").decode().splitlines()
    r.close()
    master = None
    for line in nodes:
        f = line.split()
        if "master" not in f[2].split(","):
            continue
        for rng in f[8:]:
            if rng.startswith("["):
                continue  # a slot being migrated, not served
            lo, _, hi = rng.partition("-")
            if int(lo) <= slot <= int(hi or lo):
                master = f
    if not master:
        return 1
    replica = [f for f in (line.split() for line in nodes) if f[3] == master[0]]
    if not replica:
        return 1
    ip = lambda f: f[1].split(":")[0]  # noqa: E731
    print(ip(master), ip(replica[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
