//! The thin FFI layer of the `ib` backend: RAII wrappers of the libibverbs
//! objects it uses (device context, protection domain, completion queue and
//! its channel, reliable-connected queue pair, memory region) and the few
//! calls on them. Nothing above this module calls `rdma_sys` directly.
//!
//! Ownership follows the verbs library's rules: a QP must be destroyed
//! before its CQs and PD, an MR before its PD, and everything before the
//! context. Each wrapper holds an `Arc` of what it was created from, so the
//! drop order is the reverse of creation whatever the caller does.
//!
//! Thread safety: libibverbs objects may be used from several threads (the
//! providers lock what they share); the wrappers are `Send + Sync`, but a
//! [`QueuePair`]'s send queue is only posted by its owner (an endpoint is
//! used by one thread at a time).

use std::ffi::CStr;
use std::os::raw::{c_int, c_void};
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::Duration;

use rdma_sys::*;

use super::addr::IbDevice;
use super::handshake::{PathMtu, QpAddress};
use crate::rdma::error::TransportError;

fn ib_err(what: impl std::fmt::Display) -> TransportError {
    TransportError::Ib(what.to_string())
}

fn os_err(what: &str) -> TransportError {
    ib_err(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// An open device, with the attributes of the chosen port.
pub struct Context {
    ctx: NonNull<ibv_context>,
    pub device: IbDevice,
    pub port: ibv_port_attr,
    pub gid: [u8; 16],
    pub max_qp_wr: u32,
    pub max_qp_rd_atom: u8,
    pub atomics: bool,
    /// `IBV_ATOMIC_GLOB`: the NIC's atomics are atomic with the CPU's too.
    /// Most devices report `IBV_ATOMIC_HCA` (only among the NIC's own).
    pub atomics_with_cpu: bool,
}

// SAFETY: an `ibv_context` may be used from any thread; libibverbs and its
// providers serialise what the calls share.
unsafe impl Send for Context {}
// SAFETY: as above; every method takes `&self` and only calls thread-safe verbs.
unsafe impl Sync for Context {}

impl Context {
    /// Opens `device`, or says which devices exist if it does not.
    pub fn open(device: &IbDevice) -> Result<Arc<Context>, TransportError> {
        let mut n: c_int = 0;
        // SAFETY: as in `device_names`.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() || n <= 0 {
            if !list.is_null() {
                // SAFETY: freed once, not used after.
                unsafe { ibv_free_device_list(list) };
            }
            return Err(ib_err(format!(
                "no RDMA device {}: this machine has no RDMA devices (no /sys/class/infiniband; \
                 load a NIC driver or rdma_rxe)",
                device.name
            )));
        }
        let mut found = ptr::null_mut();
        let mut names = Vec::new();
        for i in 0..n as usize {
            // SAFETY: `i < n`, so the entry is a valid device pointer.
            let dev = unsafe { *list.add(i) };
            // SAFETY: the device's name is a NUL-terminated string it owns.
            let name = unsafe { CStr::from_ptr(ibv_get_device_name(dev)) }.to_string_lossy().into_owned();
            if name == device.name {
                found = dev;
            }
            names.push(name);
        }
        let ctx = if found.is_null() {
            ptr::null_mut()
        } else {
            // SAFETY: `found` is a device of the live list (the list must
            // outlive the open call, not the context).
            unsafe { ibv_open_device(found) }
        };
        // SAFETY: freed once; the opened context does not depend on the list.
        unsafe { ibv_free_device_list(list) };
        if found.is_null() {
            return Err(ib_err(format!(
                "no RDMA device {} (this machine has: {})",
                device.name,
                names.join(", ")
            )));
        }
        let ctx =
            NonNull::new(ctx).ok_or_else(|| os_err(&format!("cannot open RDMA device {}", device.name)))?;
        // From here on, `Context`'s Drop closes the device on every error path.
        let mut this = Context {
            ctx,
            device: device.clone(),
            // SAFETY: ibv_port_attr is a plain C struct; all-zero is a valid value.
            port: unsafe { std::mem::zeroed() },
            gid: [0; 16],
            max_qp_wr: 0,
            max_qp_rd_atom: 0,
            atomics: false,
            atomics_with_cpu: false,
        };
        // SAFETY: a plain C struct, filled by the call.
        let mut dev_attr: ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the context is open and `dev_attr` a valid out-pointer.
        if unsafe { ibv_query_device(ctx.as_ptr(), &mut dev_attr) } != 0 {
            return Err(os_err(&format!("cannot query RDMA device {}", device.name)));
        }
        // SAFETY: the context is open, `port` a valid out-pointer of the
        // size the wrapper passes.
        if unsafe { ___ibv_query_port(ctx.as_ptr(), device.port, &mut this.port) } != 0 {
            return Err(os_err(&format!("cannot query port {} of {}", device.port, device.name)));
        }
        if this.port.state != ibv_port_state::IBV_PORT_ACTIVE {
            return Err(ib_err(format!("port {} of RDMA device {} is not active", device.port, device.name)));
        }
        let gid_index = device.gid_index.unwrap_or(0);
        // SAFETY: a union of plain bytes; zero is valid.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: open context, valid out-pointer; a bad index is an error return.
        if unsafe { ibv_query_gid(ctx.as_ptr(), device.port, c_int::from(gid_index), &mut gid) } == 0 {
            // SAFETY: `raw` covers the whole union.
            this.gid = unsafe { gid.raw };
        } else if this.port.lid == 0 {
            return Err(os_err(&format!("cannot read GID {gid_index} of {device} (RoCE needs one)")));
        }
        this.max_qp_wr = dev_attr.max_qp_wr.max(1) as u32;
        this.max_qp_rd_atom = dev_attr.max_qp_rd_atom.clamp(1, 16) as u8;
        this.atomics = dev_attr.atomic_cap != ibv_atomic_cap::IBV_ATOMIC_NONE;
        this.atomics_with_cpu = dev_attr.atomic_cap == ibv_atomic_cap::IBV_ATOMIC_GLOB;
        Ok(Arc::new(this))
    }

    fn as_ptr(&self) -> *mut ibv_context {
        self.ctx.as_ptr()
    }

    /// The address of `qp` on this port, for the other side's RTR.
    pub fn qp_address(&self, qpn: u32, psn: u32) -> QpAddress {
        QpAddress {
            qpn,
            psn,
            lid: self.port.lid,
            gid: self.gid,
            gid_index: self.device.gid_index.or(if self.port.lid == 0 { Some(0) } else { None }),
            mtu: PathMtu(self.port.active_mtu as u8),
        }
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every object created from the context holds an Arc of it,
        // so none is left; the context is closed once.
        unsafe { ibv_close_device(self.ctx.as_ptr()) };
    }
}

/// A protection domain: one per node.
pub struct ProtectionDomain {
    pd: NonNull<ibv_pd>,
    pub ctx: Arc<Context>,
}

// SAFETY: a PD is only passed to thread-safe verbs calls.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    pub fn new(ctx: &Arc<Context>) -> Result<Arc<Self>, TransportError> {
        // SAFETY: the context is open (held by the Arc).
        let pd = unsafe { ibv_alloc_pd(ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| os_err("cannot allocate a protection domain"))?;
        Ok(Arc::new(Self { pd, ctx: ctx.clone() }))
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // SAFETY: QPs and MRs hold an Arc of the PD, so none is left.
        unsafe { ibv_dealloc_pd(self.pd.as_ptr()) };
    }
}

/// What remote peers may do to a memory region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Local use only (staging and receive buffers): the NIC writes READ
    /// results, atomic results and received messages into it.
    Local,
    /// A region's memory: remote READ, WRITE and atomics.
    Remote,
}

/// A registered memory region. The memory itself belongs to the caller, who
/// must keep it mapped for as long as the region lives.
pub struct MemoryRegion {
    mr: NonNull<ibv_mr>,
    _pd: Arc<ProtectionDomain>,
}

// SAFETY: the MR handle is only read (keys, address) or deregistered once.
unsafe impl Send for MemoryRegion {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegion {}

impl MemoryRegion {
    /// Registers `len` bytes at `addr`.
    ///
    /// # Safety
    /// `addr .. addr + len` must be memory of this process that stays mapped
    /// until the region is dropped; with [`Access::Remote`], remote peers
    /// may read and write it at any time (like the shm backend's mappings,
    /// it must only be accessed through atomics or under a lock).
    pub unsafe fn register(
        pd: &Arc<ProtectionDomain>,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<Self, TransportError> {
        let flags = match access {
            Access::Local => ibv_access_flags::IBV_ACCESS_LOCAL_WRITE,
            Access::Remote => {
                ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
                    | ibv_access_flags::IBV_ACCESS_REMOTE_READ
                    | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
                    | ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC
            }
        };
        // SAFETY: the caller guarantees the range; the PD is alive.
        let mr = unsafe { ibv_reg_mr(pd.pd.as_ptr(), addr.cast::<c_void>(), len, flags.0 as c_int) };
        let mr = NonNull::new(mr).ok_or_else(|| os_err(&format!("cannot register {len} bytes")))?;
        Ok(Self { mr, _pd: pd.clone() })
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is registered until drop; `lkey` is a plain field.
        unsafe { self.mr.as_ref().lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: as in `lkey`.
        unsafe { self.mr.as_ref().rkey }
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        // SAFETY: registered once, deregistered once; no WR that uses it is
        // outstanding (its owner waits for its completions or destroyed the QP).
        unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
    }
}

/// A buffer of this process, registered for local use by the NIC.
pub struct LocalBuffer {
    // Declared first: deregistered before the memory is freed.
    mr: MemoryRegion,
    mem: Box<[u128]>,
}

impl LocalBuffer {
    pub fn new(pd: &Arc<ProtectionDomain>, len: usize) -> Result<Self, TransportError> {
        let mut mem = vec![0u128; len.div_ceil(16).max(1)].into_boxed_slice();
        // SAFETY: the boxed slice is ours, never reallocated, and freed only
        // after the MR (field order).
        let mr =
            unsafe { MemoryRegion::register(pd, mem.as_mut_ptr().cast(), mem.len() * 16, Access::Local)? };
        Ok(Self { mr, mem })
    }

    pub fn len(&self) -> usize {
        self.mem.len() * 16
    }

    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }

    pub fn addr(&self) -> u64 {
        self.mem.as_ptr() as u64
    }

    /// The bytes, while no work request that writes them is outstanding.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the slice covers exactly the allocation; `u8` has no
        // alignment or validity requirements.
        unsafe { std::slice::from_raw_parts(self.mem.as_ptr().cast(), self.len()) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.mem.as_mut_ptr().cast(), self.mem.len() * 16) }
    }
}

/// A completion queue, optionally with a completion channel for a thread
/// that waits for events instead of polling.
pub struct CompletionQueue {
    cq: NonNull<ibv_cq>,
    channel: Option<NonNull<ibv_comp_channel>>,
    _ctx: Arc<Context>,
}

// SAFETY: polling and arming a CQ are thread-safe verbs calls.
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

/// One polled work completion.
#[derive(Clone, Copy, Debug)]
pub struct Completion {
    pub wr_id: u64,
    pub status: u32,
    pub byte_len: u32,
    pub qp_num: u32,
}

impl CompletionQueue {
    pub fn new(ctx: &Arc<Context>, depth: u32, with_channel: bool) -> Result<Arc<Self>, TransportError> {
        let channel = if with_channel {
            // SAFETY: the context is open.
            let ch = unsafe { ibv_create_comp_channel(ctx.as_ptr()) };
            Some(NonNull::new(ch).ok_or_else(|| os_err("cannot create a completion channel"))?)
        } else {
            None
        };
        let ch_ptr = channel.map_or(ptr::null_mut(), |c| c.as_ptr());
        // SAFETY: the context is open; the channel (if any) belongs to it.
        let cq = unsafe { ibv_create_cq(ctx.as_ptr(), depth as c_int, ptr::null_mut(), ch_ptr, 0) };
        let Some(cq) = NonNull::new(cq) else {
            let e = os_err(&format!("cannot create a completion queue of {depth}"));
            if let Some(ch) = channel {
                // SAFETY: created above, unused by any CQ.
                unsafe { ibv_destroy_comp_channel(ch.as_ptr()) };
            }
            return Err(e);
        };
        Ok(Arc::new(Self { cq, channel, _ctx: ctx.clone() }))
    }

    /// Polls up to `out.len()` completions; returns how many.
    pub fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize, TransportError> {
        // SAFETY: ibv_wc is a plain C struct (zero is valid), filled by the call.
        let mut wcs: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
        let want = max.min(wcs.len()) as i32;
        // SAFETY: the CQ is alive; `wcs` has room for `want` entries.
        let n = unsafe { ibv_poll_cq(self.cq.as_ptr(), want, wcs.as_mut_ptr()) };
        if n < 0 {
            return Err(ib_err("polling the completion queue failed"));
        }
        for wc in &wcs[..n as usize] {
            out.push(Completion {
                wr_id: wc.wr_id,
                status: wc.status,
                byte_len: wc.byte_len,
                qp_num: wc.qp_num,
            });
        }
        Ok(n as usize)
    }

    /// Asks for an event at the next completion (needs a channel). The
    /// caller polls once more after arming: a completion that arrived
    /// before raises no event.
    pub fn arm(&self) -> Result<(), TransportError> {
        if self.channel.is_none() {
            return Ok(());
        }
        // SAFETY: the CQ is alive and has a channel.
        if unsafe { ibv_req_notify_cq(self.cq.as_ptr(), 0) } != 0 {
            return Err(ib_err("cannot arm the completion queue"));
        }
        Ok(())
    }

    /// Waits up to `timeout` for the event of an armed CQ on the channel's
    /// fd. Returns whether an event came; the caller polls either way.
    pub fn wait_armed(&self, timeout: Duration) -> Result<bool, TransportError> {
        let Some(ch) = self.channel else { return Ok(false) };
        // SAFETY: the channel is alive; `fd` is a plain field.
        let fd = unsafe { ch.as_ref().fd };
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        let ms = timeout.as_millis().min(i32::MAX as u128) as c_int;
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, ms) };
        if r <= 0 {
            return Ok(false);
        }
        let mut cq = ptr::null_mut();
        let mut cq_ctx = ptr::null_mut();
        // SAFETY: the fd is readable, so this returns at once with our CQ.
        if unsafe { ibv_get_cq_event(ch.as_ptr(), &mut cq, &mut cq_ctx) } == 0 {
            // SAFETY: acknowledges the one event just taken (required before destroy).
            unsafe { ibv_ack_cq_events(self.cq.as_ptr(), 1) };
        }
        Ok(true)
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        // SAFETY: QPs hold an Arc of their CQs, so none uses it; every event
        // taken was acknowledged in `wait`.
        unsafe { ibv_destroy_cq(self.cq.as_ptr()) };
        if let Some(ch) = self.channel {
            // SAFETY: its only CQ was destroyed just above.
            unsafe { ibv_destroy_comp_channel(ch.as_ptr()) };
        }
    }
}

/// Sizes of a queue pair.
#[derive(Clone, Copy, Debug)]
pub struct QpSizes {
    pub send: u32,
    pub recv: u32,
    pub max_inline: u32,
}

/// A reliable-connected queue pair.
pub struct QueuePair {
    qp: NonNull<ibv_qp>,
    pub psn: u32,
    pub max_inline: u32,
    _send_cq: Arc<CompletionQueue>,
    _recv_cq: Arc<CompletionQueue>,
    pd: Arc<ProtectionDomain>,
}

// SAFETY: posting and modifying a QP are thread-safe verbs calls; the owner
// serialises its own posts.
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

/// RDMA READs and atomics one QP may have outstanding.
const RD_ATOMIC: u8 = 16;

impl QueuePair {
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        send_cq: &Arc<CompletionQueue>,
        recv_cq: &Arc<CompletionQueue>,
        sizes: QpSizes,
    ) -> Result<Self, TransportError> {
        let cap = pd.ctx.max_qp_wr;
        let mut init = ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.cq.as_ptr(),
            recv_cq: recv_cq.cq.as_ptr(),
            srq: ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: sizes.send.min(cap),
                max_recv_wr: sizes.recv.min(cap).max(1),
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: sizes.max_inline,
            },
            qp_type: ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: PD and CQs are alive (held by the QP); `init` is valid.
        let qp = unsafe { ibv_create_qp(pd.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| os_err("cannot create a queue pair"))?;
        // A varying 24-bit starting PSN, so a late packet of an older
        // connection is not taken for one of this.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let psn = (std::process::id().wrapping_mul(2_654_435_761) ^ nanos ^ (qp.as_ptr() as usize as u32))
            & 0xFF_FFFF;
        Ok(Self {
            qp,
            psn,
            max_inline: init.cap.max_inline_data,
            _send_cq: send_cq.clone(),
            _recv_cq: recv_cq.clone(),
            pd: pd.clone(),
        })
    }

    pub fn qpn(&self) -> u32 {
        // SAFETY: the QP lives until drop; `qp_num` is a plain field.
        unsafe { self.qp.as_ref().qp_num }
    }

    /// This QP's address, for the other side.
    pub fn address(&self) -> QpAddress {
        self.pd.ctx.qp_address(self.qpn(), self.psn)
    }

    fn modify(
        &self,
        attr: &mut ibv_qp_attr,
        mask: ibv_qp_attr_mask,
        what: &str,
    ) -> Result<(), TransportError> {
        // SAFETY: the QP is alive; `attr` is valid for the fields `mask` names.
        let r = unsafe { ibv_modify_qp(self.qp.as_ptr(), attr, mask.0 as c_int) };
        if r != 0 {
            return Err(ib_err(format!(
                "cannot move the queue pair to {what}: {}",
                std::io::Error::from_raw_os_error(r)
            )));
        }
        Ok(())
    }

    /// RESET → INIT → RTR → RTS, connected to `remote` (already validated).
    pub fn connect(&self, remote: &QpAddress) -> Result<(), TransportError> {
        let ctx = &self.pd.ctx;
        // SAFETY: a plain C struct; zero is the neutral value of every field.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = ctx.device.port;
        a.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_READ
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC)
            .0;
        self.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
            "INIT",
        )?;

        // SAFETY: as above.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = remote.mtu.0.min(ctx.port.active_mtu as u8) as ibv_mtu::Type;
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        a.max_dest_rd_atomic = ctx.max_qp_rd_atom.min(RD_ATOMIC);
        a.min_rnr_timer = 12; // 0.64 ms
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = 0;
        a.ah_attr.src_path_bits = 0;
        a.ah_attr.port_num = ctx.device.port;
        if remote.needs_grh() {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            a.ah_attr.grh.sgid_index = ctx.device.gid_index.unwrap_or(0);
            a.ah_attr.grh.hop_limit = 64;
        }
        self.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;

        // SAFETY: as above.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = self.psn;
        a.timeout = 14; // 4.096 µs × 2^14 ≈ 67 ms per try
        a.retry_cnt = 7;
        a.rnr_retry = 7; // a receiver without a posted buffer: retry without limit
        a.max_rd_atomic = ctx.max_qp_rd_atom.min(RD_ATOMIC);
        self.modify(
            &mut a,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
            "RTS",
        )
    }

    /// Posts a chain of send work requests (one doorbell).
    ///
    /// # Safety
    /// `first` heads a valid chain whose scatter/gather entries point to
    /// registered memory (or inline data) that stays valid, and is not
    /// written by anyone else, until the chain's completions were polled.
    pub unsafe fn post_send(&self, first: *mut ibv_send_wr) -> Result<(), TransportError> {
        let mut bad = ptr::null_mut();
        // SAFETY: the caller's contract; the QP is alive.
        let r = unsafe { ibv_post_send(self.qp.as_ptr(), first, &mut bad) };
        if r != 0 {
            return Err(ib_err(format!(
                "posting work requests failed: {}",
                std::io::Error::from_raw_os_error(r)
            )));
        }
        Ok(())
    }

    /// Posts one receive buffer.
    ///
    /// # Safety
    /// `addr .. addr + len` is inside a registered local buffer with `lkey`
    /// that stays valid and untouched until the receive completes or the QP
    /// is destroyed.
    pub unsafe fn post_recv(&self, wr_id: u64, addr: u64, len: u32, lkey: u32) -> Result<(), TransportError> {
        let mut sge = ibv_sge { addr, length: len, lkey };
        let mut wr = ibv_recv_wr { wr_id, next: ptr::null_mut(), sg_list: &mut sge, num_sge: 1 };
        let mut bad = ptr::null_mut();
        // SAFETY: the caller's contract; `wr` and `sge` live across the call,
        // which copies them.
        let r = unsafe { ibv_post_recv(self.qp.as_ptr(), &mut wr, &mut bad) };
        if r != 0 {
            return Err(ib_err(format!(
                "posting a receive failed: {}",
                std::io::Error::from_raw_os_error(r)
            )));
        }
        Ok(())
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // SAFETY: destroyed once; the CQs and PD it uses are held by Arcs in
        // this struct and dropped after it.
        unsafe { ibv_destroy_qp(self.qp.as_ptr()) };
    }
}

/// The verbs library's text for a completion status.
pub fn status_text(status: u32) -> String {
    // SAFETY: returns a pointer to a static string for any value.
    let s = unsafe { ibv_wc_status_str(status) };
    if s.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null, static and NUL-terminated.
    unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
}

/// A zeroed send work request (every union and pointer null).
pub fn send_wr() -> ibv_send_wr {
    // SAFETY: ibv_send_wr is a C struct of integers, pointers and unions of
    // those; all-zero is a valid (empty) request.
    unsafe { std::mem::zeroed() }
}

pub use rdma_sys::{ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode};
