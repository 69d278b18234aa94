//! gdrcopy: the CPU's own loads and stores of GPU memory through a BAR1 mapping, where
//! NVIDIA's `gdrdrv` kernel driver is loaded (`/dev/gdrdrv`). A few hundred nanoseconds for a
//! small read or write, against microseconds for a CUDA copy call.
//!
//! `libgdrapi` is loaded at run time (`libgdrapi.so.2`), never linked: a machine without it
//! builds and runs the same binary. Where the driver or the library is missing, [`Gdr::open`]
//! says which, and callers use what works without it.
//!
//! The library's own CPU reads and writes of GPU memory ([`DeviceBuffer::read`] and
//! [`write`](crate::DeviceBuffer::write), and so `MemoryRegion::read`/`write` of device regions and
//! what the host reads back from GPU-memory queues) go through it wherever [`shared`] opens it.
//!
//! Knobs, for tests and unusual installs: `GDAKI_GDRAPI` names the library to load instead,
//! `GDAKI_GDRDRV` the device node to look for instead of `/dev/gdrdrv`; `GDAKI_GDRCOPY=0` keeps
//! the library's reads and writes on CUDA copies even where gdrcopy is there.
//!
//! [`DeviceBuffer::read`]: crate::DeviceBuffer::read
use std::ffi::{c_int, c_ulong, c_void};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

/// The largest read the library makes through a mapping: the CPU's loads from BAR1 are
/// uncached, one PCIe round trip per few words, so a larger read is faster as a CUDA copy.
pub const READ_MAX: usize = 4096;
/// The largest write the library makes through a mapping: the CPU's write-combined stores
/// stream, but beyond this a CUDA copy's fixed cost is paid back.
pub const WRITE_MAX: usize = 64 << 10;
/// The largest buffer the library maps whole: a mapping takes BAR1 space, which GPUDirect
/// RDMA also needs and which is a few hundred MiB on some GPUs; larger buffers keep CUDA
/// copies.
pub const MAP_MAX: usize = 64 << 20;

/// Whether `GDAKI_GDRCOPY=0` keeps the library's CPU reads and writes of GPU memory on CUDA
/// copies even where gdrcopy is there.
pub fn turned_off() -> bool {
    std::env::var("GDAKI_GDRCOPY").is_ok_and(|v| v == "0")
}

/// gdrcopy for the library's own CPU reads and writes of GPU memory, opened once per process:
/// `None` where it is absent (said once, at debug level, with why) or `GDAKI_GDRCOPY=0` turns
/// it off.
pub fn shared() -> Option<&'static Arc<Gdr>> {
    static SHARED: OnceLock<Option<Arc<Gdr>>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            if turned_off() {
                tracing::info!(
                    "gdrcopy turned off (GDAKI_GDRCOPY=0): CPU reads and writes of GPU memory are CUDA copies"
                );
                return None;
            }
            match Gdr::open() {
                Ok(gdr) => {
                    let (major, minor) = gdr.version();
                    tracing::info!(
                        "gdrcopy (libgdrapi {major}.{minor}): CPU reads and writes of GPU memory go through BAR1"
                    );
                    Some(gdr)
                }
                Err(e) => {
                    tracing::debug!("gdrcopy not used ({e}): CPU reads and writes of GPU memory are CUDA copies");
                    None
                }
            }
        })
        .as_ref()
}

/// GPU pages as gdrdrv pins them (`GPU_PAGE_SIZE` in gdrapi.h): 64 KiB.
pub const GPU_PAGE: u64 = 1 << 16;

/// Why gdrcopy is not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GdrError {
    /// The kernel driver is not loaded (no device node).
    #[error("no {0}: NVIDIA's gdrdrv kernel module is not loaded (gdrcopy's insmod.sh loads it)")]
    NoDriver(String),
    /// The user-space library could not be loaded.
    #[error("{library} could not be loaded ({why}): install gdrcopy's libgdrapi")]
    NoLibrary {
        /// The library name or path tried.
        library: String,
        /// The loader's message.
        why: String,
    },
    /// A call failed.
    #[error("{call} failed ({code})")]
    Call {
        /// The gdrapi function.
        call: &'static str,
        /// Its return value.
        code: i32,
    },
    /// A range outside the mapping, or an empty one.
    #[error("{0}")]
    Range(String),
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Mh {
    h: c_ulong,
}

type Open = unsafe extern "C" fn() -> *mut c_void;
type Close = unsafe extern "C" fn(*mut c_void) -> c_int;
type Pin = unsafe extern "C" fn(*mut c_void, c_ulong, usize, u64, u32, *mut Mh) -> c_int;
type Unpin = unsafe extern "C" fn(*mut c_void, Mh) -> c_int;
type Map = unsafe extern "C" fn(*mut c_void, Mh, *mut *mut c_void, usize) -> c_int;
type Unmap = unsafe extern "C" fn(*mut c_void, Mh, *mut c_void, usize) -> c_int;
type CopyTo = unsafe extern "C" fn(Mh, *mut c_void, *const c_void, usize) -> c_int;
type CopyFrom = unsafe extern "C" fn(Mh, *mut c_void, *const c_void, usize) -> c_int;
type Version = unsafe extern "C" fn(*mut c_int, *mut c_int);

/// An open connection to gdrdrv through libgdrapi.
pub struct Gdr {
    handle: *mut c_void,
    close: Close,
    pin: Pin,
    unpin: Unpin,
    map: Map,
    unmap: Unmap,
    copy_to: CopyTo,
    copy_from: CopyFrom,
    version: (i32, i32),
    // Last: the functions above point into it.
    _lib: libloading::Library,
}

// SAFETY: gdrapi's calls may come from any thread (its state is behind the driver's file
// descriptor); the pointers are only passed back to it.
unsafe impl Send for Gdr {}
// SAFETY: as above.
unsafe impl Sync for Gdr {}

impl std::fmt::Debug for Gdr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gdr(libgdrapi {}.{})", self.version.0, self.version.1)
    }
}

impl Gdr {
    /// Opens gdrcopy: the driver's device node must exist and libgdrapi load and open it.
    pub fn open() -> Result<Arc<Gdr>, GdrError> {
        let node = std::env::var_os("GDAKI_GDRDRV").map_or_else(|| PathBuf::from("/dev/gdrdrv"), PathBuf::from);
        if !node.exists() {
            return Err(GdrError::NoDriver(node.display().to_string()));
        }
        let name = std::env::var("GDAKI_GDRAPI").unwrap_or_else(|_| "libgdrapi.so.2".into());
        let no_library = |why: String| GdrError::NoLibrary {
            library: name.clone(),
            why,
        };
        // SAFETY: loading runs the library's initialisers; libgdrapi's only set up its state.
        let lib = unsafe { libloading::Library::new(&name) }.map_err(|e| no_library(e.to_string()))?;
        /// The function `name` of libgdrapi, of type `T`.
        ///
        /// # Safety
        /// `T` is the type gdrapi.h (version 2) declares for `name`.
        unsafe fn get<T: Copy>(lib: &libloading::Library, name: &[u8]) -> Result<T, String> {
            // SAFETY: the caller's contract.
            unsafe { lib.get::<T>(name) }.map(|s| *s).map_err(|e| e.to_string())
        }
        // SAFETY (every `get`): each type is the signature gdrapi.h declares for that name.
        let symbols = || -> Result<_, String> {
            unsafe {
                Ok((
                    get::<Open>(&lib, b"gdr_open\0")?,
                    get::<Close>(&lib, b"gdr_close\0")?,
                    get::<Pin>(&lib, b"gdr_pin_buffer\0")?,
                    get::<Unpin>(&lib, b"gdr_unpin_buffer\0")?,
                    get::<Map>(&lib, b"gdr_map\0")?,
                    get::<Unmap>(&lib, b"gdr_unmap\0")?,
                    get::<CopyTo>(&lib, b"gdr_copy_to_mapping\0")?,
                    get::<CopyFrom>(&lib, b"gdr_copy_from_mapping\0")?,
                    get::<Version>(&lib, b"gdr_runtime_get_version\0")?,
                ))
            }
        };
        let (open, close, pin, unpin, map, unmap, copy_to, copy_from, version) = symbols().map_err(no_library)?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: two valid out-pointers.
        unsafe { version(&mut major, &mut minor) };
        if major != 2 {
            return Err(no_library(format!("version {major}.{minor}; gdaki speaks version 2")));
        }
        // SAFETY: no arguments; NULL on failure.
        let handle = unsafe { open() };
        if handle.is_null() {
            return Err(GdrError::Call {
                call: "gdr_open",
                code: -1,
            });
        }
        Ok(Arc::new(Gdr {
            handle,
            close,
            pin,
            unpin,
            map,
            unmap,
            copy_to,
            copy_from,
            version: (major, minor),
            _lib: lib,
        }))
    }

    /// libgdrapi's version.
    pub fn version(&self) -> (i32, i32) {
        self.version
    }
}

impl Drop for Gdr {
    fn drop(&mut self) {
        // SAFETY: opened by gdr_open, closed once; every mapping holds an Arc and is gone.
        unsafe { (self.close)(self.handle) };
    }
}

/// `len` bytes of GPU memory at `addr` mapped for the CPU: pinned (whole 64 KiB GPU pages) and
/// mapped through BAR1. Unmapped and unpinned when dropped, which must happen before the
/// memory is freed.
#[derive(Debug)]
pub struct GdrMapping {
    gdr: Arc<Gdr>,
    mh: Mh,
    va: *mut c_void,
    map_len: usize,
    /// Where `addr` is in the mapping.
    offset: usize,
    len: usize,
}

// SAFETY: the mapping is plain memory for any thread; gdrapi's copy calls are thread-safe.
unsafe impl Send for GdrMapping {}
// SAFETY: as above.
unsafe impl Sync for GdrMapping {}

impl std::fmt::Debug for Mh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.h)
    }
}

impl GdrMapping {
    /// Maps `len` bytes of device memory at `addr`.
    ///
    /// # Safety
    /// `addr..addr + len` is device memory of this process that stays allocated until the
    /// mapping is dropped.
    pub unsafe fn new(gdr: &Arc<Gdr>, addr: u64, len: usize) -> Result<GdrMapping, GdrError> {
        let end = addr
            .checked_add(len as u64)
            .filter(|_| len > 0)
            .ok_or_else(|| GdrError::Range(format!("{len} bytes at {addr:#x}: not a mappable range")))?;
        let base = addr & !(GPU_PAGE - 1);
        let map_len = (end.div_ceil(GPU_PAGE) * GPU_PAGE - base) as usize;
        let mut mh = Mh::default();
        // SAFETY: an open gdr and a valid out-pointer; the range is the caller's device memory.
        let rc = unsafe { (gdr.pin)(gdr.handle, base as c_ulong, map_len, 0, 0, &mut mh) };
        if rc != 0 {
            return Err(GdrError::Call {
                call: "gdr_pin_buffer",
                code: rc,
            });
        }
        let mut va = std::ptr::null_mut();
        // SAFETY: a pinned handle and a valid out-pointer.
        let rc = unsafe { (gdr.map)(gdr.handle, mh, &mut va, map_len) };
        if rc != 0 || va.is_null() {
            // SAFETY: pinned above, not mapped.
            unsafe { (gdr.unpin)(gdr.handle, mh) };
            return Err(GdrError::Call {
                call: "gdr_map",
                code: rc,
            });
        }
        Ok(GdrMapping {
            gdr: gdr.clone(),
            mh,
            va,
            map_len,
            offset: (addr - base) as usize,
            len,
        })
    }

    fn range(&self, offset: usize, n: usize) -> Result<*mut c_void, GdrError> {
        if offset.checked_add(n).is_none_or(|e| e > self.len) {
            return Err(GdrError::Range(format!(
                "{n} bytes at offset {offset} of a {}-byte mapping",
                self.len
            )));
        }
        // SAFETY: within the mapping (checked above).
        Ok(unsafe { self.va.cast::<u8>().add(self.offset + offset) }.cast())
    }

    /// Writes `src` at `offset` (through gdrapi's copy, which orders the stores for the BAR).
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), GdrError> {
        let at = self.range(offset, src.len())?;
        // SAFETY: `at..at + src.len()` lies in the live mapping.
        match unsafe { (self.gdr.copy_to)(self.mh, at, src.as_ptr().cast(), src.len()) } {
            0 => Ok(()),
            code => Err(GdrError::Call {
                call: "gdr_copy_to_mapping",
                code,
            }),
        }
    }

    /// Reads `dst.len()` bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), GdrError> {
        let at = self.range(offset, dst.len())?;
        // SAFETY: `at..at + dst.len()` lies in the live mapping; `dst` is writable.
        match unsafe { (self.gdr.copy_from)(self.mh, dst.as_mut_ptr().cast(), at, dst.len()) } {
            0 => Ok(()),
            code => Err(GdrError::Call {
                call: "gdr_copy_from_mapping",
                code,
            }),
        }
    }
}

impl Drop for GdrMapping {
    fn drop(&mut self) {
        // SAFETY: mapped and pinned in `new`, undone once, in gdrapi's order.
        unsafe {
            (self.gdr.unmap)(self.gdr.handle, self.mh, self.va, self.map_len);
            (self.gdr.unpin)(self.gdr.handle, self.mh);
        }
    }
}
