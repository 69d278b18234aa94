//! The library itself (versions, errors, logging), contexts and GPUs.
use std::ffi::{c_char, CStr};

use gdaki::cuda::Gpu;
use gdaki::{Context, ContextOptions, Provider};

use crate::guard::{self, call, gdaki_status, handle, Failure};

/// The version of this C interface: raised on every incompatible change to `gdaki.h`.
/// Compare with `gdaki_abi_version()` at run time when linking dynamically.
pub const GDAKI_ABI_VERSION: u32 = 1;

/// Which HCA a context opens (`gdaki_context_open`'s `provider`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum gdaki_provider {
    /// An mlx5 NIC where one is usable, else the soft HCA (the choice is logged).
    Auto = 0,
    /// gdaki's software model of an mlx5 HCA (no NIC needed).
    Soft = 1,
    /// A ConnectX NIC through DevX.
    Mlx5 = 2,
}

impl gdaki_provider {
    fn from_raw(v: u32) -> Result<Provider, Failure> {
        Ok(match v {
            0 => Provider::Auto,
            1 => Provider::Soft,
            2 => Provider::Mlx5,
            _ => return Err(Failure::invalid(format!("provider {v} (expected 0, 1 or 2)"))),
        })
    }

    fn of(p: Provider) -> gdaki_provider {
        match p {
            Provider::Mlx5 => gdaki_provider::Mlx5,
            Provider::Soft => gdaki_provider::Soft,
            Provider::Auto => gdaki_provider::Auto,
        }
    }
}

/// An opened provider: the device every other object is made on.
pub struct gdaki_context(guard::Tagged<Context>);
handle!(gdaki_context(Context), b"gdakiCTX", "context");

/// A GPU, opened for gdaki (its primary context, which the CUDA runtime shares).
pub struct gdaki_gpu(guard::Tagged<Gpu>);
handle!(gdaki_gpu(Gpu), b"gdakiGPU", "gpu");

/// The `GDAKI_ABI_VERSION` this library was built with.
#[no_mangle]
pub extern "C" fn gdaki_abi_version() -> u32 {
    GDAKI_ABI_VERSION
}

/// The library's version ("0.1.0"), a static string.
#[no_mangle]
pub extern "C" fn gdaki_version() -> *const c_char {
    static V: &CStr = match CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
        Ok(v) => v,
        Err(_) => c"unknown",
    };
    V.as_ptr()
}

/// The C name of `status` ("GDAKI_STATUS_TIMEOUT"), a static string; "GDAKI_STATUS_UNKNOWN"
/// for a value that is not a status.
#[no_mangle]
pub extern "C" fn gdaki_status_name(status: u32) -> *const c_char {
    gdaki_status::ALL
        .iter()
        .find(|s| **s as u32 == status)
        .map_or(c"GDAKI_STATUS_UNKNOWN", |s| s.name())
        .as_ptr()
}

/// What this thread's last failed call said (the function, what was wrong, the values), or ""
/// when none failed. Valid until this thread's next failed call; copy it to keep it.
#[no_mangle]
pub extern "C" fn gdaki_last_error() -> *const c_char {
    guard::last_error()
}

/// Sends the library's diagnostics to stderr, filtered by `filter` (`tracing`'s syntax:
/// "info", "gdaki=debug,gdaki::devx=trace"); NULL takes `RUST_LOG`, else "warn". Once per
/// process: later calls, or a subscriber the program already installed, are
/// `GDAKI_STATUS_INVALID_STATE`.
///
/// # Safety
/// `filter` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn gdaki_log_init(filter: *const c_char) -> gdaki_status {
    call("gdaki_log_init", || {
        let filter = if filter.is_null() {
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into())
        } else {
            // SAFETY: the caller's contract.
            unsafe { guard::text(filter, "filter") }?.to_string()
        };
        let filter = tracing_subscriber::EnvFilter::try_new(&filter)
            .map_err(|e| Failure::invalid(format!("filter {filter:?}: {e}")))?;
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            // Colour only for a terminal: piped logs stay plain text.
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init()
            .map_err(|e| Failure::new(gdaki_status::InvalidState, format!("logging is set up already: {e}")))
    })
}

/// Opens `provider` (a `gdaki_provider`) into `*ctx`. `device` names the RDMA device
/// ("mlx5_0"; "soft" for the soft HCA), or NULL for the first usable one. Options the Rust
/// library reads from the environment (`GDAKI_*`, see the README) apply here too.
///
/// # Safety
/// `device` is NULL or a NUL-terminated string; `ctx` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_context_open(
    provider: u32,
    device: *const c_char,
    ctx: *mut *mut gdaki_context,
) -> gdaki_status {
    call("gdaki_context_open", || {
        // SAFETY: the caller's contract.
        let out = unsafe { guard::out(ctx, "ctx") }?;
        let provider = gdaki_provider::from_raw(provider)?;
        let mut options = ContextOptions::from_env();
        if !device.is_null() {
            // SAFETY: the caller's contract.
            options = options.device(unsafe { guard::text(device, "device") }?);
        }
        let opened = Context::open_with(provider, options)?;
        out.write(guard::into_handle(opened));
        Ok(())
    })
}

/// Destroys a context (NULL: nothing). Its regions, queues and channels stay usable until they
/// are destroyed themselves.
///
/// # Safety
/// `ctx` is NULL or a context handle with no call on it in flight, not used after.
#[no_mangle]
pub unsafe extern "C" fn gdaki_context_destroy(ctx: *mut gdaki_context) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_context_destroy", || unsafe { guard::destroy(ctx, "ctx") })
}

/// A new context on `ctx`'s device with a protection domain of its own, into `*pd_ctx`
/// (`ibv_alloc_pd`): regions and queue pairs made through it are in that domain, and a queue
/// pair uses keys of its own domain only (a WQE naming another domain's region completes with
/// a local protection error; a peer's request naming one is refused and moves the target
/// queue pair to error). Destroy it with `gdaki_context_destroy`; the domain is given back
/// once everything made through it is destroyed too.
///
/// # Safety
/// `ctx` is NULL or a context handle; `pd_ctx` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_context_alloc_pd(
    ctx: *const gdaki_context,
    pd_ctx: *mut *mut gdaki_context,
) -> gdaki_status {
    call("gdaki_context_alloc_pd", || {
        // SAFETY: the caller's contract.
        let (c, out) = unsafe { (guard::borrow(ctx, "ctx")?, guard::out(pd_ctx, "pd_ctx")?) };
        out.write(guard::into_handle(c.alloc_pd()?));
        Ok(())
    })
}

/// The provider the context runs on (never `GDAKI_PROVIDER_AUTO`).
///
/// # Safety
/// `ctx` is NULL or a context handle; `provider` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_context_provider(
    ctx: *const gdaki_context,
    provider: *mut gdaki_provider,
) -> gdaki_status {
    call("gdaki_context_provider", || {
        // SAFETY: the caller's contract.
        let (c, out) = unsafe { (guard::borrow(ctx, "ctx")?, guard::out(provider, "provider")?) };
        out.write(gdaki_provider::of(c.provider()));
        Ok(())
    })
}

/// Whether the context's device takes queue pairs with a reliable doorbell
/// (`gdaki_qp_config.reliable_doorbell`): 1 or 0 into `*supported`.
///
/// # Safety
/// `ctx` is NULL or a context handle; `supported` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_context_supports_reliable_doorbell(
    ctx: *const gdaki_context,
    supported: *mut u8,
) -> gdaki_status {
    call("gdaki_context_supports_reliable_doorbell", || {
        // SAFETY: the caller's contract.
        let (c, out) = unsafe { (guard::borrow(ctx, "ctx")?, guard::out(supported, "supported")?) };
        out.write(c.supports_reliable_doorbell() as u8);
        Ok(())
    })
}

/// The RDMA device's name ("mlx5_0", "soft") into `buf` of `cap` bytes, NUL-terminated; its
/// length (without the NUL) into `*len` when `len` is not NULL. `buf` NULL with `cap` 0 asks
/// for the length (`GDAKI_STATUS_BUFFER_TOO_SMALL`).
///
/// # Safety
/// `ctx` is NULL or a context handle; `buf` is NULL or valid for `cap` bytes; `len` is NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_context_device_name(
    ctx: *const gdaki_context,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> gdaki_status {
    call("gdaki_context_device_name", || {
        // SAFETY: the caller's contract.
        let c = unsafe { guard::borrow(ctx, "ctx") }?;
        // SAFETY: the caller's contract.
        unsafe { guard::write_text(&c.device_name(), buf, cap, len) }
    })
}

/// Lets peers in other processes or hosts reach this context's queue pairs: the soft HCA
/// listens on `bind` ("ip:port", port 0 for any free one) and writes the address it listens on
/// into `buf` (as `gdaki_context_device_name` does); every endpoint made afterwards carries
/// it. Once per context (later calls give the first address). A NIC needs no listener: "" is
/// written. A connection must come from the peer a queue pair was connected to and present
/// the secret its endpoint carries, but nothing is encrypted: bind to a network you trust.
///
/// # Safety
/// `ctx` is NULL or a context handle; `bind` is NULL or a NUL-terminated string; `buf` is NULL
/// or valid for `cap` bytes; `len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_context_listen(
    ctx: *const gdaki_context,
    bind: *const c_char,
    buf: *mut c_char,
    cap: usize,
    len: *mut usize,
) -> gdaki_status {
    call("gdaki_context_listen", || {
        // SAFETY: the caller's contract.
        let (c, bind) = unsafe { (guard::borrow(ctx, "ctx")?, guard::text(bind, "bind")?) };
        let addr = parse_addr(bind, "bind")?;
        let bound = c.listen(addr)?.map(|a| a.to_string()).unwrap_or_default();
        // SAFETY: the caller's contract.
        unsafe { guard::write_text(&bound, buf, cap, len) }
    })
}

/// A socket address ("10.0.0.1:18515", "[fe80::1]:7").
pub(crate) fn parse_addr(s: &str, what: &str) -> Result<std::net::SocketAddr, Failure> {
    s.parse()
        .map_err(|e| Failure::invalid(format!("{what} {s:?} is not an ip:port address: {e}")))
}

/// Opens GPU `ordinal` for gdaki (loads its kernels) into `*gpu`. No driver or no such GPU is
/// `GDAKI_STATUS_NO_DEVICE`.
///
/// # Safety
/// `gpu` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_gpu_open(ordinal: u32, gpu: *mut *mut gdaki_gpu) -> gdaki_status {
    call("gdaki_gpu_open", || {
        // SAFETY: the caller's contract.
        let out = unsafe { guard::out(gpu, "gpu") }?;
        let opened = Gpu::open(ordinal as usize)?;
        // C and C++ programs launch with the CUDA runtime, whose modules load at a kernel's first
        // launch by default; seen on H200s: a first launch while the soft HCA's copy kernel was
        // resident never ran.
        if gdaki::cuda::lazy_module_loading().unwrap_or(false) {
            tracing::warn!(
                gpu = ordinal,
                "CUDA loads modules lazily (CUDA_MODULE_LOADING is not EAGER): a kernel first launched \
                 while the soft HCA's resident copy kernel runs may never start; set \
                 CUDA_MODULE_LOADING=EAGER before the process first calls CUDA, or launch every kernel \
                 once before registering device memory"
            );
        }
        out.write(guard::into_handle(opened));
        Ok(())
    })
}

/// The number of GPUs this process sees (`CUDA_VISIBLE_DEVICES` applies) into `*count`: 0
/// where there is no driver or no GPU (not an error: CPU mode works there).
///
/// # Safety
/// `count` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn gdaki_gpu_count(count: *mut u32) -> gdaki_status {
    call("gdaki_gpu_count", || {
        // SAFETY: the caller's contract.
        let out = unsafe { guard::out(count, "count") }?;
        let n = gdaki::cuda::probe().map_or(0, |i| i.gpus.len());
        out.write(u32::try_from(n).unwrap_or(u32::MAX));
        Ok(())
    })
}

/// The GPU's UUID (`cuDeviceGetUuid`, 16 bytes) into `uuid`: the same GPU has the same UUID in every
/// process, whatever its ordinal there (`CUDA_VISIBLE_DEVICES`).
///
/// # Safety
/// `gpu` is NULL or a GPU handle; `uuid` is NULL or valid for writes of 16 bytes.
#[no_mangle]
pub unsafe extern "C" fn gdaki_gpu_uuid(gpu: *const gdaki_gpu, uuid: *mut u8) -> gdaki_status {
    call("gdaki_gpu_uuid", || {
        // SAFETY: the caller's contract.
        let (g, out) = unsafe { (guard::borrow(gpu, "gpu")?, guard::slice_mut(uuid, 16, "uuid")?) };
        out.copy_from_slice(&gdaki::cuda::gpu_uuid(g.context())?);
        Ok(())
    })
}

/// Destroys a GPU handle (NULL: nothing); regions and queues on it keep what they need.
///
/// # Safety
/// `gpu` is NULL or a GPU handle with no call on it in flight, not used after.
#[no_mangle]
pub unsafe extern "C" fn gdaki_gpu_destroy(gpu: *mut gdaki_gpu) -> gdaki_status {
    // SAFETY: the caller's contract.
    call("gdaki_gpu_destroy", || unsafe { guard::destroy(gpu, "gpu") })
}
