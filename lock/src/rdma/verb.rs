//! Verbs: what an endpoint asks of remote memory, what comes back, and the
//! per-kind counts that make verbs-per-operation a figure of merit.

use std::ops::{Add, AddAssign, Sub};

use serde::{Deserialize, Serialize};

use super::addr::RemoteAddr;

/// Largest payload of one `read` or `write` verb (a wire frame must hold it).
pub const MAX_TRANSFER: u64 = 8 << 20;

/// A one-sided verb. Atomics are 8 bytes at an 8-aligned address, or 16 bytes
/// at a 16-aligned address for the extended forms; reads and writes take any
/// length up to [`MAX_TRANSFER`] inside the region.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verb {
    Read {
        addr: RemoteAddr,
        len: u32,
    },
    Write {
        addr: RemoteAddr,
        #[serde(with = "super::codec::bytes")]
        data: Vec<u8>,
    },
    /// Compare-and-swap of the whole word; returns the old value.
    Cas {
        addr: RemoteAddr,
        expect: u64,
        new: u64,
    },
    /// Fetch-and-add on the whole word; returns the old value.
    Faa {
        addr: RemoteAddr,
        add: u64,
    },
    /// Masked compare-and-swap ([`super::arith::masked_cas_u64`]); returns the old value.
    MaskedCas {
        addr: RemoteAddr,
        cmp: u64,
        cmp_mask: u64,
        swap: u64,
        swap_mask: u64,
    },
    /// Masked fetch-and-add ([`super::arith::masked_faa_u64`]); returns the old value.
    MaskedFaa {
        addr: RemoteAddr,
        add: u64,
        boundary_mask: u64,
    },
    /// 16-byte masked compare-and-swap; returns the old value.
    ExtCas {
        addr: RemoteAddr,
        cmp: u128,
        cmp_mask: u128,
        swap: u128,
        swap_mask: u128,
    },
    /// 16-byte masked fetch-and-add; returns the old value.
    ExtFaa {
        addr: RemoteAddr,
        add: u128,
        boundary_mask: u128,
    },
    /// Makes `[addr, addr + len)` durable where the host keeps the region:
    /// `msync(MS_SYNC)` of that range of a region that maps a file, nothing
    /// for anonymous memory (and next to nothing for a file on tmpfs).
    /// Returns [`VerbReply::Written`] once done. Executed by the host's CPU
    /// (an RNIC has no such verb here), or on shm by the caller's, whose
    /// mapping shares the file's pages.
    Flush {
        addr: RemoteAddr,
        len: u64,
    },
}

impl Verb {
    pub fn addr(&self) -> RemoteAddr {
        match *self {
            Verb::Read { addr, .. }
            | Verb::Write { addr, .. }
            | Verb::Cas { addr, .. }
            | Verb::Faa { addr, .. }
            | Verb::MaskedCas { addr, .. }
            | Verb::MaskedFaa { addr, .. }
            | Verb::ExtCas { addr, .. }
            | Verb::ExtFaa { addr, .. }
            | Verb::Flush { addr, .. } => addr,
        }
    }

    pub fn kind(&self) -> VerbKind {
        match self {
            Verb::Read { .. } => VerbKind::Read,
            Verb::Write { .. } => VerbKind::Write,
            Verb::Cas { .. } => VerbKind::Cas,
            Verb::Faa { .. } => VerbKind::Faa,
            Verb::MaskedCas { .. } => VerbKind::MaskedCas,
            Verb::MaskedFaa { .. } => VerbKind::MaskedFaa,
            Verb::ExtCas { .. } => VerbKind::ExtCas,
            Verb::ExtFaa { .. } => VerbKind::ExtFaa,
            Verb::Flush { .. } => VerbKind::Flush,
        }
    }
}

/// What a verb returns on success.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum VerbReply {
    Data(#[serde(with = "super::codec::bytes")] Vec<u8>),
    Written,
    /// The old value of an 8-byte atomic.
    Old(u64),
    /// The old value of a 16-byte atomic.
    Old128(u128),
}

/// The kinds of verbs, for counting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum VerbKind {
    Read,
    Write,
    Cas,
    Faa,
    MaskedCas,
    MaskedFaa,
    ExtCas,
    ExtFaa,
    Flush,
}

impl VerbKind {
    pub const ALL: [VerbKind; 9] = [
        VerbKind::Read,
        VerbKind::Write,
        VerbKind::Cas,
        VerbKind::Faa,
        VerbKind::MaskedCas,
        VerbKind::MaskedFaa,
        VerbKind::ExtCas,
        VerbKind::ExtFaa,
        VerbKind::Flush,
    ];

    pub fn is_atomic(self) -> bool {
        !matches!(self, VerbKind::Read | VerbKind::Write | VerbKind::Flush)
    }

    pub fn name(self) -> &'static str {
        match self {
            VerbKind::Read => "read",
            VerbKind::Write => "write",
            VerbKind::Cas => "cas",
            VerbKind::Faa => "faa",
            VerbKind::MaskedCas => "masked_cas",
            VerbKind::MaskedFaa => "masked_faa",
            VerbKind::ExtCas => "ext_cas",
            VerbKind::ExtFaa => "ext_faa",
            VerbKind::Flush => "flush",
        }
    }
}

/// Counts of verbs issued, by kind, plus round trips and two-sided messages.
///
/// A round trip is one wait for the network: a single verb, or a whole batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerbCounts {
    pub by_kind: [u64; 9],
    pub round_trips: u64,
    pub messages_sent: u64,
    pub messages_received: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
}

impl VerbCounts {
    pub fn get(&self, kind: VerbKind) -> u64 {
        self.by_kind[kind as usize]
    }

    pub fn atomics(&self) -> u64 {
        VerbKind::ALL.iter().filter(|k| k.is_atomic()).map(|&k| self.get(k)).sum()
    }

    pub fn reads(&self) -> u64 {
        self.get(VerbKind::Read)
    }

    pub fn writes(&self) -> u64 {
        self.get(VerbKind::Write)
    }

    pub fn verbs(&self) -> u64 {
        self.by_kind.iter().sum()
    }
}

impl Add for VerbCounts {
    type Output = VerbCounts;
    fn add(mut self, rhs: VerbCounts) -> VerbCounts {
        self += rhs;
        self
    }
}

impl AddAssign for VerbCounts {
    fn add_assign(&mut self, rhs: VerbCounts) {
        for (a, b) in self.by_kind.iter_mut().zip(rhs.by_kind) {
            *a += b;
        }
        self.round_trips += rhs.round_trips;
        self.messages_sent += rhs.messages_sent;
        self.messages_received += rhs.messages_received;
        self.bytes_read += rhs.bytes_read;
        self.bytes_written += rhs.bytes_written;
    }
}

impl Sub for VerbCounts {
    type Output = VerbCounts;
    /// The counts between two snapshots of the same counter (`later - earlier`).
    fn sub(self, rhs: VerbCounts) -> VerbCounts {
        let mut out = self;
        for (a, b) in out.by_kind.iter_mut().zip(rhs.by_kind) {
            *a -= b;
        }
        out.round_trips -= rhs.round_trips;
        out.messages_sent -= rhs.messages_sent;
        out.messages_received -= rhs.messages_received;
        out.bytes_read -= rhs.bytes_read;
        out.bytes_written -= rhs.bytes_written;
        out
    }
}
