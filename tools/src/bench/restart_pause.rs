//! What a meta-server restart costs the applications of a mount that rides
//! through it (`citronfs bench restart`, its second table): a client with
//! a file open writes and reads 4 KiB in a loop and stats the root; the
//! meta-server stops and is started again on the same state directory and
//! port; the figure is the longest gap between two calls that answered,
//! and the calls that failed (none should).
//!
//! The meta-server is stopped by dropping it, which cuts every connection
//! as a crash does; its process lives on (a SIGKILL's restart is timed by
//! the restart tests' processes, not here). The pause is bounded below by
//! the grace period's quiet start (half a lease) and by the heartbeat that
//! notices the restart (a quarter lease).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use citronfs_core::client::{ClientConfig, FsClient, Transport};
use citronfs_core::types::{Caller, Ino};
use citronfs_meta_server::{DataServer, MetaServer, MetaServerConfig};

/// One measured restart.
pub struct Pause {
    pub transport: &'static str,
    pub lease: Duration,
    /// The longest time between two answered calls, across the restart.
    pub longest_gap: Duration,
    /// From the stop to the first call answered by the new process.
    pub stop_to_answer: Duration,
    pub calls: u64,
    pub failed: u64,
}

/// Restarts a meta-server under a working client once.
pub fn measure(transport: Transport, lease: Duration) -> Result<Pause> {
    let state = tempfile::Builder::new().prefix("citronfs-bench-pause-").tempdir_in("/dev/shm")?;
    let listen: SocketAddr = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?;
    let mut cfg = MetaServerConfig::new(listen);
    cfg.state_dir = Some(state.path().into());
    cfg.lease = lease;
    if transport == Transport::Auto {
        cfg.shm = Some(format!("pause-{}", std::process::id()));
    }
    let meta = MetaServer::start(cfg.clone()).context("meta-server")?;
    let _data = DataServer::start("127.0.0.1:0".parse()?, listen, 64 << 20, None).context("data server")?;
    let mut config = ClientConfig::new(listen);
    config.transport = transport;
    let client = Arc::new(FsClient::connect(config).context("client")?);
    let file = client.create_open(Caller::ROOT, Ino::ROOT, b"pause", 0o644)?.ino;

    let stop = Arc::new(AtomicBool::new(false));
    let answered = Arc::new(Mutex::new(Vec::<Instant>::new()));
    let failed = Arc::new(AtomicU64::new(0));
    let worker = {
        let (client, stop, answered, failed) =
            (client.clone(), stop.clone(), answered.clone(), failed.clone());
        std::thread::spawn(move || {
            let block = vec![7u8; 4096];
            for i in 0u64.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let at = (i % 256) * 4096;
                let r = client
                    .write(file, at, &block, false)
                    .and_then(|_| client.read(file, at, 4096))
                    .and_then(|_| client.getattr(Ino::ROOT));
                match r {
                    Ok(_) => answered.lock().unwrap().push(Instant::now()),
                    Err(e) => {
                        log::warn!("a call failed across the restart: {e}");
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        })
    };
    std::thread::sleep(Duration::from_secs(1));
    let stopped = Instant::now();
    drop(meta);
    let _meta = MetaServer::start(cfg).context("the meta-server again")?;
    // Until the client has gone on for a while after the restart.
    let deadline = Instant::now() + Duration::from_secs(120);
    while answered.lock().unwrap().iter().filter(|t| **t > stopped).count() < 200 && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let _ = worker.join();
    client.release(file)?;
    let answered = answered.lock().unwrap();
    let longest_gap = answered.windows(2).map(|w| w[1] - w[0]).max().unwrap_or_default();
    let stop_to_answer = answered.iter().find(|t| **t > stopped).map_or(Duration::MAX, |t| *t - stopped);
    Ok(Pause {
        transport: if transport == Transport::Tcp { "tcp" } else { "shm" },
        lease,
        longest_gap,
        stop_to_answer,
        calls: answered.len() as u64,
        failed: failed.load(Ordering::Relaxed),
    })
}
