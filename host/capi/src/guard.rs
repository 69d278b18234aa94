//! The boundary every C call crosses: statuses and the thread's last error, the panic guard,
//! typed handles, and checked pointers, strings and buffers.
use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// What every gdaki call returns: `GDAKI_STATUS_OK`, or why it did nothing.
/// `gdaki_last_error()` then says what, with the values involved. Error values start at 1001,
/// apart from the device functions' `GDAKI_CODE_*`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum gdaki_status {
    /// Done.
    Ok = 0,
    /// A pointer the call needs was NULL.
    NullArgument = 1001,
    /// A handle of another type, or one already destroyed.
    BadHandle = 1002,
    /// A value out of range: a size, a length, an offset, an unknown enum value or flag, text
    /// that is not UTF-8, an address that does not parse, objects of two contexts mixed.
    InvalidArgument = 1003,
    /// The object is not in a state that allows the call (a QP transition the state machine
    /// refuses, a CQ that already serves a QP, library access to caller memory).
    InvalidState = 1004,
    /// An output buffer is too small: the length out-parameter says how much is needed, and
    /// nothing was lost (call again with a larger one).
    BufferTooSmall = 1005,
    /// No such device: no mlx5 RDMA device, no NVIDIA driver, no such GPU.
    NoDevice = 1006,
    /// A combination the library or its device cannot serve.
    Unsupported = 1007,
    /// Memory could not be allocated.
    OutOfMemory = 1008,
    /// The device (a NIC's firmware or the soft HCA) refused a command.
    Device = 1009,
    /// A CUDA driver call failed.
    Cuda = 1010,
    /// The peer is unreachable, refused, or sent something that is not a valid frame.
    Peer = 1011,
    /// A wait on a peer ran out of time.
    Timeout = 1012,
    /// A queue pair is in error or a completion queue overran.
    QueueError = 1013,
    /// An operating-system call failed (threads, sockets).
    Io = 1014,
    /// A bug in gdaki (a Rust panic, caught at the boundary). Please report it with the text
    /// of `gdaki_last_error()`.
    Panic = 1015,
    /// Not now: the call would have to wait for work the caller has yet to let run (a stream
    /// queue pair's send queue is full until the stream reaches a wait). Nothing was done; try
    /// again later.
    Again = 1016,
}

impl gdaki_status {
    /// Every status, in order (for `gdaki_status_name` and the tests).
    pub(crate) const ALL: [gdaki_status; 17] = [
        gdaki_status::Ok,
        gdaki_status::NullArgument,
        gdaki_status::BadHandle,
        gdaki_status::InvalidArgument,
        gdaki_status::InvalidState,
        gdaki_status::BufferTooSmall,
        gdaki_status::NoDevice,
        gdaki_status::Unsupported,
        gdaki_status::OutOfMemory,
        gdaki_status::Device,
        gdaki_status::Cuda,
        gdaki_status::Peer,
        gdaki_status::Timeout,
        gdaki_status::QueueError,
        gdaki_status::Io,
        gdaki_status::Panic,
        gdaki_status::Again,
    ];

    /// The C name, NUL-terminated.
    pub(crate) fn name(self) -> &'static CStr {
        match self {
            gdaki_status::Ok => c"GDAKI_STATUS_OK",
            gdaki_status::NullArgument => c"GDAKI_STATUS_NULL_ARGUMENT",
            gdaki_status::BadHandle => c"GDAKI_STATUS_BAD_HANDLE",
            gdaki_status::InvalidArgument => c"GDAKI_STATUS_INVALID_ARGUMENT",
            gdaki_status::InvalidState => c"GDAKI_STATUS_INVALID_STATE",
            gdaki_status::BufferTooSmall => c"GDAKI_STATUS_BUFFER_TOO_SMALL",
            gdaki_status::NoDevice => c"GDAKI_STATUS_NO_DEVICE",
            gdaki_status::Unsupported => c"GDAKI_STATUS_UNSUPPORTED",
            gdaki_status::OutOfMemory => c"GDAKI_STATUS_OUT_OF_MEMORY",
            gdaki_status::Device => c"GDAKI_STATUS_DEVICE",
            gdaki_status::Cuda => c"GDAKI_STATUS_CUDA",
            gdaki_status::Peer => c"GDAKI_STATUS_PEER",
            gdaki_status::Timeout => c"GDAKI_STATUS_TIMEOUT",
            gdaki_status::QueueError => c"GDAKI_STATUS_QUEUE_ERROR",
            gdaki_status::Io => c"GDAKI_STATUS_IO",
            gdaki_status::Panic => c"GDAKI_STATUS_PANIC",
            gdaki_status::Again => c"GDAKI_STATUS_AGAIN",
        }
    }
}

/// Why a call failed: its status and the text `gdaki_last_error` returns.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: gdaki_status,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(status: gdaki_status, message: impl Into<String>) -> Failure {
        Failure {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Failure {
        Failure::new(gdaki_status::InvalidArgument, message)
    }
}

impl From<gdaki::Error> for Failure {
    fn from(e: gdaki::Error) -> Failure {
        use gdaki::cuda::CudaError;
        use gdaki::Error as E;
        let status = match &e {
            E::NoRdmaDevice => gdaki_status::NoDevice,
            E::BadSize { .. } | E::OutOfRange { .. } | E::ForeignObject { .. } => gdaki_status::InvalidArgument,
            E::CqInUse { .. } | E::BadTransition { .. } | E::CallerMemory { .. } => gdaki_status::InvalidState,
            E::Alloc { .. } => gdaki_status::OutOfMemory,
            E::PeerUnreachable { .. } | E::Protocol { .. } | E::Rejected { .. } => gdaki_status::Peer,
            E::Unsupported { .. } => gdaki_status::Unsupported,
            E::CqOverrun { .. } | E::QpError { .. } => gdaki_status::QueueError,
            E::Timeout { .. } => gdaki_status::Timeout,
            E::Device { .. } => gdaki_status::Device,
            E::Cuda(c) => match c {
                CudaError::NoDriver | CudaError::NoDevice | CudaError::NoSuchDevice { .. } => gdaki_status::NoDevice,
                CudaError::BadArgument { .. } | CudaError::OutOfBounds { .. } => gdaki_status::InvalidArgument,
                _ => gdaki_status::Cuda,
            },
            E::Proxy(_) | E::Io { .. } => gdaki_status::Io,
            _ => gdaki_status::Device,
        };
        Failure::new(status, e.to_string())
    }
}

impl From<gdaki::cuda::CudaError> for Failure {
    fn from(e: gdaki::cuda::CudaError) -> Failure {
        gdaki::Error::Cuda(e).into()
    }
}

pub(crate) type Outcome = Result<(), Failure>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `message` as this thread's last error (NUL bytes, which C cannot show, become `?`).
pub(crate) fn set_last_error(message: &str) {
    let text = CString::new(message.replace('\0', "?")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = text);
}

/// The text of this thread's last failed call: valid until this thread's next failing call.
pub(crate) fn last_error() -> *const c_char {
    // The CString's heap buffer does not move while it stays in the slot, and only this thread
    // replaces it.
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Runs one C call: a failure becomes its status and the thread's last error, a panic (a bug)
/// becomes `GDAKI_STATUS_PANIC` instead of unwinding into C (which would abort).
pub(crate) fn call(name: &str, body: impl FnOnce() -> Outcome) -> gdaki_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => gdaki_status::Ok,
        Ok(Err(f)) => {
            tracing::debug!(call = name, status = ?f.status, "{}", f.message);
            set_last_error(&format!("{name}: {}", f.message));
            f.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            tracing::error!(call = name, "internal error: {what}");
            set_last_error(&format!("{name}: internal error in gdaki (please report it): {what}"));
            gdaki_status::Panic
        }
    }
}

/// Locks a mutex, taking it over if a panic (caught at the boundary) left it poisoned: the
/// data it guards is consistent at every unlock point.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ------------------------------------------------------------------------------ handles

/// An object handed to C as an opaque pointer: boxed, with a tag that says which type it is
/// (a handle of another type, or one destroyed, is refused where the memory is still there).
pub(crate) trait Handle: Sized {
    /// What it holds.
    type Inner;
    /// Its tag (distinct per type, never 0).
    const TAG: u64;
    /// Its name in messages.
    const WHAT: &'static str;
    fn wrap(tagged: Tagged<Self::Inner>) -> Self;
    fn tagged(&self) -> &Tagged<Self::Inner>;
    fn unwrap(self) -> Tagged<Self::Inner>;
}

/// The tag and the value of a handle, the tag first (`repr(C)`: Rust's own layout put it
/// after larger values, so a check through a pointer of the wrong kind read past a small
/// handle's allocation).
#[repr(C)]
pub(crate) struct Tagged<T> {
    tag: std::sync::atomic::AtomicU64,
    value: T,
}

impl<T> Tagged<T> {
    /// Where the tag is: a handle is checked by reading it before anything else, through a
    /// pointer of whatever kind the caller passed, so it must be at the start of every handle.
    pub(crate) const TAG_OFFSET: usize = std::mem::offset_of!(Tagged<T>, tag);
}

/// Gives `value` to C as a new handle.
pub(crate) fn into_handle<H: Handle>(value: H::Inner) -> *mut H {
    Box::into_raw(Box::new(H::wrap(Tagged {
        tag: std::sync::atomic::AtomicU64::new(H::TAG),
        value,
    })))
}

/// The value behind handle `p`.
///
/// # Safety
/// `p` is NULL or points to memory this process can read as an `H` (a handle from this
/// library that has not been freed); a handle of another type or one destroyed but not yet
/// reused is detected by its tag.
pub(crate) unsafe fn borrow<'a, H: Handle + 'a>(p: *const H, what: &str) -> Result<&'a H::Inner, Failure> {
    if p.is_null() {
        return Err(Failure::new(gdaki_status::NullArgument, format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(bad_handle::<H>(what));
    }
    // SAFETY: non-null and aligned; by the caller's contract it points to a live handle of
    // some kind, and every handle's first 8 bytes are its tag (asserted where each handle type
    // is declared): only those are read until the tag says the kind is H.
    let tag = unsafe { &*p.cast::<std::sync::atomic::AtomicU64>() };
    if tag.load(std::sync::atomic::Ordering::Acquire) != H::TAG {
        return Err(bad_handle::<H>(what));
    }
    // SAFETY: the tag says it is an H.
    Ok(&unsafe { &*p }.tagged().value)
}

/// Like [`borrow`], but NULL is allowed (`None`).
///
/// # Safety
/// As [`borrow`].
pub(crate) unsafe fn borrow_opt<'a, H: Handle + 'a>(p: *const H, what: &str) -> Result<Option<&'a H::Inner>, Failure> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's contract.
    unsafe { borrow(p, what) }.map(Some)
}

fn bad_handle<H: Handle>(what: &str) -> Failure {
    Failure::new(
        gdaki_status::BadHandle,
        format!("{what} is not a live gdaki_{} handle", H::WHAT),
    )
}

/// Destroys handle `p` (NULL: nothing to do).
///
/// # Safety
/// As [`borrow`], and no other call on the handle is in flight or follows.
pub(crate) unsafe fn destroy<H: Handle>(p: *mut H, what: &str) -> Outcome {
    if p.is_null() {
        return Ok(());
    }
    // SAFETY: the caller's contract.
    unsafe { take(p, what) }.map(drop)
}

/// Ends handle `p` and hands back its value (a call that consumes the object: the handle is
/// dead afterwards, as after [`destroy`]).
///
/// # Safety
/// As [`destroy`].
pub(crate) unsafe fn take<H: Handle>(p: *mut H, what: &str) -> Result<H::Inner, Failure> {
    // SAFETY: the caller's contract; the tag check refuses NULL and other types.
    unsafe { borrow(p.cast_const(), what) }?;
    // SAFETY: a live handle of type H, made by `into_handle` with Box::into_raw; the tag is
    // cleared in place first, so a later use (while the memory is still mapped) is refused.
    unsafe { &*p }
        .tagged()
        .tag
        .store(0, std::sync::atomic::Ordering::Release);
    // SAFETY: as above; the box is ours now.
    Ok(unsafe { Box::from_raw(p) }.unwrap().value)
}

/// Makes `$name`, a tuple struct around `Tagged<$inner>` (declared where it is, so that
/// cbindgen sees it and writes its opaque C declaration), a handle.
macro_rules! handle {
    ($name:ident($inner:ty), $tag:literal, $what:literal) => {
        // Every handle's first 8 bytes are its tag (see `borrow`).
        const _: () = assert!(
            $crate::guard::Tagged::<$inner>::TAG_OFFSET == 0 && std::mem::offset_of!($name, 0) == 0,
            concat!("the tag of ", stringify!($name), " is not its first field")
        );
        impl $crate::guard::Handle for $name {
            type Inner = $inner;
            const TAG: u64 = u64::from_be_bytes(*$tag);
            const WHAT: &'static str = $what;
            fn wrap(tagged: $crate::guard::Tagged<$inner>) -> Self {
                $name(tagged)
            }
            fn tagged(&self) -> &$crate::guard::Tagged<$inner> {
                &self.0
            }
            fn unwrap(self) -> $crate::guard::Tagged<$inner> {
                self.0
            }
        }
    };
}
pub(crate) use handle;

// ------------------------------------------------------------------------------ arguments

/// Refuses a NULL pointer, or one not aligned for `T`: what every pointer argument is checked
/// for before it is used.
pub(crate) fn usable<T>(p: *const T, what: impl std::fmt::Display) -> Outcome {
    if p.is_null() {
        return Err(Failure::new(gdaki_status::NullArgument, format!("{what} is NULL")));
    }
    if !p.is_aligned() {
        return Err(Failure::invalid(format!("{what} is not aligned for its type")));
    }
    Ok(())
}

/// The place an output goes.
///
/// # Safety
/// `p` is NULL or valid for a write of `T`.
pub(crate) unsafe fn out<'a, T>(p: *mut T, what: &str) -> Result<&'a mut std::mem::MaybeUninit<T>, Failure> {
    usable(p, what)?;
    // SAFETY: non-null, aligned and writable by the caller's contract; MaybeUninit never
    // reads what is there.
    Ok(unsafe { &mut *p.cast::<std::mem::MaybeUninit<T>>() })
}

/// An input struct.
///
/// # Safety
/// `p` is NULL or valid for a read of an initialised `T`.
pub(crate) unsafe fn input<'a, T>(p: *const T, what: &str) -> Result<&'a T, Failure> {
    usable(p, what)?;
    // SAFETY: the caller's contract.
    Ok(unsafe { &*p })
}

/// A struct the call reads and writes.
///
/// # Safety
/// `p` is NULL or valid for reads and writes of an initialised `T`.
pub(crate) unsafe fn inout<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, Failure> {
    usable(p, what)?;
    // SAFETY: non-null and aligned; readable and writable by the caller's contract.
    Ok(unsafe { &mut *p })
}

/// A NUL-terminated UTF-8 string.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string.
pub(crate) unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, Failure> {
    if p.is_null() {
        return Err(Failure::new(gdaki_status::NullArgument, format!("{what} is NULL")));
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| Failure::invalid(format!("{what} is not UTF-8")))
}

/// `len` elements at `p` (any pointer when `len` is 0).
///
/// # Safety
/// When `len > 0`, `p` is NULL or valid for reads of `len` initialised elements.
pub(crate) unsafe fn slice<'a, T>(p: *const T, len: usize, what: &str) -> Result<&'a [T], Failure> {
    if len == 0 {
        return Ok(&[]);
    }
    usable(p, format_args!("{what} (with a length of {len})"))?;
    // SAFETY: the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

/// `len` writable elements at `p` (any pointer when `len` is 0).
///
/// # Safety
/// When `len > 0`, `p` is NULL or valid for writes of `len` elements.
pub(crate) unsafe fn slice_mut<'a, T>(p: *mut T, len: usize, what: &str) -> Result<&'a mut [T], Failure> {
    if len == 0 {
        return Ok(&mut []);
    }
    usable(p, format_args!("{what} (with a length of {len})"))?;
    // SAFETY: the caller's contract (the elements are plain data, any bytes are valid to
    // overwrite).
    Ok(unsafe { std::slice::from_raw_parts_mut(p, len) })
}

/// Writes `s` NUL-terminated into `buf` of `cap` bytes and its length (without the NUL) into
/// `len` (which may be NULL). Too small a buffer (NULL with 0 asks for the length) writes
/// nothing into it and is `GDAKI_STATUS_BUFFER_TOO_SMALL`.
///
/// # Safety
/// `buf` is NULL or valid for `cap` bytes; `len` is NULL or valid for a write.
pub(crate) unsafe fn write_text(s: &str, buf: *mut c_char, cap: usize, len: *mut usize) -> Outcome {
    if !len.is_null() {
        // SAFETY: the caller's contract.
        unsafe { out(len, "len") }?.write(s.len());
    }
    if cap < s.len() + 1 {
        return Err(Failure::new(
            gdaki_status::BufferTooSmall,
            format!("{} bytes needed (with the NUL), buffer has {cap}", s.len() + 1),
        ));
    }
    // SAFETY: the caller's contract; `cap` > 0 here.
    let dst = unsafe { slice_mut(buf.cast::<u8>(), cap, "buf") }?;
    dst[..s.len()].copy_from_slice(s.as_bytes());
    dst[s.len()] = 0;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct TestHandle(Tagged<u32>);
    handle!(TestHandle(u32), b"gdakiTST", "test");
    struct OtherHandle(Tagged<u64>);
    handle!(OtherHandle(u64), b"gdakiOTH", "other");

    #[test]
    fn a_panic_becomes_a_status_and_a_message() {
        let s = call("gdaki_test", || panic!("boom {}", 7));
        assert_eq!(s, gdaki_status::Panic);
        // SAFETY: last_error returns this thread's NUL-terminated text.
        let msg = unsafe { CStr::from_ptr(last_error()) }.to_str().unwrap();
        assert!(msg.contains("gdaki_test") && msg.contains("boom 7"), "{msg}");
    }

    #[test]
    fn failures_are_named_and_successes_keep_the_last_error() {
        assert_eq!(
            call("gdaki_a", || Err(Failure::invalid("bad \0 thing"))),
            gdaki_status::InvalidArgument
        );
        assert_eq!(call("gdaki_b", || Ok(())), gdaki_status::Ok);
        // SAFETY: as above.
        let msg = unsafe { CStr::from_ptr(last_error()) }.to_str().unwrap();
        assert_eq!(msg, "gdaki_a: bad ? thing");
    }

    #[test]
    fn handles_are_checked_by_type_and_destroyed_once() {
        let h = into_handle::<TestHandle>(5);
        // SAFETY: a live handle.
        assert_eq!(*unsafe { borrow(h, "h") }.unwrap(), 5);
        // SAFETY: deliberately the wrong type: the memory is a live TestHandle, readable.
        let wrong = unsafe { borrow(h.cast::<OtherHandle>(), "h") };
        assert_eq!(wrong.err().unwrap().status, gdaki_status::BadHandle);
        // SAFETY: NULL is allowed.
        assert_eq!(
            unsafe { borrow::<TestHandle>(std::ptr::null(), "h") }
                .err()
                .unwrap()
                .status,
            gdaki_status::NullArgument
        );
        // SAFETY: a live handle, destroyed once; NULL destroys nothing.
        unsafe {
            destroy(h, "h").unwrap();
            destroy::<TestHandle>(std::ptr::null_mut(), "h").unwrap();
        }
    }

    #[test]
    fn text_out_reports_the_length_and_refuses_a_short_buffer() {
        let mut len = 0usize;
        // SAFETY: NULL with capacity 0 asks for the length.
        let e = unsafe { write_text("soft", std::ptr::null_mut(), 0, &mut len) };
        assert_eq!(e.err().unwrap().status, gdaki_status::BufferTooSmall);
        assert_eq!(len, 4);
        let mut buf = [1 as c_char; 5];
        // SAFETY: a 5-byte buffer.
        unsafe { write_text("soft", buf.as_mut_ptr(), 5, &mut len) }.unwrap();
        // SAFETY: NUL-terminated now.
        assert_eq!(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_str().unwrap(), "soft");
    }

    #[test]
    fn every_status_has_its_c_name() {
        for s in gdaki_status::ALL {
            let name = s.name().to_str().unwrap();
            assert!(name.starts_with("GDAKI_STATUS_"), "{name}");
        }
    }
}
