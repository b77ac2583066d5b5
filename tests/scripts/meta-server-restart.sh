#!/usr/bin/env bash
# A meta-server's restart as an application sees it: a meta-server with a
# state directory, a data server and a mount (TRANSPORT tcp or auto, auto
# being shm on this host), and a process that writes 4 KiB into an open
# file, reads it back and stats the directory in a loop for 12 s. After
# 3 s the meta-server is killed (SIGKILL) and started again with the same
# state directory. Prints the calls answered, the calls that failed (none
# should: the mount rides through) and the longest gap between two answers.
#
# Usage: tests/scripts/meta-server-restart.sh [TRANSPORT [LEASE_MS]]
# Needs root, fuse3, python3; BIN (default target/release/citronfs).
set -eu
TRANSPORT=${1:-tcp}
LEASE=${2:-5000}
BIN=${BIN:-$(dirname "$0")/../../target/release/citronfs}
D=$(mktemp -d /dev/shm/citronfs-restart-XXXXXX); mkdir -p "$D/mnt" "$D/state"
PORT=$((20000 + RANDOM % 20000))
META=127.0.0.1:$PORT
SHM=(); [ "$TRANSPORT" = auto ] && SHM=(--shm "restart$PORT")
pids=()
cleanup() {
    umount -l "$D/mnt" 2>/dev/null || true
    kill "${pids[@]}" 2>/dev/null || true
    rm -rf "$D"
}
trap cleanup EXIT
meta() { "$BIN" meta-server --listen "$META" --state-dir "$D/state" --lease-ms "$LEASE" "${SHM[@]}" 2>>"$D/meta.log" & }
meta; pids+=($!); M=$!
sleep 0.5
"$BIN" data-server --meta "$META" --capacity 256MiB 2>>"$D/data.log" & pids+=($!)
sleep 0.5
"$BIN" mount --meta "$META" --transport "$TRANSPORT" --foreground "$D/mnt" 2>>"$D/mount.log" & pids+=($!)
for _ in $(seq 100); do mountpoint -q "$D/mnt" && break; sleep 0.1; done
python3 - "$D/mnt/f" 12 >"$D/out" <<'PY' &
import os, sys, time
path, secs = sys.argv[1], float(sys.argv[2])
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
block, answered, failed, i = b"x" * 4096, [], 0, 0
end = time.time() + secs
while time.time() < end:
    try:
        at = (i % 256) * 4096
        os.pwrite(fd, block, at)
        os.pread(fd, 4096, at)
        os.stat(os.path.dirname(path))
        answered.append(time.time())
    except OSError as e:
        failed += 1
        print("failed:", e, file=sys.stderr)
    i += 1
gap = max((b - a for a, b in zip(answered, answered[1:])), default=0)
print(f"{len(answered)} calls answered, {failed} failed, longest gap {gap * 1000:.0f} ms")
PY
P=$!
sleep 3
kill -9 "$M"; wait "$M" 2>/dev/null || true
meta; pids+=($!)
wait "$P"
echo "meta-server SIGKILL and restart, $TRANSPORT, lease $LEASE ms: $(cat "$D/out")"
