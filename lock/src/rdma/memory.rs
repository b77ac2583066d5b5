//! Registered memory: one region, its bounds and alignment checks, and the
//! execution of verbs on it.
//!
//! Every backend ends here. The shm backend maps the same region file in every
//! process and calls these methods from the client; the tcp host calls them
//! from its connection threads; the host's own threads (ALock's local cohort)
//! use [`RegionMemory::word`] directly. One implementation, one set of checks.
//!
//! The atomic methods (`cas`, `faa`, the masked and extended forms, and
//! `execute`) are the *NIC's* atomics: what a remote verb does. Host threads
//! use [`RegionMemory::word`]. The difference matters only for a region in the
//! test mode [`RemoteAtomicity::NicOnly`] (see [`super::atomicity`]), whose
//! remote RMWs are not atomic with the host's CPU atomics.
//!
//! # Memory model
//!
//! All atomics and word accesses use `SeqCst`. The verbs layer models an RNIC
//! executing verbs one after another on coherent memory, and the lock
//! algorithms above it argue in terms of verb order, not CPU fences; giving
//! every verb the strongest ordering makes that reasoning valid on the shm
//! backend as it is on the wire. The price (an `xchg` for a word store on
//! x86) is small next to what a verb costs on any real transport.
//!
//! Reads and writes that are 8-aligned, a multiple of 8 bytes and at most
//! [`WORD_ACCESS_LIMIT`] long are done word by word with atomic loads and
//! stores, so a lock word read by `read` is never torn. Longer or unaligned
//! transfers are bulk copies: like an RDMA READ or WRITE, they are not atomic,
//! and the data they move must be protected by a lock (file data under the
//! Citron range lock).

use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

use memmap2::{MmapOptions, MmapRaw};
use portable_atomic::AtomicU128;

use super::addr::{RegionId, RemoteAddr};
use super::arith;
use super::atomicity::{NicOnlyRmw, RemoteAtomicity, NIC_PAGE};
use super::error::VerbError;
use super::verb::{Verb, VerbReply, MAX_TRANSFER};

/// Transfers up to this many bytes (8-aligned, multiple of 8) are word-atomic.
pub const WORD_ACCESS_LIMIT: usize = 4096;

/// Bulk writes of at least this many bytes into a region that maps a file
/// (the shm backend's) go through `pwrite(2)` on the file instead of a copy
/// into the mapping.
///
/// Why: a data server's region is sparse until written (capacity like
/// tmpfs), so a copy into fresh pages takes one page fault per 4 KiB, each
/// of which allocates the page, zeroes it and maps it; `pwrite` allocates
/// the pages in one call without faults and without zeroing pages it fills
/// whole — the path a tmpfs write takes. A sequential write of fresh space
/// ran 1.5× faster (`citronfs bench io`, 1 MiB blocks). Below this size the
/// call's fixed cost is not worth it on pages that are already mapped.
/// And a full shm file system answers `ENOSPC` ([`VerbError::NoMemory`])
/// instead of killing the writer with `SIGBUS`.
///
/// Ordering: the kernel's stores are done when the call returns, before any
/// later verb of this thread (such as the store that releases the range
/// lock), so readers that take the lock after it see them, as with a copy.
pub const BULK_WRITE_BY_SYSCALL: usize = 64 << 10;

/// One region of registered memory, mapped into this process.
pub struct RegionMemory {
    id: RegionId,
    map: MmapRaw,
    len: u64,
    /// `Some` in the test mode [`RemoteAtomicity::NicOnly`].
    nic_only: Option<Box<NicOnlyRmw>>,
    /// The file a shared region maps, for bulk writes
    /// ([`BULK_WRITE_BY_SYSCALL`]).
    backing: Option<File>,
}

impl std::fmt::Debug for RegionMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionMemory")
            .field("id", &self.id)
            .field("len", &self.len)
            .field("remote_atomicity", &self.remote_atomicity())
            .finish()
    }
}

impl RegionMemory {
    /// A zeroed region in private anonymous memory (the tcp host's default).
    pub fn anonymous(id: RegionId, len: u64) -> std::io::Result<Self> {
        check_region_len(len)?;
        let map = MmapOptions::new().len(len as usize).map_anon()?;
        Ok(Self { id, map: MmapRaw::from(map), len, nic_only: None, backing: None })
    }

    /// Maps `file` shared: the shm backend's regions, visible to every process
    /// that maps the same file.
    pub fn from_file(id: RegionId, file: &File) -> std::io::Result<Self> {
        let len = file.metadata()?.len();
        check_region_len(len)?;
        let map = MmapOptions::new().len(len as usize).map_raw(file)?;
        Ok(Self { id, map, len, nic_only: None, backing: Some(file.try_clone()?) })
    }

    /// Sets how remote RMW verbs on this region relate to the host's own
    /// atomics. [`RemoteAtomicity::NicOnly`] is a test mode (see
    /// [`super::atomicity`]); here its NIC mutex is private to this process,
    /// which is right for the tcp host, whose NIC runs in this process. The
    /// shm backend shares it through a file instead
    /// ([`super::ShmHost::add_region_with`]).
    pub fn with_remote_atomicity(mut self, atomicity: RemoteAtomicity) -> Self {
        self.nic_only = match atomicity {
            RemoteAtomicity::WithHost => None,
            RemoteAtomicity::NicOnly => Some(Box::new(NicOnlyRmw::private())),
        };
        self
    }

    /// [`RemoteAtomicity::NicOnly`] with the NIC mutex in `nic_page`, a file
    /// of at least 8 bytes that every process executing verbs maps.
    pub(crate) fn with_shared_nic_mutex(mut self, nic_page: &File) -> std::io::Result<Self> {
        let page = MmapOptions::new().len(NIC_PAGE as usize).map_raw(nic_page)?;
        self.nic_only = Some(Box::new(NicOnlyRmw::shared(page)?));
        Ok(self)
    }

    pub fn remote_atomicity(&self) -> RemoteAtomicity {
        if self.nic_only.is_some() {
            RemoteAtomicity::NicOnly
        } else {
            RemoteAtomicity::WithHost
        }
    }

    pub fn id(&self) -> RegionId {
        self.id
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte of the mapping, for registering it with an RNIC (the
    /// `ib` backend). The mapping lives as long as `self`.
    #[cfg(feature = "rdma")]
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    #[inline]
    fn check(&self, addr: RemoteAddr, len: u64, align: u64) -> Result<usize, VerbError> {
        debug_assert_eq!(addr.region, self.id);
        let end = addr.offset.checked_add(len);
        if end.is_none_or(|end| end > self.len) {
            return Err(VerbError::OutOfBounds { addr, len, region_len: self.len });
        }
        if !addr.is_aligned(align) {
            return Err(VerbError::Misaligned { addr, align });
        }
        Ok(addr.offset as usize)
    }

    /// The 8-byte word at `offset`, for the host's own threads.
    #[inline]
    pub fn word(&self, addr: RemoteAddr) -> Result<&AtomicU64, VerbError> {
        let off = self.check(addr, 8, 8)?;
        // SAFETY: `check` proved off..off+8 lies inside the mapping and is
        // 8-aligned (the mapping itself is page-aligned). The mapping lives as
        // long as `self`, and all access to region words goes through atomics.
        Ok(unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) })
    }

    /// The 16-byte word at `offset` (extended atomics).
    #[inline]
    pub fn word128(&self, addr: RemoteAddr) -> Result<&AtomicU128, VerbError> {
        let off = self.check(addr, 16, 16)?;
        // SAFETY: as in `word`, with 16 bytes and 16-byte alignment, which is
        // what `AtomicU128` requires.
        Ok(unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU128) })
    }

    pub fn read_into(&self, addr: RemoteAddr, buf: &mut [u8]) -> Result<(), VerbError> {
        let len = buf.len() as u64;
        if len > MAX_TRANSFER {
            return Err(VerbError::TooLarge { len, max: MAX_TRANSFER });
        }
        let off = self.check(addr, len, 1)?;
        if is_word_access(off, buf.len()) {
            for (i, chunk) in buf.chunks_exact_mut(8).enumerate() {
                // SAFETY: in bounds and aligned: `off` is 8-aligned and the
                // whole range was checked.
                let w = unsafe { &*(self.map.as_mut_ptr().add(off + 8 * i) as *const AtomicU64) };
                chunk.copy_from_slice(&w.load(SeqCst).to_le_bytes());
            }
        } else {
            // SAFETY: the source range is inside the mapping (checked) and the
            // destination is a distinct Rust buffer. Other processes may write
            // the source concurrently; the bytes are then torn, exactly as an
            // RDMA READ racing a WRITE would be (see the module comment).
            unsafe { std::ptr::copy_nonoverlapping(self.map.as_ptr().add(off), buf.as_mut_ptr(), buf.len()) };
        }
        Ok(())
    }

    pub fn write_from(&self, addr: RemoteAddr, data: &[u8]) -> Result<(), VerbError> {
        let len = data.len() as u64;
        if len > MAX_TRANSFER {
            return Err(VerbError::TooLarge { len, max: MAX_TRANSFER });
        }
        let off = self.check(addr, len, 1)?;
        if is_word_access(off, data.len()) {
            for (i, chunk) in data.chunks_exact(8).enumerate() {
                // SAFETY: as in `read_into`.
                let w = unsafe { &*(self.map.as_mut_ptr().add(off + 8 * i) as *const AtomicU64) };
                w.store(u64::from_le_bytes(chunk.try_into().expect("8-byte chunk")), SeqCst);
            }
        } else if let Some(file) = self.backing.as_ref().filter(|_| data.len() >= BULK_WRITE_BY_SYSCALL) {
            use std::os::unix::fs::FileExt;
            file.write_all_at(data, off as u64).map_err(|e| {
                let reason = e.to_string();
                match e.raw_os_error() {
                    Some(libc::ENOSPC | libc::ENOMEM | libc::EDQUOT) => {
                        VerbError::NoMemory { addr, len, reason }
                    }
                    _ => VerbError::HostIo { addr, len, reason },
                }
            })?;
        } else {
            // SAFETY: destination in bounds (checked), source a distinct Rust
            // slice; concurrent access by others is the caller's lock's job.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), self.map.as_mut_ptr().add(off), data.len())
            };
        }
        Ok(())
    }

    pub fn cas(&self, addr: RemoteAddr, expect: u64, new: u64) -> Result<u64, VerbError> {
        let w = self.word(addr)?;
        if let Some(nic) = &self.nic_only {
            return Ok(nic.rmw64(w, |old| (old == expect).then_some(new)));
        }
        Ok(match w.compare_exchange(expect, new, SeqCst, SeqCst) {
            Ok(old) | Err(old) => old,
        })
    }

    pub fn faa(&self, addr: RemoteAddr, add: u64) -> Result<u64, VerbError> {
        let w = self.word(addr)?;
        if let Some(nic) = &self.nic_only {
            return Ok(nic.rmw64(w, |old| Some(old.wrapping_add(add))));
        }
        Ok(w.fetch_add(add, SeqCst))
    }

    pub fn masked_cas(
        &self,
        addr: RemoteAddr,
        cmp: u64,
        cmp_mask: u64,
        swap: u64,
        swap_mask: u64,
    ) -> Result<u64, VerbError> {
        let w = self.word(addr)?;
        if let Some(nic) = &self.nic_only {
            return Ok(nic.rmw64(w, |old| arith::masked_cas_u64(old, cmp, cmp_mask, swap, swap_mask)));
        }
        // A CAS loop: the masked update succeeds or the compare fails on the
        // value we read, which is then the returned old value.
        let mut old = w.load(SeqCst);
        loop {
            let Some(new) = arith::masked_cas_u64(old, cmp, cmp_mask, swap, swap_mask) else {
                return Ok(old);
            };
            if new == old {
                return Ok(old);
            }
            match w.compare_exchange_weak(old, new, SeqCst, SeqCst) {
                Ok(_) => return Ok(old),
                Err(actual) => old = actual,
            }
        }
    }

    pub fn masked_faa(&self, addr: RemoteAddr, add: u64, boundary_mask: u64) -> Result<u64, VerbError> {
        let w = self.word(addr)?;
        if let Some(nic) = &self.nic_only {
            return Ok(nic.rmw64(w, |old| Some(arith::masked_faa_u64(old, add, boundary_mask))));
        }
        if boundary_mask == 0 {
            return Ok(w.fetch_add(add, SeqCst));
        }
        let mut old = w.load(SeqCst);
        loop {
            let new = arith::masked_faa_u64(old, add, boundary_mask);
            match w.compare_exchange_weak(old, new, SeqCst, SeqCst) {
                Ok(_) => return Ok(old),
                Err(actual) => old = actual,
            }
        }
    }

    pub fn ext_cas(
        &self,
        addr: RemoteAddr,
        cmp: u128,
        cmp_mask: u128,
        swap: u128,
        swap_mask: u128,
    ) -> Result<u128, VerbError> {
        let w = self.word128(addr)?;
        if let Some(nic) = &self.nic_only {
            return Ok(nic.rmw128(w, |old| arith::masked_cas_u128(old, cmp, cmp_mask, swap, swap_mask)));
        }
        let mut old = w.load(SeqCst);
        loop {
            let Some(new) = arith::masked_cas_u128(old, cmp, cmp_mask, swap, swap_mask) else {
                return Ok(old);
            };
            match w.compare_exchange_weak(old, new, SeqCst, SeqCst) {
                Ok(_) => return Ok(old),
                Err(actual) => old = actual,
            }
        }
    }

    pub fn ext_faa(&self, addr: RemoteAddr, add: u128, boundary_mask: u128) -> Result<u128, VerbError> {
        let w = self.word128(addr)?;
        if let Some(nic) = &self.nic_only {
            return Ok(nic.rmw128(w, |old| Some(arith::masked_faa_u128(old, add, boundary_mask))));
        }
        let mut old = w.load(SeqCst);
        loop {
            let new = arith::masked_faa_u128(old, add, boundary_mask);
            match w.compare_exchange_weak(old, new, SeqCst, SeqCst) {
                Ok(_) => return Ok(old),
                Err(actual) => old = actual,
            }
        }
    }

    /// Executes one verb. The region of `verb.addr()` must be this one.
    pub fn execute(&self, verb: &Verb) -> Result<VerbReply, VerbError> {
        match *verb {
            Verb::Read { addr, len } => {
                if u64::from(len) > MAX_TRANSFER {
                    return Err(VerbError::TooLarge { len: len.into(), max: MAX_TRANSFER });
                }
                // Check before allocating: a hostile length must not make us allocate.
                self.check(addr, len.into(), 1)?;
                let mut buf = vec![0u8; len as usize];
                self.read_into(addr, &mut buf)?;
                Ok(VerbReply::Data(buf))
            }
            Verb::Write { addr, ref data } => self.write_from(addr, data).map(|()| VerbReply::Written),
            Verb::Cas { addr, expect, new } => self.cas(addr, expect, new).map(VerbReply::Old),
            Verb::Faa { addr, add } => self.faa(addr, add).map(VerbReply::Old),
            Verb::MaskedCas { addr, cmp, cmp_mask, swap, swap_mask } => {
                self.masked_cas(addr, cmp, cmp_mask, swap, swap_mask).map(VerbReply::Old)
            }
            Verb::MaskedFaa { addr, add, boundary_mask } => {
                self.masked_faa(addr, add, boundary_mask).map(VerbReply::Old)
            }
            Verb::ExtCas { addr, cmp, cmp_mask, swap, swap_mask } => {
                self.ext_cas(addr, cmp, cmp_mask, swap, swap_mask).map(VerbReply::Old128)
            }
            Verb::ExtFaa { addr, add, boundary_mask } => {
                self.ext_faa(addr, add, boundary_mask).map(VerbReply::Old128)
            }
            Verb::Flush { addr, len } => self.flush(addr, len).map(|()| VerbReply::Written),
        }
    }

    /// Makes `[addr, addr + len)` durable in the file the region maps
    /// (`msync(MS_SYNC)` of the pages it touches); nothing for anonymous
    /// memory, which no sync can make durable.
    pub fn flush(&self, addr: RemoteAddr, len: u64) -> Result<(), VerbError> {
        let off = self.check(addr, len, 1)?;
        if self.backing.is_none() || len == 0 {
            return Ok(());
        }
        self.map.flush_range(off, len as usize).map_err(|e| VerbError::HostIo {
            addr,
            len,
            reason: format!("msync: {e}"),
        })
    }
}

fn is_word_access(off: usize, len: usize) -> bool {
    off.is_multiple_of(8) && len.is_multiple_of(8) && len <= WORD_ACCESS_LIMIT
}

fn check_region_len(len: u64) -> std::io::Result<()> {
    if len == 0 || !len.is_multiple_of(16) || usize::try_from(len).is_err() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("region length {len} must be a non-zero multiple of 16 bytes"),
        ));
    }
    Ok(())
}

/// The regions a host serves, indexed by id.
///
/// Regions are only ever added (a host registers memory as it allocates it),
/// so readers clone an `Arc` under a short read lock.
#[derive(Default)]
pub struct RegionTable {
    regions: parking_lot::RwLock<std::collections::HashMap<RegionId, std::sync::Arc<RegionMemory>>>,
}

impl RegionTable {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a region; an id already in use is refused.
    pub fn insert(&self, region: RegionMemory) -> std::io::Result<std::sync::Arc<RegionMemory>> {
        let mut map = self.regions.write();
        if map.contains_key(&region.id) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("region {:?} is already registered", region.id),
            ));
        }
        let region = std::sync::Arc::new(region);
        map.insert(region.id, region.clone());
        Ok(region)
    }

    pub fn get(&self, id: RegionId) -> Result<std::sync::Arc<RegionMemory>, VerbError> {
        self.regions.read().get(&id).cloned().ok_or(VerbError::UnknownRegion(id))
    }

    /// Executes a verb on whichever region it names.
    pub fn execute(&self, verb: &Verb) -> Result<VerbReply, VerbError> {
        self.get(verb.addr().region)?.execute(verb)
    }

    pub fn list(&self) -> Vec<(RegionId, u64)> {
        let mut v: Vec<_> = self.regions.read().values().map(|r| (r.id, r.len)).collect();
        v.sort();
        v
    }
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    const REGION: RegionId = RegionId(7);

    fn sized_file_in(dir: &std::path::Path, len: u64) -> File {
        let f = tempfile::tempfile_in(dir).expect("a file in the directory");
        f.set_len(len).expect("sized");
        f
    }

    #[test]
    fn a_flush_syncs_a_file_region_within_its_bounds() {
        let file = tempfile::tempfile().expect("a file");
        file.set_len(8192).expect("sized");
        let m = RegionMemory::from_file(REGION, &file).expect("mapped");
        m.write_from(RemoteAddr::new(REGION, 100), b"durable!").unwrap();
        let whole = Verb::Flush { addr: RemoteAddr::new(REGION, 0), len: 8192 };
        assert_eq!(m.execute(&whole).unwrap(), VerbReply::Written);
        m.flush(RemoteAddr::new(REGION, 4100), 10).unwrap();
        assert!(matches!(m.flush(RemoteAddr::new(REGION, 8000), 1000), Err(VerbError::OutOfBounds { .. })));
        let mut back = [0u8; 8];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut back, 100).unwrap();
        assert_eq!(&back, b"durable!");
        // Anonymous memory: nothing to make durable, and no error.
        let anon = RegionMemory::anonymous(REGION, 4096).unwrap();
        anon.flush(RemoteAddr::new(REGION, 0), 4096).unwrap();
    }

    /// A bulk write goes through the file and a small one through the
    /// mapping; either is seen through every other mapping of the file (the
    /// other processes of a shm fabric), and nothing around it changes.
    #[test]
    fn bulk_and_small_writes_are_seen_through_every_mapping() {
        let file = sized_file_in(std::path::Path::new("/dev/shm"), 1 << 20);
        let (writer, reader) = (
            RegionMemory::from_file(REGION, &file).unwrap(),
            RegionMemory::from_file(REGION, &file).unwrap(),
        );
        let bulk: Vec<u8> = (0..BULK_WRITE_BY_SYSCALL * 2).map(|i| (i % 251) as u8 + 1).collect();
        let small = vec![9u8; 4000];
        writer.write_from(RemoteAddr::new(REGION, 4096), &bulk).unwrap();
        writer.write_from(RemoteAddr::new(REGION, 600_000), &small).unwrap();
        let mut got = vec![0u8; 1 << 20];
        reader.read_into(RemoteAddr::new(REGION, 0), &mut got).unwrap();
        assert!(got[..4096].iter().all(|b| *b == 0), "bytes before the bulk write changed");
        assert!(got[4096..4096 + bulk.len()] == bulk[..], "the bulk write reads back wrong");
        assert!(got[4096 + bulk.len()..600_000].iter().all(|b| *b == 0), "bytes after it changed");
        assert_eq!(&got[600_000..604_000], &small[..], "the small write reads back wrong");
        let past = writer.write_from(RemoteAddr::new(REGION, (1 << 20) - 4096), &bulk);
        assert!(matches!(past, Err(VerbError::OutOfBounds { .. })), "a bulk write past the end: {past:?}");
    }

    /// A tmpfs mounted for one test, unmounted when dropped.
    struct SmallTmpfs(tempfile::TempDir);

    impl SmallTmpfs {
        fn mount(size: &str) -> Self {
            let dir = tempfile::tempdir().unwrap();
            let ok = Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
                .arg(dir.path())
                .status()
                .map(|s| s.success());
            assert!(matches!(ok, Ok(true)), "mounting a tmpfs needs root (as the FUSE tests do): {ok:?}");
            Self(dir)
        }
    }

    impl Drop for SmallTmpfs {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(self.0.path()).status();
        }
    }

    /// A region whose file system fills up: a bulk write is refused with
    /// `NoMemory`, where a copy into the mapping would have killed this
    /// process with SIGBUS; what fits is written.
    #[test]
    fn a_full_shm_file_system_refuses_a_bulk_write_without_a_signal() {
        let fs = SmallTmpfs::mount("256k");
        let file = sized_file_in(fs.0.path(), 4 << 20);
        let region = RegionMemory::from_file(REGION, &file).unwrap();
        let fits = vec![5u8; 128 << 10];
        region.write_from(RemoteAddr::new(REGION, 0), &fits).unwrap();
        let too_much = vec![6u8; 1 << 20];
        match region.write_from(RemoteAddr::new(REGION, 1 << 20), &too_much) {
            Err(VerbError::NoMemory { len, .. }) => assert_eq!(len, 1 << 20),
            other => panic!("a write into a full tmpfs answered {other:?}"),
        }
        let mut back = vec![0u8; fits.len()];
        region.read_into(RemoteAddr::new(REGION, 0), &mut back).unwrap();
        assert_eq!(back, fits);
    }
}
