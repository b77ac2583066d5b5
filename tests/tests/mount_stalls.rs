//! A mount frozen while it holds a lock of the write path (no
//! takeover before a fence): its daemon stops (SIGSTOP, the whole process, lease renewals too) for
//! 1, 1.8, 3 or 10 s holding a byte-range lock (Citron) right after its
//! acquisition or at the last moment before its data verbs go out (after
//! its check of the hold), the inode mutex exclusive (ShiftLock, a truncate), or the
//! attribute ALock (a write that extends the file); meanwhile another
//! client writes the same bytes; then the mount resumes (SIGCONT).
//!
//! The times that decide the outcome, with the test cluster's parameters: a
//! client renews its lease every lease/4 = 0.5 s and the meta-server fences
//! it (and revokes its verbs at every NIC) 2 s after it last heard from it,
//! checked every 0.5 s: 1.5 to 2.5 s after a stop. The lock lease H is 1 s:
//! a holder posts data verbs only within H of its acquisition (checked
//! before each batch). A waiter takes a silent holder over only after the
//! algorithm's own threshold plus the fence delay (client lease + reaper
//! tick + margin = 2 + 0.5 + 0.5 = 3 s, `fence_delay_for`): Citron and the
//! ALock after 1.5 + 3 = 4.5 s without progress, ShiftLock after 3 + 3 =
//! 6 s. (Before the fence delay they took over after 1.5 and 3 s, inside
//! the fence's range: the lease ordering.) So:
//!
//! | stop  | fenced before it resumes? | the other client                | the frozen call          |
//! |-------|---------------------------|---------------------------------|--------------------------|
//! | 1 s   | no (under 1.5 s)          | waits; writes after it          | ok (after its check)     |
//! | 1.8 s | maybe (1.5 to 2.5 s)      | waits for it, or for its fence  | ok, or EIO if fenced     |
//! | 3 s   | yes                       | takes over at 4.5 / 6 s, writes | EIO                      |
//! | 10 s  | yes                       | takes over, writes              | EIO                      |
//!
//! * **1 s**: nothing lapses (at most 1.5 s without a renewal, under the
//!   2 s lease; 1 s without progress). Stopped after its check of the
//!   hold, the frozen one finishes normally and keeps working through its
//!   open files; the other's write comes after its own. (Stopped before
//!   the check, its hold would be past H = 1 s on resuming: the 1.8 s
//!   `Range` case.)
//! * **1.8 s** (the window): past the old takeover, maybe not yet fenced.
//!   Stopped after its check of the hold, with only the verbs left, the
//!   mount's bytes land before the other's write or not at all; stopped
//!   before the check, the resumed mount finds its hold past H, lets it go
//!   and writes again under a fresh acquisition (both whole, either order).
//! * **3 and 10 s**: the frozen mount is fenced before it resumes; the other
//!   client takes the lock over (or finds it given back) and writes; what
//!   the frozen mount still had in flight fails with EIO at the servers,
//!   and so does every call through its old open files, until it opens
//!   them again.
//!
//! (The ALock case needed the writer to give its range back before it
//! waits for the ALock: see `FsClient::write_under`.)
//!
//! Three checks each time: no byte (nor size change) of the frozen mount
//! lands after the other's write; the file's lock words are idle afterwards
//! (the Citron tree read word by word, and the inode mutex, the ALock and
//! the ranges taken again promptly); and the EIO rule above.
//!
//! Over tcp, in a keyed cluster (its NICs enforce per-client grants, which
//! a fence revokes), and without keys for the range lock: there the NICs
//! enforce no grants but still admit and fence the session a registered
//! client names (before they did not, and the 10 s range case saw the
//! frozen mount's write land after the other's). And a mount
//! on the shm backend maps server memory into its own address space, where
//! no server can revoke a stalled process's stores (a documented
//! limitation, see the reclamation module of the meta-server).

use std::os::unix::fs::MetadataExt;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use citron_lock::citron::geometry::SegmentedTree;
use citron_lock::citron::tree::NodeIndex;
use citron_lock::citron::word::Internal;
use citron_lock::dslr::DslrWord;
use citron_rpc::auth::Keyring;
use citronfs_core::client::stop_hook::STOP_HOLDING_VAR;
use citronfs_core::client::{FsClient, Transport};
use citronfs_core::types::{Caller, Ino};
use citronfs_tests::probe::Probe;
use citronfs_tests::{ProcessMount, TestCluster, TEST_LEASE};

const PROBE: &str = env!("CARGO_BIN_EXE_lock-probe");
const MOUNT_WORKER: &str = env!("CARGO_BIN_EXE_mount-worker");
const ME: Caller = Caller { uid: 0, gid: 0, pid: 1 };
/// The bytes both clients write.
const PIECE: usize = 64 << 10;
/// Bytes within one internal node of a file's first tree (256 units of
/// 4 KiB; a leaf word holds 64), too many for two leaves: Citron (k = 2)
/// locks that node. A unit short of the node, so that FUSE passes the
/// frozen write on as one request whatever the alignment of the writer's
/// buffer (a 1 MiB one would span 257 pages, past `max_write`, and go as
/// two requests, whose second lands after the other's write legitimately).
const NODE_BYTES: usize = (1 << 20) - (4 << 10);
/// A file's first Citron tree covers 1024 units of 4 KiB: a write of all
/// of it locks the root, whose wait for its descendants repairs whatever a
/// fenced holder left (§3.10, Line 36).
const WHOLE_TREE: usize = 4 << 20;
/// Bound for things that take a lease or two: far beyond, for liveness only.
const LIVENESS: Duration = Duration::from_secs(60);

/// Which lock the frozen mount holds, and what it is doing.
#[derive(Clone, Copy, Debug)]
enum Held {
    /// Citron byte-range lock: writing PIECE bytes of `S` over the other's,
    /// stopped right after the acquisition.
    Range,
    /// The same, stopped at the last moment before the data verbs go out
    /// (after the write's check of its hold).
    RangeChecked,
    /// ShiftLock inode mutex exclusive: truncating the file to 0.
    Inode,
    /// Attribute ALock: an extending write of PIECE bytes of `S`.
    AttrLock,
}

impl Held {
    fn hook(self) -> &'static str {
        match self {
            Held::Range => "range",
            Held::RangeChecked => "range-checked",
            Held::Inode => "inode",
            Held::AttrLock => "alock",
        }
    }
}

fn client(c: &TestCluster) -> FsClient {
    let mut config = c.client_config(None, Transport::Tcp);
    config.timeout = Duration::from_secs(5);
    FsClient::connect(config).expect("join the cluster")
}

/// Whether the cluster has keys.
#[derive(Clone, Copy, Debug)]
enum Keys {
    /// Its NICs enforce per-client grants, and a fence revokes them.
    Cluster,
    /// Its NICs enforce no grants, but admit and fence the session each
    /// registered client names.
    Without,
}

/// A test cluster, and with keys the directory of its key file.
fn cluster(keys: Keys) -> (TestCluster, Option<tempfile::TempDir>) {
    match keys {
        Keys::Cluster => {
            let ring = std::sync::Arc::new(Keyring::generate("cluster").unwrap());
            let dir = tempfile::tempdir().unwrap();
            ring.save_new(&dir.path().join("key")).unwrap();
            (TestCluster::keyed(ring, 1), Some(dir))
        }
        Keys::Without => (TestCluster::start(1, 64 << 20, 1 << 20), None),
    }
}

/// A tcp mount in a process of its own that stops itself holding `held`.
fn frozen_mount(c: &TestCluster, key_dir: Option<&std::path::Path>, held: Held) -> ProcessMount {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = std::process::Command::new(MOUNT_WORKER);
    cmd.arg(c.meta.local_addr().to_string()).arg(dir.path()).arg("--tcp").env(STOP_HOLDING_VAR, held.hook());
    if let Some(k) = key_dir {
        cmd.arg("--key-file").arg(k.join("key"));
    }
    ProcessMount::start(cmd, dir, "mounted")
}

/// Waits until process `pid` is stopped (it stopped itself in the hook).
fn wait_stopped(pid: i32) {
    let deadline = Instant::now() + LIVENESS;
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
        // The state follows the command name in parentheses.
        let state = stat.rsplit(')').next().unwrap().trim_start().chars().next();
        if state == Some('T') {
            return;
        }
        assert!(Instant::now() < deadline, "the mount never reached its stop point ({stat})");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Every word of the file's Citron tree idle (leaves clear; internal nodes
/// unoccupied, every ticket served, every notification released; no
/// scale-up marks: the test stays inside the first tree) and its spillover
/// mutex too, read by the meta-server's CPU.
fn assert_tree_idle(c: &TestCluster, ino: Ino, what: &str) {
    let state = c.meta.citron_tree(ino).unwrap_or_else(|| panic!("{what}: the file has a Citron tree"));
    assert_eq!(state.geometry.segments.len(), 1, "{what}: the tree was not scaled");
    let tree = SegmentedTree::new(&state.geometry).unwrap();
    let shape = tree.shape();
    for x in 1..=shape.node_count() {
        let node = NodeIndex(x);
        let w = c.meta.lock_word(tree.node(node)).unwrap();
        if shape.is_leaf(node) {
            assert_eq!(w, 0, "{what}: leaf {x} still has bits set");
        } else {
            let i = Internal(w);
            assert!(
                !i.occupied() && i.tcnt() == i.tmax() && i.descendants_quiet(),
                "{what}: node {x}: {i:?}"
            );
            assert!(!i.expanded() && !i.superseded(), "{what}: node {x}: {i:?}");
        }
    }
    assert_eq!(state.maximizer, 0, "{what}: maximizer");
    let spill = DslrWord(state.spillover);
    assert_eq!((spill.nx(), spill.ns()), (spill.maxx(), spill.maxs()), "{what}: spillover idle: {spill:?}");
}

/// Runs `f` on a thread and gives its result, failing if it takes longer
/// than [`LIVENESS`].
fn within<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(LIVENESS).unwrap_or_else(|_| panic!("{what}: not done within {LIVENESS:?}"))
}

/// A frozen mount and the other client's write that waits for it.
struct Frozen {
    c: TestCluster,
    _key_dir: Option<tempfile::TempDir>,
    other: std::sync::Arc<FsClient>,
    ino: Ino,
    frozen: ProcessMount,
    /// The probe whose call the mount was frozen in, and its open file.
    p: Probe,
    pf: i32,
    stopped: Instant,
    /// The other client's write of `O` over the same bytes, then its read
    /// of them.
    writer: Option<std::thread::JoinHandle<Result<Vec<u8>, citronfs_core::error::FsError>>>,
}

/// Freezes a mount holding `held` (writing `len` bytes of `S` at offset
/// 0 over as many of `o`, or truncating) and starts the other client's
/// write of `len` bytes of `O` there, in a cluster with `keys`.
fn freeze(keys: Keys, held: Held, len: usize) -> Frozen {
    let (c, key_dir) = cluster(keys);
    assert_eq!(TEST_LEASE, Duration::from_secs(2), "the outcomes below are argued for a 2 s lease");
    let other = std::sync::Arc::new(client(&c));
    let ino = other.create_open(ME, Ino::ROOT, b"f", 0o666).unwrap().ino;
    if !matches!(held, Held::AttrLock) {
        other.write(ino, 0, &vec![b'o'; len], false).unwrap();
    }
    let frozen = frozen_mount(&c, key_dir.as_ref().map(|d| d.path()), held);
    assert_eq!(std::fs::metadata(frozen.path("f")).unwrap().ino(), ino.0);
    let mut p = Probe::spawn(PROBE);
    let pf = p.open(&frozen.path("f"));
    p.send(&match held {
        Held::Range | Held::RangeChecked | Held::AttrLock => format!("write {pf} 0 {}", "S".repeat(len)),
        Held::Inode => format!("truncate {pf} 0"),
    });
    wait_stopped(frozen.pid());
    let stopped = Instant::now();
    // The other client writes the same bytes and reads them back, while
    // the mount is frozen (it waits for the lock, or takes it over).
    let writer = {
        let other = other.clone();
        Some(std::thread::spawn(move || {
            other.write(ino, 0, &vec![b'O'; len], false)?;
            other.read(ino, 0, len as u32)
        }))
    };
    Frozen { c, _key_dir: key_dir, other, ino, frozen, p, pf, stopped, writer }
}

impl Frozen {
    /// Resumes the mount `stall` after it stopped; the answer of the call
    /// it was frozen in, and what the other client read back.
    fn resume_after(&mut self, stall: Duration, what: &str) -> (String, Vec<u8>) {
        std::thread::sleep(stall.saturating_sub(self.stopped.elapsed()));
        self.resume(what)
    }

    /// Resumes the mount as soon as the other client's write is done, or
    /// `stall` after it stopped at the latest; as [`Frozen::resume_after`].
    fn resume_by(&mut self, stall: Duration, what: &str) -> (String, Vec<u8>) {
        while self.stopped.elapsed() < stall && !self.writer.as_ref().is_some_and(|w| w.is_finished()) {
            std::thread::sleep(Duration::from_millis(5));
        }
        println!(
            "{what}: resumed after {:?}, the other's write {}",
            self.stopped.elapsed(),
            if self.writer.as_ref().is_some_and(|w| w.is_finished()) { "done" } else { "waiting" }
        );
        self.resume(what)
    }

    fn resume(&mut self, what: &str) -> (String, Vec<u8>) {
        self.frozen.signal(libc::SIGCONT);
        let answer = self.p.answer();
        let writer = self.writer.take().expect("resumed once");
        let read_back = within(what, move || writer.join().unwrap())
            .unwrap_or_else(|e| panic!("{what}: the other client's write: {e}"));
        (answer, read_back)
    }

    /// The file's bytes now (all of them).
    fn contents(&self) -> Vec<u8> {
        self.other.read(self.ino, 0, WHOLE_TREE as u32).unwrap()
    }

    /// A fresh open through the mount writes again (at once if it was
    /// never fenced, after it registered again if it was).
    fn works_again(&self, what: &str) {
        let deadline = Instant::now() + LIVENESS;
        loop {
            let mut r = Probe::spawn(PROBE);
            let answer = r.ask(&format!("open {}", self.frozen.path("f").display()));
            if let Some(fd) = answer.strip_prefix("fd ") {
                if r.ask(&format!("write {fd} 0 r")) == "ok" {
                    break;
                }
            }
            assert!(Instant::now() < deadline, "{what}: the mount never worked again: {answer}");
            std::thread::sleep(Duration::from_millis(100));
        }
        assert_eq!(
            self.other.read(self.ino, 0, 1).unwrap(),
            b"r",
            "{what}: reopened, the mount writes again"
        );
    }

    /// The locks are usable: a write over the whole tree (its root repairs
    /// whatever was left behind), a size change (inode mutex exclusive, ALock on the
    /// meta-server), an extending write (ALock from a client); and every
    /// word of the tree is idle afterwards.
    fn locks_usable(self, what: &str) {
        let (o, ino) = (self.other.clone(), self.ino);
        within(what, move || {
            // Within the file's size: a write across its end takes the
            // inode mutex exclusive and no range, and the range over the
            // whole tree is what makes its root repair.
            let whole = citronfs_core::types::SetAttr { size: Some(WHOLE_TREE as u64), ..Default::default() };
            o.setattr(ME, ino, whole).unwrap();
            o.write(ino, 0, &vec![b'w'; WHOLE_TREE], false).unwrap();
            o.setattr(
                ME,
                ino,
                citronfs_core::types::SetAttr { size: Some(PIECE as u64), ..Default::default() },
            )
            .unwrap();
            o.write(ino, PIECE as u64, b"tail", false).unwrap();
        });
        assert_eq!(self.other.file_size(ino).unwrap(), PIECE as u64 + 4, "{what}");
        assert_tree_idle(&self.c, ino, what);
        println!("{what}: ok after {:?}", self.stopped.elapsed());
        self.p.kill();
    }
}

/// The whole scenario for one lock and one stall outside the window of
/// the module comment, in a keyed cluster: the outcome is known in advance.
fn stall(held: Held, stall: Duration) {
    stall_in(Keys::Cluster, held, stall)
}

/// [`stall`] in a cluster with `keys`.
fn stall_in(keys: Keys, held: Held, stall: Duration) {
    let what = format!("{held:?} for {stall:?} ({keys:?} keys)");
    // The fence decides: nothing lapses below 2 s - 0.5 s (renewal period).
    let fenced = stall >= TEST_LEASE;
    let mut f = freeze(keys, held, PIECE);
    let (answer, read_back) = f.resume_after(stall, &what);
    let expected = if fenced { "err EIO" } else { "ok" };
    assert_eq!(answer, expected, "{what}: the call the mount was frozen in");
    assert!(read_back == vec![b'O'; PIECE], "{what}: the other client read back what it did not write");
    // Nothing of the frozen mount landed after the other's write.
    let now = f.contents();
    assert_eq!(now.len(), PIECE, "{what}: the file's size changed after the other's write");
    assert!(now == vec![b'O'; PIECE], "{what}: a byte of the frozen mount landed after the other's write");
    // Its old open file: EIO once fenced, until opened again.
    std::thread::sleep(Duration::from_millis(300));
    let again = f.p.ask(&format!("write {} 0 x", f.pf));
    assert_eq!(again, expected, "{what}: a write through the old open file after resuming");
    if fenced {
        assert_eq!(f.other.read(f.ino, 0, 1).unwrap(), b"O", "{what}: the refused write changed nothing");
        f.works_again(&what);
    } else {
        assert_eq!(f.other.read(f.ino, 0, 1).unwrap(), b"x", "{what}: the old open file still writes");
    }
    f.locks_usable(&what);
}

/// `bytes` as runs of one byte, `O×4096 S×1044480`: for failure messages.
fn runs(bytes: &[u8]) -> String {
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let n = bytes[at..].iter().take_while(|&&b| b == bytes[at]).count();
        out.push(format!("{}×{n}", bytes[at] as char));
        at += n;
    }
    out.join(" ")
}

/// A stall inside the window of the module comment: past the lock's own
/// takeover time, short of the fence that the meta-server may or may not
/// have made yet. The mount stopped holding the range lock `held` while
/// writing [`NODE_BYTES`] of `S`, and the other client writes the same
/// bytes: both lock the same internal node of the tree, where a silent
/// holder is taken over quickest (Line 11: 3/2 of the lock lease, plus the
/// fence delay). The mount resumes as soon as the other's write is done,
/// or `stall` after it stopped at the latest.
///
/// * `RangeChecked` (stopped after its check of the hold, with only the
///   verbs left): the other client waits until the mount is fenced or has
///   finished, so the frozen mount's bytes land before the other's write
///   or not at all (its verbs refused, EIO).
/// * `Range` (stopped before that check): on resuming, the mount finds its
///   hold past the lock lease, lets it go and writes again under a new
///   acquisition: its call succeeds (if not fenced meanwhile) and its bytes
///   land whole, before or after the other's whole write, never into it.
fn in_the_window(held: Held, stall: Duration) {
    let what = format!("{held:?} for {stall:?}");
    let mut f = freeze(Keys::Cluster, held, NODE_BYTES);
    let (answer, read_back) = f.resume_by(stall, &what);
    println!("{what}: the frozen call answered {answer:?} after {:?}", f.stopped.elapsed());
    assert!(answer == "ok" || answer == "err EIO", "{what}: the call the mount was frozen in: {answer}");
    let now = f.contents();
    assert_eq!(now.len(), NODE_BYTES, "{what}: the file's size changed");
    let all = |b: &[u8], c: u8| b.iter().all(|&x| x == c);
    match held {
        Held::RangeChecked => {
            let (back, now_runs) = (runs(&read_back), runs(&now));
            assert!(
                all(&read_back, b'O'),
                "{what}: the other client read back what it did not write: {back}"
            );
            assert!(
                all(&now, b'O'),
                "{what}: a byte of the frozen mount landed after the other's write: {now_runs}"
            );
        }
        Held::Range => {
            // Its write again, after the other's: legal, it had not returned.
            let whole = |b: &[u8]| all(b, b'O') || (answer == "ok" && all(b, b'S'));
            let (back, now_runs) = (runs(&read_back), runs(&now));
            assert!(whole(&read_back), "{what}: the other client read back a torn or failed write: {back}");
            assert!(whole(&now), "{what}: the writes tore, or a failed one landed: {now_runs}");
        }
        Held::Inode | Held::AttrLock => unreachable!("the window cases hold a range lock"),
    }
    f.works_again(&what);
    f.locks_usable(&what);
}

/// Stopped after its check of the hold: a 1 s stop from right after the
/// acquisition would leave the hold past H = 1 s, and the resumed mount
/// would write again after the other (the `Range` window case).
#[test]
fn frozen_one_second_holding_a_range_lock() {
    stall(Held::RangeChecked, Duration::from_secs(1));
}

#[test]
fn frozen_three_seconds_holding_a_range_lock() {
    stall(Held::Range, Duration::from_secs(3));
}

#[test]
fn frozen_ten_seconds_holding_a_range_lock() {
    stall(Held::Range, Duration::from_secs(10));
}

#[test]
fn frozen_one_second_holding_the_inode_mutex() {
    stall(Held::Inode, Duration::from_secs(1));
}

#[test]
fn frozen_three_seconds_holding_the_inode_mutex() {
    stall(Held::Inode, Duration::from_secs(3));
}

#[test]
fn frozen_ten_seconds_holding_the_inode_mutex() {
    stall(Held::Inode, Duration::from_secs(10));
}

#[test]
fn frozen_one_second_holding_the_attribute_alock() {
    stall(Held::AttrLock, Duration::from_secs(1));
}

#[test]
fn frozen_three_seconds_holding_the_attribute_alock() {
    stall(Held::AttrLock, Duration::from_secs(3));
}

#[test]
fn frozen_ten_seconds_holding_the_attribute_alock() {
    stall(Held::AttrLock, Duration::from_secs(10));
}

/// The lease ordering's window: 1.8 s is past the lock's takeover of a
/// silent holder without a fence delay (3/2 of the 1 s lock lease) and
/// within the fence's range (1.5 to 2.5 s after the stop).
const IN_THE_WINDOW: Duration = Duration::from_millis(1800);

#[test]
fn frozen_in_the_window_with_only_the_verbs_left() {
    in_the_window(Held::RangeChecked, IN_THE_WINDOW);
}

#[test]
fn frozen_in_the_window_before_checking_its_hold() {
    in_the_window(Held::Range, IN_THE_WINDOW);
}

#[test]
fn frozen_three_seconds_holding_a_range_lock_without_keys() {
    stall_in(Keys::Without, Held::Range, Duration::from_secs(3));
}

#[test]
fn frozen_ten_seconds_holding_a_range_lock_without_keys() {
    stall_in(Keys::Without, Held::Range, Duration::from_secs(10));
}
