//! The state directory's files:
//!
//! | file | what |
//! |---|---|
//! | `lock` | held (flock) by the meta-server using the directory |
//! | `snapshot-N` | the namespace as of the start of segment N: one record, then one of the kept answers (`kept_answers`; absent in snapshots written before answers were kept) |
//! | `journal-N` | segment N: batches, appended in the namespace lock's order |
//! | `slots` | the attribute slot region (sizes, mtimes), mapped shared |
//! | `locks` | the lock region (lock areas, record tables, waits-for table, Citron trees), mapped shared |
//! | `locks.layout` | where the cluster's fixed lock structures were placed in `locks` |
//! | `ports` | the tcp ports clients reach (NIC, lock host), bound again at a restart |
//!
//! `N` is written with 20 digits, so names sort as numbers do. A snapshot
//! is written as `snapshot-N.tmp`, synced, renamed into place and the
//! directory synced, so a crash leaves either no `snapshot-N` or a whole one.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::image::NamespaceImage;
use super::record;
use super::JournalError;

pub const LOCK: &str = "lock";
pub const SLOTS: &str = "slots";
pub const LOCKS: &str = "locks";
pub const LOCK_LAYOUT: &str = "locks.layout";
pub const PORTS: &str = "ports";
const SNAPSHOT: &str = "snapshot-";
const SEGMENT: &str = "journal-";

pub fn snapshot_path(dir: &Path, n: u64) -> PathBuf {
    dir.join(format!("{SNAPSHOT}{n:020}"))
}

pub fn segment_path(dir: &Path, n: u64) -> PathBuf {
    dir.join(format!("{SEGMENT}{n:020}"))
}

/// The numbers of the files named `prefix`N in `dir`, ascending.
fn numbered(dir: &Path, prefix: &str) -> Result<Vec<u64>, JournalError> {
    let mut found = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| JournalError::io(dir, e))? {
        let entry = entry.map_err(|e| JournalError::io(dir, e))?;
        let name = entry.file_name();
        let Some(n) = name.to_str().and_then(|n| n.strip_prefix(prefix)) else { continue };
        if let Ok(n) = n.parse::<u64>() {
            found.push(n);
        }
    }
    found.sort_unstable();
    Ok(found)
}

pub fn snapshots(dir: &Path) -> Result<Vec<u64>, JournalError> {
    numbered(dir, SNAPSHOT)
}

pub fn segments(dir: &Path) -> Result<Vec<u64>, JournalError> {
    numbered(dir, SEGMENT)
}

/// Syncs the directory itself, so a file created or renamed in it stays.
pub fn sync_dir(dir: &Path) -> Result<(), JournalError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| JournalError::io(dir, e))
}

pub fn read_snapshot(dir: &Path, n: u64) -> Result<NamespaceImage, JournalError> {
    let path = snapshot_path(dir, n);
    let bytes = fs::read(&path).map_err(|e| JournalError::io(&path, e))?;
    let scan =
        record::scan(&bytes).map_err(|d| JournalError::Damaged { file: path.clone(), offset: d.offset })?;
    let undecodable = |offset: usize, e: bincode::Error| JournalError::Undecodable {
        file: path.clone(),
        offset: offset as u64,
        reason: e.to_string(),
    };
    // The image, then (since answers are kept) the kept answers.
    let (image, kept) = match (scan.records.as_slice(), scan.torn_at) {
        ([image], None) => (image, None),
        ([image, kept], None) => (image, Some(kept)),
        _ => return Err(JournalError::Damaged { file: path, offset: scan.torn_at.unwrap_or(0) }),
    };
    let mut image: NamespaceImage = bincode::deserialize(image).map_err(|e| undecodable(0, e))?;
    if let Some(kept) = kept {
        let at = record::HEADER + scan.records[0].len();
        image.kept = bincode::deserialize(kept).map_err(|e| undecodable(at, e))?;
    }
    Ok(image)
}

/// Writes `image` as `snapshot-N`, whole or not at all.
pub fn write_snapshot(dir: &Path, n: u64, image: &NamespaceImage) -> Result<(), JournalError> {
    let path = snapshot_path(dir, n);
    let tmp = path.with_extension("tmp");
    let encode = |e: bincode::Error| JournalError::Encode(e.to_string());
    let payload = bincode::serialize(image).map_err(encode)?;
    let kept = bincode::serialize(&image.kept).map_err(encode)?;
    let mut bytes = Vec::with_capacity(payload.len() + kept.len() + 2 * record::HEADER);
    record::frame(&payload, &mut bytes);
    record::frame(&kept, &mut bytes);
    let write = || -> std::io::Result<()> {
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp)?;
        f.write_all(&bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, &path)
    };
    write().map_err(|e| JournalError::io(&path, e))?;
    sync_dir(dir)
}
