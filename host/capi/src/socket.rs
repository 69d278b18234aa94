//! Byte-stream sockets for CPU peers (docs/sockets.md): listen, accept, connect, send and
//! receive with POSIX results, shutdown, reset, flush. The same wire protocol as GPU sockets,
//! so a C program talks to a GPU server (or serves GPU clients).
use std::ffi::{c_char, c_void};
use std::time::Duration;

use gdaki::socket::{GpuSocket, Socket, SocketConfig, SocketFailure, SocketListener, SocketMemory, SocketService};
use gdaki_layout::socket::{DevSocket, DevSocketService};

use crate::context::{gdaki_context, gdaki_gpu, parse_addr};
use crate::guard::{self, call, gdaki_status, handle, Failure};
use crate::region::gdaki_region;

/// `gdaki_socket_config.memory`: the rings in host memory (CPU use).
pub const GDAKI_SOCKET_MEMORY_HOST: u32 = 0;
/// The rings in host memory mapped into `gdaki_socket_config.gpu`.
pub const GDAKI_SOCKET_MEMORY_PINNED: u32 = 1;
/// The rings in `gdaki_socket_config.gpu`'s memory (kernels only, once exported).
pub const GDAKI_SOCKET_MEMORY_DEVICE: u32 = 2;

/// `gdaki_socket_send` / `gdaki_socket_recv` flag: never wait (`GDAKI_STATUS_AGAIN` instead).
pub const GDAKI_SOCKET_NONBLOCK: u32 = 1;

/// How a socket is made: `gdaki_socket_config_init` fills in the defaults.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gdaki_socket_config {
    /// Bytes of this side's receive ring: a power of two, 4 KiB to 1 GiB (default 64 KiB).
    pub rx_bytes: u64,
    /// How long a wait (room, bytes, the peer's handshake) may take, 1 to 3,600,000 ms
    /// (default 10,000).
    pub timeout_ms: u32,
    /// Send queue size of the socket's queue pair, a power of two (default 256).
    pub sq_size: u32,
    /// Where the rings live: a `GDAKI_SOCKET_MEMORY_*` (default host).
    pub memory: u32,
    /// The GPU of `GDAKI_SOCKET_MEMORY_PINNED` and `_DEVICE`; NULL for host memory.
    pub gpu: *const gdaki_gpu,
}

impl gdaki_socket_config {
    fn defaults() -> gdaki_socket_config {
        let d = SocketConfig::default();
        gdaki_socket_config {
            rx_bytes: d.rx_bytes,
            timeout_ms: d.timeout.as_millis() as u32,
            sq_size: d.sq_size,
            memory: GDAKI_SOCKET_MEMORY_HOST,
            gpu: std::ptr::null(),
        }
    }

    /// The Rust configuration.
    ///
    /// # Safety
    /// `gpu` is NULL or a GPU handle.
    unsafe fn to_rust(self) -> Result<SocketConfig, Failure> {
        if !(1..=3_600_000).contains(&self.timeout_ms) {
            return Err(Failure::invalid(format!(
                "timeout_ms {}: 1 to 3,600,000",
                self.timeout_ms
            )));
        }
        // SAFETY: the caller's contract.
        let gpu = unsafe { guard::borrow_opt(self.gpu, "config.gpu") }?;
        let memory = match (self.memory, gpu) {
            (GDAKI_SOCKET_MEMORY_HOST, None) => SocketMemory::Host,
            (GDAKI_SOCKET_MEMORY_PINNED, Some(g)) => SocketMemory::Pinned(g.clone()),
            (GDAKI_SOCKET_MEMORY_DEVICE, Some(g)) => SocketMemory::Device(g.clone()),
            (GDAKI_SOCKET_MEMORY_HOST, Some(_)) => {
                return Err(Failure::invalid(
                    "config.gpu is set for host memory (GDAKI_SOCKET_MEMORY_HOST)",
                ))
            }
            (GDAKI_SOCKET_MEMORY_PINNED | GDAKI_SOCKET_MEMORY_DEVICE, None) => {
                return Err(Failure::invalid(
                    "config.memory names a GPU's memory and config.gpu is NULL",
                ))
            }
            (m, _) => {
                return Err(Failure::invalid(format!(
                    "config.memory {m} (expected a GDAKI_SOCKET_MEMORY_*)"
                )))
            }
        };
        Ok(SocketConfig {
            rx_bytes: self.rx_bytes,
            timeout: Duration::from_millis(u64::from(self.timeout_ms)),
            sq_size: self.sq_size,
            memory,
        })
    }
}

/// The config at `config`, or the defaults for NULL.
///
/// # Safety
/// `config` is NULL or a readable config whose `gpu` is NULL or a GPU handle.
unsafe fn config(config: *const gdaki_socket_config) -> Result<SocketConfig, Failure> {
    let c = if config.is_null() {
        gdaki_socket_config::defaults()
    } else {
        // SAFETY: the caller's contract.
        *unsafe { guard::input(config, "config") }?
    };
    // SAFETY: the caller's contract.
    unsafe { c.to_rust() }
}

impl From<SocketFailure> for Failure {
    fn from(e: SocketFailure) -> Failure {
        let status = match &e {
            SocketFailure::WouldBlock => gdaki_status::Again,
            SocketFailure::Reset => gdaki_status::Peer,
            SocketFailure::Closed => gdaki_status::InvalidState,
            SocketFailure::TimedOut(_) => gdaki_status::Timeout,
            SocketFailure::OnGpu => gdaki_status::Unsupported,
            SocketFailure::BadSource(_) => gdaki_status::InvalidArgument,
            _ => gdaki_status::QueueError,
        };
        Failure::new(status, e.to_string())
    }
}

/// Accepts socket connections at a TCP address.
pub struct gdaki_socket_listener(guard::Tagged<SocketListener>);
handle!(gdaki_socket_listener(SocketListener), b"gdakiSKL", "socket_listener");

/// A connected byte-stream socket (one thread may send while another receives).
pub struct gdaki_socket(guard::Tagged<Socket>);
handle!(gdaki_socket(Socket), b"gdakiSCK", "socket");

/// Fills `*config` with the defaults.
///
/// # Safety
/// `config` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_config_init(config: *mut gdaki_socket_config) -> gdaki_status {
    call("gdaki_socket_config_init", || {
        // SAFETY: the caller's contract.
        unsafe { guard::out(config, "config") }?.write(gdaki_socket_config::defaults());
        Ok(())
    })
}

/// Listens at `addr` ("ip:port"; port 0: any free port) for sockets on `ctx`'s device into
/// `*listener`; `config` NULL takes the defaults.
///
/// # Safety
/// `ctx` is NULL or a context handle; `addr` NULL or a NUL-terminated string; `config` NULL or
/// a readable config; `listener` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_listen(
    ctx: *const gdaki_context,
    addr: *const c_char,
    config: *const gdaki_socket_config,
    listener: *mut *mut gdaki_socket_listener,
) -> gdaki_status {
    call("gdaki_socket_listen", || {
        // SAFETY: the caller's contract.
        let (c, addr, cfg, out) = unsafe {
            (
                guard::borrow(ctx, "ctx")?,
                guard::text(addr, "addr")?,
                self::config(config)?,
                guard::out(listener, "listener")?,
            )
        };
        let l = SocketListener::bind(c, parse_addr(addr, "addr")?, cfg)?;
        out.write(guard::into_handle(l));
        Ok(())
    })
}

/// The port the listener took (for a listener made with port 0).
///
/// # Safety
/// `listener` is NULL or a listener handle; `port` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_listener_port(
    listener: *const gdaki_socket_listener,
    port: *mut u16,
) -> gdaki_status {
    call("gdaki_socket_listener_port", || {
        // SAFETY: the caller's contract.
        let (l, out) = unsafe { (guard::borrow(listener, "listener")?, guard::out(port, "port")?) };
        out.write(l.local_addr()?.port());
        Ok(())
    })
}

/// Waits for a client (at most `wait_ms`; 0: without bound) and makes its socket into
/// `*socket`. A client speaking another protocol is refused (`GDAKI_STATUS_PEER`).
///
/// # Safety
/// `listener` is NULL or a listener handle; `socket` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_accept(
    listener: *const gdaki_socket_listener,
    wait_ms: u32,
    socket: *mut *mut gdaki_socket,
) -> gdaki_status {
    call("gdaki_socket_accept", || {
        // SAFETY: the caller's contract.
        let (l, out) = unsafe { (guard::borrow(listener, "listener")?, guard::out(socket, "socket")?) };
        let s = match wait_ms {
            0 => l.accept()?,
            ms => l.accept_within(Duration::from_millis(u64::from(ms)))?,
        };
        out.write(guard::into_handle(s));
        Ok(())
    })
}

/// Connects to a listener at `addr` ("ip:port") with `ctx`'s device into `*socket`.
///
/// # Safety
/// `ctx` is NULL or a context handle; `addr` NULL or a NUL-terminated string; `config` NULL or
/// a readable config; `socket` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_connect(
    ctx: *const gdaki_context,
    addr: *const c_char,
    config: *const gdaki_socket_config,
    socket: *mut *mut gdaki_socket,
) -> gdaki_status {
    call("gdaki_socket_connect", || {
        // SAFETY: the caller's contract.
        let (c, addr, cfg, out) = unsafe {
            (
                guard::borrow(ctx, "ctx")?,
                guard::text(addr, "addr")?,
                self::config(config)?,
                guard::out(socket, "socket")?,
            )
        };
        out.write(guard::into_handle(Socket::connect(c, parse_addr(addr, "addr")?, cfg)?));
        Ok(())
    })
}

/// Checks a send/recv flags word.
fn nonblocking(flags: u32) -> Result<bool, Failure> {
    if flags & !GDAKI_SOCKET_NONBLOCK != 0 {
        return Err(Failure::invalid(format!(
            "flags {flags:#x} (expected 0 or GDAKI_SOCKET_NONBLOCK)"
        )));
    }
    Ok(flags & GDAKI_SOCKET_NONBLOCK != 0)
}

/// Sends up to `len` bytes of `data` (POSIX `send`): `*sent` says how many (fewer when the
/// peer's ring had less room). Waits (bounded) for room, or with `GDAKI_SOCKET_NONBLOCK`
/// returns `GDAKI_STATUS_AGAIN`. Errors: `GDAKI_STATUS_PEER` reset, `_INVALID_STATE` after
/// shutdown, `_TIMEOUT`, `_QUEUE_ERROR` the connection is lost.
///
/// # Safety
/// `socket` is NULL or a socket handle; `data` NULL or readable for `len` bytes; `sent` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_send(
    socket: *const gdaki_socket,
    data: *const c_void,
    len: usize,
    flags: u32,
    sent: *mut usize,
) -> gdaki_status {
    call("gdaki_socket_send", || {
        // SAFETY: the caller's contract.
        let (s, bytes, out) = unsafe {
            (
                guard::borrow(socket, "socket")?,
                guard::slice(data.cast::<u8>(), len, "data")?,
                guard::out(sent, "sent")?,
            )
        };
        let n = if nonblocking(flags)? {
            s.try_send(bytes)?
        } else {
            s.send(bytes)?
        };
        out.write(n);
        Ok(())
    })
}

/// Sends up to `len` bytes of `region` from `offset` without copying them into the socket's
/// staging ring: `*sent` says how many (fewer when the peer's ring had less room). The HCA
/// reads them after the call returns, so they must stay unchanged until `gdaki_socket_flush`
/// returns. Waits (bounded) for room, or with `GDAKI_SOCKET_NONBLOCK` returns
/// `GDAKI_STATUS_AGAIN`. Errors as `gdaki_socket_send`'s, and `GDAKI_STATUS_INVALID_ARGUMENT`
/// (nothing sent) for bytes the region does not hold or a region of another context.
///
/// # Safety
/// `socket` is NULL or a socket handle; `region` NULL or a region handle; `sent` NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_send_from(
    socket: *const gdaki_socket,
    region: *const gdaki_region,
    offset: u64,
    len: usize,
    flags: u32,
    sent: *mut usize,
) -> gdaki_status {
    call("gdaki_socket_send_from", || {
        // SAFETY: the caller's contract.
        let (s, r, out) = unsafe {
            (
                guard::borrow(socket, "socket")?,
                guard::borrow(region, "region")?,
                guard::out(sent, "sent")?,
            )
        };
        let n = if nonblocking(flags)? {
            s.try_send_from(r, offset, len as u64)?
        } else {
            s.send_from(r, offset, len as u64)?
        };
        out.write(n);
        Ok(())
    })
}

/// Receives up to `len` bytes into `buf` (POSIX `recv`): `*received` says how many, 0 once the
/// peer shut down and everything it sent was read. Waits (bounded) for bytes, or with
/// `GDAKI_SOCKET_NONBLOCK` returns `GDAKI_STATUS_AGAIN`.
///
/// # Safety
/// `socket` is NULL or a socket handle; `buf` NULL or writable for `len` bytes; `received`
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_recv(
    socket: *const gdaki_socket,
    buf: *mut c_void,
    len: usize,
    flags: u32,
    received: *mut usize,
) -> gdaki_status {
    call("gdaki_socket_recv", || {
        // SAFETY: the caller's contract.
        let (s, bytes, out) = unsafe {
            (
                guard::borrow(socket, "socket")?,
                guard::slice_mut(buf.cast::<u8>(), len, "buf")?,
                guard::out(received, "received")?,
            )
        };
        let n = if nonblocking(flags)? {
            s.try_recv(bytes)?
        } else {
            s.recv(bytes)?
        };
        out.write(n);
        Ok(())
    })
}

/// Shuts down the sending side: the peer reads the rest, then 0; receiving goes on.
///
/// # Safety
/// `socket` is NULL or a socket handle.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_shutdown(socket: *const gdaki_socket) -> gdaki_status {
    call("gdaki_socket_shutdown", || {
        // SAFETY: the caller's contract.
        unsafe { guard::borrow(socket, "socket") }?.shutdown()?;
        Ok(())
    })
}

/// Resets the connection: both sides' later calls fail with `GDAKI_STATUS_PEER`.
///
/// # Safety
/// `socket` is NULL or a socket handle.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_reset(socket: *const gdaki_socket) -> gdaki_status {
    call("gdaki_socket_reset", || {
        // SAFETY: the caller's contract.
        unsafe { guard::borrow(socket, "socket") }?.reset()?;
        Ok(())
    })
}

/// Waits (bounded) until everything sent so far has reached the peer's memory.
///
/// # Safety
/// `socket` is NULL or a socket handle.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_flush(socket: *const gdaki_socket) -> gdaki_status {
    call("gdaki_socket_flush", || {
        // SAFETY: the caller's contract.
        unsafe { guard::borrow(socket, "socket") }?.flush()?;
        Ok(())
    })
}

/// Destroys a socket (NULL: nothing), after a bounded wait for what it sent to land.
///
/// # Safety
/// `socket` is NULL or a socket handle with no call in flight, not used after.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_destroy(socket: *mut gdaki_socket) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_socket_destroy", || unsafe { guard::destroy(socket, "socket") })
}

/// A socket handed to a GPU (`gdaki_socket_export_gpu`): kernels use it through
/// `gdaki_gpu_socket_handle`, with the `gdaki_socket_*` device functions of `gdaki_device.h`.
pub struct gdaki_gpu_socket(guard::Tagged<GpuSocket>);
handle!(gdaki_gpu_socket(GpuSocket), b"gdakiGSK", "gpu_socket");

/// Hands `*socket` to `gpu`'s kernels: its queue pair is exported there and its handle (with
/// the stream state so far) copied into GPU memory. On success `*socket` becomes NULL (the
/// socket lives on in `*gpu_socket`; destroy that) and host calls on it are over. Rings that
/// `gpu` does not reach (host memory, another GPU's) are refused with
/// `GDAKI_STATUS_UNSUPPORTED` and the socket stays as it was; should the export itself fail
/// (GPU memory, mapping), the socket is destroyed and `*socket` is NULL as well.
///
/// # Safety
/// `socket` is NULL or points to NULL or to a socket handle with no call in flight; `gpu` is
/// NULL or a GPU handle; `gpu_socket` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_export_gpu(
    socket: *mut *mut gdaki_socket,
    gpu: *const gdaki_gpu,
    gpu_socket: *mut *mut gdaki_gpu_socket,
) -> gdaki_status {
    call("gdaki_socket_export_gpu", || {
        // SAFETY: the caller's contract.
        let (slot, g, out) = unsafe {
            (
                guard::inout(socket, "socket")?,
                guard::borrow(gpu, "gpu")?,
                guard::out(gpu_socket, "gpu_socket")?,
            )
        };
        // SAFETY: `*slot` is NULL or a socket handle (the contract); refusals change nothing.
        unsafe { guard::borrow(slot.cast_const(), "*socket") }?.reached_by(g)?;
        // SAFETY: as above, and no call is in flight on it (the contract).
        let s = unsafe { guard::take(*slot, "*socket") }?;
        *slot = std::ptr::null_mut();
        out.write(guard::into_handle(s.into_gpu(g)?));
        Ok(())
    })
}

/// The exported socket's device handle: a GPU address, the `gdaki_dev_socket *` kernels pass
/// to the `gdaki_socket_*` device functions. Valid while the GPU socket lives.
///
/// # Safety
/// `gpu_socket` is NULL or a GPU-socket handle; `handle` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_gpu_socket_handle(
    gpu_socket: *const gdaki_gpu_socket,
    handle: *mut *mut DevSocket,
) -> gdaki_status {
    call("gdaki_gpu_socket_handle", || {
        // SAFETY: the caller's contract.
        let (g, out) = unsafe { (guard::borrow(gpu_socket, "gpu_socket")?, guard::out(handle, "handle")?) };
        out.write(g.device_handle() as *mut DevSocket);
        Ok(())
    })
}

/// Destroys a GPU socket (NULL: nothing): its export and the socket. No kernel may use its
/// handle any more; a kernel that closed it (`gdaki_socket_close_*`) left nothing in flight.
///
/// # Safety
/// `gpu_socket` is NULL or a GPU-socket handle with no call in flight and no kernel using it.
#[no_mangle]
pub unsafe extern "C" fn gdaki_gpu_socket_destroy(gpu_socket: *mut gdaki_gpu_socket) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_gpu_socket_destroy", || unsafe {
        guard::destroy(gpu_socket, "gpu_socket")
    })
}

/// Destroys a listener (NULL: nothing); sockets it accepted live on.
///
/// # Safety
/// `listener` is NULL or a listener handle with no call in flight, not used after.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_listener_destroy(listener: *mut gdaki_socket_listener) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_socket_listener_destroy", || unsafe {
        guard::destroy(listener, "listener")
    })
}

/// Serves kernels' connection set-up (`gdaki_socket_connect_*`, `_listen_*`, `_accept_*`,
/// `_unlisten_*`, `_release_*` of `gdaki_device.h`): a host thread and the sockets it made.
pub struct gdaki_socket_service(guard::Tagged<SocketService>);
handle!(gdaki_socket_service(SocketService), b"gdakiSSV", "socket_service");

/// Starts a socket service on `ctx`'s device into `*service`: its listeners bind `bind` (an IP
/// address, "0.0.0.0" for every interface; the port comes with each listen), its sockets are
/// made with `config` (NULL: the defaults). The callers are the kernels of `config->gpu` for
/// `GDAKI_SOCKET_MEMORY_PINNED` and `_DEVICE` (their sockets are exported to it), or CPU
/// threads in CPU mode for `GDAKI_SOCKET_MEMORY_HOST`.
///
/// # Safety
/// `ctx` is NULL or a context handle; `bind` NULL or a NUL-terminated string; `config` NULL
/// or a readable config; `service` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_service_start(
    ctx: *const gdaki_context,
    bind: *const c_char,
    config: *const gdaki_socket_config,
    service: *mut *mut gdaki_socket_service,
) -> gdaki_status {
    call("gdaki_socket_service_start", || {
        // SAFETY: the caller's contract.
        let (c, bind, cfg, out) = unsafe {
            (
                guard::borrow(ctx, "ctx")?,
                guard::text(bind, "bind")?,
                self::config(config)?,
                guard::out(service, "service")?,
            )
        };
        let ip = bind
            .parse()
            .map_err(|e| Failure::invalid(format!("bind {bind:?} is not an IP address: {e}")))?;
        out.write(guard::into_handle(SocketService::start(c, ip, cfg)?));
        Ok(())
    })
}

/// The service's device handle: the `gdaki_dev_socket_service *` kernels pass to the
/// `gdaki_socket_connect_*` ... functions (a GPU address; a host address in CPU mode). Valid
/// while the service lives.
///
/// # Safety
/// `service` is NULL or a service handle; `handle` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_service_handle(
    service: *const gdaki_socket_service,
    handle: *mut *const DevSocketService,
) -> gdaki_status {
    call("gdaki_socket_service_handle", || {
        // SAFETY: the caller's contract.
        let (s, out) = unsafe { (guard::borrow(service, "service")?, guard::out(handle, "handle")?) };
        out.write(s.device_handle() as *const DevSocketService);
        Ok(())
    })
}

/// Frees the GPU sockets kernels released since the last call (`*freed`, unless NULL, gets
/// how many). Freeing GPU memory waits for every kernel of the process, so the service never
/// does it while it serves a call: call this when no kernel runs (or leave it to the destroy).
/// CPU-mode sockets are freed at their release.
///
/// # Safety
/// `service` is NULL or a service handle; `freed` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_service_reap(
    service: *const gdaki_socket_service,
    freed: *mut u32,
) -> gdaki_status {
    call("gdaki_socket_service_reap", || {
        // SAFETY: the caller's contract.
        let s = unsafe { guard::borrow(service, "service") }?;
        let n = s.reap();
        if !freed.is_null() {
            // SAFETY: writable (the contract).
            unsafe { freed.write(n.min(u32::MAX as usize) as u32) };
        }
        Ok(())
    })
}

/// Stops a service (NULL: nothing): waits for calls in progress (at most the socket timeout)
/// and frees every socket and listener it made. No kernel may use them any more.
///
/// # Safety
/// `service` is NULL or a service handle with no call in flight and no kernel using it or its
/// sockets.
#[no_mangle]
pub unsafe extern "C" fn gdaki_socket_service_destroy(service: *mut gdaki_socket_service) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_socket_service_destroy", || unsafe {
        guard::destroy(service, "service")
    })
}
