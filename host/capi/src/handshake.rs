//! The handshake for two processes: a TCP channel that carries each side's endpoints, regions
//! and an application blob, a barrier, and a refusal with a reason.
use std::ffi::c_char;
use std::net::TcpListener;
use std::sync::Mutex;
use std::time::Duration;

use gdaki::handshake::{Channel, Hello};

use crate::context::parse_addr;
use crate::guard::{self, call, gdaki_status, handle, Failure, Outcome};
use crate::queue::gdaki_endpoint;
use gdaki_layout::handle::DevRemote;

/// A channel and a received hello the caller has not taken yet (its buffers were too small).
pub(crate) struct ChannelState {
    channel: Channel,
    pending: Option<Hello>,
}

/// One side of a handshake connection.
pub struct gdaki_channel(guard::Tagged<Mutex<ChannelState>>);
handle!(gdaki_channel(Mutex<ChannelState>), b"gdakiCHN", "channel");

/// What one side offers: to send, set the pointers and `*_len`; to receive, set the pointers
/// and `*_cap` (element counts), and the call writes `*_len`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct gdaki_hello {
    /// Application bytes both sides agree on (parameters that must match), at most
    /// `GDAKI_HELLO_MAX_APP` bytes.
    pub app: *mut u8,
    /// Bytes in `app`.
    pub app_len: usize,
    /// Room in `app` (receive).
    pub app_cap: usize,
    /// Endpoints of queue pairs to connect to, at most `GDAKI_HELLO_MAX_ITEMS`.
    pub endpoints: *mut gdaki_endpoint,
    /// Endpoints in `endpoints`.
    pub endpoints_len: usize,
    /// Room in `endpoints` (receive).
    pub endpoints_cap: usize,
    /// Regions the peer may access, at most `GDAKI_HELLO_MAX_ITEMS`.
    pub regions: *mut DevRemote,
    /// Regions in `regions`.
    pub regions_len: usize,
    /// Room in `regions` (receive).
    pub regions_cap: usize,
}

/// Most application bytes in a hello.
pub const GDAKI_HELLO_MAX_APP: usize = 4096;
/// Most endpoints (and, separately, regions) in a hello.
pub const GDAKI_HELLO_MAX_ITEMS: usize = 1024;
const _: () =
    assert!(GDAKI_HELLO_MAX_APP == gdaki::wire::MAX_APP_BYTES && GDAKI_HELLO_MAX_ITEMS == gdaki::wire::MAX_HELLO_ITEMS);

fn timeout(ms: u32) -> Result<Duration, Failure> {
    if ms == 0 {
        return Err(Failure::invalid("timeout_ms is 0"));
    }
    Ok(Duration::from_millis(ms as u64))
}

/// Gives `channel` to C in `*out`.
///
/// # Safety
/// `out` is NULL or writable.
unsafe fn new_channel(out: *mut *mut gdaki_channel, make: impl FnOnce() -> Result<Channel, Failure>) -> Outcome {
    // SAFETY: the caller's contract.
    let out = unsafe { guard::out(out, "channel") }?;
    let channel = make()?;
    out.write(guard::into_handle(Mutex::new(ChannelState { channel, pending: None })));
    Ok(())
}

/// Connects to a server at `addr` ("ip:port") into `*channel` (the client side). A refused
/// connection is `GDAKI_STATUS_PEER` at once; connecting and every later read wait at most
/// `timeout_ms`.
///
/// # Safety
/// `addr` is NULL or a NUL-terminated string; `channel` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_channel_connect(
    addr: *const c_char,
    timeout_ms: u32,
    channel: *mut *mut gdaki_channel,
) -> gdaki_status {
    call("gdaki_channel_connect", || {
        // SAFETY: the caller's contract.
        let addr = parse_addr(unsafe { guard::text(addr, "addr") }?, "addr")?;
        let t = timeout(timeout_ms)?;
        // SAFETY: the caller's contract.
        unsafe { new_channel(channel, || Ok(Channel::connect(addr, t)?)) }
    })
}

/// Listens on `bind` ("ip:port"), accepts one client within `timeout_ms` into `*channel` (the
/// server side), and closes the listener; every later read waits at most `timeout_ms`. No
/// client in time is `GDAKI_STATUS_TIMEOUT`.
///
/// # Safety
/// `bind` is NULL or a NUL-terminated string; `channel` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_channel_accept(
    bind: *const c_char,
    timeout_ms: u32,
    channel: *mut *mut gdaki_channel,
) -> gdaki_status {
    call("gdaki_channel_accept", || {
        // SAFETY: the caller's contract.
        let bind = parse_addr(unsafe { guard::text(bind, "bind") }?, "bind")?;
        let t = timeout(timeout_ms)?;
        let listener =
            TcpListener::bind(bind).map_err(|e| Failure::new(gdaki_status::Io, format!("listening on {bind}: {e}")))?;
        // SAFETY: the caller's contract.
        unsafe { new_channel(channel, || Ok(Channel::accept_within(&listener, t, t)?)) }
    })
}

/// This side's address of the connection (the interface that reaches the peer: a good `bind`
/// for `gdaki_context_listen`, with port 0), written as `gdaki_context_device_name` does.
///
/// # Safety
/// `channel` is NULL or a channel handle; `buf` is NULL or valid for `cap` bytes; `len` is
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_channel_local_addr(
    channel: *const gdaki_channel,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> gdaki_status {
    call("gdaki_channel_local_addr", || {
        // SAFETY: the caller's contract.
        let ch = unsafe { guard::borrow(channel, "channel") }?;
        let addr = guard::lock(ch).channel.local_addr();
        // SAFETY: the caller's contract.
        unsafe { guard::write_text(&addr.to_string(), buf, cap, len) }
    })
}

/// Sends what this side offers (`*_len` elements of each array; `*_cap` is not read).
///
/// # Safety
/// `channel` is NULL or a channel handle; `hello` is NULL or a `gdaki_hello` whose arrays are
/// readable for their `*_len` elements.
#[no_mangle]
pub unsafe extern "C" fn gdaki_channel_send(channel: *const gdaki_channel, hello: *const gdaki_hello) -> gdaki_status {
    call("gdaki_channel_send", || {
        // SAFETY: the caller's contract.
        let (ch, h) = unsafe { (guard::borrow(channel, "channel")?, guard::input(hello, "hello")?) };
        // SAFETY: the caller's contract.
        let (app, endpoints, regions) = unsafe {
            (
                guard::slice(h.app.cast_const(), h.app_len, "hello.app")?,
                guard::slice(h.endpoints.cast_const(), h.endpoints_len, "hello.endpoints")?,
                guard::slice(h.regions.cast_const(), h.regions_len, "hello.regions")?,
            )
        };
        let hello = Hello {
            app: app.to_vec(),
            endpoints: endpoints
                .iter()
                .enumerate()
                .map(|(i, e)| e.decode(&format!("hello.endpoints[{i}]")))
                .collect::<Result<_, _>>()?,
            regions: regions.iter().map(|r| (*r).into()).collect(),
        };
        let mut state = guard::lock(ch);
        state.channel.send(&hello).map_err(|e| match e {
            // Values this side gave that cannot be sent are the caller's to fix.
            gdaki::Error::Protocol { source, .. } => Failure::invalid(format!("hello: {source}")),
            other => other.into(),
        })
    })
}

/// Receives what the peer offers, validated, into the arrays of `*hello` (up to their `*_cap`)
/// and sets its `*_len`. When an array is too small this is `GDAKI_STATUS_BUFFER_TOO_SMALL`
/// with every `*_len` set to what is needed, and the hello is kept for the next call. A peer's
/// refusal is `GDAKI_STATUS_PEER` with its reason in `gdaki_last_error()`.
///
/// # Safety
/// `channel` is NULL or a channel handle; `hello` is NULL or a writable `gdaki_hello` whose
/// arrays are writable for their `*_cap` elements.
#[no_mangle]
pub unsafe extern "C" fn gdaki_channel_receive(channel: *const gdaki_channel, hello: *mut gdaki_hello) -> gdaki_status {
    call("gdaki_channel_receive", || {
        // SAFETY: the caller's contract.
        let (ch, h) = unsafe { (guard::borrow(channel, "channel")?, guard::inout(hello, "hello")?) };
        let mut state = guard::lock(ch);
        let got = match state.pending.take() {
            Some(p) => p,
            None => state.channel.receive()?,
        };
        let fits =
            got.app.len() <= h.app_cap && got.endpoints.len() <= h.endpoints_cap && got.regions.len() <= h.regions_cap;
        h.app_len = got.app.len();
        h.endpoints_len = got.endpoints.len();
        h.regions_len = got.regions.len();
        if !fits {
            let need = format!(
                "the peer's hello has {} app bytes, {} endpoints and {} regions; room for {}, {} and {}",
                got.app.len(),
                got.endpoints.len(),
                got.regions.len(),
                h.app_cap,
                h.endpoints_cap,
                h.regions_cap
            );
            state.pending = Some(got);
            return Err(Failure::new(gdaki_status::BufferTooSmall, need));
        }
        // SAFETY: the caller's contract (each array has room for its capacity, which the
        // lengths do not exceed).
        let (app, endpoints, regions) = unsafe {
            (
                guard::slice_mut(h.app, got.app.len(), "hello.app")?,
                guard::slice_mut(h.endpoints, got.endpoints.len(), "hello.endpoints")?,
                guard::slice_mut(h.regions, got.regions.len(), "hello.regions")?,
            )
        };
        app.copy_from_slice(&got.app);
        for (dst, e) in endpoints.iter_mut().zip(&got.endpoints) {
            *dst = gdaki_endpoint::of(e)?;
        }
        for (dst, r) in regions.iter_mut().zip(&got.regions) {
            *dst = (*r).into();
        }
        Ok(())
    })
}

/// A barrier: sends `step`, waits for the peer's, and checks both are at the same step.
///
/// # Safety
/// `channel` is NULL or a channel handle.
#[no_mangle]
pub unsafe extern "C" fn gdaki_channel_sync(channel: *const gdaki_channel, step: u64) -> gdaki_status {
    call("gdaki_channel_sync", || {
        // SAFETY: the caller's contract.
        let ch = unsafe { guard::borrow(channel, "channel") }?;
        Ok(guard::lock(ch).channel.sync(step)?)
    })
}

/// Refuses the peer with `reason` (cut at 1024 bytes); the peer's next receive or sync fails
/// with it.
///
/// # Safety
/// `channel` is NULL or a channel handle; `reason` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gdaki_channel_reject(channel: *const gdaki_channel, reason: *const c_char) -> gdaki_status {
    call("gdaki_channel_reject", || {
        // SAFETY: the caller's contract.
        let (ch, reason) = unsafe { (guard::borrow(channel, "channel")?, guard::text(reason, "reason")?) };
        Ok(guard::lock(ch).channel.reject(reason)?)
    })
}

/// Closes the channel and destroys it (NULL: nothing).
///
/// # Safety
/// `channel` is NULL or a channel handle with no call on it in flight, not used after.
#[no_mangle]
pub unsafe extern "C" fn gdaki_channel_destroy(channel: *mut gdaki_channel) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_channel_destroy", || unsafe {
        guard::destroy(channel, "channel")
    })
}
