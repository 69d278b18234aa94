//! Connection set-up for kernels (GPUnet's `gconnect_in`, `gbind`, `gaccept`): a host thread
//! serves a mailbox that kernels (or CPU threads, in CPU mode) write with
//! `gdaki_device::socket::Service`. Each call is done by a worker thread of its own (a connect
//! or an accept may take up to the socket timeout), and its socket handed to the caller as a
//! handle ready for `gdaki_device::socket::Socket::from_raw`; the service keeps the socket
//! until the caller releases it. The mailbox protocol is in `gdaki_layout::socket::SocketCall`.
//!
//! In CPU mode (rings in host memory) threads play the kernels; on a GPU the config names it
//! (`SocketMemory::Device(gpu)`) and kernels call the same functions, or the
//! `gdaki_socket_listen_block` ... of `gdaki_device.h`:
//!
//! ```
//! use gdaki::socket::{Socket, SocketConfig, SocketService};
//! use gdaki::{Context, Provider};
//! use gdaki_device::socket::{Service, Socket as DevSocket};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let service = SocketService::start(&Context::open(Provider::Soft)?, "127.0.0.1".parse()?, SocketConfig::default())?;
//! let handle = service.device_handle() as usize;
//! // SAFETY: the service's handle (host memory in CPU mode), alive while it is used.
//! let svc = |h: usize| unsafe { Service::from_raw(h as *const _) }.unwrap();
//! // What a kernel does: listen, accept, echo what comes, close, release.
//! let port = svc(handle).listen(0).unwrap();
//! let server = std::thread::spawn(move || {
//!     let s = svc(handle).accept(port).unwrap();
//!     // SAFETY: the handle the service made for this caller, used by it alone.
//!     let dev = unsafe { DevSocket::<gdaki_device::Gpu>::from_raw(s) }.unwrap();
//!     let mut buf = [0u8; 64];
//!     let n = dev.recv(&mut buf).unwrap();
//!     dev.send_all_with(gdaki_device::Thread, &buf[..n]).unwrap();
//!     dev.close_with(gdaki_device::Thread).unwrap();
//!     svc(handle).release(s).unwrap();
//! });
//! // A CPU client.
//! let ctx = Context::open(Provider::Soft)?;
//! let c = Socket::connect(&ctx, format!("127.0.0.1:{port}").parse()?, SocketConfig::default())?;
//! c.send_all(b"hello, service")?;
//! let mut back = [0u8; 14];
//! let mut got = 0;
//! while got < back.len() {
//!     got += c.recv(&mut back[got..])?;
//! }
//! assert_eq!(&back, b"hello, service");
//! c.close()?;
//! server.join().unwrap();
//! assert_eq!(service.held(), (0, 1), "the listener stays until unlisten");
//! # Ok(()) }
//! ```
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use gdaki_cuda::{Gpu, HostMapping};
use gdaki_device::status::{CODE_BAD_ARGUMENT, CODE_BAD_HANDLE, CODE_OK, CODE_REFUSED, CODE_TIMEOUT};
use gdaki_devx::util::lock;
use gdaki_devx::{HostBuffer, QueueMemory};
use gdaki_layout::socket::{
    DevSocketService, SocketCall, ADDR_TEXT_BYTES, CALL_ACCEPT, CALL_CONNECT, CALL_LISTEN, CALL_RELEASE, CALL_UNLISTEN,
    DEV_SOCKET_SERVICE_VERSION, SERVICE_SLOTS,
};
use tracing::{debug, warn};

use super::{GpuSocket, Socket, SocketConfig, SocketListener, SocketMemory};
use crate::error::{Error, Result};
use crate::{Access, Context, MemoryRegion, Rings};

/// How long the service thread sleeps when no call is waiting: connection set-up is not a
/// latency path, and an idle service should cost next to nothing.
const IDLE: Duration = Duration::from_micros(200);

/// Serves kernels' (or CPU threads') connects, listens and accepts: see the module doc.
/// Dropping it stops the service, waits for calls in progress (at most the socket timeout)
/// and frees every socket and listener it made: drop it only once nothing uses them.
pub struct SocketService {
    inner: Arc<Inner>,
    thread: Option<JoinHandle<()>>,
    // The handle and the locks, where the callers read them (dropped after the thread).
    handle: QueueMemory,
    _locks: QueueMemory,
}

impl std::fmt::Debug for SocketService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SocketService")
            .field("bind", &self.inner.bind)
            .field("slots", &self.inner.slots)
            .field("handle", &format_args!("{:#x}", self.device_handle()))
            .finish_non_exhaustive()
    }
}

/// `bytes` where the callers read them: GPU memory for a GPU's kernels, host memory for CPU
/// threads.
fn placed(gpu: Option<&Gpu>, what: &'static str, bytes: &[u8]) -> Result<QueueMemory> {
    let rings = gpu.map_or(Rings::Host, |g| Rings::Gpu(g.clone()));
    let mem = rings.alloc(what, bytes.len())?;
    mem.write(0, bytes)
        .map_err(Error::device("writing a socket service's tables"))?;
    Ok(mem)
}

/// A socket the service made and keeps until it is released (held for its drop: the caller
/// uses it through its handle).
#[allow(dead_code)]
enum Made {
    Cpu(Box<Socket>),
    Gpu(Box<GpuSocket>),
}

struct Inner {
    ctx: Context,
    cfg: SocketConfig,
    bind: IpAddr,
    slots: u32,
    /// For rings in GPU memory: a region of that GPU held for the service's life, so the soft
    /// HCA's copy kernel starts with the service, before any kernel that calls it; started
    /// while such a kernel waits for a connect, it could wait for that kernel (module loading,
    /// its stream's creation).
    _copier: Option<MemoryRegion>,
    // The mapping before its buffer (field order is drop order).
    _map: Option<HostMapping>,
    calls: HostBuffer,
    stop: AtomicBool,
    made: Mutex<HashMap<u64, Made>>,
    /// GPU sockets released (or undone) and not yet freed: freeing GPU memory waits for every
    /// kernel, the caller's included, so it waits for [`SocketService::reap`] or the drop.
    released: Mutex<Vec<Made>>,
    listeners: Mutex<HashMap<u16, Arc<SocketListener>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

// SAFETY: the mailbox is shared with the callers by design (every word has one writer, read
// and written through atomics); the sockets are Send and behind a mutex.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

/// What a call asked.
struct Call {
    n: u64,
    op: u32,
    port: u32,
    arg: u64,
    text: [u8; ADDR_TEXT_BYTES],
}

impl SocketService {
    /// Starts a service whose sockets are made with `cfg` on `ctx`, and whose listeners bind
    /// `bind` (the port comes with each listen). The callers are the kernels of the GPU that
    /// `cfg.memory` names ([`SocketMemory::Pinned`] or [`SocketMemory::Device`]: the mailbox is
    /// mapped into it, the sockets exported to it), or CPU threads for [`SocketMemory::Host`].
    pub fn start(ctx: &Context, bind: IpAddr, cfg: SocketConfig) -> Result<SocketService> {
        cfg.log_rx()?;
        let gpu = cfg.memory.gpu();
        let slots = SERVICE_SLOTS;
        let calls = HostBuffer::new(
            "a socket service's mailbox",
            slots as usize * std::mem::size_of::<SocketCall>(),
        )?;
        let map = match gpu {
            // SAFETY: the buffer is page-aligned whole pages, owned by the service, and outlives
            // the mapping (dropped first, by field order).
            Some(g) => Some(unsafe { HostMapping::new(g, calls.as_ptr(), calls.size()) }?),
            None => None,
        };
        let calls_addr = map.as_ref().map_or(calls.addr(), |m| m.device_addr(0));
        let locks = placed(gpu, "a socket service's locks", &vec![0u8; 4 * slots as usize])?;
        // A caller waits out the service's connect or accept, and then some.
        let timeout = cfg.timeout.saturating_mul(2) + Duration::from_secs(1);
        let h = DevSocketService {
            calls: calls_addr,
            locks: locks.addr(),
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            slots,
            version: DEV_SOCKET_SERVICE_VERSION,
            pad: [0; 4],
        };
        let handle = placed(gpu, "a socket service's handle", bytemuck::bytes_of(&h))?;
        let copier = match &cfg.memory {
            SocketMemory::Device(g) => Some(ctx.alloc_device_region(g, 4096, Access::ALL)?),
            _ => None,
        };
        let inner = Arc::new(Inner {
            ctx: ctx.clone(),
            cfg,
            bind,
            slots,
            _copier: copier,
            _map: map,
            calls,
            stop: AtomicBool::new(false),
            made: Mutex::new(HashMap::new()),
            released: Mutex::new(Vec::new()),
            listeners: Mutex::new(HashMap::new()),
            workers: Mutex::new(Vec::new()),
        });
        let serving = inner.clone();
        let thread = std::thread::Builder::new()
            .name("gdaki-sockets".into())
            .spawn(move || serving.serve())
            .map_err(|source| Error::Io {
                what: "starting the socket service's thread",
                source,
            })?;
        Ok(SocketService {
            inner,
            thread: Some(thread),
            handle,
            _locks: locks,
        })
    }

    /// The service's handle where its callers read it (GPU memory for a GPU's kernels, host
    /// memory in CPU mode): what they pass to `gdaki_device::socket::Service::from_raw`.
    pub fn device_handle(&self) -> u64 {
        self.handle.addr()
    }

    /// Sockets made and not yet released, and listeners open: what the service holds.
    pub fn held(&self) -> (usize, usize) {
        (lock(&self.inner.made).len(), lock(&self.inner.listeners).len())
    }

    /// Frees the GPU sockets released since the last call, and says how many. Freeing GPU
    /// memory waits for every kernel of the process, so the service never does it while
    /// serving a call (the caller's kernel is running): call this when no kernel runs, or leave
    /// it to the drop.
    pub fn reap(&self) -> usize {
        let gone = std::mem::take(&mut *lock(&self.inner.released));
        gone.len()
    }
}

impl Drop for SocketService {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let workers = std::mem::take(&mut *lock(&self.inner.workers));
        for w in workers {
            let _ = w.join();
        }
        lock(&self.inner.listeners).clear();
        lock(&self.inner.made).clear();
        lock(&self.inner.released).clear();
    }
}

impl Inner {
    fn call(&self, k: u32) -> *mut SocketCall {
        // SAFETY: k < slots: inside the mailbox.
        unsafe { (self.calls.as_ptr() as *mut SocketCall).add(k as usize) }
    }

    fn word(&self, k: u32, at: usize) -> &AtomicU64 {
        // SAFETY: an aligned u64 of slot k, alive as long as `self`; every access to it is atomic.
        unsafe { AtomicU64::from_ptr((self.call(k) as *mut u8).add(at) as *mut u64) }
    }

    /// The service thread: hands every newly posted call to a worker of its own.
    fn serve(self: Arc<Self>) {
        let mut seen = vec![0u64; self.slots as usize];
        let posted = std::mem::offset_of!(SocketCall, posted);
        while !self.stop.load(Ordering::Acquire) {
            let mut found = false;
            for k in 0..self.slots {
                let n = self.word(k, posted).load(Ordering::Acquire);
                if n == seen[k as usize] {
                    continue;
                }
                seen[k as usize] = n;
                found = true;
                let call = self.read(k, n);
                let me = self.clone();
                let worker = std::thread::Builder::new()
                    .name("gdaki-socket-call".into())
                    .spawn(move || me.answer(k, call));
                match worker {
                    Ok(w) => {
                        let mut workers = lock(&self.workers);
                        workers.retain(|w| !w.is_finished());
                        workers.push(w);
                    }
                    Err(e) => {
                        warn!("socket service: no thread for a call: {e}");
                        self.publish(k, n, CODE_REFUSED, 0);
                    }
                }
            }
            if !found {
                std::thread::sleep(IDLE);
            }
        }
    }

    /// Call `n` of slot `k` (posted: its fields are written).
    fn read(&self, k: u32, n: u64) -> Call {
        // SAFETY: the caller's half of the slot, which it does not touch until answered.
        let c = unsafe { std::ptr::read_volatile(self.call(k)) };
        Call {
            n,
            op: c.op,
            port: c.port,
            arg: c.arg,
            text: c.text,
        }
    }

    /// Does call `c` of slot `k` and answers it (or undoes it, if its caller gave up).
    fn answer(&self, k: u32, c: Call) {
        let (status, value, made) = match self.execute(&c) {
            Ok((value, made)) => (CODE_OK, value, made),
            Err(code) => (code, 0, None),
        };
        let cancelled = self
            .word(k, std::mem::offset_of!(SocketCall, cancelled))
            .load(Ordering::Acquire);
        if cancelled == c.n && status == CODE_OK {
            debug!(
                slot = k,
                op = c.op,
                "socket service: the caller gave up; undoing the call"
            );
            if let Some(m) = made {
                self.let_go(m);
            }
            if c.op == CALL_LISTEN {
                lock(&self.listeners).remove(&(value as u16));
            }
            return self.publish(k, c.n, CODE_TIMEOUT, 0);
        }
        if let Some(m) = made {
            lock(&self.made).insert(value, m);
        }
        self.publish(k, c.n, status, value);
    }

    fn publish(&self, k: u32, n: u64, status: u32, value: u64) {
        let c = self.call(k);
        // SAFETY: the service's half of the slot, which the caller reads only after `answered`.
        unsafe {
            std::ptr::addr_of_mut!((*c).status).write_volatile(status);
            std::ptr::addr_of_mut!((*c).value).write_volatile(value);
        }
        self.word(k, std::mem::offset_of!(SocketCall, answered))
            .store(n, Ordering::Release);
    }

    /// The call's value and the socket it made, or its code.
    fn execute(&self, c: &Call) -> std::result::Result<(u64, Option<Made>), u32> {
        match c.op {
            CALL_CONNECT => {
                let len = c.text.iter().position(|&b| b == 0).unwrap_or(ADDR_TEXT_BYTES);
                let text = std::str::from_utf8(&c.text[..len]).map_err(|_| CODE_BAD_ARGUMENT)?;
                let addr = text
                    .to_socket_addrs()
                    .map_err(|_| CODE_REFUSED)?
                    .next()
                    .ok_or(CODE_REFUSED)?;
                let socket = Socket::connect(&self.ctx, addr, self.cfg.clone()).map_err(|e| self.failed(c, e))?;
                self.hand_out(socket)
            }
            CALL_LISTEN => {
                let port = u16::try_from(c.port).map_err(|_| CODE_BAD_ARGUMENT)?;
                let l = SocketListener::bind(&self.ctx, SocketAddr::new(self.bind, port), self.cfg.clone())
                    .map_err(|e| self.failed(c, e))?;
                let port = l.local_addr().map_err(|e| self.failed(c, e))?.port();
                lock(&self.listeners).insert(port, Arc::new(l));
                Ok((port as u64, None))
            }
            CALL_ACCEPT => {
                let port = u16::try_from(c.port).map_err(|_| CODE_BAD_ARGUMENT)?;
                let l = lock(&self.listeners).get(&port).cloned().ok_or(CODE_REFUSED)?;
                let socket = l.accept_within(self.cfg.timeout).map_err(|e| self.failed(c, e))?;
                self.hand_out(socket)
            }
            CALL_UNLISTEN => {
                let port = u16::try_from(c.port).map_err(|_| CODE_BAD_ARGUMENT)?;
                lock(&self.listeners)
                    .remove(&port)
                    .map(|_| (0, None))
                    .ok_or(CODE_BAD_ARGUMENT)
            }
            CALL_RELEASE => {
                let m = lock(&self.made).remove(&c.arg).ok_or(CODE_BAD_HANDLE)?;
                self.let_go(m);
                Ok((0, None))
            }
            _ => Err(CODE_BAD_ARGUMENT),
        }
    }

    /// Frees a socket the callers are done with: a CPU one now, a GPU one at the next
    /// [`SocketService::reap`] (or the drop), since freeing GPU memory waits for every kernel.
    fn let_go(&self, m: Made) {
        match m {
            Made::Cpu(s) => drop(s),
            gpu => lock(&self.released).push(gpu),
        }
    }

    /// The code a failed call answers (a timeout as such, anything else as refused), logged.
    fn failed(&self, c: &Call, e: Error) -> u32 {
        debug!(op = c.op, port = c.port, "socket service: the call failed: {e}");
        match e {
            Error::Timeout { .. } => CODE_TIMEOUT,
            _ => CODE_REFUSED,
        }
    }

    /// A made socket as its callers take it: exported to the GPU (kernels), or as it is (CPU).
    fn hand_out(&self, socket: Socket) -> std::result::Result<(u64, Option<Made>), u32> {
        match self.cfg.memory.gpu() {
            Some(gpu) => {
                let g = socket.into_gpu(gpu).map_err(|e| {
                    warn!("socket service: exporting a socket to GPU {}: {e}", gpu.ordinal());
                    CODE_REFUSED
                })?;
                Ok((g.device_handle(), Some(Made::Gpu(Box::new(g)))))
            }
            None => Ok((socket.device_handle() as u64, Some(Made::Cpu(Box::new(socket))))),
        }
    }
}
