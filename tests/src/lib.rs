//! Harness for CitronFS's integration tests: fabrics on either backend, and
//! helpers to run worker processes.
//!
//! The workers are binaries of this crate (`src/bin/`), so a test can run the
//! same code in several processes, which is how clients on several nodes are
//! modelled on one machine.

pub mod citron_stress;
pub mod lock_stress;

use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use citron_lock::rdma::{FabricAddr, RegionId, RegionMemory, RegionTable, ShmHost, TcpHost};

/// The backends every conformance and stress test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Shm,
    Tcp,
}

pub const BACKENDS: [Backend; 2] = [Backend::Shm, Backend::Tcp];

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
}

impl TestFabric {
    pub fn new(backend: Backend, region_len: u64) -> Self {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        match backend {
            Backend::Shm => {
                let name = format!("test-{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
                let host = ShmHost::create(&name).expect("create shm fabric");
                host.add_region(TEST_REGION, region_len).expect("add region");
                Self {
                    addr: FabricAddr::Shm(name),
                    backend,
                    regions: host.regions().clone(),
                    shm: Some(host),
                    tcp: None,
                }
            }
            Backend::Tcp => {
                let regions = Arc::new(RegionTable::new());
                regions
                    .insert(RegionMemory::anonymous(TEST_REGION, region_len).expect("map"))
                    .expect("insert");
                let host =
                    TcpHost::spawn("127.0.0.1:0".parse().unwrap(), regions.clone()).expect("spawn host");
                Self {
                    addr: FabricAddr::Tcp(host.local_addr()),
                    backend,
                    regions,
                    shm: None,
                    tcp: Some(host),
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

/// A real FUSE mount of a cluster, served by this process: one client (one
/// "node") per mount. Unmounted when dropped.
pub struct TestMount {
    pub dir: tempfile::TempDir,
    session: Option<citronfs_mount::BackgroundSession>,
}

impl TestMount {
    /// Mounts the cluster of `meta` at a fresh temporary directory.
    pub fn new(meta: std::net::SocketAddr) -> Self {
        Self::with_transport(meta, citronfs_core::client::Transport::Auto)
    }

    /// As [`TestMount::new`], choosing how the client reaches server memory.
    pub fn with_transport(meta: std::net::SocketAddr, transport: citronfs_core::client::Transport) -> Self {
        let mut config = citronfs_core::client::ClientConfig::new(meta);
        config.transport = transport;
        config.timeout = std::time::Duration::from_secs(3);
        let client = citronfs_core::client::FsClient::connect(config).expect("join the cluster");
        let fs = citronfs_mount::CitronFuse::new(client, citronfs_mount::MountOptions::default());
        let dir = tempfile::tempdir().expect("temp dir");
        let session = citronfs_mount::spawn_mount(fs, dir.path())
            .expect("mount (needs root, /dev/fuse and fusermount3 from Debian's fuse3)");
        Self { dir, session: Some(session) }
    }

    pub fn path(&self, rel: &str) -> std::path::PathBuf {
        self.dir.path().join(rel)
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

/// A meta-server and data servers in this process, on loopback. Their
/// memory is also published as shm fabrics, so clients on this host (the
/// tests' mounts) use the shm backend; clients told to use tcp use the NICs.
pub struct TestCluster {
    pub meta: citronfs_meta_server::MetaServer,
    pub data: Vec<citronfs_meta_server::DataServer>,
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
        cfg.slot_bytes = 4 << 20;
        cfg.lease = std::time::Duration::from_secs(2);
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let unique = format!("{}-{}", std::process::id(), SEQ.fetch_add(1, Ordering::Relaxed));
        cfg.shm = Some(format!("meta-{unique}"));
        let meta = citronfs_meta_server::MetaServer::start(cfg).expect("meta-server");
        let data = (0..data_servers)
            .map(|i| {
                let shm = format!("data-{unique}-{i}");
                citronfs_meta_server::DataServer::start(
                    std::net::SocketAddr::new(ip, 0),
                    meta.local_addr(),
                    capacity,
                    Some(&shm),
                )
                .expect("data server")
            })
            .collect();
        Self { meta, data }
    }

    /// A mount on the shm backend (servers and mount share this host).
    pub fn mount(&self) -> TestMount {
        TestMount::new(self.meta.local_addr())
    }

    /// A mount that reaches server memory only through the tcp NICs.
    pub fn mount_tcp(&self) -> TestMount {
        TestMount::with_transport(self.meta.local_addr(), citronfs_core::client::Transport::Tcp)
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
