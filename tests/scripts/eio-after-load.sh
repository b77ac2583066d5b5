#!/usr/bin/env bash
# The "EIO after load" scenario of a caching mount, by hand: one embedded
# mount (`citronfs mount --cache-ttl TTL --transport T`), /usr/share/doc
# untarred into it while two busy loops occupy both cores, then (loops
# ended) find, du, ls -lR and grep -r over it, and a `git clone` of a local
# repository into it. Prints the clone's outcome and the mount's warnings
# (a call answered EIO says why: "answering EIO: ..."; a meta-server call
# that outlived the RPC timeout while the meta-server was alive says
# "no answer after ..., still waiting"; the meta-server logs requests
# slower than a second with their kind).
#
# Usage: tests/scripts/eio-after-load.sh [tcp|auto] [TTL] [REPO]
# Needs root, fuse3 and git; BIN (default target/release/citronfs).
set -u
T=${1:-tcp}; TTL=${2:-1}; REPO=${3:-$(git rev-parse --show-toplevel)}
BIN=${BIN:-$(dirname "$0")/../../target/release/citronfs}
D=$(mktemp -d); mkdir -p "$D/mnt"
RUST_LOG=${RUST_LOG:-debug,fuser=info} "$BIN" mount "$D/mnt" --foreground --cache-ttl "$TTL" \
    --transport "$T" --capacity 1GiB > "$D/mount.log" 2>&1 &
MP=$!
for _ in $(seq 100); do mountpoint -q "$D/mnt" && break; sleep 0.1; done
( while :; do :; done ) & L1=$!
( while :; do :; done ) & L2=$!
tar -C /usr/share -cf - doc | tar -C "$D/mnt" -xf -
kill $L1 $L2
find "$D/mnt" > /dev/null; du -s "$D/mnt" > /dev/null; ls -lR "$D/mnt" > /dev/null
grep -r no-such-text "$D/mnt" > /dev/null
start=$(date +%s.%N)
if git clone -q "$REPO" "$D/mnt/clone" > "$D/clone.log" 2>&1; then r=ok; else r=FAILED; fi
echo "clone $r after $(echo "$(date +%s.%N) - $start" | bc) s: $(head -2 "$D/clone.log")"
umount "$D/mnt" || umount -l "$D/mnt"
wait $MP
grep " WARN \| ERROR \| took " "$D/mount.log" | grep -v "Not Implemented\|Unmount failed"
echo "mount log: $D/mount.log"
