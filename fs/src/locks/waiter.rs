//! Blocked lock requests (`F_SETLKW`, blocking `flock`) of one client,
//! served by one thread so that no FUSE worker waits (DESIGN.md §7).
//!
//! A request that finds a conflict registers a waiting record (with this
//! thread's mailbox) and is handed here with a completion. The thread then
//! tries it again
//! * when a releaser's [`LockMessage::Wake`] for its file arrives,
//! * at once when it is handed over (a wake may have come first),
//! * every [`RETRY_EVERY`] anyway (a releaser that died before sending);
//!
//! and, every [`WATCH_EVERY`], asks each request's `interrupted` probe
//! (the mount watches the caller's pending signals), withdrawing and
//! answering `EINTR` for those that were interrupted.
//!
//! A completion is called exactly once: granted, failed, interrupted, or
//! shut down.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use citron_lock::rdma::{ClientAddr, Endpoint, RemoteAddr};
use crossbeam_channel::{select, Receiver, Sender};

use super::area::LockArea;
use super::guard::LockTiming;
use super::plan::Request;
use super::protocol::{FileLocks, LockMessage, Outcome, Registration, WaitSpec};
use super::table::TableGrowth;
use super::waits_for::WaitsFor;
use crate::error::FsError;
use crate::types::{ClientId, Ino};

/// How often pending requests are checked for interruption.
pub const WATCH_EVERY: Duration = Duration::from_millis(10);
/// How often every pending request is retried without a wake-up.
pub const RETRY_EVERY: Duration = Duration::from_millis(500);

/// Called once with the request's result.
pub type LockDone = Box<dyn FnOnce(Result<(), FsError>) + Send>;
/// Whether the waiting caller has been interrupted (or is gone).
pub type Interrupted = Box<dyn Fn() -> bool + Send>;

/// One blocked request.
pub struct Pending {
    pub ino: Ino,
    pub area: LockArea,
    pub table: RemoteAddr,
    pub req: Request,
    pub registration: Registration,
    pub interrupted: Interrupted,
    pub done: LockDone,
}

/// What the waiter thread needs from its client.
pub trait WaiterContext: Send + Sync + 'static {
    fn client(&self) -> ClientId;
    fn timing(&self) -> LockTiming;
    fn waits_for(&self) -> WaitsFor;
    /// Grows `ino`'s table (an RPC to the meta-server).
    fn growth(&self, ino: Ino) -> Box<dyn TableGrowth + '_>;
}

/// The client's side of its waiter thread.
pub struct Waiters {
    mailbox: ClientAddr,
    handoff: Sender<Pending>,
    stop: Arc<AtomicBool>,
    thread: parking_lot::Mutex<Option<JoinHandle<()>>>,
}

impl Waiters {
    /// Starts the thread on `ep` (whose mailbox waiting records name).
    pub fn start(ep: Endpoint, context: Arc<dyn WaiterContext>) -> std::io::Result<Self> {
        let mailbox = ep.addr();
        let (handoff, incoming) = crossbeam_channel::unbounded();
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("citronfs-lock-waiter".into())
                .spawn(move || WaiterThread { ep, context, incoming, pending: Vec::new(), stop }.run())?
        };
        Ok(Self { mailbox, handoff, stop, thread: parking_lot::Mutex::new(Some(thread)) })
    }

    /// Where waiting records of this client are woken.
    pub fn mailbox(&self) -> ClientAddr {
        self.mailbox
    }

    /// Hands a registered request to the thread.
    pub fn wait(&self, pending: Pending) {
        if let Err(e) = self.handoff.send(pending) {
            // The thread is gone (shutting down): answer now.
            (e.0.done)(Err(FsError::Io("the lock waiter has stopped".into())));
        }
    }
}

impl Waiters {
    /// Stops the thread: every request still waiting is answered with an
    /// error (EIO at the mount), and later ones at once. Returns when the
    /// answers are given.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

impl Drop for Waiters {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct WaiterThread {
    ep: Endpoint,
    context: Arc<dyn WaiterContext>,
    incoming: Receiver<Pending>,
    pending: Vec<Pending>,
    stop: Arc<AtomicBool>,
}

impl WaiterThread {
    fn run(mut self) {
        let mut last_sweep = Instant::now();
        while !self.stop.load(Ordering::Relaxed) {
            let mut dirty: HashSet<Ino> = HashSet::new();
            let mut fresh = Vec::new();
            select! {
                recv(self.incoming) -> p => match p {
                    Ok(p) => fresh.push(p),
                    Err(_) => break,
                },
                recv(self.ep.inbox()) -> m => if let Ok(m) = m {
                    self.ep.count_received();
                    match LockMessage::decode(&m.payload) {
                        Ok(LockMessage::Wake { ino }) => { dirty.insert(ino); }
                        Err(e) => log::warn!("from {}: {e}", m.from),
                    }
                },
                default(WATCH_EVERY) => {},
            }
            // Take whatever else is queued without waiting.
            fresh.extend(self.incoming.try_iter());
            while let Ok(m) = self.ep.inbox().try_recv() {
                self.ep.count_received();
                if let Ok(LockMessage::Wake { ino }) = LockMessage::decode(&m.payload) {
                    dirty.insert(ino);
                }
            }
            let sweep = last_sweep.elapsed() >= RETRY_EVERY;
            if sweep {
                last_sweep = Instant::now();
            }
            let mut kept = Vec::with_capacity(self.pending.len() + fresh.len());
            // A new request is retried at once: its wake may have come before
            // it was handed over.
            dirty.extend(fresh.iter().map(|p| p.ino));
            let all: Vec<Pending> = self.pending.drain(..).chain(fresh).collect();
            for p in all {
                // `Some` keeps the request waiting.
                let still_waiting = if (p.interrupted)() {
                    self.interrupt(p);
                    None
                } else if sweep || dirty.contains(&p.ino) {
                    self.retry(p)
                } else {
                    Some(p)
                };
                kept.extend(still_waiting);
            }
            self.pending = kept;
        }
        let queued: Vec<Pending> = self.incoming.try_iter().collect();
        for p in self.pending.drain(..).chain(queued) {
            (p.done)(Err(FsError::Io("the mount is shutting down".into())));
        }
    }

    fn locks<'a>(
        &'a self,
        p: &Pending,
        timing: &'a LockTiming,
        growth: &'a dyn TableGrowth,
    ) -> FileLocks<'a> {
        FileLocks {
            ep: &self.ep,
            client: self.context.client(),
            ino: p.ino,
            area: p.area,
            table: p.table,
            timing,
            waits_for: self.context.waits_for(),
            growth,
        }
    }

    /// Tries a request again; `Some` if it still waits.
    fn retry(&self, mut p: Pending) -> Option<Pending> {
        let timing = self.context.timing();
        let growth = self.context.growth(p.ino);
        let locks = self.locks(&p, &timing, &*growth);
        let spec = WaitSpec { mailbox: self.ep.addr(), registered: Some(p.registration) };
        match locks.set(&p.req, Some(spec)) {
            Ok(Outcome::Granted) => {
                (p.done)(Ok(()));
                None
            }
            Ok(Outcome::Waiting { registration, .. }) => {
                p.registration = registration;
                Some(p)
            }
            Ok(Outcome::Refused(_)) => {
                (p.done)(Err(FsError::WouldBlock));
                None
            }
            Err(e) => {
                if e != FsError::Deadlock {
                    if let Err(c) = locks.cancel(&p.req, p.registration) {
                        log::warn!("withdrawing a failed lock wait on inode {}: {c}", p.ino.0);
                    }
                }
                (p.done)(Err(e));
                None
            }
        }
    }

    fn interrupt(&self, p: Pending) {
        let timing = self.context.timing();
        let growth = self.context.growth(p.ino);
        let locks = self.locks(&p, &timing, &*growth);
        if let Err(e) = locks.cancel(&p.req, p.registration) {
            log::warn!("withdrawing an interrupted lock wait on inode {}: {e}", p.ino.0);
        }
        (p.done)(Err(FsError::Interrupted));
    }
}
