//! Lease renewal ahead of everything else the host runs: a mount
//! starved of CPU keeps its lease.
//!
//! A client fences itself when it has not renewed its lease for 3/4 of it,
//! and the meta-server drops it after a whole lease. On an HPC node whose
//! cores are kept busy by other programs (often at a higher priority than a
//! file-system daemon), a renewal thread at the ordinary priority can wait
//! seconds for a core: measured on this 2-core machine with a 1 s lease, a
//! mount at nice 19 beside four busy loops at nice −20 lost its lease every
//! 2–4 s and answered EIO to every write.
//!
//! So the renewal thread asks for the real-time round-robin class at its
//! lowest priority. It sleeps between renewals and does a few microseconds
//! of work per renewal (one RPC; the RPC layer spins at most its 50 µs
//! `POLL_BUDGET` for the answer before blocking),
//! so it cannot starve anyone: a real-time thread that blocks gives the core
//! back at once, and the kernel's real-time throttling bounds it anyway.
//! Without `CAP_SYS_NICE` (an unprivileged mount) it tries the best
//! ordinary priority it may take, and failing that keeps the one it has;
//! each case is logged once, so an operator can see why a starved mount
//! lost its lease.

/// The real-time priority asked for: the lowest of `SCHED_RR`, above every
/// ordinary (`SCHED_OTHER`) thread and below any real-time work the host
/// already runs.
const RENEWAL_RT_PRIORITY: libc::c_int = 1;

/// How the renewal thread ended up being scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RenewalPriority {
    /// `SCHED_RR` at [`RENEWAL_RT_PRIORITY`].
    RealTime,
    /// An ordinary thread at this nice value (the lowest allowed).
    Nice(libc::c_int),
    /// Unchanged: nothing better was allowed.
    Unchanged,
}

/// Raises the calling thread's scheduling priority as far as this process
/// may (see the module header). Only the calling thread is changed.
pub(super) fn raise_calling_thread() -> RenewalPriority {
    let param = libc::sched_param { sched_priority: RENEWAL_RT_PRIORITY };
    // SAFETY: `param` is a valid `sched_param` for the duration of the call;
    // pid 0 names the calling thread (Linux schedules threads).
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_RR, &param) } == 0 {
        log::info!("lease renewal runs at real-time priority (SCHED_RR {RENEWAL_RT_PRIORITY})");
        return RenewalPriority::RealTime;
    }
    let rt_error = std::io::Error::last_os_error();
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    // The nice values an unprivileged thread may take without
    // `CAP_SYS_NICE` go down only as far as RLIMIT_NICE allows; try from the
    // best down to the current one.
    // SAFETY: getpriority with a valid `which`/`who` has no preconditions
    // (its −1 is ambiguous with an error, and only used as a bound here).
    let current = unsafe { libc::getpriority(libc::PRIO_PROCESS, tid as libc::id_t) };
    for nice in -20..current {
        // SAFETY: as above; changes only the calling thread's nice value.
        if unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice) } == 0 {
            log::warn!(
                "lease renewal cannot run at real-time priority ({rt_error}); it runs at nice \
                 {nice}: a mount starved of CPU may lose its lease"
            );
            return RenewalPriority::Nice(nice);
        }
    }
    log::warn!(
        "lease renewal cannot raise its priority ({rt_error}): a mount starved of CPU may lose \
         its lease"
    );
    RenewalPriority::Unchanged
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The thread ends up at least as well placed as it started, and the
    /// answer says truly where: a real-time class, or the nice value the
    /// kernel reports.
    #[test]
    fn the_answer_matches_the_threads_scheduling() {
        std::thread::spawn(|| {
            let got = raise_calling_thread();
            // SAFETY: pid 0 is the calling thread.
            let policy = unsafe { libc::sched_getscheduler(0) };
            // SAFETY: gettid and getpriority have no preconditions.
            let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
            match got {
                RenewalPriority::RealTime => assert_eq!(policy, libc::SCHED_RR),
                RenewalPriority::Nice(n) => {
                    assert_eq!(policy, libc::SCHED_OTHER);
                    assert_eq!(nice, n);
                }
                RenewalPriority::Unchanged => assert_eq!(policy, libc::SCHED_OTHER),
            }
        })
        .join()
        .unwrap();
    }
}
