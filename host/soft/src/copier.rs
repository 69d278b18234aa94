//! GPU memory for the soft HCA: the copier, a persistent kernel (`gdaki_copier`) that moves
//! bytes to, from and within device memory and runs atomics on it, fed descriptors through a
//! host-pinned ring (`DeviceDma`, in `dma`, reaches device-memory regions through it).
//!
//! Why a persistent kernel: the CPU cannot address device memory, CUDA's copy calls cost
//! microseconds each, and work launched by the HCA's threads while an application kernel runs
//! can queue behind that kernel on a shared hardware queue, which then waits forever for the
//! HCA. A kernel started before the application's kernels and fed through memory needs no
//! launch on the data path.
//!
//! What it costs the application: while a GPU has device-memory regions, one kernel of a few
//! blocks runs on it. CUDA calls that wait for every kernel (`cuMemFree`, `cuMemHostUnregister`,
//! `cudaDeviceSynchronize`) would wait forever, so the library stops the copiers around its own
//! such calls ([`quiesced`](gdaki_cuda::quiesced)), and an application that makes them itself should wrap them in
//! [`quiesced`](gdaki_cuda::quiesced) too (or drop its device-memory regions first). Free GPU memory only while no
//! kernel waits on the soft HCA.
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use gdaki_layout::copy::{
    CopyDesc, CopyDone, CopyItem, LIST_MAX, OP_COMPARE_SWAP, OP_COPY, OP_COPY_LIST, OP_FETCH_ADD, OP_STORE, RING_SLOTS,
    SERVER_MIRROR, SPAN_FLAG_FOLLOWS, STORE_MAX, TAIL_MAX, WORK_BYTES,
};
use tracing::{debug, error};

use crate::error::DmaFault;
use gdaki_cuda::{CudaError, DeviceBuffer, Gpu, GpuUuid, HostMapping};
use gdaki_devx::util::lock;
use gdaki_devx::HostBuffer;

mod inflight;
use inflight::{InFlight, Overlap};

/// How long one copy may take before it fails (the kernel is gone or the GPU is wedged).
const COPY_TIMEOUT: Duration = Duration::from_secs(10);
/// Host-pinned bounce buffer for transfers between device memory and plain host memory.
const BOUNCE_BYTES: usize = 4 << 20;
/// Threads per copier block.
const BLOCK: u32 = 256;
/// Copies of at most this many bytes join the open copy list (see [`Copier::submit_copy`]);
/// larger ones are worth a descriptor of their own.
const LIST_ITEM_MAX: u64 = 512;
/// Bytes of one ring slot's copy list.
const LIST_BYTES: usize = LIST_MAX * std::mem::size_of::<CopyItem>();

/// Every live copier of the process, by GPU ([`Copier::existing`]).
static COPIERS: Mutex<Vec<Weak<Copier>>> = Mutex::new(Vec::new());

/// A GPU's copier: the descriptor ring, the answers, the kernel's state and the stream it runs
/// on. One per GPU per process, alive while device-memory regions on that GPU are.
pub struct Copier {
    /// Its GPU's identity across processes (`cuDeviceGetUuid`).
    gpu: GpuUuid,
    function: CudaFunction,
    /// Its GPU, whose context everything here binds and whose module holds `function`: held
    /// after it (field order = drop order), so the module's last holder is a `Gpu`, which
    /// unloads it with the other copiers stopped.
    handle: Gpu,
    stream: Arc<CudaStream>,
    grid: u32,
    // Mappings before their buffers (field order = drop order).
    descs: HostMapping,
    dones: HostMapping,
    lists: HostMapping,
    ctl: HostMapping,
    bounce: HostMapping,
    descs_buf: HostBuffer,
    dones_buf: HostBuffer,
    lists_buf: HostBuffer,
    ctl_buf: HostBuffer,
    bounce_buf: HostBuffer,
    work: DeviceBuffer,
    /// Held by one bounced transfer at a time (a transfer takes several descriptors).
    bounce_lock: Mutex<()>,
    /// Every descriptor up to this one is answered (answers come in any order; see
    /// [`done`](Self::done)).
    through: AtomicU64,
    state: Mutex<State>,
    resumed: Condvar,
}

// SAFETY: the raw CUDA handles are usable from any thread once the context is bound (every
// call here binds it first); the mutable state is behind a mutex.
unsafe impl Send for Copier {}
// SAFETY: as above.
unsafe impl Sync for Copier {}

struct State {
    /// The next descriptor's sequence number.
    next: u64,
    /// The kernel runs.
    running: bool,
    /// [`quiesced`] calls in progress.
    paused: u32,
    /// A launch or stop failed: every later copy fails.
    broken: bool,
    /// Copies submitted without waiting and not known done. A copy whose destination overlaps
    /// one of them waits for it, so writes to the same bytes land in order.
    inflight: InFlight,
    /// The copy list being filled, not yet posted: it will be descriptor `next`.
    open: Option<OpenList>,
    stats: CopierStats,
}

/// Small copies gathered into one [`OP_COPY_LIST`] descriptor: its items are written into the
/// slot's list as they come; the descriptor is posted when the list is full, when anything
/// else is posted or waited for, or at [`Copier::flush`].
#[derive(Debug, Clone, Copy)]
struct OpenList {
    count: usize,
}

/// What a copier has done so far, and how often the host side waited for it: a copier that is
/// the bottleneck shows a ring that is often full.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CopierStats {
    /// Copies submitted (each small one is an item of a copy list).
    pub copies: u64,
    /// Descriptors posted (copies, copy lists, atomics, bounced transfers).
    pub posted: u64,
    /// Posts that found the ring full and waited for the kernel to answer the slot's previous
    /// descriptor.
    pub ring_full: u64,
    /// Copies onto bytes earlier copies still wrote, ordered after them on the GPU (the host
    /// did not wait).
    pub ordered: u64,
    /// Copies onto bytes several unordered earlier copies still wrote: the host waited for
    /// them.
    pub overlap_waits: u64,
    /// Small writes queued behind every earlier descriptor ([`Copier::submit_store`]).
    pub stores: u64,
}

impl std::fmt::Debug for Copier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Copier")
            .field("gpu", &self.handle.ordinal())
            .field("grid", &self.grid)
            .finish_non_exhaustive()
    }
}

/// Descriptor `.0`, written into its ring slot but not yet visible to the kernel (its `seq`
/// unpublished): for [`Copier::publish`].
struct Unpublished(u64);

/// A descriptor (its `seq` is set when it is posted).
fn desc(op: u32, dst: u64, src: u64, len: u64, arg0: u64, arg1: u64) -> CopyDesc {
    CopyDesc {
        seq: 0,
        dst,
        src,
        len,
        arg0,
        arg1,
        op,
        span: 0,
        tail: 0,
        seen: 0,
    }
}

/// An [`OP_STORE`]'s bytes (at most [`STORE_MAX`]) as the descriptor carries them: `src`, then
/// `arg0`, in memory order, zero-padded.
fn carried(data: &[u8]) -> [u64; 2] {
    let mut bytes = [0u8; STORE_MAX];
    let n = data.len().min(STORE_MAX);
    bytes[..n].copy_from_slice(&data[..n]);
    let word = |i: usize| u64::from_ne_bytes(bytes[i..i + 8].try_into().unwrap_or_default());
    [word(0), word(8)]
}

fn fault(what: &str, e: impl std::fmt::Display) -> DmaFault {
    error!("GPU copier: {what}: {e}");
    DmaFault
}

impl Copier {
    /// The copier of `gpu`: the running one, or a new one started now (on the calling thread,
    /// which must not be an HCA thread: creating a stream may synchronise the context).
    /// Registering device memory with a soft HCA does this; it is public for benchmarks that
    /// measure the copier alone.
    pub fn of(gpu: &Gpu) -> crate::error::Result<Arc<Copier>> {
        // One creator at a time; the registries are not held while creating, because a failed
        // creation frees mappings, which takes them (see `cuda::quiesced`).
        static CREATING: Mutex<()> = Mutex::new(());
        let _one = lock(&CREATING);
        if let Some(c) = Copier::existing(gpu) {
            return Ok(c);
        }
        let c = Arc::new(Copier::new(gpu)?);
        {
            let mut st = lock(&c.state);
            c.start(&mut st).map_err(crate::error::Error::Cuda)?;
        }
        gdaki_cuda::resident(Arc::downgrade(&c) as Weak<dyn gdaki_cuda::Resident>);
        let mut all = lock(&COPIERS);
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&c));
        Ok(c)
    }

    /// The copier of `gpu` if one is alive (none is started): for reporting its [`stats`](Self::stats).
    pub fn existing(gpu: &Gpu) -> Option<Arc<Copier>> {
        let ordinal = gpu.context().ordinal();
        lock(&COPIERS)
            .iter()
            .filter_map(Weak::upgrade)
            .find(|c| c.handle.ordinal() == ordinal)
    }

    /// The live copiers of this process, oldest first (none is started).
    pub(crate) fn live() -> Vec<Arc<Copier>> {
        lock(&COPIERS).iter().filter_map(Weak::upgrade).collect()
    }

    /// The UUID of its GPU.
    pub(crate) fn gpu(&self) -> &GpuUuid {
        &self.gpu
    }

    /// The context of its GPU.
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        self.handle.context()
    }

    fn new(gpu: &Gpu) -> crate::error::Result<Copier> {
        let ctx = gpu.context();
        let function = gpu.module().load_function("gdaki_copier").map_err(CudaError::from)?;
        let stream = ctx.new_stream().map_err(CudaError::from)?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(CudaError::from)?;
        // Block 0 only fetches descriptors; at least one block copies.
        let grid = gdaki_cuda::copier_blocks(sms);
        let descs_buf = HostBuffer::new("the copier's descriptor ring", RING_SLOTS * 64)?;
        let dones_buf = HostBuffer::new("the copier's answers", RING_SLOTS * 64)?;
        let lists_buf = HostBuffer::new("the copier's copy lists", RING_SLOTS * LIST_BYTES)?;
        let ctl_buf = HostBuffer::new("the copier's stop word", 64)?;
        let bounce_buf = HostBuffer::new("the copier's bounce buffer", BOUNCE_BYTES)?;
        let map = |b: &HostBuffer| {
            // SAFETY: page-aligned whole-page buffers owned by the copier, unmapped (field
            // order) before they are freed.
            unsafe { HostMapping::new(gpu, b.as_ptr(), b.size()) }
        };
        let (descs, dones, lists) = (map(&descs_buf)?, map(&dones_buf)?, map(&lists_buf)?);
        let (ctl, bounce) = (map(&ctl_buf)?, map(&bounce_buf)?);
        let work = DeviceBuffer::zeroed(gpu, WORK_BYTES)?;
        let uuid = gdaki_cuda::gpu_uuid(ctx)?;
        debug!(gpu = ctx.ordinal(), grid, "GPU copier ready");
        Ok(Copier {
            gpu: uuid,
            function,
            handle: gpu.clone(),
            stream,
            grid,
            descs,
            dones,
            lists,
            ctl,
            bounce,
            descs_buf,
            dones_buf,
            lists_buf,
            ctl_buf,
            bounce_buf,
            work,
            bounce_lock: Mutex::new(()),
            through: AtomicU64::new(0),
            state: Mutex::new(State {
                next: 1,
                running: false,
                paused: 0,
                broken: false,
                inflight: InFlight::new(),
                open: None,
                stats: CopierStats::default(),
            }),
            resumed: Condvar::new(),
        })
    }

    fn stop_word(&self) -> &AtomicU32 {
        // SAFETY: the first word of the live, page-aligned control buffer.
        unsafe { AtomicU32::from_ptr(self.ctl_buf.as_ptr() as *mut u32) }
    }

    /// The ring slot of descriptor `n`.
    fn desc(&self, n: u64) -> *mut CopyDesc {
        let slot = (n & (RING_SLOTS as u64 - 1)) as usize;
        // SAFETY: slot < RING_SLOTS, inside the ring buffer.
        unsafe { (self.descs_buf.as_ptr() as *mut CopyDesc).add(slot) }
    }

    fn done_seq(&self, slot: usize) -> &AtomicU64 {
        // SAFETY: slot < RING_SLOTS; `seq` is the first, aligned word of the slot.
        unsafe { AtomicU64::from_ptr((self.dones_buf.as_ptr() as *mut CopyDone).add(slot) as *mut u64) }
    }

    /// Launches the kernel (its state zeroed first).
    fn start(&self, st: &mut State) -> Result<(), CudaError> {
        self.handle.context().bind_to_thread()?;
        self.stop_word().store(0, Ordering::Release);
        // Zeroed by a copy, not a memset (a memset is a kernel: it could wait behind others),
        // on the copier's own stream: a copy on the legacy stream would wait for every kernel
        // of the application's blocking streams, and a restart (after a quiesced IPC mapping,
        // say) happens while one of them may be waiting for this copier's copies.
        self.work.write_on(&self.stream, 0, &[0u8; WORK_BYTES])?;
        let (descs, dones, ctl, work) = (
            self.descs.device_addr(0),
            self.dones.device_addr(0),
            self.ctl.device_addr(0),
            self.work.device_addr(),
        );
        let first = st.next;
        let mut b = self.stream.launch_builder(&self.function);
        b.arg(&descs).arg(&dones).arg(&ctl).arg(&work).arg(&first);
        let config = LaunchConfig {
            grid_dim: (self.grid, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `gdaki_copier(descs, dones, stop, work, first)`: the rings and the stop word
        // are mapped for this GPU, `work` holds WORK_BYTES zeroed (above, stream-ordered).
        unsafe { b.launch(config) }?;
        st.running = true;
        debug!(gpu = self.handle.ordinal(), first, "GPU copier started");
        Ok(())
    }

    /// Asks the kernel to stop and waits until it has (it finishes what was submitted first).
    fn stop(&self, st: &mut State) -> Result<(), CudaError> {
        if !st.running {
            return Ok(());
        }
        self.stop_word().store(1, Ordering::Release);
        let deadline = Instant::now() + COPY_TIMEOUT;
        loop {
            // SAFETY: a query of the copier's live stream.
            match unsafe { sys::cuStreamQuery(self.stream.cu_stream()) } {
                sys::CUresult::CUDA_SUCCESS => break,
                sys::CUresult::CUDA_ERROR_NOT_READY if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_micros(50))
                }
                sys::CUresult::CUDA_ERROR_NOT_READY => {
                    st.broken = true;
                    return Err(CudaError::WrongResult {
                        kernel: "gdaki_copier",
                        detail: "did not stop within 10 s".into(),
                    });
                }
                other => {
                    st.broken = true;
                    other.result()?;
                }
            }
        }
        st.running = false;
        debug!(gpu = self.handle.ordinal(), "GPU copier stopped");
        Ok(())
    }

    /// Waits (bounded) until the copier runs, holding its state.
    fn running<'a>(
        &'a self,
        mut st: std::sync::MutexGuard<'a, State>,
    ) -> Result<std::sync::MutexGuard<'a, State>, DmaFault> {
        // The clock is read only when waiting: on the per-copy path it is not free (a system
        // call where the virtual machine's clock source has no vDSO).
        let mut deadline = None;
        while st.paused > 0 || !st.running {
            if st.broken {
                return Err(fault("copy", "the kernel failed earlier"));
            }
            let deadline = *deadline.get_or_insert_with(|| Instant::now() + COPY_TIMEOUT);
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(fault("copy", "the copier stayed stopped for 10 s"));
            }
            st = self.resumed.wait_timeout(st, left).unwrap_or_else(|e| e.into_inner()).0;
        }
        if st.broken {
            return Err(fault("copy", "the kernel failed earlier"));
        }
        Ok(st)
    }

    /// Posts the open copy list (if any), then writes descriptor `st.next` into its slot and
    /// returns its sequence number.
    fn post(&self, st: &mut State, desc: CopyDesc) -> Result<u64, DmaFault> {
        self.flush_open(st)?;
        self.post_now(st, desc)
    }

    /// Waits (bounded) until the slot of descriptor `st.next` is free: its previous descriptor
    /// answered.
    fn free_slot(&self, st: &mut State) -> Result<(), DmaFault> {
        let n = st.next;
        if n > RING_SLOTS as u64 && !self.answered(n - RING_SLOTS as u64) {
            st.stats.ring_full += 1;
            self.wait_answer(st, n - RING_SLOTS as u64, false)?;
        }
        Ok(())
    }

    /// The list of ring slot `slot`.
    fn list(&self, slot: usize) -> *mut CopyItem {
        // SAFETY: slot < RING_SLOTS, inside the lists buffer.
        unsafe { self.lists_buf.as_ptr().add(slot * LIST_BYTES) as *mut CopyItem }
    }

    /// Posts the open copy list as descriptor `st.next` (a list of one as a plain copy).
    fn flush_open(&self, st: &mut State) -> Result<(), DmaFault> {
        if let Some(list) = self.write_open(st)? {
            self.publish(list);
        }
        Ok(())
    }

    /// Writes the open copy list (if any) as descriptor `st.next`, unpublished (see
    /// [`write_slot`](Self::write_slot)).
    fn write_open(&self, st: &mut State) -> Result<Option<Unpublished>, DmaFault> {
        let Some(open) = st.open.take() else {
            return Ok(None);
        };
        let slot = (st.next & (RING_SLOTS as u64 - 1)) as usize;
        let d = if open.count == 1 {
            // SAFETY: item 0 of the open list, written by `submit_copy`.
            let it = unsafe { self.list(slot).read() };
            desc(OP_COPY, it.dst, it.src, it.len, 0, 0)
        } else {
            let at = self.lists.device_addr((slot * LIST_BYTES) as u64);
            desc(OP_COPY_LIST, 0, at, open.count as u64, 0, 0)
        };
        self.write_slot(st, d).map(Some)
    }

    /// Writes descriptor `st.next` into its slot (waiting for the slot's previous descriptor
    /// to be answered) and returns its sequence number.
    fn post_now(&self, st: &mut State, desc: CopyDesc) -> Result<u64, DmaFault> {
        let d = self.write_slot(st, desc)?;
        let n = d.0;
        self.publish(d);
        Ok(n)
    }

    /// Writes descriptor `st.next` into its slot (waiting for the slot's previous descriptor
    /// to be answered), all but its `seq`: the kernel does not see it until
    /// [`publish`](Self::publish), and sees none after it before then (it takes descriptors
    /// in order).
    fn write_slot(&self, st: &mut State, desc: CopyDesc) -> Result<Unpublished, DmaFault> {
        self.free_slot(st)?;
        let n = st.next;
        let p = self.desc(n);
        // SAFETY: the slot is free (its previous descriptor was answered, above); the kernel
        // reads it only once `seq` says so, published last (`publish`).
        unsafe { p.write_volatile(CopyDesc { seq: 0, ..desc }) };
        st.next += 1;
        st.stats.posted += 1;
        Ok(Unpublished(n))
    }

    /// Marks a written, unpublished copy [`SPAN_FLAG_FOLLOWS`]: the store after it is
    /// published.
    fn mark_flag_follows(&self, Unpublished(n): &Unpublished) {
        let p = self.desc(*n);
        // SAFETY: a live ring slot that `write_slot` filled; the kernel does not read it before
        // its `seq` is published (with release), after this.
        unsafe { std::ptr::addr_of_mut!((*p).span).write_volatile(SPAN_FLAG_FOLLOWS) };
    }

    /// Publishes a written descriptor: its `seq`, with release.
    fn publish(&self, Unpublished(n): Unpublished) {
        let p = self.desc(n);
        // SAFETY: `seq` is the first, aligned word of a live ring slot that `write_slot` filled.
        unsafe { AtomicU64::from_ptr(p as *mut u64).store(n, Ordering::Release) };
    }

    /// Whether descriptor `n` has been answered (slots are reused for `n + RING_SLOTS`, ...,
    /// so a later answer in its slot means it was).
    fn answered(&self, n: u64) -> bool {
        self.done_seq((n & (RING_SLOTS as u64 - 1)) as usize)
            .load(Ordering::Acquire)
            >= n
    }

    /// Whether descriptor `n` and every one before it have been answered. The kernel answers
    /// in any order (many warps serve small copies at once), so this walks the answers from
    /// the last point known to be complete.
    fn answered_through(&self, n: u64) -> bool {
        let mut t = self.through.load(Ordering::Acquire);
        if t >= n {
            return true;
        }
        while t < n && self.answered(t + 1) {
            t += 1;
        }
        self.through.fetch_max(t, Ordering::AcqRel);
        t >= n
    }

    /// Waits (bounded) for the answer to descriptor `n` (and, with `through`, to every earlier
    /// one); a timeout breaks the copier.
    fn wait_answer(&self, st: &mut State, n: u64, through: bool) -> Result<(), DmaFault> {
        // The open list is descriptor `next`: waiting for it (or past it) posts it first.
        if st.open.is_some() && n >= st.next {
            self.flush_open(st)?;
        }
        let is_answered = || {
            if through {
                self.answered_through(n)
            } else {
                self.answered(n)
            }
        };
        if is_answered() {
            return Ok(()); // without reading the clock (see `running`)
        }
        let started = Instant::now();
        let mut spins = 0u32;
        while !is_answered() {
            spins = spins.wrapping_add(1);
            if spins < 2048 {
                std::hint::spin_loop();
            } else if spins % 64 == 0 && started.elapsed() > COPY_TIMEOUT {
                st.broken = true;
                return Err(fault("copy", "no answer within 10 s"));
            } else {
                std::thread::yield_now();
            }
        }
        let took = started.elapsed();
        if took > Duration::from_millis(1) {
            debug!(seq = n, ?took, "GPU copier: slow answer");
        }
        Ok(())
    }

    /// Runs one descriptor once every earlier one is done (copies submitted without waiting may
    /// run in any order; atomics, reads and bounced transfers come after them, as an HCA
    /// executes a QP's requests in order), and waits for its answer; returns the atomic result.
    fn run(&self, op: u32, dst: u64, src: u64, len: u64, arg0: u64, arg1: u64) -> Result<u64, DmaFault> {
        let mut st = self.running(lock(&self.state))?;
        self.flush_open(&mut st)?;
        let last = st.next - 1;
        self.wait_answer(&mut st, last, true)?;
        let n = self.post(&mut st, desc(op, dst, src, len, arg0, arg1))?;
        self.wait_answer(&mut st, n, false)?;
        let slot = (n & (RING_SLOTS as u64 - 1)) as usize;
        // SAFETY: the answer's result word, written before its seq (acquired above); the slot
        // cannot be reused while this thread holds the state.
        Ok(unsafe {
            ((self.dones_buf.as_ptr() as *const CopyDone).add(slot) as *const u64)
                .add(1)
                .read_volatile()
        })
    }

    /// Queues a copy of `len` bytes between GPU addresses and returns without waiting: its
    /// sequence number, for [`done`](Self::done). Queued copies may be executed concurrently
    /// and become visible in any order (as an HCA's writes into GPU memory may), except that a
    /// copy onto bytes an earlier one still writes lands after it (the later write wins, as on
    /// an HCA; the kernel orders them, or, rarely, this call waits). A WQE with the
    /// STRONG_ORDERING fence mode, and every atomic, read or bounced transfer on device memory,
    /// waits for all of them (a FENCE does not: it waits for READs and atomics). Each
    /// copy's final unit lands after the rest of it.
    ///
    /// Small copies are gathered into a list that the kernel runs as one descriptor (several
    /// copies may share a sequence number): the list goes to the GPU when it is full, when
    /// anything else is posted or waited for, and at [`flush`](Self::flush), which a caller
    /// that submits a batch calls after it.
    ///
    /// # Safety
    /// `src..src + len` is readable and `dst..dst + len` writable by this copier's GPU (device
    /// memory of it, or host memory mapped into it), the two do not overlap, and nothing else
    /// accesses `dst..dst + len` until the copy is [`done`](Self::done).
    pub unsafe fn submit_copy(&self, dst: u64, src: u64, len: u64) -> Result<u64, DmaFault> {
        // SAFETY: the caller's contract.
        unsafe { self.submit(dst, src, len, None) }
    }

    /// [`submit_copy`](Self::submit_copy) of a gather of two into one range: `len` bytes from
    /// `src`, then `tail` bytes (1 to [`TAIL_MAX`]) from `tail_src`, to `dst..dst + len + tail`,
    /// the tail's final unit landing after everything else (a message from one buffer and its
    /// trailer from another, as one WRITE of two gather entries). A longer tail is refused.
    ///
    /// # Safety
    /// As for [`submit_copy`](Self::submit_copy), for both sources and the whole destination.
    pub unsafe fn submit_copy_with_tail(
        &self,
        dst: u64,
        src: u64,
        len: u64,
        tail_src: u64,
        tail: u64,
    ) -> Result<u64, DmaFault> {
        if tail == 0 || tail > TAIL_MAX as u64 {
            return Err(fault("copy", format!("a tail of {tail} bytes (1 to {TAIL_MAX})")));
        }
        // SAFETY: the caller's contract.
        unsafe { self.submit(dst, src, len, Some((tail_src, tail as u16))) }
    }

    /// [`submit_copy`](Self::submit_copy), with a tail or not.
    unsafe fn submit(&self, dst: u64, src: u64, len: u64, tail: Option<(u64, u16)>) -> Result<u64, DmaFault> {
        let mut st = self.running(lock(&self.state))?;
        let end = dst.saturating_add(len).saturating_add(tail.map_or(0, |t| t.1 as u64));
        let after = self.order_after_overlaps(&mut st, dst, end)?;
        let n = if let Some((tail_src, tail)) = tail {
            // (A gather travels alone: list items have one source each.)
            let d = CopyDesc {
                tail,
                ..desc(OP_COPY, dst, src, len, tail_src, after)
            };
            self.post(&mut st, d)?
        } else if after != 0 || len > LIST_ITEM_MAX || len == 0 {
            // (A copy ordered after another travels alone: a list would wait with it.)
            self.post(&mut st, desc(OP_COPY, dst, src, len, 0, after))?
        } else {
            if st.open.is_none() {
                // The list's items go into its slot now: the slot must be free first.
                self.free_slot(&mut st)?;
            }
            let n = st.next;
            let slot = (n & (RING_SLOTS as u64 - 1)) as usize;
            let count = st.open.map_or(0, |o| o.count);
            // SAFETY: item `count` < LIST_MAX of a free slot's list, which the kernel reads only
            // once the descriptor is posted (release, in `post_now`).
            unsafe { self.list(slot).add(count).write(CopyItem { dst, src, len, pad: 0 }) };
            st.open = Some(OpenList { count: count + 1 });
            if count + 1 == LIST_MAX {
                self.flush_open(&mut st)?;
            }
            n
        };
        st.inflight.push(n, dst, end, after);
        st.stats.copies += 1;
        Ok(n)
    }

    /// Orders a copy of `dst..end` after the copies in flight that write any of its bytes
    /// (copies onto the same bytes land in submission order): returns the descriptor it must
    /// wait for on the GPU (0: none), or waits here when no single one comes after all the
    /// others. Forgets the copies known done on the way.
    fn order_after_overlaps(&self, st: &mut State, dst: u64, end: u64) -> Result<u64, DmaFault> {
        st.inflight.retire(|seq| self.answered_through(seq));
        match st.inflight.overlapping(dst, end) {
            Overlap::None => Ok(0),
            Overlap::After(seq) => {
                st.stats.ordered += 1;
                Ok(seq)
            }
            Overlap::Many(seq) => {
                st.stats.overlap_waits += 1;
                self.wait_answer(st, seq, true)?;
                let through = self.through.load(Ordering::Acquire);
                st.inflight.retire(|s| s <= through);
                Ok(0)
            }
        }
    }

    /// Posts the open copy list now (see [`submit_copy`](Self::submit_copy)); nothing when
    /// there is none.
    pub fn flush(&self) -> Result<(), DmaFault> {
        let st = lock(&self.state);
        if st.open.is_none() {
            return Ok(());
        }
        let mut st = self.running(st)?;
        self.flush_open(&mut st)
    }

    /// Whether copy `seq` (from [`submit_copy`](Self::submit_copy)) and every descriptor before
    /// it are done and their bytes visible; `Err` once the copier broke (the copy may never
    /// happen).
    pub fn done(&self, seq: u64) -> Result<bool, DmaFault> {
        if self.answered_through(seq) {
            return Ok(true);
        }
        if lock(&self.state).broken {
            return Err(DmaFault);
        }
        Ok(false)
    }

    /// Waits (bounded) until copy `seq` and every descriptor before it are done.
    pub fn settle(&self, seq: u64) -> Result<(), DmaFault> {
        if self.answered_through(seq) {
            return Ok(());
        }
        let mut st = lock(&self.state);
        self.wait_answer(&mut st, seq, true)
    }

    /// What this copier has done, and how often the host waited for it.
    pub fn stats(&self) -> CopierStats {
        lock(&self.state).stats
    }

    /// The kernel's time stamps for descriptor `seq` (see [`CopyDone::stamps`]), while its
    /// answer is still in its slot: `None` before it is answered or once the slot was reused.
    pub fn stamps(&self, seq: u64) -> Option<[u64; 3]> {
        self.answer_of(seq, |d| d.stamps)
    }

    /// Whether descriptor `seq` was served by the warp that fetched it from the ring (a lone
    /// small one, see [`MIRROR_SERVES_MAX`](gdaki_layout::copy::MIRROR_SERVES_MAX)) rather than
    /// handed to a worker warp: `None` as for [`stamps`](Self::stamps). Diagnostics.
    pub fn served_by_mirror(&self, seq: u64) -> Option<bool> {
        self.answer_of(seq, |d| d.server == SERVER_MIRROR)
    }

    /// `f` of the answer to descriptor `seq`, if that is the answer its slot holds (before and
    /// after reading: the slot may be reused meanwhile).
    fn answer_of<T>(&self, seq: u64, f: impl FnOnce(&CopyDone) -> T) -> Option<T> {
        let slot = (seq & (RING_SLOTS as u64 - 1)) as usize;
        if self.done_seq(slot).load(Ordering::Acquire) != seq {
            return None;
        }
        // SAFETY: a live answer slot, written before its seq (acquired above).
        let done = unsafe { (self.dones_buf.as_ptr() as *const CopyDone).add(slot).read_volatile() };
        (self.done_seq(slot).load(Ordering::Acquire) == seq).then(|| f(&done))
    }

    /// Copies `len` bytes between GPU addresses (device memory or host memory mapped into this
    /// GPU), ranges not overlapping.
    pub(crate) fn copy(&self, dst: u64, src: u64, len: u64) -> Result<(), DmaFault> {
        if len == 0 {
            return Ok(());
        }
        self.run(OP_COPY, dst, src, len, 0, 0).map(|_| ())
    }

    fn bounce_host(&self) -> *mut u8 {
        self.bounce_buf.as_ptr()
    }
}

impl Copier {
    /// 8-byte fetch-and-add on device memory at `addr`; returns the old value.
    pub(crate) fn fetch_add(&self, addr: u64, add: u64) -> Result<u64, DmaFault> {
        self.run(OP_FETCH_ADD, addr, 0, 8, add, 0)
    }

    /// 8-byte compare-and-swap on device memory at `addr`; returns the old value.
    pub(crate) fn compare_swap(&self, addr: u64, compare: u64, swap: u64) -> Result<u64, DmaFault> {
        self.run(OP_COMPARE_SWAP, addr, 0, 8, compare, swap)
    }

    /// Writes `data` (at most [`STORE_MAX`] bytes) to `addr` (device memory, or host memory
    /// mapped into this GPU) with the bytes carried in the descriptor, after every earlier
    /// descriptor, as [`bounce`](Self::bounce) would, but with one PCIe read by the kernel
    /// instead of two (the descriptor, not also the bounce buffer). Longer data is refused.
    pub(crate) fn store(&self, addr: u64, data: &[u8]) -> Result<(), DmaFault> {
        if data.len() > STORE_MAX {
            return Err(fault("store", "more bytes than a descriptor carries"));
        }
        if data.is_empty() {
            return Ok(());
        }
        let [first, second] = carried(data);
        self.run(OP_STORE, addr, first, data.len() as u64, second, 0)
            .map(|_| ())
    }

    /// Queues a write of `data` (1 to [`STORE_MAX`] bytes, carried in the descriptor) to `addr`
    /// that lands once every descriptor posted before it is done, and returns without waiting:
    /// its sequence number, for [`done`](Self::done). What the synchronous `store` does, with
    /// the waiting left to the GPU: an inline WRITE after a put's copies (a message's length
    /// after its bytes) costs the engine no round trip to the GPU.
    ///
    /// # Safety
    /// `addr..addr + data.len()` is writable by this copier's GPU (device memory of it, or host
    /// memory mapped into it), and nothing else accesses it until the store is done.
    pub unsafe fn submit_store(&self, addr: u64, data: &[u8]) -> Result<u64, DmaFault> {
        if data.is_empty() || data.len() > STORE_MAX {
            return Err(fault("store", "not 1 to 16 bytes"));
        }
        let [first, second] = carried(data);
        let mut st = self.running(lock(&self.state))?;
        // After the open list too: it is written first, so it is among the descriptors before.
        // Its `seq` is published after the store's, so the kernel, which takes descriptors in
        // order, finds the message and its flag in one look and serves them as one run (a
        // look at the ring is a PCIe round trip; the flag found a look after its message came
        // that much later).
        let list = self.write_open(&mut st)?;
        // The kernel looks only at those the host has not seen answered (none: no wait at all);
        // a look at every slot of the ring cost a lone store microseconds.
        let last = st.next - 1;
        self.answered_through(last);
        let through = self.through.load(Ordering::Acquire);
        let mut d = desc(OP_STORE, addr, first, data.len() as u64, second, 0);
        if through < last {
            d.arg1 = last;
            d.span = (last - through).min(RING_SLOTS as u64) as u16;
        }
        let after = d.arg1;
        let posted = self.post_now(&mut st, d);
        // Published even when the store could not be (its slot stayed busy): the list's copies
        // were queued; marked only where its flag was.
        if let Some(list) = list {
            if posted.is_ok() {
                self.mark_flag_follows(&list);
            }
            self.publish(list);
        }
        let n = posted?;
        let end = addr + data.len() as u64;
        // Ordered after everything, so after every copy onto its bytes too: a later copy onto
        // them is ordered after it.
        st.inflight.push(n, addr, end, after);
        st.stats.stores += 1;
        Ok(n)
    }

    /// Moves `len` bytes between device memory at `dev` and host memory at `host`, through the
    /// bounce buffer, a chunk at a time; writes of at most [`STORE_MAX`] bytes travel in the
    /// descriptor instead ([`store`](Self::store)).
    ///
    /// # Safety
    /// `host..host + len` is a buffer the caller may read (and, from the device, write), and
    /// `dev..dev + len` device memory of this copier's GPU.
    pub(crate) unsafe fn bounce(&self, dev: u64, host: *mut u8, len: usize, to_device: bool) -> Result<(), DmaFault> {
        if to_device && len <= STORE_MAX {
            // SAFETY: the caller's buffer of `len` bytes.
            return self.store(dev, unsafe { std::slice::from_raw_parts(host, len) });
        }
        let c = self;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(BOUNCE_BYTES);
            let at = dev + done as u64;
            // The bounce buffer is shared: hold it for the copy and the host side of it.
            let _bounce = lock(&c.bounce_lock);
            // SAFETY: `host + done .. + n` is the caller's buffer; the bounce holds BOUNCE_BYTES.
            unsafe {
                if to_device {
                    std::ptr::copy_nonoverlapping(host.add(done), c.bounce_host(), n);
                    c.copy(at, c.bounce.device_addr(0), n as u64)?;
                } else {
                    c.copy(c.bounce.device_addr(0), at, n as u64)?;
                    std::ptr::copy_nonoverlapping(c.bounce_host(), host.add(done), n);
                }
            }
            done += n;
        }
        Ok(())
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        let mut st = lock(&self.state);
        if let Err(e) = self.stop(&mut st) {
            error!("GPU copier: stopping at drop: {e}");
        }
    }
}

/// Lets go of a reference to a copier held on an HCA thread: if it is the last, the copier is
/// stopped and freed on the reaper (stopping it and unmapping its buffers wait for kernels).
/// Any other reference is dropped here: the engine lets go of one per completed copy, and a
/// hand-over to the reaper thread each time (a channel send and often a wake-up) cost more
/// than the copy.
pub(crate) fn release(copier: Arc<Copier>) {
    // `into_inner` decrements atomically and yields the copier only to the last holder, so
    // two threads releasing at once cannot both skip the reaper.
    if let Some(last) = Arc::into_inner(copier) {
        drop(crate::Keep::new(Some(Arc::new(last))));
    }
}

// A copier is a kernel that never ends on its own: CUDA calls that wait for every kernel
// (`cuda::quiesced`) stop it around them.
impl gdaki_cuda::Resident for Copier {
    fn pause(&self) {
        let mut st = lock(&self.state);
        st.paused += 1;
        if let Err(e) = self.stop(&mut st) {
            error!("GPU copier: stopping for a free: {e}");
        }
    }

    fn resume(&self) {
        let mut st = lock(&self.state);
        st.paused -= 1;
        if st.paused == 0 && !st.running && !st.broken {
            match self.start(&mut st) {
                Ok(()) => {}
                // The process is exiting (the driver is already torn down): nothing to serve.
                Err(CudaError::Driver(e)) if e.0 == sys::CUresult::CUDA_ERROR_DEINITIALIZED => st.broken = true,
                Err(e) => {
                    error!("GPU copier: restarting after a free: {e}");
                    st.broken = true;
                }
            }
        }
        self.resumed.notify_all();
    }
}

/// The newest copy submitted to each copier without waiting and not yet known done: what a
/// thread that moves data itself must wait for first, so that it never overtakes an earlier
/// copy (a put, then its signal).
#[derive(Default)]
pub(crate) struct Pending {
    copies: Vec<(Arc<Copier>, u64)>,
    /// What the pending copies do (`None`: none pending).
    way: Option<Way>,
}

/// What a copy does for its request. The GPU orders a copy only after earlier ones onto the
/// same bytes, so copies of one way may run together, but one of the other way waits for them
/// ([`Pending::before`]): a READ must see the WRITEs before it, and a WRITE must not change what
/// an earlier READ still reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Way {
    /// A WRITE's copy: it writes the target.
    Write,
    /// A READ's copy: it reads the source.
    Read,
}

impl Pending {
    /// Before submitting a copy of `way`: waits for the pending copies if they go the other
    /// way (see [`Way`]).
    pub fn before(&mut self, way: Way) -> Result<(), DmaFault> {
        match self.way {
            Some(w) if w != way => self.settle(),
            _ => Ok(()),
        }
    }

    /// Before a store through `copier` ordered after its earlier descriptors
    /// ([`Copier::submit_store`]): waits for the pending copies on other copiers, which that
    /// order does not cover, and for pending READs' (what is pending is then one way only).
    pub fn before_store(&mut self, copier: &Arc<Copier>) -> Result<(), DmaFault> {
        let elsewhere = self.copies.iter().any(|(c, _)| !Arc::ptr_eq(c, copier));
        if elsewhere || self.way == Some(Way::Read) {
            self.settle()
        } else {
            Ok(())
        }
    }

    /// The copier of the pending copies when they are all on one.
    pub fn only_copier(&self) -> Option<&Arc<Copier>> {
        match self.copies.as_slice() {
            [(c, _)] => Some(c),
            _ => None,
        }
    }

    /// Waits for the pending copies if they are READs' (what a FENCE waits for).
    pub fn settle_reads(&mut self) -> Result<(), DmaFault> {
        self.before(Way::Write)
    }

    /// Copy `seq` of `copier`, doing `way`, was submitted (after [`before`](Self::before)).
    pub fn add(&mut self, copier: &Arc<Copier>, seq: u64, way: Way) {
        match self.copies.iter_mut().find(|(c, _)| Arc::ptr_eq(c, copier)) {
            Some(entry) => entry.1 = seq,
            None => self.copies.push((copier.clone(), seq)),
        }
        self.way = Some(way);
    }

    /// Waits (bounded) until every pending copy is done, and lets go of the copiers.
    pub fn settle(&mut self) -> Result<(), DmaFault> {
        let mut result = Ok(());
        self.way = None;
        for (copier, seq) in self.copies.drain(..) {
            if result.is_ok() {
                result = copier.settle(seq);
            }
            release(copier);
        }
        result
    }

    /// Hands the small copies gathered so far to their copiers' kernels (see
    /// [`Copier::flush`]).
    pub fn flush(&self) {
        for (copier, _) in &self.copies {
            // A copier that cannot post is broken (the copy fails where it is waited for) or
            // paused (retried at the next flush).
            let _ = copier.flush();
        }
    }

    /// Forgets the copies known done, letting go of their copiers (finished copies need no
    /// settling).
    pub fn release_done(&mut self) {
        let mut i = 0;
        while i < self.copies.len() {
            if matches!(self.copies[i].0.done(self.copies[i].1), Ok(true)) {
                release(self.copies.swap_remove(i).0);
            } else {
                i += 1;
            }
        }
        if self.copies.is_empty() {
            self.way = None;
        }
    }
}
