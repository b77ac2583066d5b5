#!/usr/bin/env bash
# A fair two-node layout on one machine: the servers in one network
# namespace pinned to one core, the clients (two mounts and the workload)
# in another pinned to the other core, joined by a veth link (with DELAY_MS
# of netem delay each way, if given). CitronFS (tcp: no shm across hosts)
# and, if its packages are installed, MooseFS are set up the same way and
# measured in the same invocation of a `citronfs bench` command, as peers:
#
#   tests/scripts/two-hosts.sh fcntl --secs 3 --scenarios one,disjoint,shared
#   tests/scripts/two-hosts.sh meta --processes 1,4 --no-bindfs
#
# The bench's own in-process cluster runs too, inside the client namespace
# on the client core: a one-host layout squeezed onto one core, named so in
# its rows (`citron`), beside the two-host peers (`citronfs-2hosts`,
# `moosefs-2hosts`). Needs root, fuse3, iproute2, util-linux (nsenter,
# taskset); BIN (default target/release/citronfs). Leaves nothing behind.
set -eu
BIN=$(realpath "${BIN:-$(dirname "$0")/../../target/release/citronfs}")
BENCH=${1:?usage: two-hosts.sh BENCH [ARGS...] (a citronfs bench subcommand that takes --peer)}
shift
SRV=cfs2h-srv CLI=cfs2h-cli
SRV_IP=10.77.0.1 CLI_IP=10.77.0.2
SRV_CORE=${SRV_CORE:-0} CLI_CORE=${CLI_CORE:-1}
D=$(mktemp -d /tmp/citronfs-2hosts-XXXXXX)
mkdir -p "$D/cfsA" "$D/cfsB" "$D/mfsA" "$D/mfsB" "$D/state"
in_srv() { nsenter --net=/var/run/netns/$SRV taskset -c "$SRV_CORE" "$@"; }
in_cli() { nsenter --net=/var/run/netns/$CLI taskset -c "$CLI_CORE" "$@"; }
MFS=0
command -v mfsmaster >/dev/null && command -v mfsmount >/dev/null && MFS=1
cleanup() {
    set +e
    for m in "$D"/cfsA "$D"/cfsB "$D"/mfsA "$D"/mfsB; do mountpoint -q "$m" && umount -l "$m"; done
    if [ $MFS = 1 ]; then
        in_srv mfschunkserver -c "$D/mfs/etc/mfschunkserver.cfg" stop >/dev/null 2>&1
        in_srv mfsmaster -c "$D/mfs/etc/mfsmaster.cfg" stop >/dev/null 2>&1
    fi
    # The servers run under nsenter and taskset in subshells: found by
    # the directory their command lines name.
    pkill -f -- "$D/" 2>/dev/null
    sleep 0.5
    ip netns del $SRV 2>/dev/null; ip netns del $CLI 2>/dev/null
    rm -rf "$D"
}
trap cleanup EXIT

# The two hosts.
ip netns del $SRV 2>/dev/null || true; ip netns del $CLI 2>/dev/null || true
ip netns add $SRV; ip netns add $CLI
ip link add cfs2h-s type veth peer name cfs2h-c
ip link set cfs2h-s netns $SRV; ip link set cfs2h-c netns $CLI
ip -n $SRV addr add $SRV_IP/24 dev cfs2h-s; ip -n $CLI addr add $CLI_IP/24 dev cfs2h-c
for ns in $SRV $CLI; do ip -n $ns link set lo up; done
ip -n $SRV link set cfs2h-s up; ip -n $CLI link set cfs2h-c up
if [ -n "${DELAY_MS:-}" ]; then
    ip netns exec $SRV tc qdisc add dev cfs2h-s root netem delay "${DELAY_MS}ms"
    ip netns exec $CLI tc qdisc add dev cfs2h-c root netem delay "${DELAY_MS}ms"
fi

# CitronFS: meta-server and data server on the server host, two tcp mounts
# on the client host.
"$BIN" key new "$D/cluster.key" >/dev/null
in_srv "$BIN" meta-server --listen $SRV_IP:7070 --state-dir "$D/state" --key-file "$D/cluster.key" \
    >"$D/meta.out" 2>"$D/meta.log" &
sleep 1
in_srv "$BIN" data-server --listen $SRV_IP:0 --meta $SRV_IP:7070 --capacity 4GiB --ephemeral \
    --key-file "$D/cluster.key" >"$D/data.out" 2>"$D/data.log" &
sleep 1
for m in cfsA cfsB; do
    in_cli "$BIN" mount "$D/$m" --meta $SRV_IP:7070 --key-file "$D/cluster.key" --transport tcp \
        --log-file "$D/$m.log" >/dev/null
done
PEERS=(--peer "citronfs-2hosts=$D/cfsA,$D/cfsB")

# MooseFS the same way: master and chunkserver on the server host.
if [ $MFS = 1 ]; then
    B=$D/mfs
    mkdir -p $B/etc $B/master $B/cs $B/chunks
    cat >$B/etc/mfsmaster.cfg <<EOC
WORKING_USER = mfs
WORKING_GROUP = mfs
DATA_PATH = $B/master
EXPORTS_FILENAME = $B/etc/mfsexports.cfg
TOPOLOGY_FILENAME = $B/etc/mfstopology.cfg
MATOML_LISTEN_HOST = $SRV_IP
MATOCS_LISTEN_HOST = $SRV_IP
MATOCL_LISTEN_HOST = $SRV_IP
EOC
    printf '*\t/\trw,alldirs,admin,maproot=0:0\n' >$B/etc/mfsexports.cfg
    : >$B/etc/mfstopology.cfg
    cat >$B/etc/mfschunkserver.cfg <<EOC
WORKING_USER = mfs
WORKING_GROUP = mfs
DATA_PATH = $B/cs
HDD_CONF_FILENAME = $B/etc/mfshdd.cfg
BIND_HOST = $SRV_IP
MASTER_HOST = $SRV_IP
CSSERV_LISTEN_HOST = $SRV_IP
EOC
    echo "$B/chunks" >$B/etc/mfshdd.cfg
    cp /var/lib/mfs/metadata.mfs.empty $B/master/metadata.mfs
    chmod 755 "$D"
    chown -R mfs:mfs $B/master $B/cs $B/chunks
    in_srv mfsmaster -c $B/etc/mfsmaster.cfg start >"$D/mfs.log" 2>&1
    in_srv mfschunkserver -c $B/etc/mfschunkserver.cfg start >>"$D/mfs.log" 2>&1
    for _ in $(seq 60); do
        in_srv mfscli -H $SRV_IP -SCS 2>/dev/null | grep -q "$SRV_IP.*9422" && break
        sleep 0.5
    done
    for m in mfsA mfsB; do in_cli mfsmount -H $SRV_IP "$D/$m" >>"$D/mfs.log" 2>&1; done
    in_cli mfssetgoal 1 "$D/mfsA" >>"$D/mfs.log" 2>&1 || { echo "MooseFS did not come up:"; tail -5 "$D/mfs.log"; exit 1; }
    PEERS+=(--peer "moosefs-2hosts=$D/mfsA,$D/mfsB")
else
    echo "MooseFS is not installed (../shared/peers/setup-moosefs.sh installs it): CitronFS only"
fi

echo "servers on core $SRV_CORE ($SRV_IP), clients on core $CLI_CORE ($CLI_IP)${DELAY_MS:+, ${DELAY_MS} ms each way}"
in_cli "$BIN" bench "$BENCH" "$@" "${PEERS[@]}" --out "${OUT:-bench-out/two-hosts}"
