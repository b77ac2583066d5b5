//! A mount starved of CPU keeps its lease: on a node
//! whose cores are kept busy by programs at a better priority than the
//! file-system daemon, lease renewal must not wait for a core, or the mount
//! is fenced and answers EIO although every server is alive.
//!
//! The servers stand for other, unloaded hosts: they and the busy loops run
//! at nice −20 (threads inherit the nice value of the thread that starts
//! them), the mount's daemon at nice 19. This test has a binary of its own
//! because its busy loops would slow every other test beside it.

use std::os::unix::process::CommandExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use citronfs_tests::probe::Probe;
use citronfs_tests::{ProcessMount, TestCluster, TEST_LEASE};

const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");
const MOUNT_WORKER: &str = env!("CARGO_BIN_EXE_mount-worker");

/// The best and the worst nice values.
const BEST_NICE: libc::c_int = -20;
const WORST_NICE: libc::c_int = 19;

/// Sets the calling thread's nice value (Linux schedules threads; threads
/// and processes it starts afterwards inherit it).
fn set_own_nice(nice: libc::c_int) {
    // SAFETY: gettid has no preconditions; setpriority only changes the
    // calling thread's nice value.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, nice) };
    assert_eq!(r, 0, "setpriority({nice}): {}", std::io::Error::last_os_error());
}

/// A mount of `cluster` served by a process of its own at `nice`.
fn process_mount_at(cluster: &TestCluster, nice: libc::c_int) -> ProcessMount {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(MOUNT_WORKER);
    cmd.arg(cluster.meta.local_addr().to_string()).arg(dir.path());
    // SAFETY: the closure runs in the forked child before exec and only
    // makes one async-signal-safe system call.
    unsafe {
        cmd.pre_exec(move || match libc::setpriority(libc::PRIO_PROCESS, 0, nice) {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        });
    }
    ProcessMount::start(cmd, dir, "mounted")
}

/// Busy loops at the calling thread's nice value, two per core, until
/// dropped.
struct Hogs {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Hogs {
    fn start() -> Self {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..2 * cores)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[test]
fn a_mount_starved_of_cpu_keeps_its_lease_and_its_locks() {
    set_own_nice(BEST_NICE);
    let cluster = TestCluster::start(1, 64 << 20, 1 << 20);
    let starved = process_mount_at(&cluster, WORST_NICE);
    let other = cluster.mount();
    std::fs::write(other.path("f"), b"0000").unwrap();
    let mut p = Probe::spawn(PROBE);
    let pf = p.open(&starved.path("f"));
    let mut q = Probe::spawn(PROBE);
    let qf = q.open(&other.path("f"));
    assert_eq!(p.ask(&format!("setlk {pf} w 0 4")), "ok");

    // Four leases of starvation: a renewal that waits for a core the busy
    // loops hold lets the lease lapse (a client fences itself after 3/4 of
    // it without renewal).
    let starved_for = 4 * TEST_LEASE;
    let hogs = Hogs::start();
    let started = Instant::now();
    while started.elapsed() < starved_for {
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(hogs);

    // The mount kept its lease: its lock still holds, and the descriptor it
    // had open still writes (a fenced mount answers EIO on old handles).
    assert_eq!(
        q.ask(&format!("getlk {qf} w 0 4")),
        format!("w 0 4 {}", p.pid),
        "the starved mount lost its lock"
    );
    assert_eq!(p.ask(&format!("write {pf} 0 pppp")), "ok", "the starved mount was fenced");
    assert_eq!(std::fs::read(other.path("f")).unwrap(), b"pppp");
    assert_eq!(p.ask(&format!("setlk {pf} u 0 4")), "ok");
    p.kill();
    q.kill();
}
