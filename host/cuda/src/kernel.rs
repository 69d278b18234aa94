//! Your own kernels: a PTX module loaded into a GPU, and launches whose arguments are typed.
//!
//! A crate of kernels depends on `gdaki-device` and builds to PTX with `gdaki-build` (see the
//! `own-kernel` example). The host loads the PTX with [`Gpu::load_module`] and launches a kernel
//! with [`Args`]: exported queue pairs ([`ExportedQp`]), GPU-reachable regions and device buffers,
//! operands of remote and local memory, and scalars. The arguments are borrowed until the kernel
//! has finished (every launch here is waited for), so no handle a kernel holds can be freed
//! under it, and each is checked against the module's GPU before anything launches. gdaki's own
//! kernels go through the same arguments.
//!
//! CUDA C++ kernels that call gdaki's C ABI (`gdaki_device.h`) are linked with gdaki's device
//! code either ahead of time (`nvcc -rdc`, then [`Gpu::load_image`]) or at run time through the
//! driver's linker ([`Gpu::link_module`], for NVRTC output).
use std::ffi::{c_void, CString};
use std::time::Duration;

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

use super::{CudaError, DeviceBuffer, Gpu, LoadedModule};
use crate::ptx::PtxSummary;
use crate::stream::timed;

/// A queue pair exported to a GPU, as a kernel argument names it: `gdaki::GpuQp`.
///
/// # Safety
/// [`device_handle`](Self::device_handle) is the address of a `gdaki_layout::DevQp` in memory
/// GPU [`gpu_ordinal`](Self::gpu_ordinal) reaches, naming rings, records and a doorbell that stay
/// valid while `self` is borrowed: kernels post through it.
pub unsafe trait ExportedQp: std::fmt::Debug {
    /// The GPU the handle lives on.
    fn gpu_ordinal(&self) -> usize;
    /// The handle's GPU address (`*mut DevQp`).
    fn device_handle(&self) -> u64;
    /// The GPU address of its receive queue's handle (`*mut DevRq`), if it has one.
    fn receive_handle(&self) -> Option<u64> {
        None
    }
}

/// A registered region as a kernel argument names it: `gdaki::MemoryRegion`.
///
/// # Safety
/// Where [`gpu_ordinal`](Self::gpu_ordinal) is `Some(g)`, `addr()..addr() + len()` is memory GPU
/// `g` reaches that stays allocated while `self` is borrowed, registered with local key
/// [`lkey`](Self::lkey): kernels read and write it themselves.
pub unsafe trait GpuRegion: std::fmt::Debug {
    /// The GPU that reaches it (`None`: host memory no GPU reaches).
    fn gpu_ordinal(&self) -> Option<usize>;
    /// Its first byte.
    fn addr(&self) -> u64;
    /// Its length in bytes.
    fn len(&self) -> u64;
    /// It has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Its local key.
    fn lkey(&self) -> u32;
}

/// A PTX module loaded into a GPU, every kernel in it loaded too. Dropped, it is unloaded with
/// the resident kernels stopped around the unload ([`quiesced`](super::quiesced)).
pub struct Module {
    gpu: Gpu,
    module: LoadedModule,
    entries: Vec<String>,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("gpu", &self.gpu.ordinal())
            .field("entries", &self.entries)
            .finish()
    }
}

impl Gpu {
    /// Loads PTX text into this GPU. A module that declares functions it does not define
    /// (`.extern .func`: a panic path or an out-of-line function of another crate left in) is
    /// refused with their names, as is one without kernels. Every kernel is loaded now: under
    /// CUDA's lazy loading a first launch would load it behind running kernels, and wait for
    /// the soft HCA's resident copier forever.
    pub fn load_module(&self, ptx: &str) -> Result<Module, CudaError> {
        let summary = PtxSummary::parse(ptx);
        if !summary.unresolved.is_empty() {
            return Err(CudaError::BadArgument {
                what: "loading a PTX module",
                why: format!(
                    "it declares functions it does not define: {} (build it with gdaki-build, which aborts \
                     on panics and inlines gdaki-device)",
                    summary.unresolved.join(", ")
                ),
            });
        }
        if summary.entries.is_empty() {
            return Err(CudaError::BadArgument {
                what: "loading a PTX module",
                why: "it has no .entry kernels".into(),
            });
        }
        self.load(cudarc::nvrtc::Ptx::from_src(ptx), summary.entries)
    }

    /// Loads a linked image (a cubin or fatbin, as `nvcc -dlink -cubin` writes one) and its
    /// kernels `kernels` (a binary image cannot be searched for them).
    pub fn load_image(&self, image: &[u8], kernels: &[&str]) -> Result<Module, CudaError> {
        if kernels.is_empty() {
            return Err(CudaError::BadArgument {
                what: "loading an image",
                why: "name at least one kernel to load".into(),
            });
        }
        let entries = kernels.iter().map(|k| k.to_string()).collect();
        self.load(cudarc::nvrtc::Ptx::from_binary(image.to_vec()), entries)
    }

    /// Links PTX modules with the driver's linker (relocatable code: NVRTC with `-rdc=true`)
    /// and loads the result, with every `.entry` of the inputs. [`LinkInput::GdakiDevice`] is
    /// gdaki's data path as `extern "C"` functions, what `gdaki_device.h` declares. A call no
    /// input defines is refused with the linker's message.
    pub fn link_module(&self, inputs: &[LinkInput<'_>]) -> Result<Module, CudaError> {
        let mut texts = Vec::with_capacity(inputs.len());
        for input in inputs {
            texts.push(match input {
                LinkInput::Ptx(text) => *text,
                LinkInput::GdakiDevice => crate::ptx::c_abi_ptx()?,
            });
        }
        let entries: Vec<String> = texts.iter().flat_map(|t| PtxSummary::parse(t).entries).collect();
        if entries.is_empty() {
            return Err(CudaError::BadArgument {
                what: "linking PTX",
                why: "no input has .entry kernels".into(),
            });
        }
        self.ctx.bind_to_thread()?;
        let image = link(&texts)?;
        self.load(cudarc::nvrtc::Ptx::from_binary(image), entries)
    }

    /// Loads a module and every kernel in `entries`.
    fn load(&self, image: cudarc::nvrtc::Ptx, entries: Vec<String>) -> Result<Module, CudaError> {
        let module = super::quiesced(|| -> Result<_, CudaError> {
            let module = self.ctx.load_module(image)?;
            for name in &entries {
                module.load_function(name)?;
            }
            Ok(module)
        })?;
        Ok(Module {
            gpu: self.clone(),
            module: LoadedModule::new(module),
            entries,
        })
    }
}

/// One input of [`Gpu::link_module`].
#[derive(Debug, Clone, Copy)]
pub enum LinkInput<'a> {
    /// PTX text (relocatable: it may call functions other inputs define).
    Ptx(&'a str),
    /// gdaki's device code as `extern "C"` functions (`gdaki_device.h`), embedded in this
    /// library.
    GdakiDevice,
}

/// Runs the driver's linker over PTX texts (the current context's device): the linked cubin.
fn link(texts: &[&str]) -> Result<Vec<u8>, CudaError> {
    use cudarc::driver::sys::{self, CUjitInputType, CUjit_option, CUresult};
    let bad = |why: String| CudaError::BadArgument {
        what: "linking PTX",
        why,
    };
    let mut log = vec![0u8; 16 << 10];
    let mut options = [
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
    ];
    // The driver reads each option's value from a pointer-sized slot: the buffer, its size.
    let mut values = [log.as_mut_ptr() as *mut c_void, log.len() as *mut c_void];
    let log_text = |log: &[u8]| {
        String::from_utf8_lossy(&log[..log.iter().position(|&b| b == 0).unwrap_or(log.len())]).into_owned()
    };
    let mut state: sys::CUlinkState = std::ptr::null_mut();
    // SAFETY: the options and values arrays outlive the link state (destroyed below), and the
    // log buffer is as large as its size option says.
    let r = unsafe { sys::cuLinkCreate_v2(2, options.as_mut_ptr(), values.as_mut_ptr(), &mut state) };
    if r != CUresult::CUDA_SUCCESS {
        return Err(bad(format!("cuLinkCreate: {r:?}")));
    }
    let result = (|| {
        for (i, text) in texts.iter().enumerate() {
            let name = CString::new(format!("input{i}.ptx")).expect("no NUL in the name");
            let data = CString::new(*text).map_err(|_| bad(format!("input {i} has a NUL byte")))?;
            let bytes = data.as_bytes_with_nul();
            // SAFETY: the state is live; the data is NUL-terminated PTX the call copies.
            let r = unsafe {
                sys::cuLinkAddData_v2(
                    state,
                    CUjitInputType::CU_JIT_INPUT_PTX,
                    bytes.as_ptr() as *mut c_void,
                    bytes.len(),
                    name.as_ptr(),
                    0,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            };
            if r != CUresult::CUDA_SUCCESS {
                return Err(bad(format!("input {i}: {r:?}: {}", log_text(&log))));
            }
        }
        let (mut cubin, mut size) = (std::ptr::null_mut(), 0usize);
        // SAFETY: the state is live; the image it returns is valid until the state is destroyed.
        let r = unsafe { sys::cuLinkComplete(state, &mut cubin, &mut size) };
        if r != CUresult::CUDA_SUCCESS || cubin.is_null() {
            return Err(bad(format!("{r:?}: {}", log_text(&log))));
        }
        // SAFETY: `size` bytes at `cubin`, owned by the live state; copied out before it goes.
        Ok(unsafe { std::slice::from_raw_parts(cubin as *const u8, size) }.to_vec())
    })();
    // SAFETY: created above, destroyed once.
    unsafe { sys::cuLinkDestroy(state) };
    result
}

impl Module {
    /// The module's kernels (`.entry` names).
    pub fn entry_points(&self) -> &[String] {
        &self.entries
    }

    /// The GPU it is loaded into.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The kernel `name`.
    pub fn kernel(&self, name: &str) -> Result<Kernel<'_>, CudaError> {
        if !self.entries.iter().any(|e| e == name) {
            return Err(CudaError::BadArgument {
                what: "finding a kernel",
                why: format!("the module has no kernel {name:?} (it has {:?})", self.entries),
            });
        }
        Ok(Kernel {
            gpu: &self.gpu,
            function: self.module.load_function(name)?,
            name: name.to_string(),
        })
    }
}

/// A kernel of a loaded module (or of gdaki's own).
pub struct Kernel<'m> {
    gpu: &'m Gpu,
    function: CudaFunction,
    name: String,
}

impl std::fmt::Debug for Kernel<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernel").field("name", &self.name).finish()
    }
}

impl<'m> Kernel<'m> {
    pub(super) fn own(gpu: &'m Gpu, name: &str) -> Result<Kernel<'m>, CudaError> {
        Ok(Kernel {
            gpu,
            function: gpu.module.load_function(name)?,
            name: name.to_string(),
        })
    }

    /// Launches the kernel over `dims` with `args`, waits for it (polling its stream, so a
    /// kernel that waits on the soft HCA never blocks the HCA's own driver calls) and returns
    /// its GPU time, measured by CUDA events around it. An argument that does not belong to
    /// this GPU is refused before anything launches.
    ///
    /// # Safety
    /// The kernel's parameters are, in order, exactly what `args` pushed (each [`Args`] method
    /// says what it pushes), and the kernel touches no memory beyond what those arguments name
    /// and what it allocates itself.
    pub unsafe fn run(&self, dims: Dims, args: Args<'_>) -> Result<Duration, CudaError> {
        if let Some(why) = args.error {
            return Err(CudaError::BadArgument {
                what: "launching a kernel",
                why: format!("{}: {why}", self.name),
            });
        }
        let ordinal = self.gpu.ordinal();
        if let Some(other) = args.gpus.iter().find(|&&g| g != ordinal) {
            return Err(CudaError::BadArgument {
                what: "launching a kernel",
                why: format!(
                    "{}: an argument belongs to GPU {other}, the kernel runs on GPU {ordinal}",
                    self.name
                ),
            });
        }
        self.check_block(&dims)?;
        let stream = self.gpu.ctx.default_stream();
        let arrays = args
            .values
            .iter()
            .map(|v| match v {
                Value::Array(words) => stream.clone_htod(words).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut b = stream.launch_builder(&self.function);
        for (v, array) in args.values.iter().zip(&arrays) {
            // An array's copy (made above) goes in its place.
            if let Some(a) = array {
                b.arg(a);
                continue;
            }
            match v {
                Value::U32(x) => b.arg(x),
                Value::U64(x) => b.arg(x),
                Value::I32(x) => b.arg(x),
                Value::I64(x) => b.arg(x),
                Value::F32(x) => b.arg(x),
                Value::F64(x) => b.arg(x),
                Value::Array(_) => continue,
            };
        }
        let config = LaunchConfig {
            grid_dim: (dims.grid[0], dims.grid[1], dims.grid[2]),
            block_dim: (dims.block[0], dims.block[1], dims.block[2]),
            shared_mem_bytes: dims.shared_mem_bytes,
        };
        // SAFETY: the caller's contract: the parameters are what was pushed, and the memory the
        // kernel touches is what they name, which `args` borrows until this returns (the launch
        // is waited for in `timed`).
        timed(&stream, || unsafe { b.launch(config) }.map(|_| ()))
    }

    /// Refuses a launch of `blocks` blocks of `threads` that wait on one another (a socket's
    /// sender on its receiver's credits) where this GPU cannot hold them all at once beside
    /// the soft HCA's resident copier ([`copier_blocks`](super::copier_blocks)): blocks left waiting for an SM
    /// would never start, and the resident ones would wait for them until their deadlines.
    pub(super) fn check_resident(&self, blocks: u32, threads: u32) -> Result<(), CudaError> {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        // A block the kernel cannot run at all is refused as such first (none fits an SM).
        self.check_block(&Dims::linear(blocks, threads))?;
        let per_sm = self
            .function
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)?;
        let sms = self.gpu.ctx.attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        resident_fit(&self.name, blocks, threads, per_sm, sms)
    }

    /// Refuses a block larger than this kernel can run on this GPU (its registers a thread
    /// bound it below the device's 1024), before the launch fails with "too many resources".
    fn check_block(&self, dims: &Dims) -> Result<(), CudaError> {
        use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK;
        let max = self.function.get_attribute(CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?;
        block_fits(&self.name, dims.block, max, || self.function.num_regs().ok())
    }
}

/// Whether a block of `block` threads fits kernel `name`, which runs at most `max` a block
/// (`regs`: its registers a thread, for the message).
fn block_fits(name: &str, block: [u32; 3], max: i32, regs: impl FnOnce() -> Option<i32>) -> Result<(), CudaError> {
    let threads = block.iter().map(|&d| u64::from(d)).product::<u64>();
    if threads <= max.max(0) as u64 {
        return Ok(());
    }
    let regs = regs()
        .map(|r| format!(" (it uses {r} registers a thread)"))
        .unwrap_or_default();
    Err(CudaError::BadArgument {
        what: "launching a kernel",
        why: format!(
            "{name}: a block of {threads} threads, where this kernel runs at most {max} a block on this GPU{regs}"
        ),
    })
}

/// Whether `blocks` blocks of `threads` of kernel `name`, `per_sm` of which fit an SM, all fit
/// at once on `sms` SMs less those the soft HCA's copier may hold ([`copier_blocks`](super::copier_blocks);
/// see [`Kernel::check_resident`]).
fn resident_fit(name: &str, blocks: u32, threads: u32, per_sm: u32, sms: i32) -> Result<(), CudaError> {
    let free = u64::try_from(sms)
        .unwrap_or(0)
        .saturating_sub(u64::from(super::copier_blocks(sms)));
    let room = u64::from(per_sm) * free;
    if u64::from(blocks) <= room {
        return Ok(());
    }
    Err(CudaError::BadArgument {
        what: "launching a kernel",
        why: format!(
            "{name}: {blocks} blocks of {threads} threads that wait on one another, where this GPU holds at most \
             {room} of them at once ({per_sm} an SM on {free} of its {sms} SMs; the soft HCA's copier may hold the rest)"
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Blocks that wait on one another are refused where they cannot all be resident, with
    /// the numbers; a launch that fits passes.
    #[test]
    fn blocks_that_cannot_all_be_resident_are_refused() {
        assert!(resident_fit("k", 99, 256, 1, 132).is_ok());
        assert!(resident_fit("k", 198, 256, 2, 132).is_ok());
        let e = resident_fit("gdaki_socket_bench", 100, 256, 1, 132).unwrap_err();
        assert_eq!(
            e.to_string(),
            "launching a kernel: gdaki_socket_bench: 100 blocks of 256 threads that wait on one another, where \
             this GPU holds at most 99 of them at once (1 an SM on 99 of its 132 SMs; the soft HCA's copier may \
             hold the rest)"
        );
        // A kernel that fits nowhere (0 an SM) or a nonsensical count refuses.
        assert!(resident_fit("k", 1, 1024, 0, 132).is_err());
        assert!(resident_fit("k", 1, 1, 1, -1).is_err());
    }

    /// A block the kernel cannot run is refused with the limit and the reason, before any
    /// launch; one that fits passes.
    #[test]
    fn a_block_larger_than_the_kernel_runs_is_refused_with_its_limit() {
        assert!(block_fits("k", [256, 1, 1], 640, || Some(96)).is_ok());
        assert!(block_fits("k", [640, 1, 1], 640, || None).is_ok());
        let e = block_fits("gdaki_socket_bench", [32, 32, 1], 640, || Some(96)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "launching a kernel: gdaki_socket_bench: a block of 1024 threads, where this kernel runs at most \
             640 a block on this GPU (it uses 96 registers a thread)"
        );
        // A nonsensical attribute refuses rather than wraps.
        assert!(block_fits("k", [1, 1, 1], -1, || None).is_err());
    }
}

/// A launch's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dims {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory per block in bytes.
    pub shared_mem_bytes: u32,
}

impl Dims {
    /// `grid` blocks of `block` threads, in x.
    pub fn linear(grid: u32, block: u32) -> Dims {
        Dims {
            grid: [grid, 1, 1],
            block: [block, 1, 1],
            shared_mem_bytes: 0,
        }
    }
}

/// One kernel parameter.
enum Value {
    U32(u32),
    U64(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
    /// Words copied to device memory for the launch; the kernel gets their address.
    Array(Vec<u64>),
}

/// A kernel's arguments, in parameter order, borrowed until the launch has finished.
#[derive(Default)]
pub struct Args<'a> {
    values: Vec<Value>,
    /// The GPUs the arguments belong to (all must be the kernel's).
    gpus: Vec<usize>,
    /// The first argument that could not be pushed.
    error: Option<String>,
    _borrows: std::marker::PhantomData<&'a ()>,
}

impl<'a> Args<'a> {
    /// No arguments yet.
    pub fn new() -> Args<'a> {
        Args::default()
    }

    /// An exported queue pair: pushes its `*mut DevQp` (`.param .u64`), which kernels pass to
    /// `gdaki_device::Qp::from_raw`.
    pub fn qp(mut self, qp: &'a (impl ExportedQp + ?Sized)) -> Self {
        self.gpus.push(qp.gpu_ordinal());
        self.values.push(Value::U64(qp.device_handle()));
        self
    }

    /// Several exported queue pairs: pushes a `*const *mut DevQp` to an array of their handles
    /// in device memory (made for the launch) and then their number as `u32`.
    pub fn qps<Q: ExportedQp + ?Sized>(mut self, qps: &[&'a Q]) -> Self {
        if qps.is_empty() || qps.len() > u32::MAX as usize {
            self.fail(format!("{} queue pairs (at least one)", qps.len()));
        }
        self.gpus.extend(qps.iter().map(|q| q.gpu_ordinal()));
        self.values
            .push(Value::Array(qps.iter().map(|q| q.device_handle()).collect()));
        self.values.push(Value::U32(qps.len() as u32));
        self
    }

    /// Remote memory as the peer's HCA checks it: pushes `addr: u64, rkey: u32`. The HCA, not
    /// the kernel, touches it, and only within what the key allows.
    pub fn remote(mut self, r: gdaki_device::Remote) -> Self {
        self.values.push(Value::U64(r.addr));
        self.values.push(Value::U32(r.rkey));
        self
    }

    /// Local memory as this side's HCA checks it: pushes `addr: u64, lkey: u32`.
    pub fn local(mut self, l: gdaki_device::Local) -> Self {
        self.values.push(Value::U64(l.addr));
        self.values.push(Value::U32(l.lkey));
        self
    }

    /// A region the kernel reads and writes itself: pushes its first byte as a GPU pointer
    /// (`u64`). It must be reachable by the kernel's GPU: device memory of that GPU, or host
    /// memory mapped into it (`gdaki::Context::alloc_pinned_region`).
    pub fn region(mut self, r: &'a (impl GpuRegion + ?Sized)) -> Self {
        match r.gpu_ordinal() {
            Some(g) => {
                self.gpus.push(g);
                self.values.push(Value::U64(r.addr()));
            }
            None => self.fail(format!(
                "region at {:#x} is host memory no GPU can reach (allocate it with alloc_pinned_region or \
                 alloc_device_region)",
                r.addr()
            )),
        }
        self
    }

    /// A device buffer: pushes its address (`u64`).
    pub fn buffer(mut self, b: &'a DeviceBuffer) -> Self {
        self.gpus.push(b.gpu_ordinal());
        self.values.push(Value::U64(b.device_addr()));
        self
    }

    /// A `u32`.
    pub fn u32(mut self, v: u32) -> Self {
        self.values.push(Value::U32(v));
        self
    }

    /// A `u64`.
    pub fn u64(mut self, v: u64) -> Self {
        self.values.push(Value::U64(v));
        self
    }

    /// An `i32`.
    pub fn i32(mut self, v: i32) -> Self {
        self.values.push(Value::I32(v));
        self
    }

    /// An `i64`.
    pub fn i64(mut self, v: i64) -> Self {
        self.values.push(Value::I64(v));
        self
    }

    /// An `f32`.
    pub fn f32(mut self, v: f32) -> Self {
        self.values.push(Value::F32(v));
        self
    }

    /// An `f64`.
    pub fn f64(mut self, v: f64) -> Self {
        self.values.push(Value::F64(v));
        self
    }

    /// Device memory the library allocated for the launch: pushes its address.
    pub(super) fn slice<T>(mut self, s: &'a cudarc::driver::CudaSlice<T>) -> Self {
        use cudarc::driver::DevicePtr;
        let stream = s.stream().clone();
        let (ptr, _record) = s.device_ptr(&stream);
        self.gpus.push(stream.context().ordinal());
        self.values.push(Value::U64(ptr));
        self
    }

    fn fail(&mut self, why: String) {
        self.error.get_or_insert(why);
    }
}
