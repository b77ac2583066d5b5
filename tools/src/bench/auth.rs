//! `citronfs bench auth`: what cluster keys and grants cost, each beside the
//! same thing without them, measured in one run:
//!
//! 1. **Per connection**: TCP connect alone; connect + the handshake of a
//!    NIC without keys (one round trip); with a key (two round trips and
//!    four HMAC-SHA256); with a client session (the server derives the
//!    session secret: one HMAC more).
//! 2. **Per verb, in the NIC**: the access check alone ([`AccessTable`]'s
//!    `execute` around a no-op), for a server principal (no check) and for
//!    a client session whose grant table holds `--grants` extents.
//! 3. **Per verb, end to end over loopback**: 8-byte reads, one at a time
//!    and in batches, from a server principal and from a granted session.
//! 4. **Per file-system operation**: a cluster without keys and one with,
//!    one client each over tcp: 4 KiB writes and reads, fcntl lock + unlock,
//!    open + close; verbs and round trips per operation (the client's
//!    counters) and time per operation.
//!
//! Rounds alternate between the compared sides so the machine's noise
//! falls on both; the figures to quote are the ratios and the verb counts.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use citron_lock::rdma::tcp::{AccessCommand, AccessTable, Extent};
use citron_lock::rdma::{
    Node, NodeCredentials, RegionId, RegionMemory, RegionTable, RemoteAddr, TcpHost, TcpOptions, Verb,
    VerbReply,
};
use citron_rpc::auth::{client_handshake, Authority, Credential, Credentials, Keyring, Principal, SessionId};
use citronfs_core::client::LockCall;
use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_core::locks::types::{ByteRange, LockFlavor, LockMode, LockOwner};
use citronfs_core::types::{Caller, FileKind, Ino};
use citronfs_meta_server::{DataServer, MetaServer, MetaServerConfig};
use clap::Args;
use hdrhistogram::Histogram;

use crate::report::{fmt_ns, Table};

#[derive(Args, Debug)]
pub struct AuthArgs {
    /// Connections per kind (part 1).
    #[arg(long, default_value_t = 300)]
    connections: u64,
    /// Grants in the session's table (parts 2 and 3): a client with this
    /// many chunks and lock areas open.
    #[arg(long, default_value_t = 1000)]
    grants: u64,
    /// Verbs per side and round (parts 2 and 3).
    #[arg(long, default_value_t = 20_000)]
    verbs: u64,
    /// File-system operations per kind and side (part 4).
    #[arg(long, default_value_t = 2_000)]
    fs_ops: u64,
    /// Rounds; sides alternate within each.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Directory for auth.csv and auth.png.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
}

const REGION: RegionId = RegionId(1);
const TIMEOUT: Duration = Duration::from_secs(10);

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

fn ns(d: Duration) -> u64 {
    d.as_nanos().clamp(1, u128::from(u64::MAX)) as u64
}

/// A result row: what, which side, p50, p99 (ns), extra figures.
struct Row {
    part: &'static str,
    what: String,
    side: &'static str,
    p50: f64,
    p99: f64,
    verbs_per_op: Option<f64>,
    trips_per_op: Option<f64>,
}

pub fn run(args: AuthArgs) -> Result<()> {
    let mut rows = Vec::new();
    println!(
        "bench auth: {} connections, {} grants, {} verbs, {} fs ops, {} rounds (machine shared: compare ratios)",
        args.connections, args.grants, args.verbs, args.fs_ops, args.rounds
    );
    connections(&args, &mut rows)?;
    check_cost(&args, &mut rows);
    verbs_end_to_end(&args, &mut rows)?;
    fs_ops(&args, &mut rows)?;

    let mut table =
        Table::new(&["part", "what", "side", "p50", "p99", "verbs/op", "rt/op", "p50_ns", "p99_ns"]);
    let opt = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.2}"));
    for r in &rows {
        table.push(vec![
            r.part.into(),
            r.what.clone(),
            r.side.into(),
            fmt_ns(r.p50),
            fmt_ns(r.p99),
            opt(r.verbs_per_op),
            opt(r.trips_per_op),
            format!("{:.0}", r.p50),
            format!("{:.0}", r.p99),
        ]);
    }
    println!();
    table.print();
    println!();
    println!("ratios (p50, keyed side / side without keys or checks):");
    let p50 = |what: &str, side: &str| rows.iter().find(|r| r.what == what && r.side == side).map(|r| r.p50);
    let mut ratios = Vec::new();
    for (what, with, without) in [
        ("connect + handshake", "key", "no key"),
        ("connect + handshake", "session", "no key"),
        ("connect + handshake", "no key", "tcp only"),
        ("access check", "session", "server"),
        ("8-byte read", "session", "server"),
        ("batch of 16 reads", "session", "server"),
        ("4 KiB write", "keyed", "no keys"),
        ("4 KiB read", "keyed", "no keys"),
        ("fcntl lock + unlock", "keyed", "no keys"),
        ("open + close", "keyed", "no keys"),
    ] {
        if let (Some(a), Some(b)) = (p50(what, with), p50(what, without)) {
            println!(
                "  {what:<22} {with:>8} / {without:<8} = {:.2}  ({} vs {})",
                a / b,
                fmt_ns(a),
                fmt_ns(b)
            );
            ratios.push((format!("{what}: {with}/{without}"), a / b));
        }
    }
    println!("verbs and round trips per operation (keyed vs no keys):");
    for what in ["4 KiB write", "4 KiB read", "fcntl lock + unlock", "open + close"] {
        let of = |side| rows.iter().find(|r| r.what == what && r.side == side);
        if let (Some(k), Some(n)) = (of("keyed"), of("no keys")) {
            println!(
                "  {what:<22} verbs {} vs {}, round trips {} vs {}",
                opt(k.verbs_per_op),
                opt(n.verbs_per_op),
                opt(k.trips_per_op),
                opt(n.trips_per_op)
            );
        }
    }
    std::fs::create_dir_all(&args.out)?;
    let csv = args.out.join("auth.csv");
    table.write_csv(&csv)?;
    println!("\nwrote {}", csv.display());
    let png = args.out.join("auth.png");
    match crate::plot::bars(&png, "cost of keys and grants (p50 ratio, 1 = free)", "ratio", &ratios) {
        Ok(()) => println!("wrote {}", png.display()),
        Err(e) => log::warn!("no plot: {e}"),
    }
    Ok(())
}

fn push(rows: &mut Vec<Row>, part: &'static str, what: &str, side: &'static str, h: &Histogram<u64>) {
    rows.push(Row {
        part,
        what: what.into(),
        side,
        p50: h.value_at_quantile(0.5) as f64,
        p99: h.value_at_quantile(0.99) as f64,
        verbs_per_op: None,
        trips_per_op: None,
    });
}

fn regions(len: u64) -> Result<Arc<RegionTable>> {
    let r = Arc::new(RegionTable::new());
    r.insert(RegionMemory::anonymous(REGION, len)?)?;
    Ok(r)
}

/// A keyed NIC with one admitted client (number 1) granted `grants`
/// extents of 4 KiB, the first of them at offset 0.
fn keyed_nic(keyring: &Arc<Keyring>, grants: u64) -> Result<(TcpHost, Credential)> {
    let len = (grants.max(1) * 8192).next_multiple_of(1 << 20);
    let access = Arc::new(AccessTable::default());
    let host = TcpHost::spawn_with(
        "127.0.0.1:0".parse()?,
        regions(len)?,
        Authority::Keyring(keyring.clone()),
        access,
    )?;
    let incarnation = 7;
    let extents =
        (0..grants.max(1)).map(|i| Extent { region: REGION, offset: i * 8192, len: 4096 }).collect();
    for c in [
        AccessCommand::Reset { incarnation },
        AccessCommand::Admit { client: 1 },
        AccessCommand::Grant { client: 1, extents, write: true },
    ] {
        host.access().apply(&c);
    }
    let id = SessionId { incarnation, client: 1 };
    let secret = keyring.session_secret(incarnation, 1).context("a cluster key")?;
    Ok((host, Credential::Session { id, secret }))
}

fn connections(args: &AuthArgs, rows: &mut Vec<Row>) -> Result<()> {
    let keyring = Arc::new(Keyring::generate("cluster")?);
    let open = TcpHost::spawn("127.0.0.1:0".parse()?, regions(1 << 20)?)?;
    let (keyed, session) = keyed_nic(&keyring, 1)?;
    // The baseline: a listener that accepts and closes.
    let plain = TcpListener::bind("127.0.0.1:0")?;
    let plain_addr = plain.local_addr()?;
    std::thread::spawn(move || for _ in plain.incoming() {});
    let kinds: [(&str, SocketAddr, Option<Credential>); 4] = [
        ("tcp only", plain_addr, None),
        ("no key", open.local_addr(), Some(Credential::Anonymous)),
        ("key", keyed.local_addr(), Some(Credential::Key(keyring.first().clone()))),
        ("session", keyed.local_addr(), Some(session)),
    ];
    let mut hists: Vec<Histogram<u64>> = kinds.iter().map(|_| hist()).collect();
    for _ in 0..args.rounds {
        for _ in 0..args.connections / u64::from(args.rounds.max(1)) {
            for (i, (_, addr, cred)) in kinds.iter().enumerate() {
                let t = Instant::now();
                let mut s = TcpStream::connect(addr)?;
                s.set_nodelay(true)?;
                if let Some(c) = cred {
                    client_handshake(&mut s, c, TIMEOUT)?;
                }
                hists[i].record(ns(t.elapsed()))?;
            }
        }
    }
    for ((side, _, _), h) in kinds.iter().zip(&hists) {
        push(rows, "1 connection", "connect + handshake", side, h);
    }
    Ok(())
}

/// The access check alone, in-process: what a verb pays in the NIC.
fn check_cost(args: &AuthArgs, rows: &mut Vec<Row>) {
    let table = AccessTable::default();
    table.apply(&AccessCommand::Reset { incarnation: 7 });
    let extents =
        (0..args.grants.max(1)).map(|i| Extent { region: REGION, offset: i * 8192, len: 4096 }).collect();
    table.apply(&AccessCommand::Grant { client: 1, extents, write: true });
    let server = Principal::Anonymous;
    let session = Principal::Session(SessionId { incarnation: 7, client: 1 });
    // A grant in the middle of the table.
    let at = RemoteAddr::new(REGION, args.grants / 2 * 8192 + 64);
    let verb = Verb::Faa { addr: at, add: 1 };
    const BATCH: u64 = 1000;
    let mut hs = [hist(), hist()];
    for _ in 0..args.rounds {
        for (i, p) in [&server, &session].into_iter().enumerate() {
            for _ in 0..(args.verbs / BATCH).max(1) {
                let t = Instant::now();
                for _ in 0..BATCH {
                    let r = table.execute(p, std::hint::black_box(&verb), |_| Ok(VerbReply::Old(0)));
                    std::hint::black_box(r).expect("granted");
                }
                hs[i].record((ns(t.elapsed()) / BATCH).max(1)).expect("in bounds");
            }
        }
    }
    push(rows, "2 check", "access check", "server", &hs[0]);
    push(rows, "2 check", "access check", "session", &hs[1]);
}

fn verbs_end_to_end(args: &AuthArgs, rows: &mut Vec<Row>) -> Result<()> {
    let keyring = Arc::new(Keyring::generate("cluster")?);
    let (host, session) = keyed_nic(&keyring, args.grants)?;
    let opts = TcpOptions::default();
    let as_server = NodeCredentials {
        host: Credentials::new(Credential::Key(keyring.first().clone())),
        ..NodeCredentials::default()
    };
    let as_session = NodeCredentials { host: Credentials::new(session), ..NodeCredentials::default() };
    let eps = [
        ("server", Node::join_tcp_as(host.local_addr(), opts, as_server)?.endpoint()?),
        ("session", Node::join_tcp_as(host.local_addr(), opts, as_session)?.endpoint()?),
    ];
    let at = RemoteAddr::new(REGION, args.grants / 2 * 8192);
    let batch: Vec<Verb> = (0..16).map(|i| Verb::Read { addr: at + 8 * i, len: 8 }).collect();
    let mut single = [hist(), hist()];
    let mut batched = [hist(), hist()];
    for _ in 0..args.rounds {
        for (i, (_, ep)) in eps.iter().enumerate() {
            for _ in 0..args.verbs / u64::from(args.rounds.max(1)) {
                let t = Instant::now();
                ep.read_u64(at)?;
                single[i].record(ns(t.elapsed()))?;
            }
            for _ in 0..args.verbs / 16 / u64::from(args.rounds.max(1)) {
                let t = Instant::now();
                let r = ep.execute(&batch)?;
                anyhow::ensure!(r.iter().all(|r| r.is_ok()), "a batched read was refused");
                batched[i].record(ns(t.elapsed()))?;
            }
        }
    }
    for (i, (side, _)) in eps.iter().enumerate() {
        push(rows, "3 verbs", "8-byte read", side, &single[i]);
        push(rows, "3 verbs", "batch of 16 reads", side, &batched[i]);
    }
    Ok(())
}

/// An in-process cluster (meta-server and one data server on loopback,
/// no shm) with keys or without, and a client over tcp.
struct Cluster {
    _meta: MetaServer,
    _data: DataServer,
    client: FsClient,
}

fn cluster(keyring: Option<Arc<Keyring>>) -> Result<Cluster> {
    let mut cfg = MetaServerConfig::new("127.0.0.1:0".parse()?);
    cfg.keyring = keyring.clone();
    let meta = MetaServer::start(cfg)?;
    let data =
        DataServer::start_keyed("127.0.0.1:0".parse()?, meta.local_addr(), 256 << 20, None, keyring.clone())?;
    let mut config = ClientConfig::new(meta.local_addr());
    config.transport = Transport::Tcp;
    config.key = keyring.map(|r| r.first().clone());
    let client = FsClient::connect(config)?;
    Ok(Cluster { _meta: meta, _data: data, client })
}

fn fs_ops(args: &AuthArgs, rows: &mut Vec<Row>) -> Result<()> {
    const FILE: u64 = 16 << 20;
    let sides =
        [("no keys", cluster(None)?), ("keyed", cluster(Some(Arc::new(Keyring::generate("cluster")?)))?)];
    let mut files = Vec::new();
    for (_, c) in &sides {
        let ino = c.client.create(Caller::ROOT, Ino::ROOT, b"bench", FileKind::File, 0o644, 0)?.ino;
        c.client.open(ino)?;
        c.client.write(ino, 0, &vec![1u8; FILE as usize], false)?;
        let other = c.client.create(Caller::ROOT, Ino::ROOT, b"opened", FileKind::File, 0o644, 0)?.ino;
        c.client.open(other)?;
        c.client.write(other, 0, &[1; 4096], false)?;
        c.client.release(other)?;
        files.push((ino, other));
    }
    let kinds = ["4 KiB write", "4 KiB read", "fcntl lock + unlock", "open + close"];
    let mut hs: Vec<Vec<Histogram<u64>>> =
        sides.iter().map(|_| kinds.iter().map(|_| hist()).collect()).collect();
    let mut verbs = vec![vec![(0u64, 0u64, 0u64); kinds.len()]; sides.len()];
    let page = vec![7u8; 4096];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let per_round = (args.fs_ops / u64::from(args.rounds.max(1))).max(1);
    // Round 0 warms up, unmeasured: the first writes past a file's first
    // Citron tree make the tree host scale it up, and I/O that meets a
    // scale-up in progress costs more verbs; let both sides get past it.
    for round in 0..=args.rounds {
        for (s, (_, c)) in sides.iter().enumerate() {
            let (ino, other) = files[s];
            for (k, kind) in kinds.iter().enumerate() {
                let before = c.client.verb_counts();
                for _ in 0..per_round {
                    let off = next() % (FILE / 4096) * 4096;
                    let t = Instant::now();
                    match *kind {
                        "4 KiB write" => {
                            c.client.write(ino, off, &page, false)?;
                        }
                        "4 KiB read" => {
                            c.client.read(ino, off, 4096)?;
                        }
                        "fcntl lock + unlock" => {
                            let range = ByteRange::new(off, off + 4095).expect("a range");
                            let call = |mode| LockCall {
                                ino,
                                owner: LockOwner(1),
                                flavor: LockFlavor::Posix,
                                mode,
                                range,
                                pid: std::process::id(),
                                fh: 1,
                            };
                            c.client.setlk(&call(Some(LockMode::Write)))?;
                            c.client.setlk(&call(None))?;
                        }
                        _ => {
                            c.client.open(other)?;
                            c.client.release(other)?;
                        }
                    }
                    if round > 0 {
                        hs[s][k].record(ns(t.elapsed()))?;
                    }
                }
                if round == 0 {
                    continue;
                }
                let d = c.client.verb_counts() - before;
                let v = &mut verbs[s][k];
                v.0 += d.verbs();
                v.1 += d.round_trips;
                v.2 += per_round;
            }
        }
    }
    for (s, (side, _)) in sides.iter().enumerate() {
        for (k, kind) in kinds.iter().enumerate() {
            let h = &hs[s][k];
            let (v, rt, n) = verbs[s][k];
            rows.push(Row {
                part: "4 fs",
                what: (*kind).into(),
                side,
                p50: h.value_at_quantile(0.5) as f64,
                p99: h.value_at_quantile(0.99) as f64,
                verbs_per_op: Some(v as f64 / n as f64),
                trips_per_op: Some(rt as f64 / n as f64),
            });
        }
    }
    Ok(())
}
