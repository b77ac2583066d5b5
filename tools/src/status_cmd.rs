//! `citronfs status`: what an operator asks of a cluster — per data server
//! capacity and use, files and open files, lock memory in use and its limit,
//! clients and their leases — as tables, or as JSON with `--json`.
//!
//! Given a mount point, the command asks that mount (through a virtual
//! extended attribute, `citronfs_mount::META_XATTR`) where its meta-server
//! is; given `--meta`, it asks the meta-server directly. Either way it is
//! one `Status` RPC and does not register as a client. Each section is a
//! function of its own, and the JSON document an object of named sections,
//! so more can be added beside them. The last section is not the cluster's
//! but this host's: the shm regions servers here publish and who owns them
//! ([`crate::regions`]).
//!
//! The output ends with one health line ([`ClusterStatus::problems`]), and
//! the JSON document has `healthy` and `problems`: the command exits 0 when
//! the cluster is healthy and [`UNHEALTHY`] (3) when it needs an operator;
//! 1 is an error of the command itself (an unreachable meta-server, say),
//! 2 a bad command line.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use citron_lock::rdma::tcp::RpcClient;
use citron_rpc::auth::Credentials;
use citronfs_core::proto::{MetaRequest, MetaResponse};
use citronfs_core::status::ClusterStatus;
use clap::Args;

use crate::keys::KeyArgs;
use crate::report::Table;

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// A citronfs mount point (or any path in one).
    #[arg(required_unless_present = "meta", conflicts_with = "meta")]
    path: Option<PathBuf>,
    /// The meta-server's address, instead of a mount point.
    #[arg(long)]
    meta: Option<SocketAddr>,
    /// Print one JSON document instead of tables.
    #[arg(long)]
    json: bool,
    /// Seconds to wait for the meta-server.
    #[arg(long, default_value_t = 5.0)]
    timeout: f64,
    /// The cluster's key, if it has one (a `citronfs mount` without
    /// `--meta` prints where it put its key).
    #[command(flatten)]
    key: KeyArgs,
}

/// The meta-server of the mount that serves `path`.
fn meta_of(path: &Path) -> Result<SocketAddr> {
    if !path.exists() {
        bail!("{} does not exist", path.display());
    }
    let value = crate::locks_cmd::getxattr(path, citronfs_mount::META_XATTR)
        .with_context(|| format!("cannot ask the mount at {} for its meta-server", path.display()))?;
    let text = String::from_utf8(value).context("the mount answered garbage")?;
    text.trim().parse().with_context(|| format!("the mount answered {text:?} for its meta-server"))
}

/// Asks the meta-server at `meta` for the cluster's status, proving the
/// key of `credentials` if the cluster has keys.
pub fn fetch(meta: SocketAddr, timeout: Duration, credentials: Credentials) -> Result<ClusterStatus> {
    let rpc: RpcClient<MetaRequest, MetaResponse> =
        RpcClient::new(meta, timeout).with_credentials(credentials);
    match rpc.call(&MetaRequest::Status).with_context(|| format!("cannot reach the meta-server at {meta}"))? {
        MetaResponse::Status(s) => Ok(*s),
        MetaResponse::Failed(e) => bail!("the meta-server at {meta} refused: {e}"),
        other => bail!("the meta-server at {meta} answered {other:?}"),
    }
}

/// The exit status of a cluster that needs an operator.
pub const UNHEALTHY: u8 = 3;

/// Prints the status; whether the cluster is healthy.
pub fn run(args: StatusArgs) -> Result<bool> {
    let timeout =
        Duration::try_from_secs_f64(args.timeout).context("--timeout must be a number of seconds")?;
    let meta = match (&args.meta, &args.path) {
        (Some(m), _) => *m,
        (None, Some(p)) => meta_of(p)?,
        (None, None) => bail!("give a mount point or --meta"),
    };
    let keyring = args.key.load()?;
    let status = fetch(meta, timeout, Credentials::of_key(keyring.as_deref().map(|r| r.first())))?;
    let regions = crate::regions::host_regions()?;
    let problems = status.problems();
    if args.json {
        let mut doc = json(meta, &status);
        doc["host_regions"] = serde_json::to_value(&regions)?;
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_tables(meta, &status);
        println!(
            "
shm regions on this host"
        );
        crate::regions::print_regions(&mut std::io::stdout().lock(), &regions, false)?;
        println!("\n{}", health_line(&problems));
    }
    Ok(problems.is_empty())
}

/// The closing line: `health: ok` and what was checked, or `health:
/// UNHEALTHY` and every problem.
pub fn health_line(problems: &[String]) -> String {
    if problems.is_empty() {
        format!(
            "health: ok (every data server answers, no lagging or fenced client, space, files and lock \
             memory below {}%)",
            citronfs_core::status::NEARLY_FULL_PERCENT
        )
    } else {
        format!("health: UNHEALTHY: {}", problems.join("; "))
    }
}

/// The JSON document: one object per section.
pub fn json(meta: SocketAddr, s: &ClusterStatus) -> serde_json::Value {
    let problems = s.problems();
    serde_json::json!({
        "meta_server": meta.to_string(),
        "chunk_size": s.chunk_size,
        "data_servers": s.data_servers,
        "files": s.files,
        "lock_memory": s.lock_memory,
        "clients": s.clients,
        "reclaim": s.reclaim,
        "state": s.state,
        "healthy": problems.is_empty(),
        "problems": problems,
    })
}

fn print_tables(meta: SocketAddr, s: &ClusterStatus) {
    println!("cluster of meta-server {meta} (chunks of {})", bytes(s.chunk_size));
    state(s);
    data_servers(s);
    files(s);
    lock_memory(s);
    clients(s);
    reclaim(s);
}

fn state(s: &ClusterStatus) {
    let st = &s.state;
    println!("\nfile system {}", st.fs);
    println!(
        "  made at {} s; this meta-server (incarnation {:016x}) started at {} s after a replay of {} ms",
        st.born_unix_s, st.incarnation, st.started_unix_s, st.replay_ms
    );
    let snapshot = match st.snapshot {
        Some((n, size, at)) => format!("snapshot {n} of {} written at {at} s", bytes(size)),
        None => "no snapshot".into(),
    };
    println!(
        "  state in {}: journal of {} in {} segments, {snapshot}",
        st.state_dir,
        bytes(st.journal_bytes),
        st.journal_segments
    );
    match st.grace {
        Some((left_ms, awaited)) => println!(
            "  grace period after the restart: at most {left_ms} ms left, {awaited} clients of the previous \
             process not back yet (opens of files nobody reclaimed wait)"
        ),
        None => println!("  no grace period: clients of the previous process, if any, have reclaimed"),
    }
}

fn data_servers(s: &ClusterStatus) {
    println!("\ndata servers");
    let mut t = Table::new(&[
        "ID",
        "NIC",
        "SHM",
        "CAPACITY",
        "USED",
        "FREE",
        "USE%",
        "EXTENTS",
        "LARGEST_FREE",
        "ANSWERS",
    ]);
    for d in &s.data_servers {
        t.push(vec![
            d.id.0.to_string(),
            d.nic.to_string(),
            d.shm.clone().unwrap_or_else(|| "-".into()),
            bytes(d.capacity),
            bytes(d.used),
            bytes(d.free),
            percent(d.used, d.capacity),
            d.extents.to_string(),
            bytes(d.largest_free),
            d.unanswered_ms.map_or_else(|| "yes".into(), |ms| format!("no, for {ms}ms")),
        ]);
    }
    t.print();
}

fn files(s: &ClusterStatus) {
    let f = &s.files;
    println!(
        "\nfiles: {} inodes, {} regular files (at most {}), {} open ({} opens), {} of data",
        f.inodes,
        f.regular_files,
        f.max_files,
        f.open_files,
        f.opens,
        bytes(f.allocated)
    );
    if f.lost_data > 0 {
        println!("  {} files lost their data with a data server that is gone (they answer EIO)", f.lost_data);
    }
}

fn lock_memory(s: &ClusterStatus) {
    let l = &s.lock_memory;
    println!(
        "lock memory: {} in use of {} ({}): {} files have lock memory (peak {}), {} opens refused (ENFILE)",
        bytes(l.in_use),
        bytes(l.limit),
        percent(l.in_use, l.limit),
        l.files,
        l.peak_files,
        l.refused_opens
    );
    println!(
        "  lock areas and tables {} of {}, Citron trees {} of {}",
        bytes(l.areas_in_use),
        bytes(l.areas),
        bytes(l.trees_in_use),
        bytes(l.trees)
    );
}

fn clients(s: &ClusterStatus) {
    println!("\nclients");
    let mut t = Table::new(&["ID", "HOST", "PID", "OPENS", "RENEWED_AGO", "LEASE"]);
    for c in &s.clients {
        t.push(vec![
            c.id.0.to_string(),
            c.hostname.clone(),
            c.pid.to_string(),
            c.opens.to_string(),
            format!("{}ms", c.renewed_ms_ago),
            format!("{}ms", c.lease_ms),
        ]);
    }
    t.print();
}

fn reclaim(s: &ClusterStatus) {
    let r = &s.reclaim;
    println!(
        "\nreclaimed: {} lock memories, {} extents ({}); {} clients fenced ({} revoked at the NICs)",
        r.lock_memory_frees,
        r.extent_frees,
        bytes(r.extent_bytes_freed),
        r.fences,
        r.revoked
    );
}

/// Bytes as a short human figure (binary units).
fn bytes(n: u64) -> String {
    const UNITS: [(u64, &str); 4] = [(1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (m, u) in UNITS {
        if n >= m {
            return format!("{:.1}{u}", n as f64 / m as f64);
        }
    }
    format!("{n}B")
}

fn percent(part: u64, whole: u64) -> String {
    if whole == 0 {
        return "-".into();
    }
    format!("{:.1}%", part as f64 * 100.0 / whole as f64)
}
