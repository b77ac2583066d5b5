//! `citronfs bench restart`: what a meta-server restart costs with a large
//! namespace (the journal, `citronfs_meta_server::journal`).
//!
//! The bench writes the state of a file system of `--files` regular files
//! (in directories of `--per-dir`) straight into a state directory, as
//! the meta-server's journal would after that many creates: batches of
//! inode images and entries, appended and committed through the journal
//! itself. It then times, on that directory:
//! 1. a replay of the whole journal (no snapshot but the empty first one);
//! 2. the snapshot a compaction writes from it;
//! 3. a replay from that snapshot (what a start finds after compaction);
//! 4. a whole `MetaServer::start` on it, until it serves.
//!
//! The files have no extents (a data server re-adopting its extents scans
//! the files once more as it joins). Figures are of this machine, one
//! process; the state directory is under /dev/shm as the default one is.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use citron_lock::rdma::RemoteAddr;
use citronfs_core::proto::AttrSlot;
use citronfs_core::types::{Attr, Caller, FileKind, Ino, Timestamp};
use citronfs_meta_server::journal::image::{Batch, Change, ContentImage, InodeImage};
use citronfs_meta_server::journal::{self, Journal, JournalConfig};
use citronfs_meta_server::service::SLOT_REGION;
use citronfs_meta_server::{MetaServer, MetaServerConfig};
use clap::Args;

use crate::report::Table;

#[derive(Args, Debug)]
pub struct RestartArgs {
    /// Regular files in the namespace.
    #[arg(long, default_value_t = 1_000_000)]
    files: u64,
    /// Files per directory.
    #[arg(long, default_value_t = 1000)]
    per_dir: u64,
    /// Changes per journal batch (one hold of the namespace lock makes one).
    #[arg(long, default_value_t = 2)]
    batch: usize,
    /// Directory for restart.csv, restart.png and restart-pause.csv.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Only the pause a restart costs a working mount (tcp and shm, at
    /// these leases in ms), not the large namespace's replay.
    #[arg(long, value_delimiter = ',')]
    pause_leases_ms: Vec<u64>,
}

fn attr(ino: Ino, kind: FileKind) -> Attr {
    let perm = if kind == FileKind::Dir { 0o755 } else { 0o644 };
    Attr::fresh(ino, kind, perm, Caller::ROOT, Timestamp::now())
}

fn dir(ino: Ino, parent: Ino) -> Change {
    let image = InodeImage {
        attr: attr(ino, FileKind::Dir),
        xattrs: Default::default(),
        content: ContentImage::Dir { parent },
    };
    Change::Inode(ino, Some(image))
}

/// The namespace's changes, as `--batch`-sized batches, appended and
/// committed as the meta-server does; returns the bytes written.
fn write_namespace(journal: &Journal, args: &RestartArgs) -> u64 {
    let (mut next_ino, mut next_cookie) = (Ino::ROOT.0 + 1, 3u64);
    let mut pending = vec![dir(Ino::ROOT, Ino::ROOT)];
    let flush = |pending: &mut Vec<Change>, next_ino: u64, next_cookie: u64| {
        let batch = Batch { next_ino, next_cookie, next_client: 1, changes: std::mem::take(pending) };
        let seq = journal.append(&batch);
        journal.commit(seq).expect("journal write");
    };
    let dirs = args.files.div_ceil(args.per_dir.max(1));
    let mut made = 0u64;
    for d in 0..dirs {
        let dir_ino = Ino(next_ino);
        next_ino += 1;
        pending.push(dir(dir_ino, Ino::ROOT));
        pending.push(Change::Entry {
            dir: Ino::ROOT,
            name: format!("d{d}").into_bytes(),
            to: Some((next_cookie, dir_ino)),
        });
        next_cookie += 1;
        for f in 0..args.per_dir.min(args.files - made) {
            let ino = Ino(next_ino);
            next_ino += 1;
            let slot = AttrSlot(RemoteAddr::new(SLOT_REGION, made * AttrSlot::BYTES));
            let content =
                ContentImage::File { slot, chunks: Vec::new(), allocated: 0, epoch: 0, ahead: Vec::new() };
            let image = InodeImage { attr: attr(ino, FileKind::File), xattrs: Default::default(), content };
            pending.push(Change::Inode(ino, Some(image)));
            pending.push(Change::Entry {
                dir: dir_ino,
                name: format!("f{f}").into_bytes(),
                to: Some((next_cookie, ino)),
            });
            next_cookie += 1;
            made += 1;
            if pending.len() >= args.batch {
                flush(&mut pending, next_ino, next_cookie);
            }
        }
    }
    flush(&mut pending, next_ino, next_cookie);
    journal.status().segment_bytes
}

pub fn run(args: RestartArgs) -> Result<()> {
    std::fs::create_dir_all(&args.out)?;
    if !args.pause_leases_ms.is_empty() {
        return pauses(&args);
    }
    let state = tempfile::Builder::new().prefix("citronfs-bench-state-").tempdir_in("/dev/shm")?;
    // Segments far larger than the namespace: the first replay reads the
    // whole journal, as after a crash before any compaction.
    let config = JournalConfig { dir: state.path().into(), segment_bytes: u64::MAX / 2 };
    let started = Instant::now();
    let (journal, _) = Journal::open(&config)?;
    let journal_bytes = write_namespace(&journal, &args);
    let wrote = started.elapsed();
    drop(journal);
    println!("journal of {} files: {:.1} MB in {wrote:.2?}", args.files, journal_bytes as f64 / 1e6);

    let t = Instant::now();
    let (journal, recovered) = Journal::open(&config)?;
    let replay_journal = t.elapsed();
    let files = recovered.image.files();
    anyhow::ensure!(files as u64 == args.files, "replayed {files} files of {}", args.files);
    drop(journal);

    // The compaction a full segment would start: every segment so far.
    let next = std::fs::read_dir(state.path())?
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("journal-")?.parse::<u64>().ok())
        .max()
        .map_or(0, |n| n + 1);
    let t = Instant::now();
    journal::compact(state.path(), next)?;
    let snapshot_write = t.elapsed();
    let snapshot_bytes = std::fs::metadata(journal::files::snapshot_path(state.path(), next))?.len();

    let t = Instant::now();
    let (journal, recovered) = Journal::open(&config)?;
    let replay_snapshot = t.elapsed();
    anyhow::ensure!(recovered.image.files() as u64 == args.files, "the snapshot lost files");
    drop(journal);

    let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse()?);
    cfg.state_dir = Some(state.path().into());
    cfg.slot_bytes = cfg.slot_bytes.max(args.files * AttrSlot::BYTES);
    let t = Instant::now();
    let meta = MetaServer::start(cfg).context("meta-server on the bench's state")?;
    let meta_start = t.elapsed();
    let served = meta.status().files.regular_files;
    drop(meta);
    anyhow::ensure!(served == args.files, "the meta-server serves {served} files of {}", args.files);

    let mut table = Table::new(&["figure", "value"]);
    let secs = |d: std::time::Duration| format!("{:.3}", d.as_secs_f64());
    table.push(vec!["files".into(), args.files.to_string()]);
    table.push(vec!["journal MB".into(), format!("{:.1}", journal_bytes as f64 / 1e6)]);
    table.push(vec!["snapshot MB".into(), format!("{:.1}", snapshot_bytes as f64 / 1e6)]);
    table.push(vec!["replay of the journal alone, s".into(), secs(replay_journal)]);
    table.push(vec!["snapshot written by compaction, s".into(), secs(snapshot_write)]);
    table.push(vec!["replay from the snapshot, s".into(), secs(replay_snapshot)]);
    table.push(vec!["meta-server start until serving, s".into(), secs(meta_start)]);
    table.print();
    table.write_csv(&args.out.join("restart.csv"))?;
    let bars = vec![
        ("replay: journal".to_string(), replay_journal.as_secs_f64()),
        ("write snapshot".to_string(), snapshot_write.as_secs_f64()),
        ("replay: snapshot".to_string(), replay_snapshot.as_secs_f64()),
        ("meta-server start".to_string(), meta_start.as_secs_f64()),
    ];
    crate::plot::bars(
        &args.out.join("restart.png"),
        &format!("meta-server restart, {} files (shm state dir)", args.files),
        "seconds",
        &bars,
    )?;
    Ok(())
}

/// The second table: a working client's pause across restarts.
fn pauses(args: &RestartArgs) -> Result<()> {
    use citronfs_core::client::Transport;
    let mut table =
        Table::new(&["transport", "lease ms", "longest gap ms", "stop to answer ms", "calls", "failed"]);
    let mut bars = Vec::new();
    for &lease_ms in &args.pause_leases_ms {
        for transport in [Transport::Tcp, Transport::Auto] {
            let p = super::restart_pause::measure(transport, std::time::Duration::from_millis(lease_ms))?;
            let ms = |d: std::time::Duration| format!("{:.0}", d.as_secs_f64() * 1e3);
            table.push(vec![
                p.transport.into(),
                p.lease.as_millis().to_string(),
                ms(p.longest_gap),
                ms(p.stop_to_answer),
                p.calls.to_string(),
                p.failed.to_string(),
            ]);
            bars.push((format!("{} lease {lease_ms} ms", p.transport), p.longest_gap.as_secs_f64() * 1e3));
        }
    }
    table.print();
    table.write_csv(&args.out.join("restart-pause.csv"))?;
    crate::plot::bars(
        &args.out.join("restart-pause.png"),
        "a working client's longest pause across a meta-server restart",
        "ms",
        &bars,
    )
}
