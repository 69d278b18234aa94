//! Completion queues and (RC) queue pairs: creation with validated sizes, placement of rings,
//! doorbell records and the doorbell word, the QP state machine, connection, and export of the
//! device handle (`gdaki_layout::DevQp`) that `gdaki-device` posts through.
use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gdaki_layout::prm::command::RqShape;
use gdaki_layout::prm::command::{self, CreateCq, CreateQp, Init2Rtr, Rst2Init, Rtr2Rts};
use gdaki_layout::prm::layout::{cqc, qpc, query_cq_out, query_qp_out};
use gdaki_layout::prm::{self, Bits, CmdStatus, Opcode};
use gdaki_layout::{cqe, AtomicReplyOrder, CqeOpcode, DevCq, DevQp, DevRq, DoorbellKind, Syndrome};
use tracing::debug;

use crate::error::{check_pow2, Error, Result};
use crate::lock;
use crate::options::ContextInner;
use crate::provider::DoorbellHandler;
pub use gdaki_devx::qp::{Endpoint, QpState, MAX_CQ_SIZE, MAX_SQ_SIZE};
use gdaki_devx::{DeviceError, HostBuffer, Owned, OwnedUar, QueueMemory, Umem};

mod reset;

/// Where a queue's ring and doorbell record live.
#[derive(Debug, Clone, Default)]
pub enum Rings {
    /// Page-locked host memory: CPU threads post to it directly and a GPU export maps it (the
    /// GPU then writes WQEs and polls CQEs over PCIe). The only placement the soft HCA serves.
    #[default]
    Host,
    /// Device memory of this GPU, which a NIC reads through a dma-buf export: kernels on that
    /// GPU write WQEs and poll CQEs in their own memory, and fence at GPU scope before a
    /// doorbell (as DOCA GPUNetIO and NVSHMEM's IBGDA place them). Only kernels on this GPU can
    /// post ([`QueuePair::cpu`] refuses); a CPU proxy only forwards the posters' doorbells,
    /// since it cannot write the doorbell record in GPU memory (CPU-assisted,
    /// `DoorbellKind::CpuAssisted`).
    Gpu(gdaki_cuda::Gpu),
}

impl Rings {
    /// `len` zeroed bytes of queue memory here, page-aligned whole pages.
    pub(crate) fn alloc(&self, what: &'static str, len: usize) -> Result<QueueMemory> {
        Ok(match self {
            Rings::Host => QueueMemory::Host(Arc::new(HostBuffer::new(what, len)?)),
            Rings::Gpu(gpu) => QueueMemory::Gpu {
                buf: Arc::new(gdaki_cuda::DeviceBuffer::zeroed(gpu, len)?),
                gpu: gpu.clone(),
            },
        })
    }
}

impl fmt::Display for Rings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rings::Host => f.write_str("host memory"),
            Rings::Gpu(gpu) => write!(f, "GPU {} memory", gpu.ordinal()),
        }
    }
}

/// Sizes and limits of a new queue pair.
#[derive(Debug, Clone)]
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
    /// Where the send queue and its doorbell record live (its CQ's placement is chosen with
    /// [`Context::create_cq_in`](crate::Context::create_cq_in)); a receive queue and its CQ
    /// live there too.
    pub rings: Rings,
    /// A receive queue, for two-sided verbs (SEND, SEND with immediate, WRITE with immediate
    /// at the peer): `None` (the default) for a QP that only sends and does one-sided verbs.
    pub receive: Option<ReceiveConfig>,
    /// How often a message the peer had no receive for is tried again, 0 to 7 (7: for ever,
    /// bounded by `timeout` on the waiter's side), as IB's `rnr_retry`. Default 7.
    pub rnr_retry: u8,
    /// The RNR NAK timer code this QP answers with when a message finds no receive: how long
    /// the peer waits before trying again (IB's table: 1 is 0.01 ms, 12 is 0.64 ms, 14 is
    /// 1.28 ms, 0 is 655 ms). Default 12, as rdma-core's tests and perftest set it.
    pub min_rnr_timer: u8,
    /// A cross-channel QP (Core-Direct master, `qpc.cd_master`): it may post WAIT WQEs, which
    /// hold its send queue until another QP's CQ has produced a given CQE. What a counter that
    /// advances when operations complete is made of ([`gdaki_device::Qp::count_when_done`] on
    /// such a companion QP). Refused on a device without the Core-Direct capability. Default
    /// off.
    pub cross_channel: bool,
    /// A reliable doorbell (DOCA GPUNetIO 2.0's `GPU_SM_NO_DBR`, NCCL's
    /// `NCCL_GDAKI_USE_RELIABLE_DB`): the QP is created with `qpc.send_dbr_mode` `NO_DBR_EXT`,
    /// so the HCA takes each doorbell as it comes and never reads the send doorbell record.
    /// Posters (and a proxy) then ring once, at the register for such QPs, and never write the
    /// record: one store to PCIe and one fence per post instead of three stores and two fences
    /// ([`gdaki_device::Qp::ring`]). Refused on a device without the capability
    /// (`cmd_hca_cap_2.send_dbr_mode_no_dbr_ext`: ConnectX-8; the soft HCA has it);
    /// [`Context::supports_reliable_doorbell`](crate::Context::supports_reliable_doorbell)
    /// says beforehand. Default off.
    pub reliable_doorbell: bool,
}

/// The receive queue of a queue pair ([`QpConfig::receive`]). Its completions go to a CQ of its
/// own that the QP creates (as large as the queue), in the QP's [`Rings`]. `docs/two-sided.md`
/// has the whole story; a SEND with immediate data between two soft HCAs, in CPU mode:
///
/// ```
/// use gdaki::{Access, Context, Provider, QpConfig, ReceiveConfig};
/// use gdaki_device::{Exclusive, RecvKind};
///
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let cfg = QpConfig {
///     receive: Some(ReceiveConfig { size: 64, max_bufs: 1 }),
///     min_rnr_timer: 1, // a message that finds no receive is tried again after 10 us
///     ..Default::default()
/// };
/// let (a, b) = (Context::open(Provider::Soft)?, Context::open(Provider::Soft)?);
/// let (qa, qb) = (a.create_qp(&a.create_cq(1024)?, cfg.clone())?, b.create_qp(&b.create_cq(1024)?, cfg)?);
/// qa.connect(&qb.endpoint())?;
/// qb.connect(&qa.endpoint())?;
/// let (src, dst) = (a.alloc_region(4096, Access::ALL)?, b.alloc_region(4096, Access::ALL)?);
/// src.write(0, b"hello")?;
/// // SAFETY: the views do not outlive their QPs; one thread uses each.
/// let (send, recv) = unsafe { (qa.cpu::<Exclusive>()?, qb.cpu_receive::<Exclusive>()?) };
/// let r = recv.post_recv_one(dst.local(0), 4096)?;
/// send.wait(send.send_imm(src.local(0), 5, 42)?)?;
/// let got = recv.poll(r)?;
/// assert_eq!((got.bytes, got.kind), (5, RecvKind::SendImm(42)));
/// let mut bytes = [0; 5];
/// dst.read(0, &mut bytes)?;
/// assert_eq!(&bytes, b"hello");
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReceiveConfig {
    /// Receives it holds: a power of two, at most [`MAX_SQ_SIZE`]. A queue smaller than 64
    /// bytes of receive WQEs is rounded up to that (the send queue follows it in memory).
    pub size: u32,
    /// The most buffers one receive scatters into: 1 to 4
    /// ([`gdaki_layout::recv::MAX_RECV_SGES`]).
    pub max_bufs: u32,
}

impl Default for ReceiveConfig {
    fn default() -> Self {
        ReceiveConfig {
            size: 1024,
            max_bufs: 1,
        }
    }
}

impl Default for QpConfig {
    fn default() -> Self {
        QpConfig {
            sq_size: 1024,
            max_msg_size: 1 << 30,
            timeout: Duration::from_secs(10),
            retry_timeout: Duration::from_secs(4),
            handler: DoorbellHandler::Gpu,
            rings: Rings::Host,
            receive: None,
            rnr_retry: 7,
            min_rnr_timer: 12,
            cross_channel: false,
            reliable_doorbell: false,
        }
    }
}

// ------------------------------------------------------------------------------ device objects

/// A completion queue as the library holds it: its device object and the memory of its ring
/// and doorbell record, shared by the [`CompletionQueue`] and the QP it serves.
pub(crate) struct Cq {
    // Fields drop in order: the object is destroyed before its umem is deregistered.
    obj: Owned,
    /// The CQE ring, then the doorbell record (`[consumer index, arm]`) after it.
    umem: Umem,
    cqn: u32,
    /// log2 of the ring's entries (what the HCA was given).
    log_size: u32,
    /// Collapsed: every CQE in entry 0 ([`Context::create_collapsed_cq_in`](crate::Context::create_collapsed_cq_in)).
    collapsed: bool,
    /// The QP it serves (one at most: device tickets are CQE indices).
    serves: Mutex<Option<u32>>,
    ctx: Arc<ContextInner>,
}

impl Cq {
    /// `DevCq::log_size`: the entries posters read, one for a collapsed CQ.
    fn device_log_size(&self) -> u32 {
        if self.collapsed {
            0
        } else {
            self.log_size
        }
    }

    fn ring(&self) -> u64 {
        self.umem.mem.addr()
    }

    fn dbrec(&self) -> u64 {
        self.ring() + (64u64 << self.log_size)
    }

    /// `QUERY_CQ`: the CQ context as the device has it.
    fn context(&self) -> Result<Vec<u8>> {
        let out = self
            .obj
            .query(&command::object_command(Opcode::QueryCq, self.cqn), query_cq_out::BYTES)
            .map_err(Error::device("querying a completion queue"))?;
        Ok(out)
    }

    fn context_field(out: &[u8], field: Bits) -> u64 {
        prm::get(out, field.within(query_cq_out::CQ_CONTEXT))
    }

    /// A copy of every CQE in the ring. The HCA writes CQEs concurrently: each may be stale,
    /// and only fields of entries it finished writing are to be trusted.
    fn cqes(&self) -> Result<Vec<cqe::Cqe64>> {
        let n = 1usize << self.log_size;
        match &self.umem.mem {
            QueueMemory::Host(_) => Ok((0..n)
                .map(|i| {
                    // SAFETY: entry i lies inside the ring, which `self` keeps alive; the copy
                    // is volatile because the HCA writes entries concurrently.
                    unsafe { std::ptr::read_volatile((self.ring() as *const cqe::Cqe64).add(i)) }
                })
                .collect()),
            QueueMemory::Gpu { buf, .. } => {
                let mut all = vec![bytemuck::Zeroable::zeroed(); n];
                buf.read(0, bytemuck::cast_slice_mut(&mut all))?;
                Ok(all)
            }
        }
    }
}

/// Claims a CQ for one QP; releases it when dropped (after the QP's device object is gone).
struct CqClaim(Arc<Cq>);

impl CqClaim {
    fn new(cq: &Arc<Cq>, qpn_hint: u32) -> Result<CqClaim> {
        let mut serves = lock(&cq.serves);
        if let Some(other) = *serves {
            return Err(Error::CqInUse {
                cqn: cq.cqn,
                qpn: other,
            });
        }
        *serves = Some(qpn_hint);
        Ok(CqClaim(cq.clone()))
    }
}

impl Drop for CqClaim {
    fn drop(&mut self) {
        *lock(&self.0.serves) = None;
    }
}

/// A queue pair as the library holds it: its device object, UAR page and memory, shared by
/// the [`QueuePair`], its GPU exports and the proxies that ring for it.
pub(crate) struct Qp {
    // Fields drop in order: the object is destroyed first, then its UAR page and umem go, then
    // its CQ is free again (and destroyed, if its handle is gone).
    obj: Owned,
    uar: OwnedUar,
    /// The send queue, then the doorbell record (`[receive, send]` counters) after it.
    umem: Umem,
    cq: CqClaim,
    /// The receive queue (at the start of `umem`, the send queue after it) and its CQ.
    rq: Option<RqPart>,
    qpn: u32,
    sq_log: u32,
    /// The first PSN this QP sends, chosen here.
    psn: u32,
    max_msg_size: u64,
    retry_timeout: Duration,
    rnr_retry: u8,
    min_rnr_timer: u8,
    /// The RTR peer's READ/atomic responder resources (its endpoint's `rd_atomic`), which
    /// bound this QP's `log_sra_max` at RTR2RTS.
    peer_rd_atomic: AtomicU8,
    /// Created without a doorbell record ([`QpConfig::reliable_doorbell`]).
    reliable_doorbell: bool,
    /// CPU-proxy QPs: the u64 producer index posters publish for the proxy.
    proxy_word: Arc<HostBuffer>,
    /// After a reset: the next ticket, which the next connect realigns the send queue with.
    pad: Mutex<Option<u64>>,
    /// The handles of live GPU exports, whose counters a reset rewrites.
    exports: reset::Exports,
    /// The receive handles of live GPU exports, likewise.
    recv_exports: reset::Exports,
    ctx: Arc<ContextInner>,
}

/// A QP's receive queue as the library holds it.
struct RqPart {
    /// Its CQ, which serves it alone.
    cq: CqClaim,
    log_size: u32,
    log_stride: u32,
}

impl RqPart {
    fn bytes(&self) -> u64 {
        gdaki_layout::recv::queue_bytes(self.log_size, self.log_stride) as u64
    }
}

impl Qp {
    /// Bytes of receive WQEs before the send queue in `umem`.
    fn rq_bytes(&self) -> u64 {
        self.rq.as_ref().map_or(0, RqPart::bytes)
    }

    fn sq(&self) -> u64 {
        self.umem.mem.addr() + self.rq_bytes()
    }

    /// The `DevRq` of receive queue `r` whose work-queue buffer starts at `wq` and whose CQE
    /// ring at `cqe_base`, as the poster reaches them (the CPU's addresses, or a GPU's).
    fn dev_rq(&self, r: &RqPart, wq: u64, cqe_base: u64, timeout: Duration) -> DevRq {
        let rcq = &r.cq.0;
        DevRq {
            rq_base: wq,
            // The receive word is word 0 of the record after the send queue.
            rq_dbrec: wq + r.bytes() + (64u64 << self.sq_log),
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            qpn: self.qpn,
            log_size: r.log_size,
            log_stride: r.log_stride,
            flags: if self.queues_in_gpu_memory() {
                gdaki_layout::handle::QP_RINGS_IN_GPU_MEMORY
            } else {
                0
            },
            version: gdaki_layout::handle::DEV_RQ_VERSION,
            cq: DevCq {
                cqe_base,
                dbrec: cqe_base + (rcq.dbrec() - rcq.ring()),
                cqn: rcq.cqn,
                log_size: rcq.device_log_size(),
                ..bytemuck::Zeroable::zeroed()
            },
            ..bytemuck::Zeroable::zeroed()
        }
    }

    /// The send counter of the doorbell record.
    fn sq_dbrec_offset(&self) -> u64 {
        (64u64 << self.sq_log) + 4 * gdaki_layout::dbrec::SND_DBR as u64
    }

    /// `QUERY_QP`: the QP context as the device has it.
    fn context(&self) -> Result<Vec<u8>> {
        self.obj
            .query(&command::object_command(Opcode::QueryQp, self.qpn), query_qp_out::BYTES)
            .map_err(Error::device("querying a queue pair"))
    }

    fn context_field(out: &[u8], field: Bits) -> u64 {
        prm::get(out, field.within(query_qp_out::QPC))
    }

    fn state(&self) -> Result<QpState> {
        let out = self.context()?;
        Ok(QpState::from_qpc(Self::context_field(&out, qpc::STATE) as u8))
    }

    /// The word posters ring (the doorbell) or publish to (the proxy word), and its kind, for
    /// `handler`: where the doorbell record is in GPU memory, which a proxy's CPU cannot write,
    /// posters ring the proxy word as they would the UAR and the proxy forwards (CPU-assisted).
    fn ring_word(&self, handler: DoorbellHandler) -> (u64, DoorbellKind) {
        match handler {
            DoorbellHandler::Gpu => (self.doorbell_addr(), DoorbellKind::Gpu),
            DoorbellHandler::CpuProxy if self.queues_in_gpu_memory() => {
                (self.proxy_word.addr(), DoorbellKind::CpuAssisted)
            }
            DoorbellHandler::CpuProxy => (self.proxy_word.addr(), DoorbellKind::CpuProxy),
        }
    }

    /// `DevQp::sq_dbrec` for a send queue at `sq` (in the address space of the handle's
    /// posters): the send word of its record, or 0 for a QP without one, which is how the
    /// handle says so ([`DevQp::no_doorbell_record`]).
    fn sq_dbrec_for_posters(&self, sq: u64) -> u64 {
        if self.reliable_doorbell {
            0
        } else {
            sq + self.sq_dbrec_offset()
        }
    }

    /// Where in the UAR page this QP's doorbell register is: the reliable doorbell's own
    /// register for a QP without a record.
    fn doorbell_offset(&self) -> u64 {
        if self.reliable_doorbell {
            self.uar.uar.dbr_less_offset
        } else {
            self.uar.uar.reg_offset
        }
    }

    /// The CPU address of this QP's doorbell register.
    pub(crate) fn doorbell_addr(&self) -> u64 {
        self.uar.uar.base + self.doorbell_offset()
    }

    /// Whether the work queues and their doorbell record (the QP's umem) are in GPU memory.
    fn queues_in_gpu_memory(&self) -> bool {
        self.umem.mem.gpu().is_some()
    }
}

/// The smaller of gdaki's own limit and a device capability given as log2.
fn limit(ours: u64, log_cap: u8) -> u64 {
    ours.min(1u64 << log_cap.min(63))
}

/// The local ACK timeout code and retry count whose total wait (IB: 4.096 µs · 2^timeout per
/// try, `retry_count + 1` tries) is the shortest one not below `total`.
pub(crate) fn ack_timeout_for(total: Duration) -> (u8, u8) {
    let want = total.as_nanos();
    let mut best = (31u8, 7u8, u128::MAX);
    for timeout in 0..=31u8 {
        for retries in 0..=7u8 {
            let got = (4096u128 << timeout) * (retries as u128 + 1);
            if got >= want && (got < best.2 || (got == best.2 && retries > best.1)) {
                best = (timeout, retries, got);
            }
        }
    }
    (best.0, best.1)
}

// ------------------------------------------------------------------------------ public objects

/// A completion queue. Each queue pair has its own (device tickets are CQE indices).
pub struct CompletionQueue {
    inner: Arc<Cq>,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("cqn", &self.inner.cqn)
            .field("size", &(1u32 << self.inner.log_size))
            .field("collapsed", &self.inner.collapsed)
            .finish()
    }
}

impl CompletionQueue {
    pub(crate) fn create(
        ctx: &Arc<ContextInner>,
        size: u32,
        rings: &Rings,
        collapsed: bool,
    ) -> Result<CompletionQueue> {
        let dev = &ctx.device;
        let max = limit(MAX_CQ_SIZE as u64, dev.caps.general.log_max_cq_sz);
        let log_size = check_pow2("completion queue size", size as u64, 1, max)?;
        let ring_bytes = 64usize << log_size;
        let mem = rings.alloc("a CQE ring and its doorbell record", ring_bytes + 64)?;
        // Every CQE starts invalid with owner 1, so the first lap (owner 0) is not mistaken:
        // written a chunk at a time (one copy each for GPU memory).
        let chunk_entries = (1usize << log_size).min(1024);
        let mut chunk = vec![0u8; 64 * chunk_entries];
        for entry in chunk.chunks_mut(64) {
            entry[cqe::field::OP_OWN.start] = cqe::OP_OWN_INIT;
        }
        for offset in (0..ring_bytes).step_by(chunk.len()) {
            mem.write(offset, &chunk)
                .map_err(Error::device("initialising queue memory"))?;
        }
        let umem = dev.devx.umem(mem).map_err(Error::device("registering a CQE ring"))?;
        let obj = dev
            .devx
            .create_owned(
                &CreateCq {
                    log_size: log_size as u8,
                    uar_page: dev.cq_uar.uar.page,
                    eqn: dev.eqn,
                    umem_id: umem.id,
                    dbr_umem_id: umem.id,
                    dbr_offset: ring_bytes as u64,
                    // As DOCA's: the newest CQE overwrites, whatever the consumer index says.
                    collapsed,
                    overrun_ignore: collapsed,
                    ..Default::default()
                }
                .encode(),
            )
            .map_err(Error::device("creating a completion queue"))?;
        debug!(
            cqn = format_args!("{:#x}", obj.obj.number),
            size,
            collapsed,
            %rings,
            "completion queue created"
        );
        Ok(CompletionQueue {
            inner: Arc::new(Cq {
                cqn: obj.obj.number,
                obj,
                umem,
                log_size,
                collapsed,
                serves: Mutex::new(None),
                ctx: ctx.clone(),
            }),
        })
    }

    /// CQ number.
    pub fn cqn(&self) -> u32 {
        self.inner.cqn
    }

    /// Size in CQEs (of a collapsed CQ: of the ring the HCA was given, only entry 0 written).
    pub fn size(&self) -> u32 {
        1 << self.inner.log_size
    }

    /// Whether it is collapsed ([`Context::create_collapsed_cq_in`](crate::Context::create_collapsed_cq_in)).
    pub fn collapsed(&self) -> bool {
        self.inner.collapsed
    }

    /// CQEs the HCA has written so far, modulo 2^24 (the device's `producer_counter`).
    pub fn written(&self) -> Result<u32> {
        let out = self.inner.context()?;
        Ok(Cq::context_field(&out, cqc::PRODUCER_COUNTER) as u32)
    }

    /// `Err(CqOverrun)` once the HCA found no room for a CQE (the device's CQ status).
    pub fn status(&self) -> Result<()> {
        let out = self.inner.context()?;
        match Cq::context_field(&out, cqc::STATUS) as u8 {
            command::CQC_STATUS_OK => Ok(()),
            _ => Err(Error::CqOverrun { cqn: self.inner.cqn }),
        }
    }
}

/// A reliable-connected queue pair, with its device handle.
pub struct QueuePair {
    inner: Arc<Qp>,
    /// The exported `DevQp`, in memory posters can reach.
    handle: HostBuffer,
    /// The exported `DevRq`, for a QP with a receive queue.
    recv_handle: Option<HostBuffer>,
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
        if !Arc::ptr_eq(&cq.inner.ctx, ctx) {
            return Err(Error::ForeignObject {
                what: "the completion queue",
            });
        }
        let dev = &ctx.device;
        let max_sq = limit(MAX_SQ_SIZE as u64, dev.caps.general.log_max_qp_sz);
        let sq_log = check_pow2("send queue size", cfg.sq_size as u64, 1, max_sq)?;
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
        let max_msg = limit(1 << 31, dev.caps.general.log_max_msg);
        if cfg.max_msg_size == 0 || cfg.max_msg_size > max_msg {
            return Err(Error::OutOfRange {
                what: "max_msg_size",
                got: cfg.max_msg_size,
                min: 1,
                max: max_msg,
            });
        }
        if cfg.rnr_retry > 7 || cfg.min_rnr_timer > 31 {
            return Err(Error::OutOfRange {
                what: if cfg.rnr_retry > 7 {
                    "rnr_retry"
                } else {
                    "min_rnr_timer"
                },
                got: cfg.rnr_retry.max(cfg.min_rnr_timer) as u64,
                min: 0,
                max: if cfg.rnr_retry > 7 { 7 } else { 31 },
            });
        }
        if cfg.cross_channel && !dev.caps.general.cd {
            return Err(Error::Unsupported {
                what: "a cross-channel queue pair (QpConfig::cross_channel)",
                why: "the device does not report the Core-Direct capability (cmd_hca_cap.cd)".into(),
            });
        }
        if cfg.reliable_doorbell && !dev.caps.general2.send_dbr_mode_no_dbr_ext {
            return Err(Error::Unsupported {
                what: "a reliable doorbell (QpConfig::reliable_doorbell)",
                why: "the device does not take doorbells without a record \
                      (cmd_hca_cap_2.send_dbr_mode_no_dbr_ext: ConnectX-8 and later)"
                    .into(),
            });
        }
        let rq_shape = match cfg.receive {
            None => None,
            Some(r) => {
                let max_bufs = gdaki_layout::recv::MAX_RECV_SGES as u64;
                if r.max_bufs == 0 || r.max_bufs as u64 > max_bufs {
                    return Err(Error::OutOfRange {
                        what: "receive max_bufs",
                        got: r.max_bufs as u64,
                        min: 1,
                        max: max_bufs,
                    });
                }
                let log_receives = check_pow2("receive queue size", r.size as u64, 1, max_sq)?;
                Some(gdaki_layout::recv::queue_shape(log_receives, r.max_bufs))
            }
        };
        // The QPN is not known before CREATE_QP: claim the CQ with 0 and name it after.
        let claim = CqClaim::new(&cq.inner, 0)?;
        // The receive queue's own CQ, as large as the queue: it can never overrun.
        let rq = match rq_shape {
            None => None,
            Some((log_size, log_stride)) => {
                let rcq = CompletionQueue::create(ctx, 1 << log_size, &cfg.rings, false)?;
                Some(RqPart {
                    cq: CqClaim::new(&rcq.inner, 0)?,
                    log_size,
                    log_stride,
                })
            }
        };
        let rq_bytes = rq.as_ref().map_or(0, RqPart::bytes) as usize;
        let sq_bytes = 64usize << sq_log;
        let mem = cfg.rings.alloc(
            "a receive and send queue and their doorbell record",
            rq_bytes + sq_bytes + 64,
        )?;
        let umem = dev.devx.umem(mem).map_err(Error::device("registering a send queue"))?;
        let uar = dev.devx.uar().map_err(Error::device("allocating a UAR page"))?;
        let obj = dev
            .devx
            .create_owned(
                &CreateQp {
                    pd: ctx.pd.number,
                    ts_format: dev.caps.qp_ts_format(),
                    uar_page: uar.uar.page,
                    cqn_snd: cq.cqn(),
                    cqn_rcv: rq.as_ref().map_or(cq.cqn(), |r| r.cq.0.cqn),
                    log_sq_size: sq_log as u8,
                    umem_id: umem.id,
                    dbr_umem_id: umem.id,
                    dbr_offset: (rq_bytes + sq_bytes) as u64,
                    receive: rq.as_ref().map(|r| RqShape {
                        log_size: r.log_size as u8,
                        log_stride: r.log_stride as u8,
                    }),
                    cd_master: cfg.cross_channel,
                    send_dbr_mode: if cfg.reliable_doorbell {
                        command::QPC_SEND_DBR_MODE_NO_DBR_EXT
                    } else {
                        command::QPC_SEND_DBR_MODE_DBR_VALID
                    },
                    ..Default::default()
                }
                .encode(),
            )
            .map_err(Error::device("creating a queue pair"))?;
        let qpn = obj.obj.number;
        *lock(&cq.inner.serves) = Some(qpn);
        if let Some(r) = &rq {
            *lock(&r.cq.0.serves) = Some(qpn);
        }
        let reply = if dev.caps.atomic.reply_mode == 1 {
            AtomicReplyOrder::HostOrder
        } else {
            AtomicReplyOrder::BigEndian
        };
        let qp = Arc::new(Qp {
            obj,
            uar,
            umem,
            cq: claim,
            rq,
            qpn,
            sq_log,
            psn: crate::random_u32() & 0xff_ffff,
            max_msg_size: cfg.max_msg_size,
            retry_timeout: cfg.retry_timeout,
            rnr_retry: cfg.rnr_retry,
            min_rnr_timer: cfg.min_rnr_timer,
            peer_rd_atomic: AtomicU8::new(0),
            reliable_doorbell: cfg.reliable_doorbell,
            proxy_word: Arc::new(HostBuffer::new("a proxy producer index", 64)?),
            pad: Mutex::new(None),
            exports: Default::default(),
            recv_exports: Default::default(),
            ctx: ctx.clone(),
        });
        let handle = HostBuffer::new("a device QP handle", std::mem::size_of::<DevQp>())?;
        let (doorbell, kind) = qp.ring_word(cfg.handler);
        let dev_qp = DevQp {
            sq_base: qp.sq(),
            sq_dbrec: qp.sq_dbrec_for_posters(qp.sq()),
            doorbell,
            max_msg_size: cfg.max_msg_size,
            timeout_ns: cfg.timeout.as_nanos().min(u64::MAX as u128) as u64,
            qpn,
            sq_log_size: sq_log,
            doorbell_kind: kind as u8,
            version: gdaki_layout::handle::DEV_QP_VERSION,
            flags: reply.qp_flags()
                | if qp.queues_in_gpu_memory() {
                    gdaki_layout::handle::QP_RINGS_IN_GPU_MEMORY
                } else {
                    0
                },
            cq: DevCq {
                cqe_base: cq.inner.ring(),
                dbrec: cq.inner.dbrec(),
                cqn: cq.cqn(),
                log_size: cq.inner.device_log_size(),
                ..bytemuck::Zeroable::zeroed()
            },
            ..bytemuck::Zeroable::zeroed()
        };
        // SAFETY: the buffer is DevQp-sized and page-aligned; nobody else sees it yet.
        unsafe { (handle.as_ptr() as *mut DevQp).write(dev_qp) };
        let recv_handle = match &qp.rq {
            None => None,
            Some(r) => {
                let h = HostBuffer::new("a device receive-queue handle", std::mem::size_of::<DevRq>())?;
                let dev_rq = qp.dev_rq(r, qp.umem.mem.addr(), r.cq.0.ring(), cfg.timeout);
                // SAFETY: the buffer is DevRq-sized and page-aligned; nobody else sees it yet.
                unsafe { (h.as_ptr() as *mut DevRq).write(dev_rq) };
                Some(h)
            }
        };
        debug!(
            qpn = format_args!("{qpn:#x}"),
            cqn = format_args!("{:#x}", cq.cqn()),
            sq = cfg.sq_size,
            rings = %cfg.rings,
            "queue pair created"
        );
        Ok(QueuePair {
            inner: qp,
            handle,
            recv_handle,
            handler: AtomicU8::new(cfg.handler as u8),
            fallback: Mutex::new(None),
        })
    }

    /// QP number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// Current state, as the device reports it (`QUERY_QP`). A device that cannot be asked
    /// reads as [`QpState::Error`], and the reason is logged.
    pub fn state(&self) -> QpState {
        self.inner.state().unwrap_or_else(|e| {
            tracing::warn!(qpn = format_args!("{:#x}", self.inner.qpn), "{e}");
            QpState::Error
        })
    }

    /// The first error's syndrome, once the QP is in error: read from the error CQE the HCA
    /// wrote for the WQE that failed (a send's, else a receive's), or [`Syndrome::WrFlush`] when
    /// there is none (the QP was moved to error, or that CQE was overwritten since, or a CQE
    /// ring in GPU memory could not be copied: that is logged).
    pub fn error(&self) -> Option<Syndrome> {
        if self.state() != QpState::Error {
            return None;
        }
        let first_in = |cq: &Cq, kind: CqeOpcode| {
            let cqes = cq.cqes().unwrap_or_else(|e| {
                tracing::warn!(qpn = format_args!("{:#x}", self.inner.qpn), "reading the CQE ring: {e}");
                Vec::new()
            });
            cqes.iter().find_map(|entry| {
                let err = entry.as_error();
                (entry.opcode() == kind && err.syndrome() != Syndrome::WrFlush).then(|| err.syndrome())
            })
        };
        let first = first_in(&self.inner.cq.0, CqeOpcode::ReqErr).or_else(|| {
            self.inner
                .rq
                .as_ref()
                .and_then(|r| first_in(&r.cq.0, CqeOpcode::RespErr))
        });
        Some(first.unwrap_or(Syndrome::WrFlush))
    }

    /// What a peer needs to connect to this QP.
    pub fn endpoint(&self) -> Endpoint {
        let port = &self.inner.ctx.device.port;
        Endpoint {
            gid: port.gid,
            lid: port.lid,
            qpn: self.inner.qpn,
            psn: self.inner.psn,
            mtu: port.mtu as u16,
            secret: self.inner.ctx.device.device().transport_secret(self.inner.qpn),
            rd_atomic: self.log_rra_max(),
            addr: self.inner.ctx.device.device().transport_addr(),
        }
    }

    /// log2 of the RDMA READs and atomics this QP accepts outstanding as a responder: what the
    /// device allows (`log_max_ra_res_qp`), at most what a QP context holds.
    fn log_rra_max(&self) -> u8 {
        let caps = &self.inner.ctx.device.caps.general;
        caps.log_max_ra_res_qp.min(gdaki_devx::wire::MAX_RD_ATOMIC)
    }

    /// Runs a modify command that moves the QP to `to`; a device that refuses it because of
    /// the QP's state answers [`Error::BadTransition`].
    fn modify(&self, input: &[u8], to: QpState) -> Result<()> {
        match self.inner.obj.modify(input) {
            Ok(()) => {
                debug!(qpn = format_args!("{:#x}", self.qpn()), %to, "modify QP");
                Ok(())
            }
            Err(DeviceError::Command { error, .. }) if error.status == CmdStatus::BadQpState => {
                Err(Error::BadTransition {
                    qpn: self.qpn(),
                    from: self.state(),
                    to,
                })
            }
            Err(e) => Err(Error::device("modifying a queue pair")(e)),
        }
    }

    /// RESET → INIT. Atomics are enabled in the mode the device's atomic capabilities allow
    /// (as the kernel chooses it), and not at all on a device without them.
    pub fn to_init(&self) -> Result<()> {
        let atomic_mode = self.inner.ctx.device.caps.qp_atomic_mode();
        let input = Rst2Init {
            qpn: self.qpn(),
            port: self.inner.ctx.device.port.number,
            remote_read: true,
            remote_write: true,
            remote_atomic: atomic_mode.is_some(),
            atomic_mode: atomic_mode.unwrap_or(0),
            ..Default::default()
        };
        self.modify(&input.encode(), QpState::Init)
    }

    /// INIT → RTR: the peer QP, the path to it (resolved from its GID, and for a soft HCA in
    /// another process from its address) and the PSN it starts sending with.
    pub fn to_rtr(&self, peer: &Endpoint) -> Result<()> {
        let port = &self.inner.ctx.device.port;
        let mtu = (peer.mtu as u32).min(port.mtu);
        let Some(mtu) = command::mtu_code(mtu) else {
            return Err(Error::OutOfRange {
                what: "the peer's MTU (256, 512, 1024, 2048 or 4096)",
                got: peer.mtu as u64,
                min: 256,
                max: 4096,
            });
        };
        let mut path = self
            .inner
            .ctx
            .device
            .device()
            .resolve(peer)
            .map_err(Error::device("resolving the path to a peer"))?;
        path.gid_index = port.gid_index;
        let input = Init2Rtr {
            qpn: self.qpn(),
            mtu,
            log_msg_max: (64 - (self.inner.max_msg_size - 1).leading_zeros()) as u8,
            remote_qpn: peer.qpn,
            next_rcv_psn: peer.psn,
            min_rnr_nak: self.inner.min_rnr_timer,
            log_rra_max: self.log_rra_max(),
            path,
        };
        self.modify(&input.encode(), QpState::Rtr)?;
        self.inner.peer_rd_atomic.store(peer.rd_atomic, Ordering::Release);
        Ok(())
    }

    /// RTR → RTS: the first PSN this QP sends and its retry policy ([`QpConfig::retry_timeout`]
    /// as IB's ACK timeout and retry count). The soft HCA connects its transport here: a peer
    /// it cannot reach is refused, and the QP stays in RTR.
    pub fn to_rts(&self) -> Result<()> {
        let (ack_timeout, retry_count) = ack_timeout_for(self.inner.retry_timeout);
        // Outstanding READs and atomics as requester: what the device allows, within what the
        // peer accepts (NVSHMEM takes both from the caps; a peer of another kind may take fewer).
        let caps = &self.inner.ctx.device.caps.general;
        let log_sra_max = caps
            .log_max_ra_req_qp
            .min(gdaki_devx::wire::MAX_RD_ATOMIC)
            .min(self.inner.peer_rd_atomic.load(Ordering::Acquire));
        let input = Rtr2Rts {
            qpn: self.qpn(),
            next_send_psn: self.inner.psn,
            retry_count,
            rnr_retry: self.inner.rnr_retry,
            ack_timeout,
            log_sra_max,
        };
        self.modify(&input.encode(), QpState::Rts)
    }

    /// Any state → ERROR: outstanding and later WQEs are flushed.
    pub fn to_error(&self) -> Result<()> {
        self.modify(&command::object_command(Opcode::Qp2Err, self.qpn()), QpState::Error)
    }

    /// RESET → INIT → RTR → RTS against `peer`. After a [`reset`](Self::reset) the send
    /// queue is then realigned with its CQ before this returns (a few NOPs: see `reset`).
    pub fn connect(&self, peer: &Endpoint) -> Result<()> {
        self.to_init()?;
        self.to_rtr(peer)?;
        self.to_rts()?;
        if let Some(next) = self.pending_pad() {
            self.realign(next)?;
            *lock(&self.inner.pad) = None;
        }
        Ok(())
    }

    /// The exported device handle. Valid while this QP lives; posters use it through
    /// `gdaki_device::Qp::from_raw` (CPU mode here; [`export_gpu`](Self::export_gpu) for GPUs).
    /// With rings in GPU memory its addresses are the GPU's, which CPU code must not touch.
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
        let keep: Arc<dyn Send + Sync> = q.clone();
        let (index, doorbell) = (q.proxy_word.as_ptr() as *const u64, q.doorbell_addr() as *mut u64);
        // SAFETY: the proxy word, the send word of the doorbell record and the doorbell word
        // are aligned words of memory `keep` keeps: the proxy word, the QP's umem and its UAR
        // page, which the QP gives back only when it goes. The record is handed over only where
        // it is host memory; in GPU memory the posters write it and ring the proxy word as a
        // doorbell (CPU-assisted, `ring_word`). Posters, the proxy and the HCA access them
        // atomically.
        unsafe {
            if q.queues_in_gpu_memory() {
                gdaki_proxy::Target::forwarding(q.qpn, index, doorbell, keep)
            } else if q.reliable_doorbell {
                gdaki_proxy::Target::without_record(q.qpn, index, doorbell, keep)
            } else {
                let record = (q.sq() + q.sq_dbrec_offset()) as *mut u32;
                gdaki_proxy::Target::new(q.qpn, index, record, doorbell, keep)
            }
        }
    }

    /// How posters submit to this QP ([`DoorbellKind`]): what [`handler`](Self::handler) and
    /// the rings' placement chose ([`DoorbellKind::CpuAssisted`] for a proxy and rings in GPU
    /// memory).
    pub fn doorbell_kind(&self) -> DoorbellKind {
        self.inner.ring_word(self.handler()).1
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
        let (doorbell, kind) = self.inner.ring_word(DoorbellHandler::CpuProxy);
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

    /// Whether the send queue or the CQE ring is in GPU memory ([`Rings::Gpu`]).
    pub fn rings_in_gpu_memory(&self) -> bool {
        self.inner.queues_in_gpu_memory()
            || self.inner.cq.0.umem.mem.gpu().is_some()
            || self.inner.rq.as_ref().is_some_and(|r| r.cq.0.umem.mem.gpu().is_some())
    }

    /// The exported receive-queue handle, for a QP created with a receive queue
    /// ([`QpConfig::receive`]): what `gdaki_device::Rq::from_raw` takes in CPU mode. Valid
    /// while this QP lives.
    pub fn receive_handle(&self) -> Option<*mut DevRq> {
        self.recv_handle.as_ref().map(|h| h.as_ptr() as *mut DevRq)
    }

    /// A CPU-mode view of this QP's receive queue in sharing mode `M`: refused for a QP
    /// without one, or whose rings are in GPU memory.
    ///
    /// # Safety
    /// As [`cpu`](Self::cpu): the value must not outlive this `QueuePair`, and concurrent
    /// users share one sharing mode.
    pub unsafe fn cpu_receive<M: gdaki_device::Sharing>(&self) -> Result<gdaki_device::Rq<M>> {
        let Some(h) = self.receive_handle() else {
            return Err(Error::Unsupported {
                what: "receiving on a queue pair without a receive queue",
                why: "create it with QpConfig::receive (in C, gdaki_qp_config.rq_size)".into(),
            });
        };
        self.cpu_reachable()?;
        // SAFETY: the handle was filled in `create` and lives as long as self (caller's contract).
        Ok(unsafe { gdaki_device::Rq::from_raw(h) })
    }

    /// A CPU-mode poster's view of this QP in sharing mode `M`. Refused when a ring is in GPU
    /// memory (only kernels on that GPU reach it).
    ///
    /// # Safety
    /// The value must not outlive this `QueuePair`, and all concurrent posters must use the
    /// same sharing mode (exclusive: one thread at a time).
    pub unsafe fn cpu<M: gdaki_device::Sharing>(&self) -> Result<gdaki_device::Qp<M>> {
        self.cpu_reachable()?;
        // SAFETY: the handle was filled in `create` and lives as long as self (caller's contract).
        Ok(unsafe { gdaki_device::Qp::from_raw(self.device_handle()) })
    }

    /// Whether CPU threads reach the rings: refused where a ring is in GPU memory.
    fn cpu_reachable(&self) -> Result<()> {
        if self.rings_in_gpu_memory() {
            return Err(Error::Unsupported {
                what: "posting from the CPU to a queue pair whose rings are in GPU memory",
                why: "only kernels on that GPU reach them: post through export_gpu, or place the rings in \
                      host memory (Rings::Host)"
                    .into(),
            });
        }
        Ok(())
    }
}

/// A queue pair exported to a GPU: its send queue, CQ ring and doorbell records are in that
/// GPU's memory ([`Rings::Gpu`]) or mapped into it (host memory: the GPU writes WQEs over PCIe,
/// the soft HCA reads them locally), its doorbell page is mapped into it, and its device handle
/// lives in GPU memory. Kernels take
/// [`device_handle`](Self::device_handle) as their `*mut DevQp`.
pub struct GpuQp {
    /// Shared with the QP's list of exports, which a reset rewrites.
    handle: Arc<gdaki_cuda::DeviceBuffer>,
    /// The `DevRq` in GPU memory, for a QP with a receive queue.
    recv_handle: Option<Arc<gdaki_cuda::DeviceBuffer>>,
    /// What `handle` was written with: the GPU's addresses of the rings, records and doorbell
    /// (what a CUDA stream's memory operations store to and wait on).
    view: DevQp,
    /// What `recv_handle` was written with.
    recv_view: Option<DevRq>,
    // Unmapped before the QP's memory can go: the QP is kept alive by `qp`.
    _maps: Vec<gdaki_cuda::HostMapping>,
    qp: Arc<Qp>,
}

impl fmt::Debug for GpuQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuQp")
            .field("qpn", &self.qp.qpn)
            .field("handle", &format_args!("{:#x}", self.handle.device_addr()))
            .finish()
    }
}

// SAFETY: the handle is a `DevQp` in memory of the GPU it was exported to, and the rings,
// records and doorbell it names are kept (`_maps`, the QP) for as long as the GpuQp lives.
unsafe impl gdaki_cuda::ExportedQp for GpuQp {
    fn gpu_ordinal(&self) -> usize {
        GpuQp::gpu_ordinal(self)
    }
    fn device_handle(&self) -> u64 {
        GpuQp::device_handle(self)
    }
    fn receive_handle(&self) -> Option<u64> {
        GpuQp::receive_handle(self)
    }
}

impl GpuQp {
    /// The `DevQp` in GPU memory (what [`Args::qp`](gdaki_cuda::Args::qp) passes to kernels).
    pub fn device_handle(&self) -> u64 {
        self.handle.device_addr()
    }

    /// The `DevRq` in GPU memory, for a QP with a receive queue: kernels take it as their
    /// `*mut DevRq` (`gdaki_device::Rq::from_raw`).
    pub fn receive_handle(&self) -> Option<u64> {
        self.recv_handle.as_ref().map(|h| h.device_addr())
    }

    /// The handle as it was written into GPU memory (its counters as of the export): the
    /// GPU's addresses of the rings, records and doorbell.
    pub(crate) fn view(&self) -> &DevQp {
        &self.view
    }

    /// The receive handle as it was written into GPU memory (the receive CQ's GPU address).
    pub(crate) fn recv_view(&self) -> Option<&DevRq> {
        self.recv_view.as_ref()
    }

    /// Whether this is an export of `qp`.
    pub fn exports(&self, qp: &QueuePair) -> bool {
        Arc::ptr_eq(&self.qp, &qp.inner)
    }

    /// The GPU it is exported to.
    pub fn gpu_ordinal(&self) -> usize {
        self.handle.gpu_ordinal()
    }

    /// The counters kernels keep in the device handle, read back from GPU memory, next to the
    /// HCA's own progress (`QUERY_QP`'s WQE counter, `QUERY_CQ`'s producer counter): where a
    /// stuck or failed kernel left the QP. Read it when no kernel runs on the QP (the copy is
    /// not atomic against one).
    pub fn counters(&self) -> Result<QpCounters> {
        let mut dev: DevQp = bytemuck::Zeroable::zeroed();
        self.handle.read(0, bytemuck::bytes_of_mut(&mut dev))?;
        let qp_out = self.qp.context()?;
        let cq_out = self.qp.cq.0.context()?;
        // The device counts modulo 2^16 (WQEs) and 2^24 (CQEs); each trails the poster's own
        // count by less than that, so the full counts follow from the posters'.
        let fetched = Qp::context_field(&qp_out, qpc::HW_SQ_WQEBB_COUNTER) as u16;
        let produced = Cq::context_field(&cq_out, cqc::PRODUCER_COUNTER) as u32;
        Ok(QpCounters {
            sq_reserved: dev.sq_reserved,
            sq_ready: dev.sq_ready,
            sq_rung: dev.sq_rung,
            cq_consumed: dev.cq.consumed,
            cq_error: (dev.cq.error & gdaki_layout::handle::ERROR_VALID != 0).then_some(dev.cq.error),
            hca_fetched: at_or_below(dev.sq_rung, fetched as u64, 16),
            hca_completed: at_or_above(dev.cq.consumed, produced as u64, 24),
        })
    }
}

/// The full count whose low `bits` bits are `low`, at most `ahead` and less than 2^`bits`
/// below it.
fn at_or_below(ahead: u64, low: u64, bits: u32) -> u64 {
    let mask = (1u64 << bits) - 1;
    ahead.wrapping_sub(ahead.wrapping_sub(low) & mask)
}

/// The full count whose low `bits` bits are `low`, at least `behind` and less than 2^`bits`
/// above it.
fn at_or_above(behind: u64, low: u64, bits: u32) -> u64 {
    let mask = (1u64 << bits) - 1;
    behind.wrapping_add(low.wrapping_sub(behind) & mask)
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
    pub fn export_gpu(&self, gpu: &gdaki_cuda::Gpu) -> Result<GpuQp> {
        let q = &self.inner;
        let cq = &q.cq.0;
        let rcq = q.rq.as_ref().map(|r| &r.cq.0);
        for ring in [Some(&q.umem.mem), Some(&cq.umem.mem), rcq.map(|c| &c.umem.mem)]
            .into_iter()
            .flatten()
        {
            if let Some(theirs) = ring.gpu().filter(|g| g.ordinal() != gpu.ordinal()) {
                return Err(Error::Unsupported {
                    what: "exporting a queue pair to another GPU than the one its rings are in",
                    why: format!(
                        "its rings are in GPU {}'s memory, the export is to GPU {}",
                        theirs.ordinal(),
                        gpu.ordinal()
                    ),
                });
            }
        }
        let map = |b: &HostBuffer| {
            // SAFETY: every buffer is page-aligned whole pages, owned by the QP or its CQ,
            // which `GpuQp` keeps alive for as long as the mapping.
            unsafe { gdaki_cuda::HostMapping::new(gpu, b.as_ptr(), b.size()) }
        };
        let mut maps = Vec::new();
        // A ring's address in the GPU: its own in GPU memory, its mapping's for host memory.
        let mut place = |mem: &QueueMemory| -> Result<u64> {
            Ok(match mem {
                QueueMemory::Gpu { buf, .. } => buf.device_addr(),
                QueueMemory::Host(b) => {
                    let m = map(b)?;
                    let at = m.device_addr(0);
                    maps.push(m);
                    at
                }
            })
        };
        let wq = place(&q.umem.mem)?;
        let sq = wq + q.rq_bytes();
        let cqe_base = place(&cq.umem.mem)?;
        let rcqe_base = rcq.map(|c| place(&c.umem.mem)).transpose()?;
        let unmappable = q.ctx.options.models_unmappable_doorbell();
        let doorbell = match self.handler() {
            DoorbellHandler::Gpu => {
                let page = &q.uar.uar;
                // SAFETY: the UAR page is page-aligned whole pages the QP holds until it goes
                // (`GpuQp` keeps it); it is mapped only here.
                match unsafe { crate::doorbell::map_page(gpu, page, unmappable) } {
                    Ok(m) => m,
                    Err(why) => {
                        self.fall_back(&why)?;
                        map(&q.proxy_word)?
                    }
                }
            }
            DoorbellHandler::CpuProxy => map(&q.proxy_word)?,
        };
        let doorbell_base = doorbell.device_addr(0);
        maps.push(doorbell);
        // SAFETY: the CPU handle was written in `create` and is only read here.
        let mut dev = unsafe { self.device_handle().read() };
        // Where the GPU does not order NIC writes for its own reads, fetched data is read only
        // after a fenced DUMP (the device code does it when the handle says so).
        let ordering = gpu.rdma_writes_ordering()?;
        if !ordering.owner_sees_writes_in_order() || q.ctx.options.models_unordered_rdma_writes() {
            dev.flags |= gdaki_layout::handle::QP_FLUSH_AFTER_FETCH;
            debug!(
                qpn = format_args!("{:#x}", q.qpn),
                %ordering,
                "GPUDirect RDMA writes ordering below owner: READs and fetching atomics end with a fenced DUMP"
            );
        }
        dev.sq_base = sq;
        dev.sq_dbrec = q.sq_dbrec_for_posters(sq);
        // The doorbell register's place in the page (the proxy word when it fell back).
        dev.doorbell = doorbell_base
            + match self.handler() {
                DoorbellHandler::Gpu => q.doorbell_offset(),
                DoorbellHandler::CpuProxy => 0,
            };
        dev.cq.cqe_base = cqe_base;
        dev.cq.dbrec = cqe_base + (cq.dbrec() - cq.ring());
        let handle = Arc::new(gdaki_cuda::DeviceBuffer::zeroed(gpu, std::mem::size_of::<DevQp>())?);
        handle.write(0, bytemuck::bytes_of(&dev))?;
        q.exports.add(&handle);
        let (recv_handle, recv_view) = match (&q.rq, rcqe_base) {
            (Some(r), Some(base)) => {
                let timeout = Duration::from_nanos(dev.timeout_ns);
                let mut dev_rq = q.dev_rq(r, wq, base, timeout);
                // The hot words as the CPU handle has them (a reset's base among them), as the
                // send side's export copies the CPU handle.
                if let Some(cpu) = self.receive_handle() {
                    // SAFETY: the CPU receive handle, alive with self, read whole.
                    let now = unsafe { cpu.read() };
                    (dev_rq.rq_reserved, dev_rq.rq_ready, dev_rq.index_base) =
                        (now.rq_reserved, now.rq_ready, now.index_base);
                    (dev_rq.cq.consumed, dev_rq.cq.error) = (now.cq.consumed, now.cq.error);
                }
                let h = Arc::new(gdaki_cuda::DeviceBuffer::zeroed(gpu, std::mem::size_of::<DevRq>())?);
                h.write(0, bytemuck::bytes_of(&dev_rq))?;
                q.recv_exports.add(&h);
                (Some(h), Some(dev_rq))
            }
            _ => (None, None),
        };
        debug!(
            qpn = format_args!("{:#x}", q.qpn),
            handle = format_args!("{:#x}", handle.device_addr()),
            "queue pair exported to the GPU"
        );
        Ok(GpuQp {
            handle,
            recv_handle,
            view: dev,
            recv_view,
            _maps: maps,
            qp: q.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Access, Context, Provider};

    #[test]
    fn device_counters_extend_to_full_counts() {
        // The HCA fetched 5 WQEs fewer than were rung, across a 16-bit wrap.
        assert_eq!(at_or_below(0x1_0002, 0xfffd, 16), 0xfffd);
        assert_eq!(at_or_below(70_000, 70_000 & 0xffff, 16), 70_000);
        // The HCA wrote 3 CQEs more than were consumed, across a 24-bit wrap.
        assert_eq!(at_or_above(0xff_fffe, 0x1, 24), 0x100_0001);
        assert_eq!(at_or_above(5, 5, 24), 5);
    }

    #[test]
    fn the_retry_timeout_becomes_the_nearest_ib_timer_not_below_it() {
        let total = |(t, r): (u8, u8)| Duration::from_nanos((4096u64 << t) * (r as u64 + 1));
        for ms in [1u64, 7, 300, 1000, 4000, 3_600_000] {
            let want = Duration::from_millis(ms);
            let got = total(ack_timeout_for(want));
            assert!(
                got >= want && got.as_secs_f64() <= want.as_secs_f64() * 1.25,
                "{want:?}: {got:?}"
            );
        }
        // Exactly expressible: 8 tries of 4.096 µs · 2^10.
        assert_eq!(ack_timeout_for(Duration::from_nanos(8 * (4096 << 10))), (10, 7));
        // Below the shortest timer: the shortest.
        assert_eq!(ack_timeout_for(Duration::from_nanos(1)), (0, 0));
    }

    /// Rings in GPU memory, on a device that takes GPU umems as a NIC does (the recording
    /// double): the umems are the GPU's memory, every CQE starts invalid there, the handle says
    /// where the rings are and the export uses them in place; CPU posting is refused; a CPU
    /// proxy (chosen, or the fallback) only rings, the posters writing the record
    /// (CPU-assisted); the first error is read from the GPU ring.
    #[test]
    fn rings_in_gpu_memory_are_registered_initialised_and_exported_in_place() {
        let Some(gpu) =
            crate::devx_tests::gpu_or_skip("rings_in_gpu_memory_are_registered_initialised_and_exported_in_place")
        else {
            return;
        };
        let (ctx, rec) = crate::devx_tests::recording_context_with(true);
        rec.take();
        let rings = Rings::Gpu(gpu.clone());
        let cq = ctx.create_cq_in(64, &rings).unwrap();
        // 64 CQEs and the doorbell record: 4160 bytes, whole pages.
        assert_eq!(rec.take(), ["umem_reg(gpu, 8192 bytes)", "CREATE_CQ"]);
        let cqes = cq.inner.cqes().unwrap();
        assert_eq!(cqes.len(), 64);
        assert!(
            cqes.iter()
                .all(|c| bytemuck::bytes_of(c)[cqe::field::OP_OWN.start] == cqe::OP_OWN_INIT),
            "every CQE in GPU memory starts invalid with owner 1"
        );

        let proxied = QpConfig {
            sq_size: 64,
            handler: DoorbellHandler::CpuProxy,
            rings: rings.clone(),
            ..Default::default()
        };
        let assisted = ctx.create_qp(&cq, proxied).unwrap();
        assert_eq!(assisted.doorbell_kind(), DoorbellKind::CpuAssisted);
        // SAFETY: the handle was written in `create`; read only.
        let h = unsafe { assisted.device_handle().read() };
        assert_eq!(h.doorbell_kind, DoorbellKind::CpuAssisted as u8);
        assert_eq!(h.doorbell, assisted.inner.proxy_word.addr());
        assert!(!assisted.proxy_target().unwrap().writes_record());
        drop(assisted);
        rec.take();

        let cfg = QpConfig {
            sq_size: 64,
            rings: rings.clone(),
            ..Default::default()
        };
        let qp = ctx.create_qp(&cq, cfg).unwrap();
        assert_eq!(rec.take(), ["umem_reg(gpu, 8192 bytes)", "alloc_uar", "CREATE_QP"]);
        assert!(qp.rings_in_gpu_memory());
        // SAFETY: refused, so nothing posts.
        let err = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.err().unwrap();
        assert!(matches!(err, Error::Unsupported { .. }), "{err}");
        // SAFETY: the handle was written in `create`; read only.
        let cpu_handle = unsafe { qp.device_handle().read() };
        assert!(cpu_handle.rings_in_gpu_memory());
        assert_eq!(cpu_handle.sq_base, qp.inner.umem.mem.addr());
        assert_eq!(cpu_handle.cq.cqe_base, cq.inner.umem.mem.addr());

        // Exported in place: only the doorbell page is mapped.
        let exported = qp.export_gpu(&gpu).unwrap();
        assert_eq!(exported._maps.len(), 1);
        let mut theirs: DevQp = bytemuck::Zeroable::zeroed();
        exported.handle.read(0, bytemuck::bytes_of_mut(&mut theirs)).unwrap();
        assert!(theirs.rings_in_gpu_memory());
        let rings_of = |d: &DevQp| (d.sq_base, d.sq_dbrec, d.cq.cqe_base, d.cq.dbrec);
        assert_eq!(rings_of(&theirs), rings_of(&cpu_handle));
        // The fallback keeps the rings where they are: the library's proxy only rings.
        assert_eq!(qp.doorbell_kind(), DoorbellKind::Gpu);
        qp.fall_back(&crate::doorbell::Unmappable::Modelled).unwrap();
        assert!(qp.fell_back() && qp.handler() == DoorbellHandler::CpuProxy);
        assert_eq!(qp.doorbell_kind(), DoorbellKind::CpuAssisted);
        // SAFETY: the handle was just written; read only.
        let h = unsafe { qp.device_handle().read() };
        assert_eq!(h.doorbell_kind, DoorbellKind::CpuAssisted as u8);

        // The first error, from an error CQE in the GPU ring.
        qp.connect(&qp.endpoint()).unwrap();
        qp.to_error().unwrap();
        assert_eq!(qp.error(), Some(Syndrome::WrFlush), "no error CQE yet");
        let failed = cqe::ErrCqe::new(
            qp.qpn(),
            0,
            gdaki_layout::WqeOpcode::RdmaWrite.raw(),
            Syndrome::RemoteAccess,
            0,
            0,
        )
        .as_cqe();
        let QueueMemory::Gpu { buf, .. } = &cq.inner.umem.mem else {
            panic!("the CQ ring is in GPU memory")
        };
        buf.write(5 * 64, bytemuck::bytes_of(&failed)).unwrap();
        assert_eq!(qp.error(), Some(Syndrome::RemoteAccess));
        rec.take();
        drop((exported, qp, cq));
        assert_eq!(
            rec.take(),
            ["destroy", "free_uar", "umem_dereg", "destroy", "umem_dereg"]
        );
    }

    /// CPU-assisted on a GPU (NVSHMEM's mode without gdrcopy): with the rings in GPU memory
    /// (the recording double, which hands its firmware host stand-ins), kernels write the WQEs
    /// and the doorbell record there themselves and publish their producer index; a proxy
    /// rings the UAR with it and never touches the record. Nothing executes the WQEs (no NIC
    /// behind the double), so the kernel's waits for them time out, as they should.
    #[test]
    fn a_proxy_rings_for_kernels_that_write_their_own_record_in_gpu_memory() {
        let Some(gpu) =
            crate::devx_tests::gpu_or_skip("a_proxy_rings_for_kernels_that_write_their_own_record_in_gpu_memory")
        else {
            return;
        };
        let (ctx, _rec) = crate::devx_tests::recording_context_with(true);
        let rings = Rings::Gpu(gpu.clone());
        let cq = ctx.create_cq_in(64, &rings).unwrap();
        let cfg = QpConfig {
            sq_size: 64,
            handler: DoorbellHandler::CpuProxy,
            rings,
            timeout: Duration::from_millis(300),
            ..Default::default()
        };
        let qp = ctx.create_qp(&cq, cfg).unwrap();
        assert_eq!(qp.doorbell_kind(), DoorbellKind::CpuAssisted);
        let proxy = gdaki_proxy::Proxy::start(Default::default()).unwrap();
        proxy.add(qp.proxy_target().unwrap());
        let exported = qp.export_gpu(&gpu).unwrap();
        const THREADS: u32 = 48;
        let stream = gdaki_cuda::PutStream {
            dst: gdaki_device::Remote { addr: 0x10000, rkey: 7 },
            src: gdaki_device::Local { addr: 0x20000, lkey: 9 },
            len: 8,
            slots: THREADS as u64,
            first: 0,
            iters: 1,
            threads_per_qp: 0,
            op: gdaki_cuda::StreamOp::Write,
        };
        let launch = gdaki_cuda::DataPathLaunch {
            scope: gdaki_cuda::KernelScope::Thread,
            mode: gdaki_cuda::KernelMode::Gpu,
            grid: 1,
            block: THREADS,
        };
        let run = gpu.run_put(&[&exported], launch, &stream).unwrap();
        let codes: std::collections::BTreeSet<u32> = run.status.iter().copied().collect();
        assert_eq!(
            codes,
            [gdaki_device::status::CODE_TIMEOUT].into(),
            "every wait times out, nothing else fails"
        );
        let rung = proxy.stop();
        assert!(rung.doorbells >= 1, "{rung:?}");

        let QueueMemory::Gpu { buf, .. } = &qp.inner.umem.mem else {
            panic!("the send queue is in GPU memory")
        };
        let sq = qp.inner.rq_bytes() as usize;
        let mut wqes = vec![0u8; 64 * THREADS as usize];
        buf.read(sq, &mut wqes).unwrap();
        let mut ids: Vec<u16> = wqes
            .chunks(64)
            .map(|w| {
                let view = gdaki_layout::wqe::WqeView::new_checked(w).unwrap();
                let wr = gdaki_layout::wqe::WorkRequest::parse(&view).unwrap();
                assert_eq!((wr.qpn, wr.opcode), (qp.qpn(), gdaki_layout::WqeOpcode::RdmaWrite));
                wr.wqe_index
            })
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..THREADS as u16).collect::<Vec<_>>());
        let mut record = [0u8; 4];
        buf.read(sq + qp.inner.sq_dbrec_offset() as usize, &mut record).unwrap();
        assert_eq!(
            u32::from_be_bytes(record),
            THREADS,
            "the kernels' record names every WQE"
        );
        // SAFETY: the UAR page lives with the QP; the proxy has stopped, so nothing writes it.
        let db = unsafe { (qp.inner.doorbell_addr() as *const u64).read_volatile() };
        assert_eq!(
            gdaki_layout::doorbell::decode(db.to_ne_bytes()),
            (qp.qpn(), THREADS as u16),
            "the proxy rang with the last published index"
        );
    }

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
        assert_eq!(qp.doorbell_kind(), DoorbellKind::CpuProxy);
        assert_eq!(dev.doorbell, qp.inner.proxy_word.addr());

        let src = ctx.alloc_region(4096, Access::ALL).unwrap();
        let dst = ctx.alloc_region(4096, Access::ALL).unwrap();
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        src.write(0, &data).unwrap();
        // SAFETY: this thread is the only poster; the QP outlives `post`.
        let post = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.unwrap();
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

    /// A reliable doorbell (no doorbell record): posters ringing themselves (one thread, and four
    /// sharing the QP) and a CPU proxy ringing for them move every byte, through a QP reset and
    /// its realignment too, and nothing ever writes the QP's send doorbell record.
    #[test]
    fn a_reliable_doorbell_moves_data_and_never_writes_the_record() {
        use gdaki_device::Gpu;
        use std::thread;
        let ctx = Context::open(Provider::Soft).unwrap();
        assert!(ctx.supports_reliable_doorbell());
        let mr = ctx.alloc_region(1 << 16, Access::ALL).unwrap();
        let data: Vec<u8> = (0..1u32 << 15).map(|i| (i * 7 + i / 251) as u8).collect();
        mr.write(0, &data).unwrap();
        let record = |qp: &QueuePair| {
            // SAFETY: the live QP's handle, read whole.
            let h = unsafe { qp.device_handle().read() };
            assert_eq!(h.sq_dbrec, 0, "the handle names no record");
            // SAFETY: the send word of the record, an aligned u32 of the QP's umem (host memory),
            // which the QP keeps.
            unsafe { ((qp.inner.sq() + qp.inner.sq_dbrec_offset()) as *const u32).read_volatile() }
        };
        for handler in [DoorbellHandler::Gpu, DoorbellHandler::CpuProxy] {
            let cfg = QpConfig {
                handler,
                reliable_doorbell: true,
                ..Default::default()
            };
            let qp = ctx
                .create_qp(&ctx.create_cq(16).unwrap(), QpConfig { sq_size: 16, ..cfg })
                .unwrap();
            qp.connect(&qp.endpoint()).unwrap();
            let proxy = (handler == DoorbellHandler::CpuProxy).then(|| {
                let p = gdaki_proxy::Proxy::start(Default::default()).unwrap();
                p.add(qp.proxy_target().unwrap());
                p
            });
            let round = |base: u64| {
                thread::scope(|s| {
                    for t in 0..4u64 {
                        let (qp, mr) = (&qp, &mr);
                        s.spawn(move || {
                            // SAFETY: posters share the QP through the GPU-scope (shared) handle;
                            // the QP outlives them.
                            let dev = unsafe { qp.cpu::<Gpu>() }.unwrap();
                            for i in 0..64u64 {
                                let off = (t * 64 + i) * 16;
                                dev.put(mr.remote(base + off), mr.local(off), 16).unwrap();
                            }
                            dev.quiet().unwrap();
                        });
                    }
                });
                let mut got = vec![0; 4096];
                mr.read(base, &mut got).unwrap();
                assert_eq!(got, data[..4096], "{handler:?}");
            };
            round(1 << 15);
            // SAFETY: nobody posts until connect returns.
            unsafe { qp.reset() }.unwrap();
            qp.connect(&qp.endpoint()).unwrap();
            mr.write(1 << 15, &[0; 4096]).unwrap();
            round(1 << 15);
            assert_eq!(record(&qp), 0, "{handler:?}: the record was written");
            drop(proxy);
            assert_eq!(qp.error(), None);
        }
    }

    /// A collapsed CQ: posters sharing the QP (and one alone) complete every WQE through its one
    /// entry, far past the 16-bit WQE counter's wrap, with the ring's other entries never
    /// written and no overrun; an error reaches every wait from the first WQE not known to have
    /// completed; a reset realigns through the same entry and the QP moves data again.
    #[test]
    fn a_collapsed_cq_completes_every_wqe_through_its_one_entry() {
        use gdaki_device::{Gpu, WaitError};
        use std::thread;
        let ctx = Context::open(Provider::Soft).unwrap();
        let mr = ctx.alloc_region(1 << 14, Access::ALL).unwrap();
        let data: Vec<u8> = (0..1u32 << 13).map(|i| (i * 13 + i / 253) as u8).collect();
        mr.write(0, &data).unwrap();
        let cq = ctx.create_collapsed_cq_in(16, &Rings::Host).unwrap();
        assert!(cq.collapsed() && cq.size() == 16);
        let cfg = QpConfig {
            sq_size: 16,
            timeout: Duration::from_secs(5),
            ..Default::default()
        };
        let qp = ctx.create_qp(&cq, cfg).unwrap();
        qp.connect(&qp.endpoint()).unwrap();
        let round = |per_thread: u64| {
            mr.write(1 << 13, &[0; 4096]).unwrap();
            thread::scope(|s| {
                for t in 0..4u64 {
                    let (qp, mr) = (&qp, &mr);
                    s.spawn(move || {
                        // SAFETY: posters share the QP through the GPU-scope (shared) handle; the
                        // QP outlives them.
                        let dev = unsafe { qp.cpu::<Gpu>() }.unwrap();
                        for i in 0..per_thread {
                            let off = (t * 64 + i % 64) * 16;
                            let ticket = dev.put(mr.remote((1 << 13) + off), mr.local(off), 16).unwrap();
                            if i % 1000 == 999 {
                                dev.poll_at(ticket).unwrap();
                            }
                        }
                        dev.quiet().unwrap();
                    });
                }
            });
            let mut got = vec![0; 4096];
            mr.read(1 << 13, &mut got).unwrap();
            assert_eq!(got, data[..4096]);
        };
        // 4 x 17,000 WQEs: the WQE counter wraps.
        round(17_000);
        // SAFETY: the CPU handle of the live QP, which no other poster uses now.
        let alone = unsafe { qp.cpu::<gdaki_device::Exclusive>() }.unwrap();
        for i in 0..100u64 {
            let t = alone.put(mr.remote((1 << 13) + i * 8), mr.local(i * 8), 8).unwrap();
            if i % 3 == 0 {
                alone.poll_at(t).unwrap();
            }
        }
        alone.quiet().unwrap();
        let entries = cq.inner.cqes().unwrap();
        assert_ne!(entries[0].op_own, cqe::OP_OWN_INIT, "entry 0 holds the newest CQE");
        assert!(
            entries[1..].iter().all(|e| e.op_own == cqe::OP_OWN_INIT),
            "no other entry was written"
        );
        cq.status().unwrap();

        // An error: a put to a key nobody has fails, and so does every wait from there.
        let ok = alone.put(mr.remote(1 << 13), mr.local(0), 8).unwrap();
        alone.poll_at(ok).unwrap();
        let mut bad = mr.remote(0);
        bad.rkey ^= 0x5a5a_5a00;
        let failed = alone.put(bad, mr.local(0), 8).unwrap();
        let after = alone.put(mr.remote(1 << 13), mr.local(0), 8).unwrap();
        let err = alone.poll_at(after).unwrap_err();
        assert!(matches!(err, WaitError::Cqe(_)), "{err:?}");
        assert!(matches!(alone.poll_at(failed), Err(WaitError::Cqe(_))));
        assert_eq!(
            alone.poll_at(ok),
            Ok(()),
            "a WQE completed before the error stays a success"
        );
        assert!(qp.error().is_some());

        // SAFETY: nobody posts until connect returns.
        unsafe { qp.reset() }.unwrap();
        qp.connect(&qp.endpoint()).unwrap();
        round(500);
        assert_eq!(qp.error(), None);
        cq.status().unwrap();
    }
}
