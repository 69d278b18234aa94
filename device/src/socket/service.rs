//! Connection set-up called from the device (GPUnet's `gconnect_in`, `gbind` and `gaccept`): a
//! [`Service`] is a mailbox that a host thread serves (`gdaki::socket::SocketService`). A call
//! takes a free slot, writes its request, posts it and waits for the answer, a socket handle
//! ready for [`Socket::from_raw`](super::Socket::from_raw). In warp and block scope every member
//! calls with the same arguments; the leader makes the call and all get its result.
use gdaki_layout::socket::{
    DevSocket, DevSocketService, SocketCall, ADDR_TEXT_BYTES, CALL_ACCEPT, CALL_CONNECT, CALL_LISTEN, CALL_RELEASE,
    CALL_UNLISTEN, DEV_SOCKET_SERVICE_VERSION,
};

use super::{on_leader, SocketError};
use crate::arch;
use crate::qp::Deadline;
use crate::scope::{Scope, Thread};
use crate::sharing::{Gpu, Sharing};
use crate::status::{CODE_BAD_HANDLE, CODE_OK};

/// A socket service's mailbox, as a caller uses it.
#[derive(Clone, Copy)]
pub struct Service {
    calls: *mut SocketCall,
    locks: *mut u32,
    slots: u32,
    timeout_ns: u64,
}

/// One request.
struct Request<'a> {
    op: u32,
    port: u32,
    arg: u64,
    text: &'a [u8],
}

impl Service {
    /// Wraps a service handle the host wrote.
    ///
    /// # Safety
    /// `ptr` points to a `DevSocketService` written by the host for this device (its mailbox
    /// and locks reachable from here), alive, with its service running, for as long as this
    /// value is used.
    pub unsafe fn from_raw(ptr: *const DevSocketService) -> Result<Service, SocketError> {
        if ptr.is_null() {
            return Err(SocketError::BadHandle { version: 0 });
        }
        // SAFETY: a live handle (the caller's contract), read once.
        let h = unsafe { core::ptr::read_volatile(ptr) };
        if h.version != DEV_SOCKET_SERVICE_VERSION || h.slots == 0 {
            return Err(SocketError::BadHandle { version: h.version });
        }
        Ok(Service {
            calls: h.calls as *mut SocketCall,
            locks: h.locks as *mut u32,
            slots: h.slots,
            timeout_ns: h.timeout_ns,
        })
    }

    /// Connects to the socket listener at `addr` ("host:port", at most 64 bytes; the host
    /// resolves it): the new socket's handle.
    pub fn connect(&self, addr: &[u8]) -> Result<*mut DevSocket, SocketError> {
        self.connect_with(Thread, addr)
    }

    /// [`connect`](Self::connect) by a group.
    pub fn connect_with<S: Scope>(&self, scope: S, addr: &[u8]) -> Result<*mut DevSocket, SocketError> {
        let req = Request {
            op: CALL_CONNECT,
            port: 0,
            arg: 0,
            text: addr,
        };
        self.call(scope, req).map(|v| v as *mut DevSocket)
    }

    /// Listens at `port` on the service's interface (0: a free port): the port.
    pub fn listen(&self, port: u16) -> Result<u16, SocketError> {
        self.listen_with(Thread, port)
    }

    /// [`listen`](Self::listen) by a group.
    pub fn listen_with<S: Scope>(&self, scope: S, port: u16) -> Result<u16, SocketError> {
        self.call(scope, Request::port(CALL_LISTEN, port)).map(|v| v as u16)
    }

    /// Waits (up to the service's timeout) for a connection at the listener of `port`: the new
    /// socket's handle.
    pub fn accept(&self, port: u16) -> Result<*mut DevSocket, SocketError> {
        self.accept_with(Thread, port)
    }

    /// [`accept`](Self::accept) by a group.
    pub fn accept_with<S: Scope>(&self, scope: S, port: u16) -> Result<*mut DevSocket, SocketError> {
        self.call(scope, Request::port(CALL_ACCEPT, port))
            .map(|v| v as *mut DevSocket)
    }

    /// Stops listening at `port` (connections already accepted stay).
    pub fn unlisten(&self, port: u16) -> Result<(), SocketError> {
        self.unlisten_with(Thread, port)
    }

    /// [`unlisten`](Self::unlisten) by a group.
    pub fn unlisten_with<S: Scope>(&self, scope: S, port: u16) -> Result<(), SocketError> {
        self.call(scope, Request::port(CALL_UNLISTEN, port)).map(|_| ())
    }

    /// Hands a socket this service made back to it, to be freed: close it first
    /// (`Socket::close_with`), and use the handle no more.
    pub fn release(&self, socket: *mut DevSocket) -> Result<(), SocketError> {
        self.release_with(Thread, socket)
    }

    /// [`release`](Self::release) by a group.
    pub fn release_with<S: Scope>(&self, scope: S, socket: *mut DevSocket) -> Result<(), SocketError> {
        let req = Request {
            op: CALL_RELEASE,
            port: 0,
            arg: socket as u64,
            text: &[],
        };
        self.call(scope, req).map(|_| ())
    }

    fn call<S: Scope>(&self, scope: S, req: Request<'_>) -> Result<u64, SocketError> {
        on_leader(scope, || self.call_now(&req))
    }

    /// Takes a slot, posts `req` there and waits for the answer. A caller that waited its
    /// timeout says it gave up and waits as long again: the service then undoes the call, or
    /// had already answered it (the answer stands). A service that answers nothing in twice the
    /// timeout is gone: the slot stays taken.
    fn call_now(&self, req: &Request<'_>) -> Result<u64, SocketError> {
        let bad = match req.op {
            CALL_CONNECT => req.text.is_empty() || req.text.len() > ADDR_TEXT_BYTES,
            CALL_RELEASE => req.arg == 0,
            _ => req.port > u16::MAX as u32,
        };
        if bad {
            return Err(SocketError::BadArgument);
        }
        let slot = self.take_slot()?;
        // SAFETY: slot < slots, inside the mailbox (the handle's contract); this caller holds
        // the slot's lock, so it alone writes the caller's half.
        let c = unsafe { self.calls.add(slot as usize) };
        // SAFETY: as above; every field written is the caller's.
        let n = unsafe {
            let n = core::ptr::addr_of!((*c).posted).read_volatile() + 1;
            core::ptr::addr_of_mut!((*c).op).write_volatile(req.op);
            core::ptr::addr_of_mut!((*c).port).write_volatile(req.port);
            core::ptr::addr_of_mut!((*c).arg).write_volatile(req.arg);
            let text = core::ptr::addr_of_mut!((*c).text) as *mut u8;
            for i in 0..ADDR_TEXT_BYTES {
                text.add(i).write_volatile(req.text.get(i).copied().unwrap_or(0));
            }
            // The request before the post that announces it.
            arch::to_device_barrier();
            arch::store_sys(core::ptr::addr_of_mut!((*c).posted), n);
            n
        };
        let mut deadline = Deadline::new(self.timeout_ns);
        let mut gave_up = false;
        loop {
            // SAFETY: the service's half of the slot, read-only here.
            let answered = unsafe { arch::load_u64_acquire(core::ptr::addr_of!((*c).answered)) };
            if answered == n {
                // SAFETY: the answer, written before `answered` (an acquire load).
                let (status, value) = unsafe {
                    (
                        arch::load_u32_volatile(core::ptr::addr_of!((*c).status)),
                        arch::load_u64_volatile(core::ptr::addr_of!((*c).value)),
                    )
                };
                // SAFETY: the lock this caller took.
                unsafe { Gpu::unlock(self.locks.add(slot as usize)) };
                return match status {
                    CODE_OK => Ok(value),
                    CODE_BAD_HANDLE => Err(SocketError::BadHandle { version: 0 }),
                    code => Err(SocketError::from_code(code)),
                };
            }
            if deadline.expired() {
                if gave_up {
                    return Err(SocketError::TimedOut);
                }
                // SAFETY: the caller's half of the slot this caller holds.
                unsafe { arch::store_sys(core::ptr::addr_of_mut!((*c).cancelled), n) };
                gave_up = true;
                deadline = Deadline::new(self.timeout_ns);
            }
        }
    }

    /// A free slot (its lock taken), trying every slot from one that spreads callers, until
    /// the timeout.
    fn take_slot(&self) -> Result<u32, SocketError> {
        let first = (arch::global_timer_ns() >> 6) as u32 % self.slots;
        let mut deadline = Deadline::new(self.timeout_ns);
        loop {
            for i in 0..self.slots {
                let k = (first + i) % self.slots;
                // SAFETY: lock `k` < slots of the handle's lock array.
                if unsafe { Gpu::try_lock(self.locks.add(k as usize)) } {
                    return Ok(k);
                }
            }
            if deadline.expired() {
                return Err(SocketError::TimedOut);
            }
        }
    }
}

impl Request<'_> {
    fn port(op: u32, port: u16) -> Request<'static> {
        Request {
            op,
            port: port as u32,
            arg: 0,
            text: &[],
        }
    }
}
