//! The meta-server's journal: its namespace survives a restart or a crash
//! of the process (and, on a persistent directory, a reboot).
//!
//! # What is logged, and where it enters
//!
//! The namespace is served from memory; the journal is a redo log of its
//! changes. Every change passes through one room, the namespace's inode
//! table ([`crate::namespace`]'s `table`), which notes what each hold of
//! the namespace lock touched. When the hold ends, [`Logged`]'s guard
//! turns that into one [`Batch`] (the images of the inodes whose persistent
//! part changed, the entries made or removed, the counters) and appends it
//! here, still under the lock, so the journal's order is the namespace's.
//! No request handler calls the journal itself.
//!
//! # When an answer may leave: group commit
//!
//! A request's answer leaves only once every batch it could have seen is
//! durable ([`Journal::commit`], called once per request by the RPC
//! service). Appends only copy bytes into a buffer; the first request
//! thread that must wait writes the whole buffer with one `write` and one
//! `fdatasync`, and every request whose batches it held goes on together.
//! Under load, concurrent changes share appends and syncs; alone, a change
//! costs one `write` and one `fdatasync` (a no-op on tmpfs).
//!
//! Durability, by where the state directory is:
//! - under `/dev/shm` (the default): an answered change is in the page
//!   cache of a tmpfs, so it survives any crash or restart of the process
//!   and is lost at reboot, as tmpfs is;
//! - on a disk: `fdatasync` of the segment before the answer, so an
//!   answered change survives a power cut; a new segment or snapshot is
//!   created with an `fsync` of its directory.
//!
//! # Snapshots, while serving
//!
//! The journal is cut into segments of [`JournalConfig::segment_bytes`].
//! When one is full, a background thread makes `snapshot-N` from the
//! previous snapshot and the segments before N, by the same replay a start
//! does, and then removes them. The live namespace is never locked for a
//! snapshot; the cost is a second copy of the namespace image in memory
//! for the time of the compaction.
//!
//! # Why this is written here rather than taken from a crate
//!
//! An embedded store such as redb would keep a second, on-disk copy of the
//! whole namespace and make each change a transaction with its own commit;
//! what is needed is an append of a few hundred bytes under the namespace
//! lock and one shared sync outside it. The write-ahead-log crates either
//! sync per entry or keep their own checkpoint policy and record format.
//! What is written here is the framing ([`record`], CRC-32 by `crc32fast`),
//! the file names ([`files`]), the group commit and the compaction; the
//! encoding is bincode's.

pub mod files;
pub mod image;
pub mod kept_answers;
mod logged;
pub mod record;
mod state_dir;

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use citronfs_core::types::FsId;
use parking_lot::{Condvar, Mutex};
use thiserror::Error;

pub use image::{Batch, NamespaceImage};
pub use logged::{Logged, LoggedGuard};
pub use state_dir::ScratchDir;

/// Default segment length: a compaction per 64 MiB of changes.
pub const DEFAULT_SEGMENT_BYTES: u64 = 64 << 20;

#[derive(Debug, Error)]
pub enum JournalError {
    #[error("{}: {source}", file.display())]
    Io { file: PathBuf, source: std::io::Error },
    #[error(
        "{}: damaged record at byte {offset}; a partial namespace is never served (restore the file, or move the \
         state directory away to start an empty file system)",
        file.display()
    )]
    Damaged { file: PathBuf, offset: u64 },
    #[error("{}: the record at byte {offset} does not decode: {reason}", file.display())]
    Undecodable { file: PathBuf, offset: u64, reason: String },
    #[error("{}: journal segments without a snapshot to start from", .0.display())]
    NoSnapshot(PathBuf),
    #[error("encoding a journal record: {0}")]
    Encode(String),
    #[error("the state directory {} is in use by another meta-server", .0.display())]
    InUse(PathBuf),
    #[error("the journal could not be written ({0}); changes are refused until the meta-server restarts")]
    Broken(String),
}

impl JournalError {
    pub(crate) fn io(file: &Path, source: std::io::Error) -> Self {
        Self::Io { file: file.to_path_buf(), source }
    }
}

#[derive(Clone, Debug)]
pub struct JournalConfig {
    /// The state directory (`--state-dir`).
    pub dir: PathBuf,
    /// A segment's length before a snapshot replaces it.
    pub segment_bytes: u64,
}

impl JournalConfig {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self { dir: dir.into(), segment_bytes: DEFAULT_SEGMENT_BYTES }
    }
}

/// What a start found.
#[derive(Debug)]
pub struct Recovered {
    pub image: NamespaceImage,
    /// No state existed: a new file system.
    pub fresh: bool,
    pub snapshot: Option<u64>,
    pub segments: usize,
    pub batches: u64,
    /// A torn tail cut from the last segment: the file and where.
    pub torn: Option<(PathBuf, u64)>,
    pub took: Duration,
}

/// The journal as `citronfs status` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JournalStatus {
    pub dir: PathBuf,
    pub segments: usize,
    pub segment_bytes: u64,
    /// The newest snapshot: its number, bytes and when it was written.
    pub snapshot: Option<(u64, u64, SystemTime)>,
}

struct Pending {
    /// Framed batches not yet written.
    buf: Vec<u8>,
    /// Batches appended, and written and synced.
    appended: u64,
    durable: u64,
    /// A thread is writing; the others wait for it.
    flushing: bool,
    broken: Option<String>,
}

struct Writer {
    file: File,
    segment: u64,
    bytes: u64,
}

pub struct Journal {
    dir: PathBuf,
    segment_bytes: u64,
    /// Held while this journal is open: one meta-server per directory.
    _lock: File,
    pending: Mutex<Pending>,
    /// `pending.appended` and `pending.durable`, readable without the lock.
    appended: AtomicU64,
    durable: AtomicU64,
    flushed: Condvar,
    writer: Mutex<Writer>,
    compactor: Option<(mpsc::Sender<u64>, JoinHandle<()>)>,
}

impl Journal {
    /// Opens the state directory (made if missing): takes its lock, loads
    /// the newest snapshot, replays the segments after it (cutting a torn
    /// tail of the last one), and starts a new segment. An empty directory
    /// is a new file system with a new identity.
    pub fn open(config: &JournalConfig) -> Result<(Self, Recovered), JournalError> {
        let dir = config.dir.clone();
        std::fs::create_dir_all(&dir).map_err(|e| JournalError::io(&dir, e))?;
        let lock_path = dir.join(files::LOCK);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| JournalError::io(&lock_path, e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Err(JournalError::InUse(dir)),
            Err(std::fs::TryLockError::Error(e)) => return Err(JournalError::io(&lock_path, e)),
        }
        let recovered = recover(&dir, None, true)?;
        let next = files::segments(&dir)?.last().map_or(0, |n| n + 1).max(recovered.snapshot.unwrap_or(0));
        let writer = Writer { file: create_segment(&dir, next)?, segment: next, bytes: 0 };
        let compactor = spawn_compactor(dir.clone())?;
        let journal = Self {
            dir,
            segment_bytes: config.segment_bytes.max(4096),
            _lock: lock,
            pending: Mutex::new(Pending {
                buf: Vec::new(),
                appended: 0,
                durable: 0,
                flushing: false,
                broken: None,
            }),
            appended: AtomicU64::new(0),
            durable: AtomicU64::new(0),
            flushed: Condvar::new(),
            writer: Mutex::new(writer),
            compactor: Some(compactor),
        };
        Ok((journal, recovered))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The attribute slot region's file, at least `len` bytes long (a
    /// longer one from an earlier start keeps its length).
    pub fn slot_file(&self, len: u64) -> Result<File, JournalError> {
        let path = self.dir.join(files::SLOTS);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| JournalError::io(&path, e))?;
        let had = file.metadata().map_err(|e| JournalError::io(&path, e))?.len();
        if had < len {
            file.set_len(len).map_err(|e| JournalError::io(&path, e))?;
        }
        Ok(file)
    }

    /// The lock region's file, `len` bytes. With `keep`, a file of exactly
    /// that length from an earlier start is kept as it is (`true`: a
    /// restart re-adopts the locks in it); any other is made zero (an
    /// idle lock, an empty table everywhere) and `false` is answered.
    pub fn lock_file(&self, path: &Path, len: u64, keep: bool) -> Result<(File, bool), JournalError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| JournalError::io(path, e))?;
        let had = file.metadata().map_err(|e| JournalError::io(path, e))?.len();
        if keep && had == len {
            return Ok((file, true));
        }
        file.set_len(0).and_then(|()| file.set_len(len)).map_err(|e| JournalError::io(path, e))?;
        Ok((file, false))
    }

    /// Appends one batch (under the namespace lock); its number.
    pub fn append(&self, batch: &Batch) -> u64 {
        let payload = bincode::serialize(batch).expect("a batch always encodes");
        let mut p = self.pending.lock();
        record::frame(&payload, &mut p.buf);
        p.appended += 1;
        // Relaxed: a hint for `appended()`; `commit` takes the lock.
        self.appended.store(p.appended, Ordering::Relaxed);
        p.appended
    }

    /// The number of the last batch appended.
    pub fn appended(&self) -> u64 {
        self.appended.load(Ordering::Relaxed)
    }

    /// Returns once batch `seq` and every one before it is durable: writes
    /// them itself if no other thread is writing, else waits for that one
    /// (group commit).
    pub fn commit(&self, seq: u64) -> Result<(), JournalError> {
        // Acquire: pairs with the Release store below, after the write and
        // sync of every batch up to it returned.
        if self.durable.load(Ordering::Acquire) >= seq {
            return Ok(());
        }
        let mut p = self.pending.lock();
        // Only what was appended here can become durable here.
        let seq = seq.min(p.appended);
        loop {
            if p.durable >= seq {
                return Ok(());
            }
            if let Some(e) = &p.broken {
                return Err(JournalError::Broken(e.clone()));
            }
            if p.flushing {
                self.flushed.wait(&mut p);
                continue;
            }
            p.flushing = true;
            let buf = std::mem::take(&mut p.buf);
            let target = p.appended;
            let written = parking_lot::MutexGuard::unlocked(&mut p, || self.write(&buf));
            p.flushing = false;
            match written {
                Ok(()) => {
                    p.durable = target;
                    self.durable.store(target, Ordering::Release);
                }
                Err(e) => {
                    log::error!("journal: {e}; the meta-server refuses every change until it restarts");
                    p.broken = Some(e.to_string());
                }
            }
            self.flushed.notify_all();
        }
    }

    /// Writes and syncs `buf` to the current segment; starts the next one
    /// when it is full (and has the segments before it compacted).
    fn write(&self, buf: &[u8]) -> Result<(), JournalError> {
        let mut w = self.writer.lock();
        let path = files::segment_path(&self.dir, w.segment);
        w.file.write_all(buf).map_err(|e| JournalError::io(&path, e))?;
        w.file.sync_data().map_err(|e| JournalError::io(&path, e))?;
        w.bytes += buf.len() as u64;
        if w.bytes >= self.segment_bytes {
            let next = w.segment + 1;
            w.file = create_segment(&self.dir, next)?;
            w.segment = next;
            w.bytes = 0;
            if let Some((tx, _)) = &self.compactor {
                let _ = tx.send(next);
            }
        }
        Ok(())
    }

    /// Writes what is appended (a stopping meta-server).
    pub fn flush(&self) -> Result<(), JournalError> {
        self.commit(self.appended())
    }

    pub fn status(&self) -> JournalStatus {
        let segments = files::segments(&self.dir).unwrap_or_default();
        let bytes = segments
            .iter()
            .filter_map(|&n| std::fs::metadata(files::segment_path(&self.dir, n)).ok())
            .map(|m| m.len())
            .sum();
        let snapshot = files::snapshots(&self.dir).ok().and_then(|s| s.last().copied()).and_then(|n| {
            let meta = std::fs::metadata(files::snapshot_path(&self.dir, n)).ok()?;
            Some((n, meta.len(), meta.modified().ok()?))
        });
        JournalStatus { dir: self.dir.clone(), segments: segments.len(), segment_bytes: bytes, snapshot }
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        if let Err(e) = self.flush() {
            log::error!("journal: the last changes could not be written: {e}");
        }
        if let Some((tx, thread)) = self.compactor.take() {
            drop(tx);
            let _ = thread.join();
        }
    }
}

fn create_segment(dir: &Path, n: u64) -> Result<File, JournalError> {
    let path = files::segment_path(dir, n);
    let file =
        OpenOptions::new().create(true).append(true).open(&path).map_err(|e| JournalError::io(&path, e))?;
    files::sync_dir(dir)?;
    Ok(file)
}

/// Rebuilds the image: the newest snapshot, then every segment from its
/// number on (below `below`, if given). With `repair`, a torn tail of the
/// last segment is cut off; anywhere else it is damage.
fn recover(dir: &Path, below: Option<u64>, repair: bool) -> Result<Recovered, JournalError> {
    let started = Instant::now();
    let snapshots: Vec<u64> =
        files::snapshots(dir)?.into_iter().filter(|&n| below.is_none_or(|b| n < b)).collect();
    let segments: Vec<u64> =
        files::segments(dir)?.into_iter().filter(|&n| below.is_none_or(|b| n < b)).collect();
    let Some(&base) = snapshots.last() else {
        if !segments.is_empty() {
            return Err(JournalError::NoSnapshot(dir.to_path_buf()));
        }
        let image = NamespaceImage::empty(FsId::random());
        files::write_snapshot(dir, 0, &image)?;
        let took = started.elapsed();
        return Ok(Recovered {
            image,
            fresh: true,
            snapshot: Some(0),
            segments: 0,
            batches: 0,
            torn: None,
            took,
        });
    };
    let mut image = files::read_snapshot(dir, base)?;
    let replayed: Vec<u64> = segments.into_iter().filter(|&n| n >= base).collect();
    let (mut batches, mut torn) = (0, None);
    for (i, &n) in replayed.iter().enumerate() {
        let path = files::segment_path(dir, n);
        let bytes = std::fs::read(&path).map_err(|e| JournalError::io(&path, e))?;
        let scan = record::scan(&bytes)
            .map_err(|d| JournalError::Damaged { file: path.clone(), offset: d.offset })?;
        let mut offset = 0u64;
        for payload in scan.records {
            let batch: Batch = bincode::deserialize(payload).map_err(|e| JournalError::Undecodable {
                file: path.clone(),
                offset,
                reason: e.to_string(),
            })?;
            image.apply(batch);
            batches += 1;
            offset += (record::HEADER + payload.len()) as u64;
        }
        if let Some(at) = scan.torn_at {
            if !(repair && i + 1 == replayed.len()) {
                return Err(JournalError::Damaged { file: path, offset: at });
            }
            log::warn!("journal: {} ends with a torn record at byte {at}; replayed up to it", path.display());
            let cut = OpenOptions::new()
                .write(true)
                .open(&path)
                .and_then(|f| f.set_len(at).and_then(|()| f.sync_all()));
            cut.map_err(|e| JournalError::io(&path, e))?;
            torn = Some((path, at));
        }
    }
    Ok(Recovered {
        image,
        fresh: false,
        snapshot: Some(base),
        segments: replayed.len(),
        batches,
        torn,
        took: started.elapsed(),
    })
}

/// The thread that turns full segments into snapshots: for segment N
/// started, it writes `snapshot-N` and removes what it replaces.
fn spawn_compactor(dir: PathBuf) -> Result<(mpsc::Sender<u64>, JoinHandle<()>), JournalError> {
    let (tx, rx) = mpsc::channel::<u64>();
    let thread = std::thread::Builder::new()
        .name("citronfs-journal".into())
        .spawn(move || {
            while let Ok(mut upto) = rx.recv() {
                // Only the newest request matters.
                while let Ok(later) = rx.try_recv() {
                    upto = upto.max(later);
                }
                if let Err(e) = compact(&dir, upto) {
                    log::error!(
                        "journal: cannot write snapshot {upto}: {e}; the segments stay until the next try"
                    );
                }
            }
        })
        .map_err(|e| JournalError::io(Path::new("journal thread"), e))?;
    Ok((tx, thread))
}

/// Writes `snapshot-N` from the segments below N, then removes the older
/// snapshots and those segments.
pub fn compact(dir: &Path, upto: u64) -> Result<(), JournalError> {
    let started = Instant::now();
    let recovered = recover(dir, Some(upto), false)?;
    files::write_snapshot(dir, upto, &recovered.image)?;
    for n in files::snapshots(dir)?.into_iter().filter(|&n| n < upto) {
        let _ = std::fs::remove_file(files::snapshot_path(dir, n));
    }
    for n in files::segments(dir)?.into_iter().filter(|&n| n < upto) {
        let _ = std::fs::remove_file(files::segment_path(dir, n));
    }
    files::sync_dir(dir)?;
    log::info!(
        "journal: snapshot {upto} of {} inodes written in {:?} ({} batches replayed)",
        recovered.image.inodes.len(),
        started.elapsed(),
        recovered.batches
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::image::{Change, ContentImage, InodeImage};
    use super::*;
    use citronfs_core::types::{Attr, Caller, FileKind, Ino, Timestamp};

    fn file(ino: u64) -> Change {
        let attr = Attr::fresh(
            Ino(ino),
            FileKind::Symlink,
            0o777,
            Caller { uid: 1, gid: 1, pid: 0 },
            Timestamp::now(),
        );
        let content = ContentImage::Symlink(format!("target-{ino}").into_bytes());
        Change::Inode(Ino(ino), Some(InodeImage { attr, xattrs: Default::default(), content }))
    }

    fn batch(ino: u64) -> Batch {
        let entry =
            Change::Entry { dir: Ino::ROOT, name: format!("n{ino}").into_bytes(), to: Some((ino, Ino(ino))) };
        Batch { next_ino: ino + 1, next_cookie: ino + 1, next_client: 1, changes: vec![file(ino), entry] }
    }

    fn config(dir: &Path, segment_bytes: u64) -> JournalConfig {
        JournalConfig { dir: dir.into(), segment_bytes }
    }

    #[test]
    fn committed_batches_are_there_after_a_reopen_with_the_same_identity() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, first) = Journal::open(&config(dir.path(), DEFAULT_SEGMENT_BYTES)).unwrap();
        assert!(first.fresh);
        for ino in 2..5 {
            let seq = journal.append(&batch(ino));
            journal.commit(seq).unwrap();
        }
        drop(journal);
        let (_journal, again) = Journal::open(&config(dir.path(), DEFAULT_SEGMENT_BYTES)).unwrap();
        assert!(!again.fresh);
        assert_eq!(again.image.fs, first.image.fs, "the file system keeps its identity");
        assert_eq!(again.image.inodes.len(), 3);
        assert_eq!(again.image.entries[&Ino::ROOT].len(), 3);
        assert_eq!(again.image.next_ino, 5);
        assert_eq!(again.batches, 3);
    }

    #[test]
    fn concurrent_commits_all_land_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(&config(dir.path(), DEFAULT_SEGMENT_BYTES)).unwrap();
        let order = Mutex::new(());
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (journal, order) = (&journal, &order);
                s.spawn(move || {
                    for i in 0..50u64 {
                        // Appends in a global order, as under the namespace lock.
                        let seq = {
                            let _held = order.lock();
                            journal.append(&batch(2 + t * 1000 + i))
                        };
                        journal.commit(seq).unwrap();
                    }
                });
            }
        });
        drop(journal);
        let (_journal, again) = Journal::open(&config(dir.path(), DEFAULT_SEGMENT_BYTES)).unwrap();
        assert_eq!(again.batches, 400);
        assert_eq!(again.image.inodes.len(), 400);
    }

    #[test]
    fn compaction_keeps_the_image_and_removes_what_it_replaces() {
        let dir = tempfile::tempdir().unwrap();
        // Tiny segments: the background thread compacts while batches go.
        let (journal, _) = Journal::open(&config(dir.path(), 4096)).unwrap();
        for ino in 2..400 {
            journal.commit(journal.append(&batch(ino))).unwrap();
        }
        drop(journal);
        let newest = *files::snapshots(dir.path()).unwrap().last().unwrap();
        assert!(newest > 0, "full segments were compacted");
        assert!(
            files::segments(dir.path()).unwrap().iter().all(|&n| n >= newest),
            "what a snapshot replaces goes"
        );
        let (journal, before) = Journal::open(&config(dir.path(), 4096)).unwrap();
        assert_eq!(before.image.inodes.len(), 398);
        drop(journal);
        // Once more, by hand, up to the last segment.
        let upto = files::segments(dir.path()).unwrap().last().copied().unwrap();
        compact(dir.path(), upto).unwrap();
        assert_eq!(files::snapshots(dir.path()).unwrap(), vec![upto]);
        let (_journal, after) = Journal::open(&config(dir.path(), 4096)).unwrap();
        assert_eq!(after.image, before.image, "a snapshot holds what the segments held");
    }

    #[test]
    fn kept_answers_outlive_a_snapshot() {
        use citronfs_core::types::{ChangeSeq, ClientId};
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(&config(dir.path(), 4096)).unwrap();
        let (c, kept) = (ClientId(3), b"the answer".to_vec());
        let mut first = batch(2);
        first.changes.push(Change::Applied { client: c, seq: ChangeSeq(7) });
        journal.commit(journal.append(&first)).unwrap();
        let answered = Change::Answered {
            client: c,
            seq: ChangeSeq(7),
            answered_below: ChangeSeq(7),
            answer: kept.clone(),
        };
        let mut second = batch(3);
        second.changes.push(answered);
        journal.commit(journal.append(&second)).unwrap();
        drop(journal);
        let upto = files::segments(dir.path()).unwrap().last().copied().unwrap() + 1;
        compact(dir.path(), upto).unwrap();
        assert!(files::segments(dir.path()).unwrap().is_empty(), "only the snapshot is left");
        let (_journal, again) = Journal::open(&config(dir.path(), 4096)).unwrap();
        assert_eq!(again.image.kept.get(c, ChangeSeq(7)), Some(&kept_answers::Kept::Answered(kept)));
    }

    #[test]
    fn a_commit_never_waits_for_a_batch_not_appended() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _) = Journal::open(&config(dir.path(), DEFAULT_SEGMENT_BYTES)).unwrap();
        let seq = journal.append(&batch(2));
        // A number from elsewhere (another journal of the process) returns
        // once what is here is durable.
        journal.commit(seq + 1000).unwrap();
        drop(journal);
        let (_journal, again) = Journal::open(&config(dir.path(), DEFAULT_SEGMENT_BYTES)).unwrap();
        assert_eq!(again.batches, 1);
    }

    #[test]
    fn one_meta_server_per_state_directory() {
        let dir = tempfile::tempdir().unwrap();
        let (_journal, _) = Journal::open(&config(dir.path(), DEFAULT_SEGMENT_BYTES)).unwrap();
        match Journal::open(&config(dir.path(), DEFAULT_SEGMENT_BYTES)) {
            Err(JournalError::InUse(d)) => assert_eq!(d, dir.path()),
            other => panic!("a second journal on the same directory: {:?}", other.map(|_| ())),
        }
    }
}
