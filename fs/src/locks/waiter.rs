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
//! A pending request holds its file's table address, which is valid only
//! while the file is open on this client: before the client's last release
//! of a file, [`Waiters::cancel_file`] withdraws the file's requests (a
//! caller the kernel abandoned, e.g. SIGKILLed while it waited) and waits
//! until that is done. A request of an older registration of the client
//! (its lease was lost, the meta-server removed its records) is answered
//! EIO without touching lock memory.
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

/// What the client hands its waiter thread.
enum Handoff {
    Wait(Box<Pending>),
    /// Withdraw every request on this file, then answer on the channel.
    Cancel(Ino, Sender<()>),
}

/// How long the last release of a file waits for its waits to be withdrawn
/// (the waiter thread may be in the middle of one retry).
const CANCEL_WAIT: Duration = Duration::from_secs(30);

/// The client's side of its waiter thread.
pub struct Waiters {
    mailbox: ClientAddr,
    handoff: Sender<Handoff>,
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
        if let Err(e) = self.handoff.send(Handoff::Wait(Box::new(pending))) {
            // The thread is gone (shutting down): answer now.
            if let Handoff::Wait(p) = e.0 {
                (p.done)(Err(FsError::Io("the lock waiter has stopped".into())));
            }
        }
    }

    /// Withdraws every request waiting on `ino` (answered
    /// [`FsError::Interrupted`]) and returns once they are withdrawn: after
    /// this the thread holds no address of the file's lock memory.
    pub fn cancel_file(&self, ino: Ino) {
        let (ack, acked) = crossbeam_channel::bounded(1);
        if self.handoff.send(Handoff::Cancel(ino, ack)).is_err() {
            return; // stopped: it holds nothing
        }
        if acked.recv_timeout(CANCEL_WAIT).is_err() {
            log::error!("the lock waiter did not withdraw the waits on inode {} in {CANCEL_WAIT:?}", ino.0);
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
    incoming: Receiver<Handoff>,
    pending: Vec<Pending>,
    stop: Arc<AtomicBool>,
}

impl WaiterThread {
    fn run(mut self) {
        let mut last_sweep = Instant::now();
        while !self.stop.load(Ordering::Relaxed) {
            let mut dirty: HashSet<Ino> = HashSet::new();
            let mut fresh = Vec::new();
            let mut cancels = Vec::new();
            select! {
                recv(self.incoming) -> h => match h {
                    Ok(Handoff::Wait(p)) => fresh.push(*p),
                    Ok(Handoff::Cancel(ino, ack)) => cancels.push((ino, ack)),
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
            for h in self.incoming.try_iter() {
                match h {
                    Handoff::Wait(p) => fresh.push(*p),
                    Handoff::Cancel(ino, ack) => cancels.push((ino, ack)),
                }
            }
            if !cancels.is_empty() {
                let all: Vec<Pending> = self.pending.drain(..).chain(fresh.drain(..)).collect();
                for p in all {
                    if cancels.iter().any(|(ino, _)| *ino == p.ino) {
                        self.interrupt(p);
                    } else {
                        self.pending.push(p);
                    }
                }
                for (_, ack) in cancels {
                    let _ = ack.send(());
                }
            }
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
                let still_waiting = if p.req.owner.client != self.context.client() {
                    // The client lost its lease since: the meta-server has
                    // removed this wait, and the file may be another's now.
                    (p.done)(Err(FsError::Io("lease lost while waiting for a lock".into())));
                    None
                } else if (p.interrupted)() {
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
        for p in self.pending.drain(..) {
            (p.done)(Err(FsError::Io("the mount is shutting down".into())));
        }
        // Requests and cancellations still queued: nothing is held any more.
        for h in self.incoming.try_iter() {
            match h {
                Handoff::Wait(p) => (p.done)(Err(FsError::Io("the mount is shutting down".into()))),
                Handoff::Cancel(_, ack) => drop(ack.send(())),
            }
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
        if p.req.owner.client != self.context.client() {
            (p.done)(Err(FsError::Interrupted));
            return;
        }
        let timing = self.context.timing();
        let growth = self.context.growth(p.ino);
        let locks = self.locks(&p, &timing, &*growth);
        if let Err(e) = locks.cancel(&p.req, p.registration) {
            log::warn!("withdrawing an interrupted lock wait on inode {}: {e}", p.ino.0);
        }
        (p.done)(Err(FsError::Interrupted));
    }
}
