//! Completion queues and (RC) queue pairs: creation with validated sizes, placement of rings,
//! doorbell records and the doorbell word, the QP state machine, connection, and export of the
//! device handle (`gdaki_layout::DevQp`) that `gdaki-device` posts through.
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gdaki_layout::{cqe, DevCq, DevQp, DoorbellKind, Syndrome};
use tracing::debug;

use crate::context::ContextInner;
use crate::error::{check_pow2, Error, Result};
use crate::memory::HostBuffer;
use crate::provider::DoorbellHandler;
use crate::soft::net::Link;
use crate::soft::objects::{Peer, SoftCq, SoftQp, Window};
use crate::soft::{lock, Hca};

/// Largest send queue in WQEs (the device tells CQE laps apart by 16-bit WQE counters).
pub const MAX_SQ_SIZE: u32 = 1 << 15;
/// Largest completion queue in CQEs.
pub const MAX_CQ_SIZE: u32 = 1 << 22;

/// The state of a queue pair (the verbs state machine, RC subset).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum QpState {
    /// Created; nothing is executed.
    Reset = 0,
    /// Initialised; not yet connected.
    Init = 1,
    /// Ready to receive: connected to its peer, serving its requests.
    Rtr = 2,
    /// Ready to send: executes its own WQEs.
    Rts = 3,
    /// Failed: every WQE is flushed (completes in error).
    Error = 4,
}

impl QpState {
    pub(crate) fn from_raw(v: u8) -> QpState {
        match v {
            0 => QpState::Reset,
            1 => QpState::Init,
            2 => QpState::Rtr,
            3 => QpState::Rts,
            _ => QpState::Error,
        }
    }
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::Rtr => "RTR",
            QpState::Rts => "RTS",
            QpState::Error => "ERROR",
        })
    }
}

/// What a peer needs to connect to a queue pair: its identity, and where to reach it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    /// The HCA that owns the QP: a random 64-bit identity. A peer in the same process is
    /// reached directly through it; 0 means "not in this process" (go through `addr`).
    pub hca: u64,
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Where the HCA accepts transport connections from other processes or hosts (the soft
    /// HCA's listener, see [`Context::listen`](crate::Context::listen)); `None` when it does
    /// not listen.
    pub addr: Option<SocketAddr>,
}

/// Sizes and limits of a new queue pair.
#[derive(Debug, Clone, Copy)]
pub struct QpConfig {
    /// Send queue size in WQEs: a power of two, at most [`MAX_SQ_SIZE`], and at most the CQ's.
    pub sq_size: u32,
    /// Largest message one WQE may carry; bigger puts are split by the device.
    pub max_msg_size: u64,
    /// How long device waits on this QP may take before they report a timeout.
    pub timeout: Duration,
    /// How long the HCA waits for a remote peer's answer before it completes the request with
    /// a transport error (IB's retry count times its timeout). Keep it below `timeout` so
    /// waits see the transport error rather than their own timeout.
    pub retry_timeout: Duration,
    /// Who rings the doorbell: the poster itself, or a CPU proxy (posters then publish their
    /// producer index; hand [`QueuePair::proxy_target`] to a `gdaki_proxy::Proxy`).
    pub handler: DoorbellHandler,
}

impl Default for QpConfig {
    fn default() -> Self {
        QpConfig {
            sq_size: 1024,
            max_msg_size: 1 << 30,
            timeout: Duration::from_secs(10),
            retry_timeout: Duration::from_secs(4),
            handler: DoorbellHandler::Gpu,
        }
    }
}

// ------------------------------------------------------------------------------ public objects

/// A completion queue. Each queue pair has its own (device tickets are CQE indices).
pub struct CompletionQueue {
    ctx: Arc<ContextInner>,
    pub(crate) inner: Arc<SoftCq>,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("cqn", &self.inner.cqn)
            .field("size", &(1u32 << self.inner.log_size))
            .finish()
    }
}

impl CompletionQueue {
    pub(crate) fn create(ctx: &Arc<ContextInner>, size: u32) -> Result<CompletionQueue> {
        let log_size = check_pow2("completion queue size", size as u64, 1, MAX_CQ_SIZE as u64)?;
        let ring = HostBuffer::new("a CQE ring", 64 << log_size)?;
        // Every CQE starts invalid with owner 1, so the first lap (owner 0) is not mistaken.
        for i in 0..1usize << log_size {
            // SAFETY: byte 63 of entry i lies inside the ring just allocated.
            unsafe {
                ring.as_ptr()
                    .add(64 * i + cqe::field::OP_OWN.start)
                    .write(cqe::OP_OWN_INIT)
            };
        }
        let inner = Arc::new(SoftCq::new(
            ctx.hca.alloc_qpn(),
            log_size,
            Window::of(Arc::new(ring)),
            Window::of(Arc::new(HostBuffer::new("a CQ doorbell record", 64)?)),
        ));
        Ok(CompletionQueue {
            ctx: ctx.clone(),
            inner,
        })
    }

    /// CQ number.
    pub fn cqn(&self) -> u32 {
        self.inner.cqn
    }

    /// Size in CQEs.
    pub fn size(&self) -> u32 {
        1 << self.inner.log_size
    }

    /// CQEs the HCA has written so far.
    pub fn written(&self) -> u64 {
        self.inner.pi.load(Ordering::Acquire)
    }

    /// `Err(CqOverrun)` once the HCA found no room for a CQE.
    pub fn status(&self) -> Result<()> {
        if self.inner.overrun.load(Ordering::Acquire) {
            return Err(Error::CqOverrun { cqn: self.inner.cqn });
        }
        Ok(())
    }
}

/// A reliable-connected queue pair, with its device handle.
pub struct QueuePair {
    ctx: Arc<ContextInner>,
    inner: Arc<SoftQp>,
    /// The exported `DevQp`, in memory posters can reach.
    handle: HostBuffer,
    /// CPU-proxy QPs: the u64 producer index posters publish for the proxy.
    proxy_word: Arc<HostBuffer>,
    /// Who rings the doorbell (a [`DoorbellHandler`] as `u8`): set at creation, and switched to
    /// the CPU proxy once if a GPU export cannot map the doorbell page.
    handler: AtomicU8,
    /// Where a GPU export could not map the doorbell page: the library's proxy ringing for it.
    fallback: Mutex<Option<crate::doorbell::AutoProxy>>,
}

impl fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &self.inner.qpn)
            .field("state", &self.state())
            .field("sq_size", &(1u32 << self.inner.sq_log))
            .finish()
    }
}

impl QueuePair {
    pub(crate) fn create(ctx: &Arc<ContextInner>, cq: &CompletionQueue, cfg: QpConfig) -> Result<QueuePair> {
        if !Arc::ptr_eq(&cq.ctx, ctx) {
            return Err(Error::ForeignObject {
                what: "the completion queue",
            });
        }
        let sq_log = check_pow2("send queue size", cfg.sq_size as u64, 1, MAX_SQ_SIZE as u64)?;
        if cfg.sq_size > cq.size() {
            return Err(Error::OutOfRange {
                what: "send queue size (must not exceed its CQ's)",
                got: cfg.sq_size as u64,
                min: 1,
                max: cq.size() as u64,
            });
        }
        for (what, d) in [("timeout", cfg.timeout), ("retry_timeout", cfg.retry_timeout)] {
            if d.is_zero() || d > Duration::from_secs(3600) {
                return Err(Error::OutOfRange {
                    what,
                    got: d.as_millis().min(u64::MAX as u128) as u64,
                    min: 1,
                    max: 3_600_000,
                });
            }
        }
        if cfg.max_msg_size == 0 || cfg.max_msg_size > 1 << 31 {
            return Err(Error::OutOfRange {
                what: "max_msg_size",
                got: cfg.max_msg_size,
                min: 1,
                max: 1 << 31,
            });
        }
        let qpn = ctx.hca.alloc_qpn();
        {
            let mut serves = lock(&cq.inner.qpn);
            if let Some(other) = *serves {
                return Err(Error::CqInUse {
                    cqn: cq.cqn(),
                    qpn: other,
                });
            }
            *serves = Some(qpn);
        }
        let built = (|| -> Result<(Arc<SoftQp>, HostBuffer, Arc<HostBuffer>)> {
            let inner = Arc::new(SoftQp::new(
                qpn,
                crate::soft::random_u32() & 0xff_ffff,
                sq_log,
                Window::of(Arc::new(HostBuffer::new("a send queue", 64 << sq_log)?)),
                Window::of(Arc::new(HostBuffer::new("QP doorbell records", 64)?)),
                Window::of(Arc::new(HostBuffer::new("a doorbell page", 64)?)),
                cq.inner.clone(),
                cfg.max_msg_size,
                cfg.retry_timeout,
                ctx.options.atomic_reply(),
            ));
            let proxy_word = Arc::new(HostBuffer::new("a proxy producer index", 64)?);
            let handle = HostBuffer::new("a device QP handle", std::mem::size_of::<DevQp>())?;
            let (doorbell, kind) = ring_word(&inner, &proxy_word, cfg.handler);
            let dev = DevQp {
                sq_base: inner.sq.addr(),
                sq_dbrec: inner.records.addr() + 4 * gdaki_layout::dbrec::SND_DBR as u64,
                doorbell,
                max_msg_size: cfg.max_msg_size,
                timeout_ns: cfg.timeout.as_nanos().min(u64::MAX as u128) as u64,
                qpn,
                sq_log_size: sq_log,
                doorbell_kind: kind as u8,
                flags: ctx.options.atomic_reply().qp_flags(),
                cq: DevCq {
                    cqe_base: cq.inner.ring.addr(),
                    dbrec: cq.inner.dbrec.addr(),
                    cqn: cq.inner.cqn,
                    log_size: cq.inner.log_size,
                    ..bytemuck::Zeroable::zeroed()
                },
                ..bytemuck::Zeroable::zeroed()
            };
            // SAFETY: the buffer is DevQp-sized and page-aligned; nobody else sees it yet.
            unsafe { (handle.as_ptr() as *mut DevQp).write(dev) };
            Ok((inner, handle, proxy_word))
        })();
        let (inner, handle, proxy_word) = match built {
            Ok(b) => b,
            Err(e) => {
                *lock(&cq.inner.qpn) = None;
                return Err(e);
            }
        };
        ctx.hca.attach(&inner);
        debug!(
            qpn = format_args!("{qpn:#x}"),
            cqn = format_args!("{:#x}", cq.cqn()),
            sq = cfg.sq_size,
            "queue pair created"
        );
        Ok(QueuePair {
            ctx: ctx.clone(),
            inner,
            handle,
            proxy_word,
            handler: AtomicU8::new(cfg.handler as u8),
            fallback: Mutex::new(None),
        })
    }

    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.inner.state()
    }

    /// The first error's syndrome, once the QP is in error.
    pub fn error(&self) -> Option<Syndrome> {
        *lock(&self.inner.first_error)
    }

    /// What a peer needs to connect to this QP.
    pub fn endpoint(&self) -> Endpoint {
        Endpoint {
            hca: self.ctx.hca.id,
            qpn: self.inner.qpn,
            psn: self.inner.psn(),
            addr: self.ctx.hca.listen_addr(),
        }
    }

    fn transition(&self, from: &[QpState], to: QpState) -> Result<()> {
        let now = self.state();
        if !from.contains(&now) {
            return Err(Error::BadTransition {
                qpn: self.qpn(),
                from: now,
                to,
            });
        }
        self.inner.set_state(to);
        debug!(qpn = format_args!("{:#x}", self.qpn()), %now, %to, "modify QP");
        Ok(())
    }

    /// RESET → INIT.
    pub fn to_init(&self) -> Result<()> {
        self.transition(&[QpState::Reset], QpState::Init)
    }

    /// INIT → RTR: connects to `peer`, which must be reachable: an HCA of this process is
    /// reached directly, any other through `peer.addr` (its soft HCA's listener), which must
    /// accept the connection.
    pub fn to_rtr(&self, peer: &Endpoint) -> Result<()> {
        if self.state() != QpState::Init {
            return Err(Error::BadTransition {
                qpn: self.qpn(),
                from: self.state(),
                to: QpState::Rtr,
            });
        }
        let local = (peer.hca != 0).then(|| Hca::find(peer.hca)).flatten();
        let link = match (local, peer.addr) {
            (Some(hca), _) => {
                let Some(target) = hca.qp(peer.qpn) else {
                    return Err(Error::PeerUnreachable {
                        what: format!("QP {:#x} on HCA {:#x}", peer.qpn, peer.hca),
                    });
                };
                Peer::Local {
                    hca: Arc::downgrade(&hca),
                    qp: Arc::downgrade(&target),
                }
            }
            (None, Some(addr)) => Peer::Remote(Link::connect(self.ctx.hca.id, &self.inner, peer, addr)?),
            (None, None) => {
                return Err(Error::PeerUnreachable {
                    what: format!(
                        "HCA {:#x} (QP {:#x}): not in this process, and the endpoint has no address",
                        peer.hca, peer.qpn
                    ),
                })
            }
        };
        lock(&self.inner.progress).peer = Some(link);
        self.transition(&[QpState::Init], QpState::Rtr)
    }

    /// RTR → RTS.
    pub fn to_rts(&self) -> Result<()> {
        self.transition(&[QpState::Rtr], QpState::Rts)
    }

    /// Any state → ERROR: outstanding and later WQEs are flushed.
    pub fn to_error(&self) {
        self.inner.fail(Syndrome::WrFlush);
    }

    /// RESET → INIT → RTR → RTS against `peer`.
    pub fn connect(&self, peer: &Endpoint) -> Result<()> {
        self.to_init()?;
        self.to_rtr(peer)?;
        self.to_rts()
    }

    /// The exported device handle. Valid while this QP lives; posters use it through
    /// `gdaki_device::Qp::from_raw` (CPU mode here; GPU export comes with the GPU provider).
    pub fn device_handle(&self) -> *mut DevQp {
        self.handle.as_ptr() as *mut DevQp
    }

    /// Who rings this QP's doorbell: the handler it was created with, or
    /// [`DoorbellHandler::CpuProxy`] once it fell back (see [`fell_back`](Self::fell_back)).
    pub fn handler(&self) -> DoorbellHandler {
        match self.handler.load(Ordering::Acquire) {
            x if x == DoorbellHandler::CpuProxy as u8 => DoorbellHandler::CpuProxy,
            _ => DoorbellHandler::Gpu,
        }
    }

    /// Whether a GPU export found the doorbell page unmappable and switched this QP to the
    /// library's own CPU proxy (which rings for it until the QP is dropped).
    pub fn fell_back(&self) -> bool {
        lock(&self.fallback).is_some()
    }

    /// The counters of the library's fallback proxy (shared by every QP that fell back), if
    /// this QP [`fell_back`](Self::fell_back).
    pub fn fallback_proxy_counters(&self) -> Option<gdaki_proxy::ProxyCounters> {
        lock(&self.fallback).as_ref().map(|p| p.counters())
    }

    /// What a CPU proxy needs to ring for this QP: `None` unless it was created with the
    /// [`DoorbellHandler::CpuProxy`] handler (a QP that [`fell_back`](Self::fell_back) is rung
    /// by the library's proxy; a second proxy must not ring it). The target keeps the QP's
    /// rings alive.
    pub fn proxy_target(&self) -> Option<gdaki_proxy::Target> {
        if self.handler() != DoorbellHandler::CpuProxy || self.fell_back() {
            return None;
        }
        Some(self.target())
    }

    fn target(&self) -> gdaki_proxy::Target {
        let q = &self.inner;
        let keep: Arc<dyn Send + Sync> = Arc::new((q.clone(), self.proxy_word.clone()));
        // SAFETY: the proxy word, the send word of the doorbell record and the doorbell word
        // are aligned words of buffers kept alive by `keep` (the proxy word, and the SoftQp's
        // windows); posters, the proxy and the HCA access them atomically.
        unsafe {
            gdaki_proxy::Target::new(
                q.qpn,
                self.proxy_word.as_ptr() as *const u64,
                (q.records.addr() + 4 * gdaki_layout::dbrec::SND_DBR as u64) as *mut u32,
                q.uar.as_ptr() as *mut u64,
                keep,
            )
        }
    }

    /// Switches this QP to the library's CPU proxy because its doorbell page cannot be mapped
    /// for a GPU: the proxy starts ringing first, then the CPU handle is pointed at the proxy
    /// word (so CPU posters submit the same way as the GPU's). Called before posting starts
    /// (exports precede posting); a failure changes nothing.
    fn fall_back(&self, why: &crate::doorbell::Unmappable) -> Result<()> {
        let mut fallback = lock(&self.fallback);
        if fallback.is_some() {
            return Ok(());
        }
        *fallback = Some(crate::doorbell::AutoProxy::ring_for(self.target())?);
        let (doorbell, kind) = ring_word(&self.inner, &self.proxy_word, DoorbellHandler::CpuProxy);
        let dev = self.device_handle();
        // SAFETY: the handle is this QP's live DevQp; these two fields are plain words posters
        // read when they ring, and no poster runs during an export.
        unsafe {
            std::ptr::addr_of_mut!((*dev).doorbell).write_volatile(doorbell);
            std::ptr::addr_of_mut!((*dev).doorbell_kind).write_volatile(kind as u8);
        }
        self.handler.store(DoorbellHandler::CpuProxy as u8, Ordering::Release);
        crate::doorbell::say_fallback(self.inner.qpn, why);
        Ok(())
    }

    /// A CPU-mode poster's view of this QP in sharing mode `M`.
    ///
    /// # Safety
    /// The value must not outlive this `QueuePair`, and all concurrent posters must use the
    /// same sharing mode (exclusive: one thread at a time).
    pub unsafe fn cpu<M: gdaki_device::Sharing>(&self) -> gdaki_device::Qp<M> {
        // SAFETY: the handle was filled in `create` and lives as long as self (caller's contract).
        unsafe { gdaki_device::Qp::from_raw(self.device_handle()) }
    }
}

/// The word posters ring (the doorbell) or publish to (the proxy word), and its kind, for
/// `handler`.
fn ring_word(qp: &SoftQp, proxy_word: &HostBuffer, handler: DoorbellHandler) -> (u64, DoorbellKind) {
    match handler {
        DoorbellHandler::Gpu => (qp.uar.addr(), DoorbellKind::Gpu),
        DoorbellHandler::CpuProxy => (proxy_word.addr(), DoorbellKind::CpuProxy),
    }
}

/// A queue pair exported to a GPU: its send queue, CQ ring, doorbell records and doorbell page
/// are mapped into the GPU (host-pinned: the GPU writes WQEs and rings over PCIe, the soft HCA
/// reads them locally), and its device handle lives in GPU memory. Kernels take
/// [`device_handle`](Self::device_handle) as their `*mut DevQp`.
pub struct GpuQp {
    handle: crate::cuda::DeviceBuffer,
    // Unmapped before the QP's memory can go: the QP is kept alive by `qp`.
    _maps: Vec<crate::cuda::HostMapping>,
    qp: Arc<SoftQp>,
    _proxy_word: Arc<HostBuffer>,
    _ctx: Arc<ContextInner>,
}

impl fmt::Debug for GpuQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuQp")
            .field("qpn", &self.qp.qpn)
            .field("handle", &format_args!("{:#x}", self.handle.device_addr()))
            .finish()
    }
}

impl GpuQp {
    /// The `DevQp` in GPU memory (pass it to kernels).
    pub fn device_handle(&self) -> u64 {
        self.handle.device_addr()
    }

    /// The counters kernels keep in the device handle, read back from GPU memory, next to the
    /// HCA's own progress: where a stuck or failed kernel left the QP. Read it when no kernel
    /// runs on the QP (the copy is not atomic against one).
    pub fn counters(&self) -> Result<QpCounters> {
        let mut dev: DevQp = bytemuck::Zeroable::zeroed();
        self.handle.read(0, bytemuck::bytes_of_mut(&mut dev))?;
        let q = &self.qp;
        Ok(QpCounters {
            sq_reserved: dev.sq_reserved,
            sq_ready: dev.sq_ready,
            sq_rung: dev.sq_rung,
            cq_consumed: dev.cq.consumed,
            cq_error: (dev.cq.error & gdaki_layout::handle::ERROR_VALID != 0).then_some(dev.cq.error),
            hca_fetched: lock(&q.progress).ci,
            hca_completed: q.cq.pi.load(Ordering::Acquire),
        })
    }
}

/// Where a QP's posters and its HCA are ([`GpuQp::counters`]): every count is in WQEs (one
/// building block each, as `gdaki-device` posts them) since the QP was created.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCounters {
    /// Slots reserved by posters.
    pub sq_reserved: u64,
    /// Slots written and marked ready.
    pub sq_ready: u64,
    /// Slots covered by a doorbell.
    pub sq_rung: u64,
    /// CQEs consumed by pollers.
    pub cq_consumed: u64,
    /// The sticky error word of the CQ (`gdaki_device::CqeError::from_word` decodes it).
    pub cq_error: Option<u64>,
    /// Building blocks the HCA has fetched from the send queue.
    pub hca_fetched: u64,
    /// CQEs the HCA has written.
    pub hca_completed: u64,
}

impl QueuePair {
    /// Exports this QP to `gpu` (once per QP and GPU: the memory stays mapped while the
    /// returned value lives). The GPU then posts exactly as CPU threads do through
    /// [`cpu`](Self::cpu); do not post from both at once unless the sharing mode allows it.
    pub fn export_gpu(&self, gpu: &crate::cuda::Gpu) -> Result<GpuQp> {
        let q = &self.inner;
        let map = |b: &Window| {
            // SAFETY: every window is page-aligned whole pages, owned by the QP or its CQ,
            // which `GpuQp` keeps alive for as long as the mapping.
            unsafe { crate::cuda::HostMapping::new(gpu, b.as_ptr(), b.size()) }
        };
        let proxy_word = || {
            // SAFETY: as `map`; the proxy word is kept alive by `GpuQp::_proxy_word`.
            unsafe { crate::cuda::HostMapping::new(gpu, self.proxy_word.as_ptr(), self.proxy_word.size()) }
        };
        let unmappable = self.ctx.options.models_unmappable_doorbell();
        let doorbell = match self.handler() {
            // SAFETY: as `map` above; the doorbell page is mapped only here.
            DoorbellHandler::Gpu => {
                match unsafe { crate::doorbell::map_page(gpu, q.uar.as_ptr(), q.uar.size(), unmappable) } {
                    Ok(m) => m,
                    Err(why) => {
                        self.fall_back(&why)?;
                        proxy_word()?
                    }
                }
            }
            DoorbellHandler::CpuProxy => proxy_word()?,
        };
        let maps = vec![
            map(&q.sq)?,
            map(&q.records)?,
            doorbell,
            map(&q.cq.ring)?,
            map(&q.cq.dbrec)?,
        ];
        // SAFETY: the CPU handle was written in `create` and is only read here.
        let mut dev = unsafe { self.device_handle().read() };
        // Where the GPU does not order NIC writes for its own reads, fetched data is read only
        // after a fenced DUMP (the device code does it when the handle says so).
        let ordering = gpu.rdma_writes_ordering()?;
        if !ordering.owner_sees_writes_in_order() || self.ctx.options.models_unordered_rdma_writes() {
            dev.flags |= gdaki_layout::handle::QP_FLUSH_AFTER_FETCH;
            debug!(
                qpn = format_args!("{:#x}", q.qpn),
                %ordering,
                "GPUDirect RDMA writes ordering below owner: READs and fetching atomics end with a fenced DUMP"
            );
        }
        dev.sq_base = maps[0].device_addr(0);
        dev.sq_dbrec = maps[1].device_addr(4 * gdaki_layout::dbrec::SND_DBR as u64);
        dev.doorbell = maps[2].device_addr(0);
        dev.cq.cqe_base = maps[3].device_addr(0);
        dev.cq.dbrec = maps[4].device_addr(0);
        let handle = crate::cuda::DeviceBuffer::zeroed(gpu, std::mem::size_of::<DevQp>())?;
        handle.write(0, bytemuck::bytes_of(&dev))?;
        debug!(
            qpn = format_args!("{:#x}", q.qpn),
            handle = format_args!("{:#x}", handle.device_addr()),
            "queue pair exported to the GPU"
        );
        Ok(GpuQp {
            handle,
            _maps: maps,
            qp: q.clone(),
            _proxy_word: self.proxy_word.clone(),
            _ctx: self.ctx.clone(),
        })
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        self.ctx.hca.detach(self.inner.qpn);
        *lock(&self.inner.cq.qpn) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Access, Context, Provider};

    /// The fallback itself, without a GPU: a QP created with the GPU handler is switched to the
    /// library's proxy (as `export_gpu` does when the doorbell page cannot be mapped), CPU
    /// posters then publish instead of ringing, and the shared proxy rings for them until the
    /// QP goes.
    #[test]
    fn a_queue_pair_that_falls_back_is_rung_by_the_library_proxy() {
        let ctx = Context::open_with(Provider::Soft, crate::ContextOptions::default()).unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let qp = ctx
            .create_qp(
                &cq,
                QpConfig {
                    sq_size: 64,
                    ..Default::default()
                },
            )
            .unwrap();
        qp.connect(&qp.endpoint()).unwrap();
        assert_eq!((qp.handler(), qp.fell_back()), (DoorbellHandler::Gpu, false));
        assert!(qp.proxy_target().is_none());
        qp.fall_back(&crate::doorbell::Unmappable::Modelled).unwrap();
        qp.fall_back(&crate::doorbell::Unmappable::Modelled).unwrap(); // once is enough
        assert_eq!((qp.handler(), qp.fell_back()), (DoorbellHandler::CpuProxy, true));
        // A second proxy must not ring it too.
        assert!(qp.proxy_target().is_none());
        // SAFETY: the handle was just written; read only.
        let dev = unsafe { qp.device_handle().read() };
        assert_eq!(dev.doorbell_kind, DoorbellKind::CpuProxy as u8);
        assert_eq!(dev.doorbell, qp.proxy_word.addr());

        let src = ctx.alloc_region(4096, Access::ALL).unwrap();
        let dst = ctx.alloc_region(4096, Access::ALL).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        src.write(0, &data).unwrap();
        // SAFETY: this thread is the only poster; the QP outlives `post`.
        let post = unsafe { qp.cpu::<gdaki_device::Exclusive>() };
        for i in 0..200u64 {
            let off = (i % 64) * 64;
            let t = post.put(dst.remote(off), src.local(off), 64).unwrap();
            if i % 50 == 49 {
                post.wait(t).unwrap();
            }
        }
        let mut got = vec![0u8; 4096];
        dst.read(0, &mut got).unwrap();
        assert_eq!(got, data);
        let rung = qp.fallback_proxy_counters().unwrap();
        assert!(rung.doorbells > 0 && rung.targets >= 1, "{rung:?}");
        drop(qp);
        // No other test of this binary falls back, so this QP was the proxy's last.
        assert!(
            !crate::doorbell::shared_proxy_runs(),
            "the last QP that fell back stops the proxy"
        );
    }
}
