//! Completion queues, queue pairs (create, endpoint, connect, export), and the CPU doorbell
//! proxy.
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gdaki::{CompletionQueue, DoorbellHandler, GpuQp, QpConfig, QpState, QueuePair, ReceiveConfig, Rings};
use gdaki_layout::handle::{DevQp, DevRq, DoorbellKind};

use crate::context::{gdaki_context, gdaki_gpu};
use crate::guard::{self, call, gdaki_status, handle, Failure};

/// A completion queue: serves one queue pair.
pub struct gdaki_cq(guard::Tagged<CompletionQueue>);
handle!(gdaki_cq(CompletionQueue), b"gdakiCQ\0", "cq");

/// A reliable-connected queue pair and its device handle.
/// (Shared: a stream queue pair keeps it alive.)
pub struct gdaki_qp(guard::Tagged<Arc<QueuePair>>);
handle!(gdaki_qp(Arc<QueuePair>), b"gdakiQP\0", "qp");

/// A queue pair exported to a GPU: its device handle lives in GPU memory.
/// (Shared: a stream queue pair keeps it alive.)
pub struct gdaki_gpu_qp(guard::Tagged<Arc<GpuQp>>);
handle!(gdaki_gpu_qp(Arc<GpuQp>), b"gdakiGQP", "gpu_qp");

/// An endpoint as a fixed-size blob: what a peer needs to connect to a queue pair (its port's
/// GID and LID, QPN, PSN, MTU, the READs and atomics it accepts outstanding, and the soft HCA's
/// transport address). Plain bytes, the same on every host: exchange it through any bootstrap
/// (`MPI_Allgather`, a key-value store, a file).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gdaki_endpoint {
    /// The encoded endpoint (magic, version, fields, zero padding).
    pub bytes: [u8; GDAKI_ENDPOINT_BYTES],
}

/// Size of a `gdaki_endpoint`.
pub const GDAKI_ENDPOINT_BYTES: usize = 64;
const _: () = assert!(GDAKI_ENDPOINT_BYTES == gdaki::wire::ENDPOINT_BLOB_LEN);

impl gdaki_endpoint {
    pub(crate) fn of(e: &gdaki::Endpoint) -> Result<gdaki_endpoint, Failure> {
        let bytes = gdaki::wire::encode_endpoint(e)
            .map_err(|err| Failure::new(gdaki_status::Device, format!("encoding the endpoint: {err}")))?;
        Ok(gdaki_endpoint { bytes })
    }

    pub(crate) fn decode(&self, what: &str) -> Result<gdaki::Endpoint, Failure> {
        gdaki::wire::decode_endpoint(&self.bytes)
            .map_err(|e| Failure::invalid(format!("{what} is not a valid endpoint: {e}")))
    }
}

/// `DoorbellHandler` from a `GDAKI_DOORBELL_*` value of `gdaki_device.h` (the handle's
/// `doorbell_kind`, which says the same thing). `GDAKI_DOORBELL_CPU_ASSISTED` asks for the
/// proxy too: whether the posters write the record follows from where the rings are.
fn handler(raw: u32) -> Result<DoorbellHandler, Failure> {
    match u8::try_from(raw).ok().and_then(DoorbellKind::from_raw) {
        Some(DoorbellKind::Gpu) => Ok(DoorbellHandler::Gpu),
        Some(DoorbellKind::CpuProxy | DoorbellKind::CpuAssisted) => Ok(DoorbellHandler::CpuProxy),
        None => Err(Failure::invalid(format!(
            "doorbell {raw} (expected GDAKI_DOORBELL_GPU, GDAKI_DOORBELL_CPU_PROXY or GDAKI_DOORBELL_CPU_ASSISTED)"
        ))),
    }
}

/// A queue pair's state (the verbs state machine, RC subset).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum gdaki_qp_state {
    /// Created; nothing is executed.
    Reset = 0,
    /// Initialised, not connected.
    Init = 1,
    /// Connected: serves its peer's requests.
    Rtr = 2,
    /// Ready to send: executes its own WQEs.
    Rts = 3,
    /// Failed: every WQE completes in error.
    Error = 4,
}

/// How to create a queue pair: `gdaki_qp_config_init` fills in the defaults.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gdaki_qp_config {
    /// Send queue size in WQEs: a power of two, at most the CQ's size (default 1024).
    pub sq_size: u32,
    /// Who rings the doorbell: `GDAKI_DOORBELL_GPU` (default: the poster, a GPU thread or a
    /// CPU thread in CPU mode) or `GDAKI_DOORBELL_CPU_PROXY` (posters publish their producer
    /// index, a `gdaki_proxy` rings for them; with `rings_gpu` the posters write the doorbell
    /// record and ring a host word the proxy forwards, CPU-assisted, and
    /// `GDAKI_DOORBELL_CPU_ASSISTED` asks for the same).
    pub doorbell: u32,
    /// Largest message of one WQE; bigger puts are split by the device (default 1 GiB).
    pub max_msg_size: u64,
    /// How long device waits on this QP may take before they report a timeout, 1 to
    /// 3,600,000 ms (default 10,000).
    pub timeout_ms: u32,
    /// How long the HCA waits for a peer before it completes with a transport error, 1 to
    /// 3,600,000 ms, below `timeout_ms` (default 4,000).
    pub retry_timeout_ms: u32,
    /// The GPU whose memory holds the send queue and its doorbell record, or NULL for host
    /// memory (default). Only kernels on that GPU can then post.
    pub rings_gpu: *const gdaki_gpu,
    /// Receives the QP's receive queue holds, a power of two, for two-sided verbs; 0 (default)
    /// for a QP without one. Its CQ is the QP's own.
    pub rq_size: u32,
    /// The most buffers one receive scatters into, 1 to 4 (default 1).
    pub rq_max_bufs: u32,
    /// How often a message the peer had no receive for is tried again, 0 to 7 (default 7:
    /// for ever, bounded by the waiter's timeout).
    pub rnr_retry: u8,
    /// The RNR NAK timer code this QP answers with (IB's table: 1 is 0.01 ms, 12 is 0.64 ms;
    /// default 12).
    pub min_rnr_timer: u8,
    /// 1: a cross-channel QP (Core-Direct master), which may post WAIT WQEs on other QPs'
    /// completions: the companion QP of counters (`gdaki_count_when_done_*`). Default 0.
    pub cross_channel: u8,
    /// 1: a reliable doorbell (no doorbell record: posters ring once; ConnectX-8 and the soft
    /// HCA; refused with GDAKI_ERR_UNSUPPORTED elsewhere, see
    /// `gdaki_context_supports_reliable_doorbell`). Default 0.
    pub reliable_doorbell: u8,
}

impl gdaki_qp_config {
    fn defaults() -> gdaki_qp_config {
        let d = QpConfig::default();
        gdaki_qp_config {
            sq_size: d.sq_size,
            doorbell: match d.handler {
                DoorbellHandler::Gpu => DoorbellKind::Gpu as u32,
                DoorbellHandler::CpuProxy => DoorbellKind::CpuProxy as u32,
            },
            max_msg_size: d.max_msg_size,
            timeout_ms: d.timeout.as_millis() as u32,
            retry_timeout_ms: d.retry_timeout.as_millis() as u32,
            rings_gpu: std::ptr::null(),
            rq_size: 0,
            rq_max_bufs: ReceiveConfig::default().max_bufs,
            rnr_retry: d.rnr_retry,
            min_rnr_timer: d.min_rnr_timer,
            cross_channel: d.cross_channel as u8,
            reliable_doorbell: d.reliable_doorbell as u8,
        }
    }

    /// The Rust configuration.
    ///
    /// # Safety
    /// `rings_gpu` is NULL or a GPU handle.
    unsafe fn to_rust(self) -> Result<QpConfig, Failure> {
        let handler = handler(self.doorbell)?;
        // SAFETY: the caller's contract.
        let rings = match unsafe { guard::borrow_opt(self.rings_gpu, "config.rings_gpu") }? {
            Some(g) => Rings::Gpu(g.clone()),
            None => Rings::Host,
        };
        Ok(QpConfig {
            sq_size: self.sq_size,
            max_msg_size: self.max_msg_size,
            timeout: Duration::from_millis(self.timeout_ms as u64),
            retry_timeout: Duration::from_millis(self.retry_timeout_ms as u64),
            handler,
            rings,
            receive: (self.rq_size != 0).then_some(ReceiveConfig {
                size: self.rq_size,
                max_bufs: self.rq_max_bufs,
            }),
            rnr_retry: self.rnr_retry,
            min_rnr_timer: self.min_rnr_timer,
            cross_channel: match self.cross_channel {
                0 => false,
                1 => true,
                other => return Err(Failure::invalid(format!("cross_channel {other} (expected 0 or 1)"))),
            },
            reliable_doorbell: match self.reliable_doorbell {
                0 => false,
                1 => true,
                other => return Err(Failure::invalid(format!("reliable_doorbell {other} (expected 0 or 1)"))),
            },
        })
    }
}

/// What `gdaki_qp_query` reports.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gdaki_qp_info {
    /// QP number (24 bits).
    pub qpn: u32,
    /// Its state, as the device reports it now.
    pub state: gdaki_qp_state,
    /// In `GDAKI_QP_STATE_ERROR`: the first error CQE's syndrome (mlx5's
    /// `MLX5_CQE_SYNDROME_*`; 0x05 is a flush); else 0.
    pub syndrome: u32,
    /// Who rings its doorbell, a `GDAKI_DOORBELL_*` (a GPU export that could not map the
    /// doorbell page switches it to the library's own CPU proxy): `GDAKI_DOORBELL_CPU_ASSISTED`
    /// for a proxy and rings in GPU memory (the posters write the doorbell record).
    pub doorbell: u32,
    /// 1 when its send queue or CQ ring is in GPU memory.
    pub rings_in_gpu_memory: u32,
}

/// A completion queue of `size` CQEs (a power of two) into `*cq`, its ring in host memory, or
/// in `rings_gpu`'s memory when that is not NULL (only kernels on that GPU can then poll it).
///
/// # Safety
/// `ctx` is NULL or a context handle, `rings_gpu` NULL or a GPU handle; `cq` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_cq_create(
    ctx: *const gdaki_context,
    size: u32,
    rings_gpu: *const gdaki_gpu,
    cq: *mut *mut gdaki_cq,
) -> gdaki_status {
    call("gdaki_cq_create", || {
        // SAFETY: the caller's contract.
        let (c, out) = unsafe { (guard::borrow(ctx, "ctx")?, guard::out(cq, "cq")?) };
        // SAFETY: the caller's contract.
        let made = match unsafe { guard::borrow_opt(rings_gpu, "rings_gpu") }? {
            Some(g) => c.create_cq_in(size, &Rings::Gpu(g.clone()))?,
            None => c.create_cq(size)?,
        };
        out.write(guard::into_handle(made));
        Ok(())
    })
}

/// A collapsed completion queue (DOCA GPUNetIO 2.0's `cq_collapsed`) into `*cq`: the HCA
/// writes every CQE to entry 0, the newest over the rest, so pollers read one entry; a WQE is
/// complete once the newest CQE is its own or a later one's, and an error shows only as the
/// newest CQE. `size` is the ring the HCA is given (a power of two, at least the send queue it
/// serves); `rings_gpu` as for `gdaki_cq_create`. Not for stream-triggered posting.
///
/// # Safety
/// As `gdaki_cq_create`.
#[no_mangle]
pub unsafe extern "C" fn gdaki_cq_create_collapsed(
    ctx: *const gdaki_context,
    size: u32,
    rings_gpu: *const gdaki_gpu,
    cq: *mut *mut gdaki_cq,
) -> gdaki_status {
    call("gdaki_cq_create_collapsed", || {
        // SAFETY: the caller's contract.
        let (c, out) = unsafe { (guard::borrow(ctx, "ctx")?, guard::out(cq, "cq")?) };
        // SAFETY: the caller's contract.
        let rings = match unsafe { guard::borrow_opt(rings_gpu, "rings_gpu") }? {
            Some(g) => Rings::Gpu(g.clone()),
            None => Rings::Host,
        };
        out.write(guard::into_handle(c.create_collapsed_cq_in(size, &rings)?));
        Ok(())
    })
}

/// Destroys a completion queue (NULL: nothing); a queue pair it serves keeps it alive.
///
/// # Safety
/// `cq` is NULL or a CQ handle with no call on it in flight, not used after.
#[no_mangle]
pub unsafe extern "C" fn gdaki_cq_destroy(cq: *mut gdaki_cq) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_cq_destroy", || unsafe { guard::destroy(cq, "cq") })
}

/// Fills `*config` with the defaults.
///
/// # Safety
/// `config` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_qp_config_init(config: *mut gdaki_qp_config) -> gdaki_status {
    call("gdaki_qp_config_init", || {
        // SAFETY: the caller's contract.
        unsafe { guard::out(config, "config") }?.write(gdaki_qp_config::defaults());
        Ok(())
    })
}

/// A queue pair completing into `cq` (which must serve no other) into `*qp`; `config` NULL
/// takes the defaults.
///
/// # Safety
/// `ctx`, `cq` are NULL or handles of their types; `config` is NULL or a `gdaki_qp_config`
/// whose `rings_gpu` is NULL or a GPU handle; `qp` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_qp_create(
    ctx: *const gdaki_context,
    cq: *const gdaki_cq,
    config: *const gdaki_qp_config,
    qp: *mut *mut gdaki_qp,
) -> gdaki_status {
    call("gdaki_qp_create", || {
        // SAFETY: the caller's contract.
        let (c, q, out) = unsafe {
            (
                guard::borrow(ctx, "ctx")?,
                guard::borrow(cq, "cq")?,
                guard::out(qp, "qp")?,
            )
        };
        let cfg = if config.is_null() {
            gdaki_qp_config::defaults()
        } else {
            // SAFETY: the caller's contract.
            *unsafe { guard::input(config, "config") }?
        };
        // SAFETY: the caller's contract.
        let cfg = unsafe { cfg.to_rust() }?;
        out.write(guard::into_handle(Arc::new(c.create_qp(q, cfg)?)));
        Ok(())
    })
}

/// Destroys a queue pair (NULL: nothing). Its GPU exports and proxy registrations keep its
/// memory alive until they go.
///
/// # Safety
/// `qp` is NULL or a QP handle with no call on it in flight, not used after, and no CPU-mode
/// poster still uses its host handle.
#[no_mangle]
pub unsafe extern "C" fn gdaki_qp_destroy(qp: *mut gdaki_qp) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_qp_destroy", || unsafe { guard::destroy(qp, "qp") })
}

/// The queue pair's endpoint, to hand to its peer (call `gdaki_context_listen` first where the
/// peer is in another process on the soft HCA).
///
/// # Safety
/// `qp` is NULL or a QP handle; `endpoint` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_qp_endpoint(qp: *const gdaki_qp, endpoint: *mut gdaki_endpoint) -> gdaki_status {
    call("gdaki_qp_endpoint", || {
        // SAFETY: the caller's contract.
        let (q, out) = unsafe { (guard::borrow(qp, "qp")?, guard::out(endpoint, "endpoint")?) };
        out.write(gdaki_endpoint::of(&q.endpoint())?);
        Ok(())
    })
}

/// Connects the queue pair to the peer's endpoint (RESET → INIT → RTR → RTS); its own endpoint
/// may be given for a loopback. A blob that does not decode is `GDAKI_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `qp` is NULL or a QP handle; `peer` is NULL or a readable `gdaki_endpoint`.
#[no_mangle]
pub unsafe extern "C" fn gdaki_qp_connect(qp: *const gdaki_qp, peer: *const gdaki_endpoint) -> gdaki_status {
    call("gdaki_qp_connect", || {
        // SAFETY: the caller's contract.
        let (q, p) = unsafe { (guard::borrow(qp, "qp")?, guard::input(peer, "peer")?) };
        Ok(q.connect(&p.decode("peer")?)?)
    })
}

/// Back to RESET from any state, after an error for instance: what is outstanding is flushed
/// and its completions consumed, then 2RST. `gdaki_qp_connect` (the peer resets and connects
/// too) makes the QP post again through the same handles (the host one and every GPU export),
/// its tickets going on; receives posted before are flushed, their completions consumed. A QP
/// with rings in GPU memory is `GDAKI_STATUS_UNSUPPORTED`.
///
/// # Safety
/// `qp` is NULL or a QP handle, and nothing (host thread or kernel) posts on it or waits on it
/// from this call until `gdaki_qp_connect` has returned.
#[no_mangle]
pub unsafe extern "C" fn gdaki_qp_reset(qp: *const gdaki_qp) -> gdaki_status {
    call("gdaki_qp_reset", || {
        // SAFETY: the caller's contract.
        let q = unsafe { guard::borrow(qp, "qp")? };
        // SAFETY: nothing posts meanwhile (the caller's contract).
        Ok(unsafe { q.reset() }?)
    })
}

/// The queue pair's number, state, error syndrome and doorbell handler.
///
/// # Safety
/// `qp` is NULL or a QP handle; `info` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_qp_query(qp: *const gdaki_qp, info: *mut gdaki_qp_info) -> gdaki_status {
    call("gdaki_qp_query", || {
        // SAFETY: the caller's contract.
        let (q, out) = unsafe { (guard::borrow(qp, "qp")?, guard::out(info, "info")?) };
        let state = match q.state() {
            QpState::Reset => gdaki_qp_state::Reset,
            QpState::Init => gdaki_qp_state::Init,
            QpState::Rtr => gdaki_qp_state::Rtr,
            QpState::Rts => gdaki_qp_state::Rts,
            QpState::Error => gdaki_qp_state::Error,
        };
        out.write(gdaki_qp_info {
            qpn: q.qpn(),
            state,
            syndrome: q.error().map_or(0, |s| s.raw() as u32),
            doorbell: q.doorbell_kind() as u32,
            rings_in_gpu_memory: q.rings_in_gpu_memory() as u32,
        });
        Ok(())
    })
}

/// The queue pair's device handle in host memory, for CPU threads posting with
/// `gdaki_device.h`'s thread-scope functions (CPU mode). Valid while the queue pair lives.
/// Rings in GPU memory are `GDAKI_STATUS_UNSUPPORTED` (only kernels on that GPU reach them).
///
/// # Safety
/// `qp` is NULL or a QP handle; `handle` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_qp_host_handle(qp: *const gdaki_qp, handle: *mut *mut DevQp) -> gdaki_status {
    call("gdaki_qp_host_handle", || {
        // SAFETY: the caller's contract.
        let (q, out) = unsafe { (guard::borrow(qp, "qp")?, guard::out(handle, "handle")?) };
        // SAFETY: the view is dropped at once; only the handle's address leaves, with the
        // documented lifetime (the queue pair's).
        unsafe { q.cpu::<gdaki_device::Exclusive>() }?;
        out.write(q.device_handle());
        Ok(())
    })
}

/// The queue pair's receive-queue handle in host memory, for CPU threads posting and polling
/// receives with `gdaki_device.h`'s `gdaki_post_recv_*` and `gdaki_poll_recv_*` (CPU mode).
/// Valid while the queue pair lives. A queue pair created without a receive queue
/// (`rq_size` 0), or whose rings are in GPU memory, is `GDAKI_STATUS_UNSUPPORTED`.
///
/// # Safety
/// `qp` is NULL or a QP handle; `handle` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_qp_host_receive_handle(qp: *const gdaki_qp, handle: *mut *mut DevRq) -> gdaki_status {
    call("gdaki_qp_host_receive_handle", || {
        // SAFETY: the caller's contract.
        let (q, out) = unsafe { (guard::borrow(qp, "qp")?, guard::out(handle, "handle")?) };
        // SAFETY: the view is dropped at once; only the handle's address leaves, with the
        // documented lifetime (the queue pair's).
        let rq = unsafe { q.cpu_receive::<gdaki_device::Exclusive>() }?;
        out.write(rq.as_ptr());
        Ok(())
    })
}

/// Exports the queue pair to `gpu` into `*gpu_qp` (once per queue pair and GPU): its rings,
/// records and doorbell are mapped into the GPU and its device handle copied to GPU memory.
///
/// # Safety
/// `qp`, `gpu` are NULL or handles of their types; `gpu_qp` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_qp_export_gpu(
    qp: *const gdaki_qp,
    gpu: *const gdaki_gpu,
    gpu_qp: *mut *mut gdaki_gpu_qp,
) -> gdaki_status {
    call("gdaki_qp_export_gpu", || {
        // SAFETY: the caller's contract.
        let (q, g, out) = unsafe {
            (
                guard::borrow(qp, "qp")?,
                guard::borrow(gpu, "gpu")?,
                guard::out(gpu_qp, "gpu_qp")?,
            )
        };
        out.write(guard::into_handle(Arc::new(q.export_gpu(g)?)));
        Ok(())
    })
}

/// The exported queue pair's device handle: a GPU address, the `gdaki_dev_qp *` kernels pass
/// to the device functions. Valid while the export lives.
///
/// # Safety
/// `gpu_qp` is NULL or an exported-QP handle; `handle` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_gpu_qp_handle(gpu_qp: *const gdaki_gpu_qp, handle: *mut *mut DevQp) -> gdaki_status {
    call("gdaki_gpu_qp_handle", || {
        // SAFETY: the caller's contract.
        let (g, out) = unsafe { (guard::borrow(gpu_qp, "gpu_qp")?, guard::out(handle, "handle")?) };
        out.write(g.device_handle() as *mut DevQp);
        Ok(())
    })
}

/// The exported queue pair's receive-queue handle: a GPU address, the `gdaki_dev_rq *`
/// kernels pass to `gdaki_post_recv_*` and `gdaki_poll_recv_*`. Valid while the export lives.
/// A queue pair without a receive queue is `GDAKI_STATUS_UNSUPPORTED`.
///
/// # Safety
/// `gpu_qp` is NULL or an exported-QP handle; `handle` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_gpu_qp_receive_handle(
    gpu_qp: *const gdaki_gpu_qp,
    handle: *mut *mut DevRq,
) -> gdaki_status {
    call("gdaki_gpu_qp_receive_handle", || {
        // SAFETY: the caller's contract.
        let (g, out) = unsafe { (guard::borrow(gpu_qp, "gpu_qp")?, guard::out(handle, "handle")?) };
        let Some(h) = g.receive_handle() else {
            return Err(gdaki::Error::Unsupported {
                what: "a receive-queue handle of a queue pair without a receive queue",
                why: "create it with gdaki_qp_config.rq_size".into(),
            }
            .into());
        };
        out.write(h as *mut DevRq);
        Ok(())
    })
}

/// Destroys an export (NULL: nothing): unmaps it from the GPU. No kernel may use its handle
/// any more.
///
/// # Safety
/// `gpu_qp` is NULL or an exported-QP handle with no call in flight and no kernel using it.
#[no_mangle]
pub unsafe extern "C" fn gdaki_gpu_qp_destroy(gpu_qp: *mut gdaki_gpu_qp) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_gpu_qp_destroy", || unsafe { guard::destroy(gpu_qp, "gpu_qp") })
}

// ------------------------------------------------------------------------------ proxy

/// A CPU proxy and the queue pairs added to it, by the id `gdaki_proxy_add` gave.
pub(crate) struct Proxy {
    proxy: ::gdaki_proxy::Proxy,
    added: Mutex<Vec<(u64, ::gdaki_proxy::TargetId)>>,
    next: std::sync::atomic::AtomicU64,
}

/// CPU threads that ring doorbells for queue pairs created with `GDAKI_DOORBELL_CPU_PROXY`
/// (where a GPU cannot ring a NIC's doorbell itself).
pub struct gdaki_proxy(guard::Tagged<Proxy>);
handle!(gdaki_proxy(Proxy), b"gdakiPRX", "proxy");

/// Starts a proxy of `threads` threads (1 to 64) into `*proxy`; idle threads spin, then yield,
/// then sleep up to 100 µs.
///
/// # Safety
/// `proxy` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_proxy_start(threads: u32, proxy: *mut *mut gdaki_proxy) -> gdaki_status {
    call("gdaki_proxy_start", || {
        // SAFETY: the caller's contract.
        let out = unsafe { guard::out(proxy, "proxy") }?;
        let cfg = ::gdaki_proxy::ProxyConfig {
            threads: threads as usize,
            ..Default::default()
        };
        let started = ::gdaki_proxy::Proxy::start(cfg).map_err(|e| match e {
            ::gdaki_proxy::ProxyError::Config(why) => Failure::invalid(why),
            other => Failure::new(gdaki_status::Io, other.to_string()),
        })?;
        out.write(guard::into_handle(Proxy {
            proxy: started,
            added: Mutex::new(Vec::new()),
            next: std::sync::atomic::AtomicU64::new(1),
        }));
        Ok(())
    })
}

/// Lets the proxy ring for `qp` (created with `GDAKI_DOORBELL_CPU_PROXY`; another is
/// `GDAKI_STATUS_INVALID_STATE`); `*id` names it for `gdaki_proxy_remove`. The proxy keeps the
/// queue pair's rings alive while it is added.
///
/// # Safety
/// `proxy`, `qp` are NULL or handles of their types; `id` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_proxy_add(proxy: *const gdaki_proxy, qp: *const gdaki_qp, id: *mut u64) -> gdaki_status {
    call("gdaki_proxy_add", || {
        // SAFETY: the caller's contract.
        let (p, q, out) = unsafe {
            (
                guard::borrow(proxy, "proxy")?,
                guard::borrow(qp, "qp")?,
                guard::out(id, "id")?,
            )
        };
        let target = q.proxy_target().ok_or_else(|| {
            Failure::new(
                gdaki_status::InvalidState,
                format!(
                    "queue pair {:#x} is rung by its poster or by the library's own proxy, not by this one \
                     (create it with doorbell GDAKI_DOORBELL_CPU_PROXY)",
                    q.qpn()
                ),
            )
        })?;
        let mine = p.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut added = crate::guard::lock(&p.added);
        added.push((mine, p.proxy.add(target)));
        out.write(mine);
        Ok(())
    })
}

/// Stops ringing for the queue pair `gdaki_proxy_add` named `id` (after one last look at it);
/// an unknown id is `GDAKI_STATUS_INVALID_ARGUMENT`.
///
/// # Safety
/// `proxy` is NULL or a proxy handle.
#[no_mangle]
pub unsafe extern "C" fn gdaki_proxy_remove(proxy: *const gdaki_proxy, id: u64) -> gdaki_status {
    call("gdaki_proxy_remove", || {
        // SAFETY: the caller's contract.
        let p = unsafe { guard::borrow(proxy, "proxy") }?;
        let mut added = crate::guard::lock(&p.added);
        let at = added
            .iter()
            .position(|(mine, _)| *mine == id)
            .ok_or_else(|| Failure::invalid(format!("id {id} is not a queue pair added to this proxy")))?;
        let (_, target) = added.swap_remove(at);
        p.proxy.remove(target);
        Ok(())
    })
}

/// Stops the proxy and destroys it (NULL: nothing); it rings what was posted before it stops.
///
/// # Safety
/// `proxy` is NULL or a proxy handle with no call on it in flight, not used after.
#[no_mangle]
pub unsafe extern "C" fn gdaki_proxy_destroy(proxy: *mut gdaki_proxy) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_proxy_destroy", || unsafe { guard::destroy(proxy, "proxy") })
}
