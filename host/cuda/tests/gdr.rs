//! gdrcopy's call sequence, against a stand-in libgdrapi (`tests/gdr_standin.c`, compiled
//! here with `cc`): no machine here has the gdrdrv kernel driver, so what runs on a real one is
//! the same calls in the same order, which this checks, and the stand-in refuses what gdrdrv
//! refuses (unaligned pins, maps of another size, copies outside the mapping).
use std::io::Write as _;
use std::path::PathBuf;
use std::process::Command;

use gdaki_cuda::gdr::{Gdr, GdrError, GdrMapping, GPU_PAGE};

fn standin() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gdaki-gdr-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lib = dir.join("libgdrapi_standin.so");
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/gdr_standin.c");
    let out = Command::new("cc")
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o"])
        .arg(&lib)
        .arg(&src)
        .arg("-ldl")
        .output()
        .expect("cc (tools/setup.sh installs gcc)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    lib
}

/// The stand-in's call log, read through `lib` (the test keeps the library loaded, so its
/// state survives gdaki's own handle).
fn calls(lib: &libloading::Library) -> String {
    // SAFETY: `standin_log` returns the stand-in's NUL-terminated log.
    unsafe {
        let f: libloading::Symbol<unsafe extern "C" fn() -> *const std::ffi::c_char> =
            lib.get(b"standin_log\0").unwrap();
        std::ffi::CStr::from_ptr(f()).to_string_lossy().trim().to_string()
    }
}

/// One test (the knobs are process-wide environment variables): absent driver, absent library,
/// then the whole sequence on the stand-in.
#[test]
fn gdrcopy_is_opened_pinned_mapped_copied_and_released_in_order() {
    // SAFETY (each set_var): this test binary has no other test and no other thread reading them.
    unsafe { std::env::set_var("GDAKI_GDRDRV", "/nonexistent/gdrdrv") };
    assert!(matches!(Gdr::open().unwrap_err(), GdrError::NoDriver(_)));
    let node = std::env::temp_dir().join(format!("gdaki-gdrdrv-{}", std::process::id()));
    std::fs::write(&node, b"").unwrap();
    unsafe { std::env::set_var("GDAKI_GDRDRV", &node) };
    unsafe { std::env::set_var("GDAKI_GDRAPI", "/nonexistent/libgdrapi.so.2") };
    let err = Gdr::open().unwrap_err();
    assert!(matches!(err, GdrError::NoLibrary { .. }), "{err}");
    assert!(err.to_string().contains("libgdrapi"), "{err}");

    let lib = standin();
    // SAFETY: the stand-in built above (its initialisers do nothing).
    let kept = unsafe { libloading::Library::new(&lib) }.unwrap();
    unsafe { std::env::set_var("GDAKI_GDRAPI", &lib) };
    let gdr = Gdr::open().unwrap();
    assert_eq!(gdr.version(), (2, 5));
    // "Device memory": two GPU pages of host memory, the range straddling the boundary.
    let layout = std::alloc::Layout::from_size_align(2 * GPU_PAGE as usize, GPU_PAGE as usize).unwrap();
    // SAFETY: a non-zero layout; freed at the end.
    let base = unsafe { std::alloc::alloc_zeroed(layout) };
    let addr = base as u64 + GPU_PAGE - 100;
    {
        // SAFETY: the range lies in the allocation, which outlives the mapping.
        let m = unsafe { GdrMapping::new(&gdr, addr, 200) }.unwrap();
        let data: Vec<u8> = (0..200u8).collect();
        m.write(0, &data).unwrap();
        // SAFETY: inside the allocation.
        let landed = unsafe { std::slice::from_raw_parts(base.add(GPU_PAGE as usize - 100), 200) };
        assert_eq!(landed, &data[..], "the bytes are where the address said");
        let mut back = [0u8; 50];
        m.read(150, &mut back).unwrap();
        assert_eq!(&back[..], &data[150..]);
        // Outside the range: refused before any call.
        assert!(matches!(m.write(150, &[0; 51]), Err(GdrError::Range(_))));
        assert!(matches!(m.read(usize::MAX, &mut back), Err(GdrError::Range(_))));
    }
    // SAFETY: as above.
    assert!(matches!(
        unsafe { GdrMapping::new(&gdr, addr, 0) },
        Err(GdrError::Range(_))
    ));
    drop(gdr);
    assert_eq!(calls(&kept), "open pin map copy_to copy_from unmap unpin close");
    // SAFETY: allocated above with this layout.
    unsafe { std::alloc::dealloc(base, layout) };

    device_buffers_read_and_write_through_the_mapping(&kept);
    let _ = std::fs::remove_file(&node);
}

/// On a GPU (the stand-in's CUDA mode: its copies are CUDA copies of the real memory): a device
/// buffer's small reads and writes go through one gdrcopy mapping of the whole buffer, pinned
/// only once its memory synchronises memory operations, and released before the memory is
/// freed; larger ones are CUDA copies; the bytes are where CUDA's own copies find them.
/// Without a GPU: says SKIPPED (fails under `GDAKI_REQUIRE_GPU=1`).
fn device_buffers_read_and_write_through_the_mapping(kept: &libloading::Library) {
    use cudarc::driver::sys;
    let gpu = match gdaki_cuda::Gpu::open(0) {
        Ok(g) => g,
        Err(e) if std::env::var("GDAKI_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("GDAKI_REQUIRE_GPU=1 but no usable GPU: {e}")
        }
        Err(e) => {
            // Not captured by the test harness (as the other GPU tests say it).
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED (no usable GPU): device_buffers_read_and_write_through_the_mapping: {e}"
            );
            return;
        }
    };
    // SAFETY: as above (no other thread reads the environment).
    unsafe { std::env::set_var("STANDIN_CUDA", "1") };
    let before = calls(kept).len();
    let buf = gdaki_cuda::DeviceBuffer::zeroed(&gpu, 3 * GPU_PAGE as usize + 100).unwrap();
    let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 255) as u8).collect();
    let at = GPU_PAGE as usize - 1000; // across a GPU page boundary
    buf.write(at, &data).unwrap();
    assert!(buf.cpu_mapped(), "{}", calls(kept));
    let mut seen = vec![0u8; data.len()];
    // SAFETY: a range inside the live buffer, into a host slice of its length.
    unsafe { sys::cuMemcpyDtoH_v2(seen.as_mut_ptr().cast(), buf.device_addr() + at as u64, seen.len()) }
        .result()
        .unwrap();
    assert_eq!(seen, data, "what the mapping wrote is in device memory");
    let back: Vec<u8> = data.iter().rev().copied().collect();
    // SAFETY: as above, from a host slice.
    unsafe { sys::cuMemcpyHtoD_v2(buf.device_addr() + 64, back.as_ptr().cast(), back.len()) }
        .result()
        .unwrap();
    let mut got = vec![0u8; back.len()];
    // Reads up to READ_MAX go through the mapping, larger ones (the rest: 5904 bytes) are
    // CUDA copies.
    assert!(back.len() - gdaki_cuda::gdr::READ_MAX > gdaki_cuda::gdr::READ_MAX);
    buf.read(64, &mut got[..gdaki_cuda::gdr::READ_MAX]).unwrap();
    let mapped = calls(kept);
    buf.read(64 + gdaki_cuda::gdr::READ_MAX, &mut got[gdaki_cuda::gdr::READ_MAX..])
        .unwrap();
    assert_eq!(got, back, "the mapping reads device memory, and so does the CUDA copy");
    let big = vec![7u8; gdaki_cuda::gdr::WRITE_MAX + 1];
    buf.write(0, &big).unwrap();
    assert_eq!(calls(kept), mapped, "the larger read and write went past the mapping");
    assert!(matches!(
        buf.read(buf.len() - 10, &mut [0u8; 11]),
        Err(gdaki_cuda::CudaError::OutOfBounds { .. })
    ));
    drop(buf);
    let log = calls(kept);
    assert_eq!(
        &log[before..].trim(),
        &"open pin map copy_to copy_from unmap unpin",
        "one mapping of the whole buffer, released with it"
    );
}
