//! Sockets through the C ABI (`docs/sockets.md`): `gdaki_socket_<operation>_<scope>_<mode>
//! (gdaki_dev_socket *socket, [block scope: gdaki_block_scratch *block_scratch,] params...)`,
//! the thread, warp and block forms of [`crate::socket::Socket`]'s calls, declared in
//! `gdaki_device.h` beside the queue pair's. The mode is the socket's queue pair's sharing mode.
//!
//! Results as the Rust calls': `GDAKI_OK` with the bytes moved written to the out-pointer (0
//! from a receive at the end of the stream), or `GDAKI_CODE_WOULD_BLOCK` (the `try_` forms),
//! `_RESET`, `_CLOSED` (a send after shutdown; a `recv_exact` the stream ended first),
//! `_TIMEOUT`, `_BAD_HANDLE` (null, or not a socket of this layout), `_BAD_ARGUMENT` (a null
//! buffer with a length), or the code of the queue pair's failed post or completion. In warp
//! and block scope every member calls with the same socket, buffer and length, and all get the
//! same result.
use super::*;
use crate::socket::{Service, Socket, SocketError};
use gdaki_layout::socket::{DevSocket, DevSocketService, ADDR_TEXT_BYTES};

/// What the bodies get: the socket and the calling member's scope.
pub(crate) struct Scoped<M: Sharing, S: Scope> {
    sock: Socket<M>,
    scope: S,
}

/// Checks the socket handle, then runs `f` with it in the caller's scope.
///
/// # Safety
/// `socket` is null or points to readable memory of a `DevSocket`'s size; if its version word
/// matches, it is a socket handle as [`Socket::from_raw`] requires, used in mode `M` by scope
/// `S`.
#[inline(always)]
unsafe fn enter_socket<M: Sharing, S: Scope>(
    socket: *mut DevSocket,
    scope: Result<S, u32>,
    f: impl FnOnce(Scoped<M, S>) -> u32,
) -> u32 {
    if socket.is_null() {
        return CODE_BAD_HANDLE;
    }
    let scope = match scope {
        Ok(scope) => scope,
        Err(code) => return code,
    };
    // SAFETY: readable, and a socket of this layout if its version matches (the contract);
    // `from_raw` checks the version before anything else is used.
    match unsafe { Socket::<M>::from_raw(socket) } {
        Ok(sock) => f(Scoped { sock, scope }),
        Err(e) => e.code(),
    }
}

/// The bytes a send reads: empty for 0 bytes, `None` for a null pointer with a length.
///
/// # Safety
/// `data` is null or valid for reads of `len` bytes.
#[inline(always)]
unsafe fn buffer<'a>(data: *const u8, len: u64) -> Option<&'a [u8]> {
    match (data.is_null(), len) {
        (_, 0) => Some(&[]),
        (true, _) => None,
        // SAFETY: valid for `len` bytes (the contract).
        (false, n) => Some(unsafe { core::slice::from_raw_parts(data, n as usize) }),
    }
}

/// The buffer a receive fills, as [`buffer`].
///
/// # Safety
/// `buf` is null or valid for writes of `len` bytes.
#[inline(always)]
unsafe fn buffer_mut<'a>(buf: *mut u8, len: u64) -> Option<&'a mut [u8]> {
    match (buf.is_null(), len) {
        (_, 0) => Some(&mut []),
        (true, _) => None,
        // SAFETY: valid for `len` bytes (the contract). A group's members name the same bytes:
        // each writes only its own part of them (the socket's group copies).
        (false, n) => Some(unsafe { core::slice::from_raw_parts_mut(buf, n as usize) }),
    }
}

/// The code of a call that moved bytes, their count written to `out`.
///
/// # Safety
/// `out` is null or writable.
#[inline(always)]
unsafe fn moved(r: Result<usize, SocketError>, out: *mut u64) -> u32 {
    match r {
        Ok(n) => {
            // SAFETY: per the contract.
            unsafe { give(out, n as u64) };
            CODE_OK
        }
        Err(e) => e.code(),
    }
}

/// The code of a peek, its view's address and length written to `addr` and `len`.
///
/// # Safety
/// `addr` and `len` are null or writable.
#[inline(always)]
unsafe fn view(r: Result<crate::socket::Landed, SocketError>, addr: *mut u64, len: *mut u64) -> u32 {
    match r {
        Ok(v) => {
            // SAFETY: per the contract.
            unsafe {
                give(addr, v.addr());
                give(len, v.len());
            }
            CODE_OK
        }
        Err(e) => e.code(),
    }
}

/// The code of a call that moves nothing.
#[inline(always)]
fn done(r: Result<(), SocketError>) -> u32 {
    r.map_or_else(|e| e.code(), |()| CODE_OK)
}

c_abi! {
    handle socket: *mut DevSocket, enter_socket, Scoped;

    /// Sends up to `len` bytes of `data` (POSIX `send`), waiting (bounded) for room in the
    /// peer's ring: `*sent` (unless null) gets how many, fewer when the ring had less room.
    /// `data` may be reused at once (the bytes are copied into the socket's staging ring).
    fn socket_send(s, data: *const u8, len: u64, sent: *mut u64) {
        // SAFETY (every body): buffers and out-pointers as the header documents them.
        let Some(data) = (unsafe { buffer(data, len) }) else { return CODE_BAD_ARGUMENT };
        unsafe { moved(s.sock.send_with(s.scope, data), sent) }
    }

    /// `socket_send` that never waits: `GDAKI_CODE_WOULD_BLOCK` when the peer's ring is full.
    fn socket_try_send(s, data: *const u8, len: u64, sent: *mut u64) {
        let Some(data) = (unsafe { buffer(data, len) }) else { return CODE_BAD_ARGUMENT };
        unsafe { moved(s.sock.try_send_with(s.scope, data), sent) }
    }

    /// Sends all `len` bytes of `data`, as many sends as it takes.
    fn socket_send_all(s, data: *const u8, len: u64) {
        let Some(data) = (unsafe { buffer(data, len) }) else { return CODE_BAD_ARGUMENT };
        done(s.sock.send_all_with(s.scope, data))
    }

    /// Sends up to `len` bytes of registered memory at `addr` (local key `lkey`) without
    /// copying them into the staging ring, waiting (bounded) for room: `*sent` (unless null)
    /// gets how many. The HCA reads them after the call returns, so they must stay unchanged
    /// until `socket_flush` returns; a key the HCA refuses fails the queue pair (later calls
    /// return its code). In a block the leader posts after a barrier.
    fn socket_send_from(s, addr: u64, lkey: u32, len: u64, sent: *mut u64) {
        unsafe { moved(s.sock.send_from_with(s.scope, Local { addr, lkey }, len), sent) }
    }

    /// `socket_send_from` that never waits: `GDAKI_CODE_WOULD_BLOCK` when the peer's ring is
    /// full.
    fn socket_try_send_from(s, addr: u64, lkey: u32, len: u64, sent: *mut u64) {
        unsafe { moved(s.sock.try_send_from_with(s.scope, Local { addr, lkey }, len), sent) }
    }

    /// Sends all `len` bytes at `addr` as `socket_send_from` does, as many sends as it takes.
    fn socket_send_all_from(s, addr: u64, lkey: u32, len: u64) {
        done(s.sock.send_all_from_with(s.scope, Local { addr, lkey }, len))
    }

    /// Receives up to `len` bytes into `buf` (POSIX `recv`), waiting (bounded) for some:
    /// `*received` (unless null) gets how many, 0 once the peer shut down and every byte it
    /// sent has been read.
    fn socket_recv(s, buf: *mut u8, len: u64, received: *mut u64) {
        let Some(buf) = (unsafe { buffer_mut(buf, len) }) else { return CODE_BAD_ARGUMENT };
        unsafe { moved(s.sock.recv_with(s.scope, buf), received) }
    }

    /// `socket_recv` that never waits: `GDAKI_CODE_WOULD_BLOCK` when nothing has arrived and
    /// the stream has not ended.
    fn socket_try_recv(s, buf: *mut u8, len: u64, received: *mut u64) {
        let Some(buf) = (unsafe { buffer_mut(buf, len) }) else { return CODE_BAD_ARGUMENT };
        unsafe { moved(s.sock.try_recv_with(s.scope, buf), received) }
    }

    /// Receives exactly `len` bytes into `buf`, as many receives as it takes;
    /// `GDAKI_CODE_CLOSED` if the stream ends first.
    fn socket_recv_exact(s, buf: *mut u8, len: u64) {
        let Some(buf) = (unsafe { buffer_mut(buf, len) }) else { return CODE_BAD_ARGUMENT };
        done(s.sock.recv_exact_with(s.scope, buf))
    }

    /// Waits (bounded) until stream bytes have landed and says where they lie in the socket's
    /// receive ring, without copying them out: `*addr` and `*len` (unless null) get the
    /// address and count of up to `max` of them (one frame's at most); `*len` is 0 once the
    /// peer shut down and every byte it sent has been consumed. Read them there, then
    /// `socket_consume` what was read; until then a peek sees the same bytes. In warp and block
    /// scope every member gets the same view and reads it after the call returns.
    fn socket_peek(s, max: u64, addr: *mut u64, len: *mut u64) {
        unsafe { view(s.sock.peek_with(s.scope, max), addr, len) }
    }

    /// `socket_peek` that never waits: `GDAKI_CODE_WOULD_BLOCK` when nothing has arrived and
    /// the stream has not ended.
    fn socket_try_peek(s, max: u64, addr: *mut u64, len: *mut u64) {
        unsafe { view(s.sock.try_peek_with(s.scope, max), addr, len) }
    }

    /// Consumes the stream's next `n` bytes, those a `socket_peek` showed: a later receive or
    /// peek starts after them, and their ring space goes back to the peer (the peer writes
    /// there again only after this). `GDAKI_CODE_BAD_ARGUMENT`, consuming nothing, where fewer
    /// than `n` have landed in the frame a peek shows. In warp and block scope every member
    /// calls once its reads of the bytes are done.
    fn socket_consume(s, n: u64) {
        done(s.sock.consume_next_with(s.scope, n))
    }

    /// Shuts down the sending side: the peer reads what was sent, then gets 0; later sends
    /// fail with `GDAKI_CODE_CLOSED`. A second call does nothing.
    fn socket_shutdown(s) {
        done(s.sock.shutdown_with(s.scope))
    }

    /// Resets the connection: both sides' later calls fail with `GDAKI_CODE_RESET`.
    fn socket_reset(s) {
        done(s.sock.reset_with(s.scope))
    }

    /// Waits (bounded) until everything this side posted has reached the peer's memory.
    fn socket_flush(s) {
        done(s.sock.flush_with(s.scope))
    }

    /// An orderly close in both directions (GPUnet's `gclose`): shuts down, waits for the
    /// peer's end of stream (dropping what it still sends), flushes. Afterwards neither side
    /// posts to the other, so both may destroy their sockets.
    fn socket_close(s) {
        done(s.sock.close_with(s.scope))
    }
}

/// The socket service's calls (`gdaki_socket_<operation>_<scope>(gdaki_dev_socket_service
/// *service, [block scope: gdaki_block_scratch *block_scratch,] params...)`): connection set-up
/// from kernels ([`crate::socket::Service`]). They post to no queue pair, so they have no mode.
/// In warp and block scope every member calls with the same arguments and gets the same result
/// (the leader makes the call).
macro_rules! service_abi {
    (
        $(
            $(#[doc = $doc:literal])*
            fn $op:ident($svc:ident, $scope:ident $(, $arg:ident: $ty:ty)* $(,)?) $body:block
        )*
    ) => {
        /// The service calls' bodies, generic over scope; each returns a status code.
        mod service_ops {
            use super::*;
            $(
                $(#[doc = $doc])*
                ///
                /// # Safety
                /// Every pointer argument is null or valid for what the call reads or writes.
                #[inline(always)]
                pub(super) unsafe fn $op<S: Scope>($svc: Service, $scope: S $(, $arg: $ty)*) -> u32 $body
            )*
        }

        /// The socket service's calls, as the header declares them.
        #[cfg(not(target_arch = "nvptx64"))]
        pub const SERVICE_OPERATIONS: &[Operation] = &[$(Operation {
            name: stringify!($op),
            doc: concat!($($doc, "\n"),*),
            params: &[$(Param { name: stringify!($arg), c_type: <$ty as CType>::C }),*],
        }),*];

        service_abi!(@scope service_thread, "thread", Thread; $($op($($arg: $ty),*))*);
        #[cfg(target_arch = "nvptx64")]
        service_abi!(@scope service_warp, "warp", Warp; $($op($($arg: $ty),*))*);
        /// The socket service's calls in block scope (`gdaki_socket_<operation>_block`).
        #[cfg(target_arch = "nvptx64")]
        pub mod service_block {
            use super::*;
            $(
                #[doc = concat!("`gdaki_", stringify!($op), "_block`, as `gdaki_device.h` documents it.")]
                ///
                /// # Safety
                /// `service` is null or a service handle; `block_scratch` is null or a block
                /// scratch area every thread of the block passes and no one else uses
                /// meanwhile; other pointers are null where allowed or valid as the header says.
                #[export_name = concat!("gdaki_", stringify!($op), "_block")]
                // Always inlined by clang builds that link the bitcode (module docs).
                #[allow(unused_attributes)]
                #[inline(always)]
                pub unsafe extern "C" fn $op(
                    service: *const DevSocketService,
                    block_scratch: *mut BlockScratch
                    $(, $arg: $ty)*
                ) -> u32 {
                    if block_scratch.is_null() {
                        return CODE_BAD_ARGUMENT;
                    }
                    // SAFETY: per the contract.
                    let scope = unsafe { Block::new(block_scratch) };
                    // SAFETY: per the contract.
                    unsafe { enter_service(service, Ok(scope), |svc, s| service_ops::$op(svc, s $(, $arg)*)) }
                }
            )*
        }
    };
    (@scope $module:ident, $suffix:literal, $scope:ty; $($op:ident($($arg:ident: $ty:ty),*))*) => {
        #[doc = concat!("The socket service's calls in ", $suffix, " scope (`gdaki_socket_<operation>_", $suffix, "`).")]
        pub mod $module {
            use super::*;
            $(
                #[doc = concat!("`gdaki_", stringify!($op), "_", $suffix, "`, as `gdaki_device.h` documents it.")]
                ///
                /// # Safety
                /// `service` is null or a service handle; other pointers are null where
                /// allowed or valid as the header says.
                #[export_name = concat!("gdaki_", stringify!($op), "_", $suffix)]
                // Always inlined by clang builds that link the bitcode (module docs).
                #[allow(unused_attributes)]
                #[inline(always)]
                pub unsafe extern "C" fn $op(service: *const DevSocketService $(, $arg: $ty)*) -> u32 {
                    // SAFETY: per the contract.
                    unsafe {
                        enter_service(service, <$scope as Here>::here(), |svc, s| service_ops::$op(svc, s $(, $arg)*))
                    }
                }
            )*
        }
    };
}

/// Checks the service handle, then runs `f` with it in the caller's scope.
///
/// # Safety
/// `service` is null or a service handle as [`Service::from_raw`] requires.
#[inline(always)]
unsafe fn enter_service<S: Scope>(
    service: *const DevSocketService,
    scope: Result<S, u32>,
    f: impl FnOnce(Service, S) -> u32,
) -> u32 {
    let scope = match scope {
        Ok(scope) => scope,
        Err(code) => return code,
    };
    // SAFETY: per the contract (`from_raw` refuses null and other versions).
    match unsafe { Service::from_raw(service) } {
        Ok(svc) => f(svc, scope),
        Err(e) => e.code(),
    }
}

/// A NUL-terminated address of at most [`ADDR_TEXT_BYTES`] bytes, or `None`.
///
/// # Safety
/// `addr` is null or a NUL-terminated string (read up to its NUL, or `ADDR_TEXT_BYTES + 1` bytes).
#[inline(always)]
unsafe fn address<'a>(addr: *const core::ffi::c_char) -> Option<&'a [u8]> {
    if addr.is_null() {
        return None;
    }
    let p = addr as *const u8;
    let mut len = 0;
    // SAFETY: bytes up to the NUL, at most one past the longest address (the contract).
    while len <= ADDR_TEXT_BYTES && unsafe { p.add(len).read() } != 0 {
        len += 1;
    }
    // SAFETY: `len` bytes before the NUL were read above.
    (len <= ADDR_TEXT_BYTES).then(|| unsafe { core::slice::from_raw_parts(p, len) })
}

/// The code of a call that made a socket, its handle written to `out`.
///
/// # Safety
/// `out` is null or writable.
#[inline(always)]
unsafe fn made(r: Result<*mut DevSocket, SocketError>, out: *mut *mut DevSocket) -> u32 {
    match r {
        Ok(s) => {
            // SAFETY: per the contract.
            unsafe { give(out, s) };
            CODE_OK
        }
        Err(e) => e.code(),
    }
}

service_abi! {
    /// Connects to the socket listener at `addr` ("host:port", NUL-terminated, at most 64
    /// bytes; the host resolves it): `*socket` gets the new socket's handle.
    /// `GDAKI_CODE_REFUSED` when nothing listens there or the address does not resolve.
    fn socket_connect(svc, scope, addr: *const core::ffi::c_char, socket: *mut *mut DevSocket) {
        // SAFETY (every body): pointers as the header documents them.
        let Some(addr) = (unsafe { address(addr) }) else { return CODE_BAD_ARGUMENT };
        unsafe { made(svc.connect_with(scope, addr), socket) }
    }

    /// Listens at `port` on the service's interface (0: a free port): `*bound` (unless null)
    /// gets the port. `GDAKI_CODE_REFUSED` when the port is taken.
    fn socket_listen(svc, scope, port: u32, bound: *mut u32) {
        let Ok(port) = u16::try_from(port) else { return CODE_BAD_ARGUMENT };
        match svc.listen_with(scope, port) {
            Ok(p) => {
                // SAFETY: null or writable (the contract).
                unsafe { give(bound, p as u32) };
                CODE_OK
            }
            Err(e) => e.code(),
        }
    }

    /// Waits (up to the service's socket timeout: `GDAKI_CODE_TIMEOUT`) for a connection at
    /// the listener of `port`: `*socket` gets its handle. `GDAKI_CODE_REFUSED` when nothing
    /// listens at that port.
    fn socket_accept(svc, scope, port: u32, socket: *mut *mut DevSocket) {
        let Ok(port) = u16::try_from(port) else { return CODE_BAD_ARGUMENT };
        unsafe { made(svc.accept_with(scope, port), socket) }
    }

    /// Stops listening at `port`.
    fn socket_unlisten(svc, scope, port: u32) {
        let Ok(port) = u16::try_from(port) else { return CODE_BAD_ARGUMENT };
        done(svc.unlisten_with(scope, port))
    }

    /// Hands a socket the service made back to it, to be freed: close it first
    /// (`gdaki_socket_close_*`) and use the handle no more.
    fn socket_release(svc, scope, socket: *mut DevSocket) {
        done(svc.release_with(scope, socket))
    }
}
