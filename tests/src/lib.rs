//! Harness for CitronFS's integration tests: fabrics on either backend, and
//! helpers to run worker processes.
//!
//! The workers are binaries of this crate (`src/bin/`), so a test can run the
//! same code in several processes, which is how clients on several nodes are
//! modelled on one machine.

pub mod alock_oracle;
pub mod args;
pub mod citron_stress;
pub mod coherence;
pub mod coherence_checker;
pub mod deadlock_oracle;
pub mod lock_calls;
pub mod lock_stress;
pub mod posix_stress;
pub mod probe;
pub mod probe_ops;
pub mod range_stress;
pub mod sqlite;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use citron_lock::rdma::{
    FabricAddr, IbDevice, IbFabric, IbHost, RegionId, RegionMemory, RegionTable, RemoteAtomicity, ShmHost,
    TcpHost,
};

/// The backends every conformance and stress test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Shm,
    Tcp,
    /// RC queue pairs on the RDMA device named by `CITRONFS_IB_DEVICE`
    /// (the tests run on it only when the variable is set).
    Ib,
}

/// The backends every conformance and stress test runs on: `for backend in
/// BACKENDS`. Always shm and tcp; ib too when `CITRONFS_IB_DEVICE` names
/// an RDMA device (and the build has `--features citron-lock/rdma`),
/// otherwise a line on stderr says that the ib runs were skipped.
pub const BACKENDS: Backends = Backends;

/// The set [`BACKENDS`] iterates.
#[derive(Clone, Copy, Debug)]
pub struct Backends;

impl IntoIterator for Backends {
    type Item = Backend;
    type IntoIter = std::vec::IntoIter<Backend>;
    fn into_iter(self) -> Self::IntoIter {
        let mut v = vec![Backend::Shm, Backend::Tcp];
        match ib_device() {
            Some(_) => v.push(Backend::Ib),
            None => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    eprintln!(
                        "ib backend: skipped (no RDMA device named; set {}=DEVICE, e.g. mlx5_0 or rxe0, \
                         and build with --features citron-lock/rdma to run these tests on it)",
                        citron_lock::rdma::ib::DEVICE_ENV
                    )
                });
            }
        }
        v.into_iter()
    }
}

/// The RDMA device the device-dependent tests use, if one is named.
///
/// # Panics
/// If the variable is set but does not parse: a typo must not turn into a
/// silent skip.
pub fn ib_device() -> Option<IbDevice> {
    IbDevice::from_env().map(|r| r.unwrap_or_else(|e| panic!("{}: {e}", citron_lock::rdma::ib::DEVICE_ENV)))
}

/// The region every test fabric registers.
pub const TEST_REGION: RegionId = RegionId(1);

/// A fabric served by this process: a shm host or a tcp software NIC with one
/// zeroed region of the requested size. Dropping it tears the fabric down.
pub struct TestFabric {
    pub addr: FabricAddr,
    pub backend: Backend,
    pub regions: Arc<RegionTable>,
    shm: Option<ShmHost>,
    tcp: Option<TcpHost>,
    _ib: Option<IbHost>,
}

impl TestFabric {
    pub fn new(backend: Backend, region_len: u64) -> Self {
        Self::with_atomicity(backend, region_len, RemoteAtomicity::WithHost)
    }

    /// A fabric whose region executes remote RMW verbs with `atomicity`
    /// ([`RemoteAtomicity::NicOnly`]: the verbs layer's test mode in which
    /// they are not atomic with the host's own CPU atomics).
    pub fn with_atomicity(backend: Backend, region_len: u64, atomicity: RemoteAtomicity) -> Self {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        match backend {
            Backend::Shm => {
                let name = format!("test-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
                let host = ShmHost::create(&name).expect("create shm fabric");
                host.add_region_with(TEST_REGION, region_len, atomicity).expect("add region");
                Self {
                    addr: FabricAddr::Shm(name),
                    backend,
                    regions: host.regions().clone(),
                    shm: Some(host),
                    tcp: None,
                    _ib: None,
                }
            }
            Backend::Tcp => {
                let regions = Arc::new(RegionTable::new());
                regions
                    .insert(
                        RegionMemory::anonymous(TEST_REGION, region_len)
                            .expect("map")
                            .with_remote_atomicity(atomicity),
                    )
                    .expect("insert");
                let host =
                    TcpHost::spawn("127.0.0.1:0".parse().unwrap(), regions.clone()).expect("spawn host");
                Self {
                    addr: FabricAddr::Tcp(host.local_addr()),
                    backend,
                    regions,
                    shm: None,
                    tcp: Some(host),
                    _ib: None,
                }
            }
            Backend::Ib => {
                let device = ib_device().expect("Backend::Ib is only listed when a device is named");
                let regions = Arc::new(RegionTable::new());
                regions
                    .insert(
                        RegionMemory::anonymous(TEST_REGION, region_len)
                            .expect("map")
                            .with_remote_atomicity(atomicity),
                    )
                    .expect("insert");
                let host = IbHost::spawn(
                    &device,
                    "127.0.0.1:0".parse().unwrap(),
                    regions.clone(),
                    citron_rpc::auth::Authority::Open,
                )
                .unwrap_or_else(|e| panic!("cannot serve a test region on RDMA device {device}: {e}"));
                Self {
                    addr: FabricAddr::Ib(IbFabric { device, host: host.local_addr() }),
                    backend,
                    regions,
                    shm: None,
                    tcp: None,
                    _ib: Some(host),
                }
            }
        }
    }

    pub fn tcp_host(&mut self) -> Option<&mut TcpHost> {
        self.tcp.as_mut()
    }

    pub fn shm_host(&self) -> Option<&ShmHost> {
        self.shm.as_ref()
    }

    /// The test region as the host's own threads see it.
    pub fn region(&self) -> Arc<RegionMemory> {
        self.regions.get(TEST_REGION).expect("the test region")
    }
}

/// Starts a worker binary of this crate with `args`; its output is inherited
/// so a failing worker explains itself in the test log.
pub fn spawn_worker(exe: &str, args: &[String]) -> Child {
    Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {exe}: {e}"))
}

/// Waits for every worker and fails the test if any exited unsuccessfully.
pub fn wait_all(children: Vec<Child>) {
    for mut c in children {
        let status = c.wait().expect("wait for worker");
        assert!(status.success(), "worker failed: {status}");
    }
}

/// Names the environment variable that runs the tests of the default
/// (strict) mount on coherent caching mounts instead: its value is the
/// grant TTL in seconds (`CITRONFS_TEST_CACHE_TTL=1 cargo test -p
/// citronfs-tests --test mount_posix`). Unset or 0: strict mounts.
pub const CACHE_TTL_VAR: &str = "CITRONFS_TEST_CACHE_TTL";

/// The options of [`TestCluster::mount`] and [`TestCluster::mount_tcp`]:
/// the default mount's, or coherent caching with the TTL that
/// [`CACHE_TTL_VAR`] names, so that every POSIX test runs in both modes.
pub fn mount_options() -> citronfs_mount::MountOptions {
    let ttl = std::env::var(CACHE_TTL_VAR).ok().map(|v| {
        let secs: f64 = v.parse().unwrap_or_else(|_| panic!("{CACHE_TTL_VAR}={v:?} is not seconds"));
        std::time::Duration::from_secs_f64(secs)
    });
    citronfs_mount::MountOptions { cache_ttl: ttl.unwrap_or_default(), ..Default::default() }
}

/// A real FUSE mount of a cluster, served by this process: one client (one
/// "node") per mount. Unmounted when dropped.
pub struct TestMount {
    pub dir: tempfile::TempDir,
    session: Option<citronfs_mount::BackgroundSession>,
    /// The mount's client (its counters: verbs, metadata calls by kind).
    pub client: Arc<citronfs_core::client::FsClient>,
    /// The mount's FUSE requests by kind.
    pub requests: citronfs_mount::FuseCounters,
    /// The mount's invalidation thread (coherent caching).
    pub invalidations: citronfs_mount::InvalidationControl,
}

impl TestMount {
    /// Mounts the cluster of `meta` at a fresh temporary directory.
    pub fn new(meta: std::net::SocketAddr) -> Self {
        Self::with_transport(meta, citronfs_core::client::Transport::Auto)
    }

    /// As [`TestMount::new`], choosing how the client reaches server memory.
    pub fn with_transport(meta: std::net::SocketAddr, transport: citronfs_core::client::Transport) -> Self {
        Self::with_options(meta, transport, citronfs_mount::MountOptions::default())
    }

    /// As [`TestMount::with_transport`], with mount options (e.g. few FUSE
    /// worker threads).
    pub fn with_options(
        meta: std::net::SocketAddr,
        transport: citronfs_core::client::Transport,
        options: citronfs_mount::MountOptions,
    ) -> Self {
        let mut config = citronfs_core::client::ClientConfig::new(meta);
        config.transport = transport;
        Self::with_config_and_options(config, options)
    }

    /// A mount `added_rtt` farther from the servers than the others: every
    /// round trip of its client (tcp only) takes that much longer.
    pub fn far(meta: std::net::SocketAddr, added_rtt: std::time::Duration) -> Self {
        let mut config = citronfs_core::client::ClientConfig::new(meta);
        config.transport = citronfs_core::client::Transport::Tcp;
        config.added_rtt = added_rtt;
        Self::with_config(config)
    }

    /// A mount of a client made with `config` (a 3 s timeout if it has the
    /// default).
    pub fn with_config(config: citronfs_core::client::ClientConfig) -> Self {
        Self::with_config_and_options(config, citronfs_mount::MountOptions::default())
    }

    /// A mount of a client made with `config`, with mount `options`.
    pub fn with_config_and_options(
        mut config: citronfs_core::client::ClientConfig,
        options: citronfs_mount::MountOptions,
    ) -> Self {
        if config.timeout == citronfs_core::client::ClientConfig::new(config.meta).timeout {
            config.timeout = std::time::Duration::from_secs(3);
        }
        let client = citronfs_core::client::FsClient::connect(config).expect("join the cluster");
        let fs = citronfs_mount::CitronFuse::new(client, options);
        let (client, requests, invalidations) = (fs.client(), fs.requests(), fs.invalidations());
        let dir = tempfile::tempdir().expect("temp dir");
        let session = citronfs_mount::spawn_mount(fs, dir.path())
            .expect("mount (needs root, /dev/fuse and fusermount3 from Debian's fuse3)");
        Self { dir, session: Some(session), client, requests, invalidations }
    }

    pub fn path(&self, rel: &str) -> std::path::PathBuf {
        self.dir.path().join(rel)
    }

    /// Guards against a hang: if the returned watchdog is still alive
    /// after `after`, it aborts this mount's FUSE connection, so calls
    /// blocked on the mount fail (ENOTCONN) and the test fails instead of
    /// hanging. Only a hang ever trips it.
    pub fn watchdog(&self, after: std::time::Duration) -> Watchdog {
        Watchdog::arm(self.dir.path(), after)
    }
}

/// See [`TestMount::watchdog`]; disarmed when dropped.
pub struct Watchdog {
    disarm: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    fn arm(mountpoint: &std::path::Path, after: std::time::Duration) -> Self {
        use std::os::unix::fs::MetadataExt;
        // The FUSE connection's number is the minor of the mount's device
        // (taken now, while the mount answers).
        let dev = std::fs::metadata(mountpoint).expect("stat the mount point").dev();
        let minor = libc::minor(dev);
        let (disarm, armed) = std::sync::mpsc::channel::<()>();
        let mountpoint = mountpoint.to_path_buf();
        let thread = std::thread::spawn(move || {
            if armed.recv_timeout(after) != Err(std::sync::mpsc::RecvTimeoutError::Timeout) {
                return;
            }
            eprintln!("watchdog: {} hung for {after:?}; aborting its FUSE connection", mountpoint.display());
            let connections = std::path::Path::new("/sys/fs/fuse/connections");
            if !connections.join(minor.to_string()).exists() {
                let _ = Command::new("mount").args(["-t", "fusectl", "none"]).arg(connections).output();
            }
            let _ = std::fs::write(connections.join(minor.to_string()).join("abort"), b"1");
        });
        Self { disarm: Some(disarm), thread: Some(thread) }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.disarm.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for TestMount {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            if let Err(e) = s.umount_and_join() {
                eprintln!("unmount of {} failed: {e}", self.dir.path().display());
            }
        }
    }
}

/// The client lease of test clusters: short, so failure tests are quick.
pub const TEST_LEASE: std::time::Duration = std::time::Duration::from_secs(2);

/// A meta-server and data servers in this process, on loopback. Their
/// memory is also published as shm fabrics, so clients on this host (the
/// tests' mounts) use the shm backend; clients told to use tcp use the NICs.
pub struct TestCluster {
    pub meta: citronfs_meta_server::MetaServer,
    pub data: Vec<citronfs_meta_server::DataServer>,
    /// The cluster's keys, if it has any.
    pub keyring: Option<std::sync::Arc<citron_rpc::auth::Keyring>>,
}

impl TestCluster {
    pub fn start(data_servers: usize, capacity: u64, chunk_size: u64) -> Self {
        Self::start_on("127.0.0.1".parse().unwrap(), data_servers, capacity, chunk_size)
    }

    /// A cluster whose servers listen on `ip` (e.g. a veth address that
    /// another network namespace reaches).
    pub fn start_on(ip: std::net::IpAddr, data_servers: usize, capacity: u64, chunk_size: u64) -> Self {
        let mut cfg = citronfs_meta_server::MetaServerConfig::new(std::net::SocketAddr::new(ip, 0));
        cfg.chunk_size = chunk_size;
        cfg.lease = TEST_LEASE;
        Self::start_with(cfg, data_servers, capacity)
    }

    /// The test defaults (1 MiB chunks, a 2 s client lease) with the
    /// cluster's lock choice (`--range-lock`, `--inode-lock`).
    pub fn with_locks(choice: citronfs_core::locks::area::LockChoice) -> Self {
        let mut cfg = citronfs_meta_server::MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
        cfg.chunk_size = 1 << 20;
        cfg.lease = TEST_LEASE;
        cfg.lock_choice = choice;
        Self::start_with(cfg, 1, 64 << 20)
    }

    /// A cluster from `cfg` (its listen address, chunk size, lease and lock
    /// choice are kept), with `data_servers` of `capacity` each, all also
    /// published as shm fabrics.
    pub fn start_with(
        mut cfg: citronfs_meta_server::MetaServerConfig,
        data_servers: usize,
        capacity: u64,
    ) -> Self {
        cfg.slot_bytes = 4 << 20;
        cfg.lock_bytes = 16 << 20;
        Self::start_sized(cfg, data_servers, capacity)
    }

    /// As [`TestCluster::start_with`], keeping `cfg`'s attribute-slot and
    /// lock memory sizes.
    pub fn start_sized(
        mut cfg: citronfs_meta_server::MetaServerConfig,
        data_servers: usize,
        capacity: u64,
    ) -> Self {
        let ip = cfg.listen.ip();
        let keyring = cfg.keyring.clone();
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let unique = format!("{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        cfg.shm = Some(format!("meta-{unique}"));
        let meta = citronfs_meta_server::MetaServer::start(cfg).expect("meta-server");
        let data = (0..data_servers)
            .map(|i| {
                let shm = format!("data-{unique}-{i}");
                citronfs_meta_server::DataServer::start_keyed(
                    std::net::SocketAddr::new(ip, 0),
                    meta.local_addr(),
                    capacity,
                    Some(&shm),
                    keyring.clone(),
                )
                .expect("data server")
            })
            .collect();
        Self { meta, data, keyring }
    }

    /// A cluster with keys (on loopback, the test defaults otherwise).
    pub fn keyed(keyring: std::sync::Arc<citron_rpc::auth::Keyring>, data_servers: usize) -> Self {
        let mut cfg = citronfs_meta_server::MetaServerConfig::new("127.0.0.1:0".parse().unwrap());
        cfg.chunk_size = 1 << 20;
        cfg.lease = TEST_LEASE;
        cfg.keyring = Some(keyring);
        Self::start_with(cfg, data_servers, 64 << 20)
    }

    /// The client configuration of a mount of this cluster that proves
    /// `key` (none: the cluster's first key, if it has keys) over `transport`.
    pub fn client_config(
        &self,
        key: Option<citron_rpc::auth::Key>,
        transport: citronfs_core::client::Transport,
    ) -> citronfs_core::client::ClientConfig {
        let mut config = citronfs_core::client::ClientConfig::new(self.meta.local_addr());
        config.transport = transport;
        config.key = key.or_else(|| self.keyring.as_ref().map(|r| r.first().clone()));
        config
    }

    /// [`Self::client_config`] for a client whose answered creates and
    /// unlinks, and releases, wait until a call sends them: none goes on
    /// its own at a linger's end, however slowly the test runs.
    pub fn holding_config(
        &self,
        transport: citronfs_core::client::Transport,
    ) -> citronfs_core::client::ClientConfig {
        let mut config = self.client_config(None, transport);
        config.late_linger = std::time::Duration::from_secs(3600);
        config.release_linger = std::time::Duration::from_secs(3600);
        config
    }

    /// A mount on the shm backend (servers and mount share this host), in
    /// the mode [`mount_options`] chooses.
    pub fn mount(&self) -> TestMount {
        self.mount_with(mount_options())
    }

    /// A mount on the shm backend with mount `options` (caching, threads).
    pub fn mount_with(&self, options: citronfs_mount::MountOptions) -> TestMount {
        let config = self.client_config(None, citronfs_core::client::Transport::Auto);
        TestMount::with_config_and_options(config, options)
    }

    /// A mount that reaches server memory only through the tcp NICs, in
    /// the mode [`mount_options`] chooses.
    pub fn mount_tcp(&self) -> TestMount {
        let config = self.client_config(None, citronfs_core::client::Transport::Tcp);
        TestMount::with_config_and_options(config, mount_options())
    }

    /// A tcp mount `added_rtt` farther away than the others ([`TestMount::far`]).
    pub fn mount_far(&self, added_rtt: std::time::Duration) -> TestMount {
        TestMount::far(self.meta.local_addr(), added_rtt)
    }
}

/// A worker started with its stdout piped, read line by line.
pub struct Watched {
    pub child: Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl Watched {
    pub fn spawn(exe: &str, args: &[String]) -> Self {
        let mut child = Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {exe}: {e}"));
        let lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().expect("piped")));
        Self { child, lines }
    }

    /// Blocks until the worker prints `line`; panics if it exits first.
    pub fn wait_for(&mut self, line: &str) {
        for l in self.lines.by_ref() {
            if l.expect("worker output") == line {
                return;
            }
        }
        panic!("worker exited before printing {line:?}");
    }

    /// SIGKILL, as a crash.
    pub fn kill(mut self) {
        self.child.kill().expect("kill worker");
        let _ = self.child.wait();
    }
}

/// A network namespace with a veth link to this one: a second host for tests
/// that need traffic to cross a network. Removed on drop.
pub struct RemoteHost {
    pub ns: String,
    host_if: String,
    /// This namespace's end of the link (where servers listen).
    pub host_ip: std::net::IpAddr,
}

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

impl RemoteHost {
    /// `tag` keeps hosts of different tests in one process apart.
    pub fn create(tag: u32) -> Self {
        let id = (std::process::id() * 7 + tag) % 50_000;
        let (ns, host_if, ns_if) = (format!("citron{id}"), format!("vch{id}"), format!("vcn{id}"));
        let octet = 1 + id % 250;
        let host_ip = format!("10.213.{octet}.1");
        let ns_ip = format!("10.213.{octet}.2");
        let _ = Command::new("ip").args(["netns", "del", &ns]).output();
        let _ = Command::new("ip").args(["link", "del", &host_if]).output();
        sh(&["ip", "netns", "add", &ns]);
        let host = Self { ns: ns.clone(), host_if: host_if.clone(), host_ip: host_ip.parse().unwrap() };
        sh(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", &ns_if]);
        sh(&["ip", "link", "set", &ns_if, "netns", &ns]);
        sh(&["ip", "addr", "add", &format!("{host_ip}/24"), "dev", &host_if]);
        sh(&["ip", "link", "set", &host_if, "up"]);
        sh(&["ip", "-n", &ns, "addr", "add", &format!("{ns_ip}/24"), "dev", &ns_if]);
        sh(&["ip", "-n", &ns, "link", "set", &ns_if, "up"]);
        sh(&["ip", "-n", &ns, "link", "set", "lo", "up"]);
        host
    }

    /// A command that runs in the other host's network namespace (only the
    /// network namespace changes, so its FUSE mounts are visible here).
    pub fn command(&self, exe: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/var/run/netns/{}", self.ns)).arg(exe);
        c
    }
}

impl Drop for RemoteHost {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "del", &self.host_if]).output();
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

/// A mount served by a process of its own (a client node that can be
/// killed or stopped): `mount-worker`, or `citronfs mount`. Unmounted (lazily,
/// if its daemon is gone) and reaped on drop, never waiting forever.
pub struct ProcessMount {
    pub child: Child,
    pub dir: tempfile::TempDir,
}

impl ProcessMount {
    /// Starts `command` (which must mount at `dir` and print a line with
    /// `ready` on stdout once it serves) and waits for it.
    pub fn start(mut command: Command, dir: tempfile::TempDir, ready: &str) -> Self {
        let mut child = command.stdout(Stdio::piped()).spawn().expect("start the mount process");
        let stdout = child.stdout.take().expect("piped");
        let line = std::io::BufRead::lines(std::io::BufReader::new(stdout)).next().and_then(Result::ok);
        let m = Self { child, dir };
        let line = line.unwrap_or_default();
        assert!(line.contains(ready), "mount process failed to mount: {line:?}");
        m
    }

    pub fn path(&self, rel: &str) -> std::path::PathBuf {
        self.dir.path().join(rel)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: a signal to our own child.
        let r = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(r, 0, "kill {} {sig}", self.pid());
    }
}

impl Drop for ProcessMount {
    fn drop(&mut self) {
        // SIGCONT first: a stopped daemon can neither unmount nor die cleanly.
        // SAFETY: signals to our own child.
        unsafe {
            libc::kill(self.pid(), libc::SIGCONT);
        }
        let _ = Command::new("fusermount3").arg("-u").arg(self.dir.path()).output();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A daemon that died leaves its mount point dead: detach it.
        let _ = Command::new("fusermount3").arg("-uz").arg(self.dir.path()).output();
    }
}
