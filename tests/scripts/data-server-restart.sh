#!/usr/bin/env bash
# A data server's restart as an application sees it: a meta-server, a data
# server with a data directory and a mount (tcp), GIB GiB written through
# the mount with dd, then a reader that reads 4 KiB of the file every
# millisecond and records its longest wait while the data server is killed
# (SIGKILL) and started again with the same data directory. Prints the
# data server's restart time (exec to its "serving" line), the reader's
# longest pause and its errors, and checks every byte of a sample read
# after the restart against what was written.
#
# Usage: tests/scripts/data-server-restart.sh [GIB]
# Needs root, fuse3, python3; BIN (default target/release/citronfs).
set -eu
GIB=${1:-1}
BIN=${BIN:-$(dirname "$0")/../../target/release/citronfs}
D=$(mktemp -d); mkdir -p "$D/mnt"
PORT=$((20000 + RANDOM % 20000))
META=127.0.0.1:$PORT
cleanup() {
    umount -l "$D/mnt" 2>/dev/null || true
    kill $(jobs -p) 2>/dev/null || true
    rm -rf "$D" /dev/shm/citronfs-restart-data-$PORT
}
trap cleanup EXIT
"$BIN" meta-server --listen "$META" --state-dir "$D/state" > "$D/meta.out" 2> "$D/meta.log" &
sleep 1
DATA=(data-server --meta "$META" --capacity $((GIB + 1))GiB --data-dir /dev/shm/citronfs-restart-data-$PORT)
"$BIN" "${DATA[@]}" > "$D/data.out" 2> "$D/data.log" &
DP=$!
sleep 1
"$BIN" mount "$D/mnt" --meta "$META" --transport tcp --timeout 30 --foreground > "$D/mount.log" 2>&1 &
for _ in $(seq 100); do mountpoint -q "$D/mnt" && break; sleep 0.1; done
dd if=/dev/urandom of="$D/sample" bs=1M count=16 status=none
dd if="$D/sample" of="$D/mnt/big" bs=1M count=16 status=none conv=fsync
dd if=/dev/zero of="$D/mnt/big" bs=1M seek=16 count=$((GIB * 1024 - 16)) status=none conv=fsync,notrunc
python3 - "$D/mnt/big" "$D/pause" <<'PY' &
import os, sys, time
f, out = sys.argv[1], sys.argv[2]
fd = os.open(f, os.O_RDONLY)
longest, errors, end = 0.0, 0, time.time() + 12
while time.time() < end:
    t = time.time()
    try:
        os.pread(fd, 4096, 0)
    except OSError:
        errors += 1
    longest = max(longest, time.time() - t)
    time.sleep(0.001)
open(out, "w").write(f"{longest:.3f} {errors}\n")
PY
READER=$!
sleep 2
kill -KILL $DP; wait $DP 2>/dev/null || true
start=$(date +%s.%N)
"$BIN" "${DATA[@]}" > "$D/data2.out" 2> "$D/data2.log" &
while [ ! -s "$D/data2.out" ]; do sleep 0.01; done
restart=$(echo "$(date +%s.%N) - $start" | bc)
wait $READER
read -r pause errors < "$D/pause"
cmp <(head -c $((16 << 20)) "$D/mnt/big") "$D/sample" && same=yes || same=NO
echo "data server of ${GIB} GiB written: restart ${restart} s; reader's longest pause ${pause} s, ${errors} errors; bytes after restart identical: ${same}"
