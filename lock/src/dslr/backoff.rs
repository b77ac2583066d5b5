//! Waiting without a verb: [`pause`] (a yielding spin for short waits, a
//! sleep for long ones) and the truncated binary exponential random
//! backoff of Appendix A.3 ([`RandomBackoff`]). The other locks of this
//! crate wait with them too.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::time::{Duration, Instant};

/// Below this a wait spins (yielding); above it the thread sleeps.
const SPIN_LIMIT: Duration = Duration::from_micros(50);

/// Waits `d`: yielding spin for short waits, sleep for long ones.
pub fn pause(d: Duration) {
    if d >= SPIN_LIMIT {
        std::thread::sleep(d);
    } else {
        let t = Instant::now();
        while t.elapsed() < d {
            std::thread::yield_now();
        }
    }
}

/// Truncated binary exponential random backoff (Appendix A.3): after the
/// c-th consecutive failure wait W uniform in `[0, min(R · 2^(c−1), L)]`.
#[derive(Debug)]
pub struct RandomBackoff {
    base: Duration,
    cap: Duration,
    failures: u32,
    rng: u64,
}

impl RandomBackoff {
    pub fn new(base: Duration, cap: Duration) -> Self {
        let mut h = RandomState::new().build_hasher();
        h.write_u64(base.as_nanos() as u64);
        Self { base, cap: cap.max(base), failures: 0, rng: h.finish() | 1 }
    }

    /// The window the next wait is drawn from.
    pub fn window(&self) -> Duration {
        let doublings = self.failures.saturating_sub(1).min(30);
        self.base.saturating_mul(1 << doublings).min(self.cap)
    }

    /// Records a failure and waits; returns the wait.
    pub fn wait(&mut self) -> Duration {
        self.failures += 1;
        let window = self.window().as_nanos() as u64;
        // xorshift64*: plenty for spreading retries.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        let r = self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D);
        let w = Duration::from_nanos(r % (window + 1));
        pause(w);
        w
    }

    /// After a success.
    pub fn reset(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_window_doubles_up_to_the_cap() {
        let mut b = RandomBackoff::new(Duration::from_nanos(10), Duration::from_nanos(50));
        assert_eq!(b.window(), Duration::from_nanos(10));
        let mut windows = Vec::new();
        for _ in 0..5 {
            b.failures += 1;
            windows.push(b.window().as_nanos());
        }
        assert_eq!(windows, [10, 20, 40, 50, 50]);
        assert!(b.wait() <= Duration::from_nanos(50));
        b.reset();
        assert_eq!(b.window(), Duration::from_nanos(10));
    }
}
