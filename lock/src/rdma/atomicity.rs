//! A **test mode** of the verbs layer: remote read-modify-write verbs that are
//! atomic among themselves but *not* with the host CPU's own atomics, as on a
//! real RNIC (alock-spaa24.md §1 and Table 1: "RDMA RMW operations are not
//! atomic with local RMW operations ... from the perspective of local memory,
//! a remote RMW is nothing more than a read followed by a write").
//!
//! By default ([`RemoteAtomicity::WithHost`]) both backends execute a remote
//! CAS or FAA with a CPU atomic on the region's memory, so it is atomic with
//! everything, including the atomics the host's own threads apply through
//! [`RegionMemory::word`](super::RegionMemory::word). That hides exactly the
//! bug class ALock exists to avoid. A region registered with
//! [`RemoteAtomicity::NicOnly`] executes every remote RMW verb (`cas`, `faa`,
//! `masked_cas`, `masked_faa`, `ext_cas`, `ext_faa`, alone or in a batch) as
//!
//! 1. take the region's NIC mutex (remote RMWs stay atomic among themselves,
//!    as an RNIC's atomic unit serialises them),
//! 2. load the word,
//! 3. compute the new value; unless a compare failed (then nothing is
//!    written), yield the CPU ([`std::thread::yield_now`]): the window in
//!    which a host thread's CPU atomic can slip in,
//! 4. store the new value, release the NIC mutex, return the loaded value.
//!
//! A host thread's `compare_exchange` on the word does not take the NIC mutex,
//! so it can succeed inside step 3 and have its effect overwritten by step 4
//! (or the other way round): a lost update, as on hardware. Reads and writes
//! are unchanged (8-byte reads and writes are atomic with local accesses on
//! hardware too, Table 1).
//!
//! Where the mode lives:
//! * **tcp**: on the [`RegionMemory`](super::RegionMemory) the software NIC
//!   executes verbs on ([`RegionMemory::with_remote_atomicity`](super::RegionMemory::with_remote_atomicity));
//!   the NIC mutex is a word in the host process. "Remote" is the NIC's
//!   connection threads.
//! * **shm**: [`ShmHost::add_region_with`](super::ShmHost::add_region_with)
//!   publishes a page `region-<id>.nic` beside the region file before the
//!   region itself; every process that maps the region maps that page too and
//!   uses its first word as the NIC mutex. "Remote" is every process's verbs.
//!
//! Cost when off: one test of an `Option` that is `None` per RMW verb; the
//! emulation itself is a `#[cold]` function.
//!
//! Limits (it is a test mode): the NIC mutex is a spin lock that yields while
//! it waits. On shm it holds the holder's pid, and a waiter that has waited
//! for a second takes it over if that process is gone (a worker SIGKILLed
//! inside the window must not hang the others); a stopped but living holder
//! still blocks everyone's RMWs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::MmapRaw;
use portable_atomic::AtomicU128;

/// Whether remote RMW verbs on a region are atomic with the host's own CPU
/// atomics. See the module comment; `NicOnly` is a test mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum RemoteAtomicity {
    /// Remote RMWs are CPU atomics: atomic with everything (the default).
    #[default]
    WithHost,
    /// Remote RMWs are atomic only among remote verbs, as on a real RNIC:
    /// read, yield, write under a NIC-side mutex.
    NicOnly,
}

impl RemoteAtomicity {
    pub fn name(self) -> &'static str {
        match self {
            RemoteAtomicity::WithHost => "with-host",
            RemoteAtomicity::NicOnly => "nic-only",
        }
    }
}

/// Bytes of the shm file that holds a region's NIC mutex.
pub(crate) const NIC_PAGE: u64 = 4096;

/// How long a waiter for the NIC mutex waits before it checks whether the
/// holder's process still exists.
const TAKEOVER_AFTER: Duration = Duration::from_secs(1);

/// Where the NIC mutex word lives.
enum MutexWord {
    /// In this process (tcp: every remote verb runs in the host process).
    Private(Box<AtomicU64>),
    /// In a page shared by every process of a shm fabric.
    Shared(MmapRaw),
}

/// The NIC side of [`RemoteAtomicity::NicOnly`]: the mutex that serialises
/// remote RMWs, and the read-yield-write execution of each.
pub(crate) struct NicOnlyRmw {
    word: MutexWord,
    pid: u64,
}

impl NicOnlyRmw {
    /// A NIC mutex private to this process.
    pub fn private() -> Self {
        Self { word: MutexWord::Private(Box::new(AtomicU64::new(0))), pid: u64::from(std::process::id()) }
    }

    /// A NIC mutex in `page`, a shared mapping of at least 8 bytes.
    pub fn shared(page: MmapRaw) -> std::io::Result<Self> {
        if page.len() < 8 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "NIC mutex page too short"));
        }
        Ok(Self { word: MutexWord::Shared(page), pid: u64::from(std::process::id()) })
    }

    fn word(&self) -> &AtomicU64 {
        match &self.word {
            MutexWord::Private(w) => w,
            // SAFETY: the mapping is at least 8 bytes long (checked in
            // `shared`), page-aligned, lives as long as `self`, and every
            // process accesses its first word only through atomics.
            MutexWord::Shared(map) => unsafe { &*(map.as_mut_ptr() as *const AtomicU64) },
        }
    }

    /// Takes the NIC mutex. Acquire pairs with the Release in `unlock`, so
    /// one RMW's store is visible to the next RMW's load (they are SeqCst
    /// anyway; the mutex only needs to be a mutex).
    fn lock(&self) -> NicGuard<'_> {
        let w = self.word();
        let mut since: Option<Instant> = None;
        loop {
            match w.compare_exchange_weak(0, self.pid, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return NicGuard { word: w },
                Err(0) => continue,
                Err(holder) => {
                    let start = *since.get_or_insert_with(Instant::now);
                    if start.elapsed() > TAKEOVER_AFTER && !process_exists(holder) {
                        if w.compare_exchange(holder, self.pid, Ordering::Acquire, Ordering::Relaxed).is_ok()
                        {
                            log::warn!("NIC mutex taken over from vanished process {holder}");
                            return NicGuard { word: w };
                        }
                        since = None;
                    }
                    std::thread::yield_now();
                }
            }
        }
    }

    /// A remote 8-byte RMW: `apply` maps the old value to the new one, or to
    /// `None` when the verb leaves the word alone (a failed compare).
    #[cold]
    pub fn rmw64(&self, w: &AtomicU64, apply: impl FnOnce(u64) -> Option<u64>) -> u64 {
        let _nic = self.lock();
        let old = w.load(Ordering::SeqCst);
        if let Some(new) = apply(old) {
            std::thread::yield_now();
            w.store(new, Ordering::SeqCst);
        }
        old
    }

    /// A remote 16-byte RMW, as [`NicOnlyRmw::rmw64`].
    #[cold]
    pub fn rmw128(&self, w: &AtomicU128, apply: impl FnOnce(u128) -> Option<u128>) -> u128 {
        let _nic = self.lock();
        let old = w.load(Ordering::SeqCst);
        if let Some(new) = apply(old) {
            std::thread::yield_now();
            w.store(new, Ordering::SeqCst);
        }
        old
    }
}

struct NicGuard<'a> {
    word: &'a AtomicU64,
}

impl Drop for NicGuard<'_> {
    fn drop(&mut self) {
        self.word.store(0, Ordering::Release);
    }
}

/// Whether process `pid` of this host still exists (a pid that may have
/// been reused counts as existing).
pub fn process_exists(pid: u64) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return false };
    // SAFETY: kill with signal 0 sends nothing; it only checks that the
    // process exists (ESRCH if not). No memory is involved.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmw_applies_or_leaves_alone() {
        let nic = NicOnlyRmw::private();
        let w = AtomicU64::new(5);
        assert_eq!(nic.rmw64(&w, |old| Some(old + 1)), 5);
        assert_eq!(w.load(Ordering::SeqCst), 6);
        assert_eq!(nic.rmw64(&w, |_| None), 6);
        assert_eq!(w.load(Ordering::SeqCst), 6);
        let w = AtomicU128::new(1 << 100);
        assert_eq!(nic.rmw128(&w, |old| Some(old | 1)), 1 << 100);
        assert_eq!(w.load(Ordering::SeqCst), (1 << 100) | 1);
        assert_eq!(nic.word().load(Ordering::SeqCst), 0, "the NIC mutex is free again");
    }

    #[test]
    fn a_vanished_holder_is_taken_over() {
        let nic = NicOnlyRmw::private();
        // A pid above Linux's largest pid_max (2^22): no such process.
        nic.word().store(0x3FFF_FFFF, Ordering::SeqCst);
        let w = AtomicU64::new(0);
        let t = Instant::now();
        assert_eq!(nic.rmw64(&w, |_| Some(1)), 0);
        assert!(t.elapsed() >= TAKEOVER_AFTER);
        assert_eq!(nic.word().load(Ordering::SeqCst), 0);
    }
}
