#!/usr/bin/env bash
# fsx (the file system exerciser of xfstests: random reads, writes, mapped
# reads and writes, truncates, each read checked against its own copy of the
# file) through a mount while the meta-server is killed (SIGKILL) and started
# again, and later the data server. A meta-server with a state directory, a
# data server with a data directory and one mount (TRANSPORT tcp or auto,
# auto being shm on this host). fsx must see no error and no corruption: the
# mount rides through both restarts. Prints fsx's last lines and its status.
#
# Usage: tests/scripts/fsx-restarts.sh [TRANSPORT [OPS]]
# Needs root, fuse3; BIN (default target/release/citronfs); FSX, an fsx
# binary (not packaged by Debian: build it from xfstests' ltp/fsx.c).
set -eu
TRANSPORT=${1:-tcp}
OPS=${2:-200000}
BIN=${BIN:-$(dirname "$0")/../../target/release/citronfs}
FSX=${FSX:?set FSX to an fsx binary}
D=$(mktemp -d /dev/shm/citronfs-fsx-XXXXXX); mkdir -p "$D/mnt" "$D/state"
PORT=$((20000 + RANDOM % 20000))
META=127.0.0.1:$PORT
SHM=(); DSHM=()
[ "$TRANSPORT" = auto ] && { SHM=(--shm "fsx$PORT"); DSHM=(--shm "fsxd$PORT"); }
pids=()
cleanup() {
    umount -l "$D/mnt" 2>/dev/null || true
    kill "${pids[@]}" 2>/dev/null || true
    sleep 0.5
    rm -rf "$D"
}
trap cleanup EXIT
meta() { "$BIN" meta-server --listen "$META" --state-dir "$D/state" "${SHM[@]}" 2>>"$D/meta.log" & M=$!; pids+=($M); }
data() { "$BIN" data-server --meta "$META" --capacity 1GiB --data-dir "$D/data" "${DSHM[@]}" 2>>"$D/data.log" & S=$!; pids+=($S); }
meta; sleep 0.5
data; sleep 0.5
"$BIN" mount --meta "$META" --transport "$TRANSPORT" --foreground "$D/mnt" 2>>"$D/mount.log" & pids+=($!)
for _ in $(seq 100); do mountpoint -q "$D/mnt" && break; sleep 0.1; done
echo "$(date +%T.%N) fsx started" >>"$D/events"
"$FSX" -N "$OPS" -p 20000 -S 1 "$D/mnt/fsxfile" >"$D/fsx.out" 2>&1 &
F=$!
sleep 5
kill -9 "$M"; wait "$M" 2>/dev/null || true
echo "$(date +%T.%N) meta-server killed and started again" >>"$D/events"
meta
sleep 10
kill -9 "$S"; wait "$S" 2>/dev/null || true
echo "$(date +%T.%N) data server killed and started again" >>"$D/events"
data
set +e
wait "$F"; status=$?
set -e
echo "$(date +%T.%N) fsx ended" >>"$D/events"
cat "$D/events"
tail -4 "$D/fsx.out"
echo "fsx through a meta-server and a data server restart, $TRANSPORT, $OPS operations: fsx status $status"
[ "$status" = 0 ] || { echo "--- mount log"; tail -20 "$D/mount.log"; cp "$D/fsx.out" /tmp/fsx-restarts.out 2>/dev/null; }
exit "$status"
