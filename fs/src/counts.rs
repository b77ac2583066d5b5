//! Events counted by kind: live atomic counters ([`Counters`]) and the
//! `Copy` snapshots read from them ([`Counts`]), which subtract to what one
//! operation cost. One mechanism for every such count of metadata cost: the
//! client's metadata calls ([`crate::rpc_counts`]) and the mount's FUSE
//! requests (`citronfs_mount::FuseCounts`).
//!
//! A set of kinds is a plain enum declared with
//! [`counted_kinds!`](crate::counted_kinds), which also gives it its
//! [`Kind`] implementation: the list of kinds, their names, and the array
//! type a snapshot keeps its counts in. That array's length comes from the
//! list, so a snapshot is `Copy` and the counting types need no const
//! generic parameter: a crate names its counts `Counts<ItsKind>`.

use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A closed set of kinds of event, declared with
/// [`counted_kinds!`](crate::counted_kinds).
pub trait Kind: Copy + Eq + fmt::Debug + 'static {
    /// `[u64; ALL.len()]`: what a snapshot keeps its counts in.
    type Array: Copy + Eq + fmt::Debug + AsRef<[u64]> + AsMut<[u64]> + Send + Sync + 'static;
    /// An array of zeros.
    const ZEROS: Self::Array;
    /// Every kind, in declaration order: a kind's index in the counts.
    const ALL: &'static [Self];
    /// Kinds that are not the operations being measured (a client's
    /// background threads, say): left out of [`Counts::operations`] and
    /// [`Counts::describe`], still in [`Counts::total`].
    const BACKGROUND: &'static [Self];

    fn name(self) -> &'static str;

    /// Where this kind is counted: its place in [`Kind::ALL`].
    fn index(self) -> usize;
}

/// Declares a set of kinds: a fieldless enum with `ALL` (every kind, in
/// declaration order) and `name` (the variant's name), and its [`Kind`]
/// implementation. An optional `background: [...]` lists the kinds
/// [`Counts::operations`] and [`Counts::describe`] leave out.
///
/// For example, [`MetaKind`](crate::rpc_counts::MetaKind), whose counts
/// are [`RpcCounts`](crate::rpc_counts::RpcCounts):
///
/// ```text
/// counted_kinds! {
///     /// The kind of a [`MetaRequest`], without its arguments.
///     pub enum MetaKind { RegisterClient, DataServers, Heartbeat, ... }
///     background: [Heartbeat, ReportLockTiming, AwaitInvalidations]
/// }
/// pub type RpcCounts = Counts<MetaKind>;
/// ```
#[macro_export]
macro_rules! counted_kinds {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident { $($kind:ident),* $(,)? }
        $(background: [$($background:ident),* $(,)?])?
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        $vis enum $name {
            $($kind),*
        }

        impl $name {
            /// Every kind, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$kind),*];

            pub fn name(self) -> &'static str {
                match self {
                    $($name::$kind => stringify!($kind)),*
                }
            }
        }

        impl $crate::counts::Kind for $name {
            type Array = [u64; $name::ALL.len()];
            const ZEROS: Self::Array = [0; $name::ALL.len()];
            const ALL: &'static [Self] = $name::ALL;
            const BACKGROUND: &'static [Self] = &[$($($name::$background),*)?];

            fn name(self) -> &'static str {
                $name::name(self)
            }

            fn index(self) -> usize {
                self as usize
            }
        }
    };
}

/// Live counters, one per kind. Clones share the counters, so whoever
/// reads them may hold one while the counting side serves.
pub struct Counters<K: Kind> {
    live: Arc<[AtomicU64]>,
    kind: PhantomData<K>,
}

impl<K: Kind> Default for Counters<K> {
    fn default() -> Self {
        Self { live: K::ALL.iter().map(|_| AtomicU64::new(0)).collect(), kind: PhantomData }
    }
}

impl<K: Kind> Clone for Counters<K> {
    fn clone(&self) -> Self {
        Self { live: Arc::clone(&self.live), kind: PhantomData }
    }
}

impl<K: Kind> fmt::Debug for Counters<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Counters").field(&self.live).finish()
    }
}

impl<K: Kind> Counters<K> {
    pub fn count(&self, kind: K) {
        self.live[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Counts `kind` when the returned guard is dropped (at the end of the
    /// request's handling rather than its start).
    pub fn on_drop(&self, kind: K) -> CountOnDrop<'_, K> {
        CountOnDrop { counters: self, kind }
    }

    pub fn snapshot(&self) -> Counts<K> {
        let mut counts = K::ZEROS;
        for (c, live) in counts.as_mut().iter_mut().zip(self.live.iter()) {
            *c = live.load(Ordering::Relaxed);
        }
        Counts(counts)
    }
}

/// See [`Counters::on_drop`].
pub struct CountOnDrop<'a, K: Kind> {
    counters: &'a Counters<K>,
    kind: K,
}

impl<K: Kind> Drop for CountOnDrop<'_, K> {
    fn drop(&mut self) {
        self.counters.count(self.kind);
    }
}

/// Events by kind at one moment (or between two, by subtraction).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counts<K: Kind>(K::Array);

impl<K: Kind> Default for Counts<K> {
    fn default() -> Self {
        Self(K::ZEROS)
    }
}

impl<K: Kind> Counts<K> {
    pub fn get(&self, kind: K) -> u64 {
        self.0.as_ref()[kind.index()]
    }

    /// Every event, background ones included.
    pub fn total(&self) -> u64 {
        self.0.as_ref().iter().sum()
    }

    /// Events of the operations measured: the total without the
    /// background kinds ([`Kind::BACKGROUND`]).
    pub fn operations(&self) -> u64 {
        self.total() - K::BACKGROUND.iter().map(|k| self.get(*k)).sum::<u64>()
    }

    /// The kinds with events, by name, e.g. `Lookup=1 Create=1 Flush=1`
    /// (background kinds left out); `none` if there are none.
    pub fn describe(&self) -> String {
        let parts: Vec<String> = K::ALL
            .iter()
            .filter(|k| !K::BACKGROUND.contains(k) && self.get(**k) > 0)
            .map(|k| format!("{}={}", k.name(), self.get(*k)))
            .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(" ")
        }
    }
}

impl<K: Kind> std::ops::AddAssign for Counts<K> {
    fn add_assign(&mut self, other: Self) {
        for (a, b) in self.0.as_mut().iter_mut().zip(other.0.as_ref()) {
            *a += b;
        }
    }
}

impl<K: Kind> std::ops::Sub for Counts<K> {
    type Output = Counts<K>;
    fn sub(mut self, earlier: Self) -> Counts<K> {
        for (a, b) in self.0.as_mut().iter_mut().zip(earlier.0.as_ref()) {
            *a = a.saturating_sub(*b);
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    counted_kinds! {
        enum Toy { Read, Write, Tick }
        background: [Tick]
    }

    counted_kinds! {
        enum Plain { A, B }
    }

    #[test]
    fn snapshots_subtract_add_and_describe_without_the_background() {
        let c = Counters::<Toy>::default();
        let shared = c.clone();
        let before = c.snapshot();
        assert_eq!((before.total(), before.describe()), (0, "none".to_string()));
        shared.count(Toy::Write);
        shared.count(Toy::Write);
        drop(shared.on_drop(Toy::Read));
        c.count(Toy::Tick);
        let d = c.snapshot() - before;
        assert_eq!((d.get(Toy::Write), d.get(Toy::Read), d.total(), d.operations()), (2, 1, 4, 3));
        assert_eq!(d.describe(), "Read=1 Write=2");
        let mut sum = d;
        sum += d;
        assert_eq!((sum.get(Toy::Write), sum.total()), (4, 8));
        assert_eq!(before - d, Counts::default(), "differences saturate at zero");
    }

    #[test]
    fn kinds_without_background_count_every_event_as_an_operation() {
        let c = Counters::<Plain>::default();
        c.count(Plain::B);
        let s = c.snapshot();
        assert_eq!((s.total(), s.operations(), s.describe()), (1, 1, "B=1".to_string()));
        assert_eq!(Plain::ALL, &[Plain::A, Plain::B]);
        assert_eq!(<Plain as Kind>::BACKGROUND, &[] as &[Plain]);
    }
}
