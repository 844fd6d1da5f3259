#!/usr/bin/env bash
# run.sh SCENARIO [short|long]: one network-fault scenario in a world of its
# own (world.sh), its checks as TAP lines and one RESULT line with the
# figures (check.py). Exit 0 when every check held, 1 when one failed, 77
# (skip, with the reason) without root or without ip netns / nft.
#   blackhole loss slow_link reset_all reset_random disk_full
#   sentinel sentinel_wait cluster cluster_wait consumer consumer_sentinel
# OUTBOX_SLOW=N stretches every deadline N times; NF_KEEP=1 keeps the
# world's directory (logs, database) for a look afterwards.
# SC_LOG_LEVEL=debug gives the relays that log level (default info).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
scenario=${1:?usage: run.sh SCENARIO [short|long]}
export SC_MODE=${2:-short}
# shellcheck source=world.sh
source "$here/world.sh"
# shellcheck source=scenarios.sh
source "$here/scenarios.sh"
declare -F "sc_$scenario" >/dev/null || { echo "run.sh: no scenario '$scenario'" >&2; exit 2; }
nf_require
# The disk-full scenario mounts a tmpfs: in a mount namespace of its own.
[ "$scenario" = disk_full ] && nf_private_mounts "$@"
"sc_$scenario"
echo "1..$SC_POINTS"
exit "$SC_FAILED"
