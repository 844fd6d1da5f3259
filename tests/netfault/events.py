#!/usr/bin/env python3
"""events.py SOCKET CHANNEL...: subscribes through a Unix socket (a
sentinel's, for its +switch-master and +sdown events) and prints each
message as one line, "<unix ms> <channel> <message>", flushed at once, so
that a scenario can tell when Sentinel decided something by the same clock
that stamps stream entries."""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check import Resp  # noqa: E402


def main():
    if len(sys.argv) < 3:
        print("usage: events.py SOCKET CHANNEL...", file=sys.stderr)
        return 2
    r = Resp(sys.argv[1], timeout=None)
    r.cmd("SUBSCRIBE", *sys.argv[2:])
    for _ in sys.argv[3:]:
        r._reply()
    while True:
        msg = r._reply()
        if isinstance(msg, list) and len(msg) == 3 and msg[0] == b"message":
            print("%d %s %s" % (time.time() * 1000, msg[1].decode(), msg[2].decode(errors="replace")), flush=True)


if __name__ == "__main__":
    sys.exit(main())
