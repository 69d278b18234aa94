//! The C and CUDA C++ headers, generated from the Rust sources: `gdaki_device.h` (the shared
//! structs, the constants and the `extern "C"` data path of `gdaki_device::ffi`),
//! `gdaki_layout_check.h` (every struct's size, alignment and field offsets as Rust sees them,
//! as static assertions a C, C++ or CUDA compiler checks) and `gdaki.h` (the host C API of
//! `gdaki-capi`, through cbindgen). They are kept in the repository;
//! `gen-headers --check` (and the test suite) fails when regeneration would change them.
//!
//! The structs come from `gdaki-layout` through cbindgen; the constants and the function
//! declarations from the Rust constants and from `gdaki_device::ffi::OPERATIONS`, the table the
//! functions themselves are generated from, so neither can drift from the code.
use std::fmt::Write as _;
use std::mem::{align_of, offset_of, size_of};
use std::path::Path;

use gdaki_device::ffi::{self, OPERATIONS};
use gdaki_device::status;
use gdaki_layout::handle::{self, DevCq, DevQp, DevRemote, DevRq, DoorbellKind};
use gdaki_layout::socket::{DevSocket, DevSocketService, DEV_SOCKET_SERVICE_VERSION, DEV_SOCKET_VERSION};

/// Where the device header lives, from the workspace root.
pub const DEVICE_HEADER: &str = "device/include/gdaki_device.h";
/// Where the layout-check header lives, from the workspace root.
pub const LAYOUT_CHECK_HEADER: &str = "device/include/gdaki_layout_check.h";
/// Where the host C API's header lives, from the workspace root.
pub const HOST_HEADER: &str = "host/capi/include/gdaki.h";

/// The generated headers' text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Headers {
    /// `gdaki_device.h`.
    pub device: String,
    /// `gdaki_layout_check.h`.
    pub layout_check: String,
    /// `gdaki.h`.
    pub host: String,
}

impl Headers {
    /// Each header with its path from the workspace root.
    pub fn files(&self) -> [(&'static str, &str); 3] {
        [
            (DEVICE_HEADER, &self.device),
            (LAYOUT_CHECK_HEADER, &self.layout_check),
            (HOST_HEADER, &self.host),
        ]
    }

    /// The headers whose file under `workspace` differs from the generated text (or is missing).
    pub fn stale(&self, workspace: &Path) -> Vec<&'static str> {
        self.files()
            .into_iter()
            .filter(|(path, text)| std::fs::read_to_string(workspace.join(path)).ok().as_deref() != Some(*text))
            .map(|(path, _)| path)
            .collect()
    }
}

/// Why the headers could not be made.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    /// cbindgen could not read `gdaki-layout` or `gdaki-capi`.
    #[error("cbindgen on {crate_dir}: {why}")]
    Cbindgen {
        /// The crate it read.
        crate_dir: String,
        /// What it said.
        why: String,
    },
    /// The layout table below and the struct cbindgen found disagree (a field added in Rust
    /// and not listed here, or the reverse).
    #[error("{name}: fields in Rust {rust:?}, in the layout table {table:?}: update tools/src/headers.rs")]
    Fields {
        /// The C struct.
        name: &'static str,
        /// Its fields as cbindgen wrote them.
        rust: Vec<String>,
        /// Its fields as the table lists them.
        table: Vec<&'static str>,
    },
}

/// One struct's layout as Rust computes it.
struct Layout {
    c_name: &'static str,
    size: usize,
    align: usize,
    fields: Vec<(&'static str, usize)>,
}

/// A struct's layout: every field must be listed (checked against cbindgen's output).
macro_rules! layout {
    ($t:ty as $c:literal { $($field:ident),* $(,)? }) => {
        Layout {
            c_name: $c,
            size: size_of::<$t>(),
            align: align_of::<$t>(),
            fields: vec![$((stringify!($field), offset_of!($t, $field))),*],
        }
    };
}

fn layouts() -> Vec<Layout> {
    vec![
        layout!(DevCq as "gdaki_dev_cq" {
            consumed, error, hot_pad, cqe_base, dbrec, cqn, log_size, const_pad
        }),
        layout!(DevQp as "gdaki_dev_qp" {
            sq_reserved, sq_ready, sq_rung, db_lock, lock_pad, hot_pad, sq_base, sq_dbrec, doorbell,
            max_msg_size, timeout_ns, qpn, sq_log_size, doorbell_kind, flags, version_pad, version,
            const_pad, cq
        }),
        layout!(DevRq as "gdaki_dev_rq" {
            rq_reserved, rq_ready, index_base, hot_pad, rq_base, rq_dbrec, timeout_ns, qpn, log_size, log_stride,
            flags, version_pad, version, const_pad, cq
        }),
        layout!(DevRemote as "gdaki_remote_region" { addr, len, rkey, reserved }),
        layout!(DevSocket as "gdaki_dev_socket" {
            sent, consumed, credited, flags, credit_seen, taken, rx_key, tx_key, qp, rx_window, tx_ring, peer_window, rx_lkey,
            tx_lkey, peer_rkey, log_rx, log_tx, version, tail_pad
        }),
        layout!(DevSocketService as "gdaki_dev_socket_service" {
            calls, locks, timeout_ns, slots, version, pad
        }),
    ]
}

/// The constants the header defines: name, value, C type suffix (`u`, `ull`).
fn constants() -> Vec<(&'static str, u64, &'static str, &'static str)> {
    vec![
        (
            "GDAKI_DEV_QP_VERSION",
            handle::DEV_QP_VERSION as u64,
            "u",
            "version word of gdaki_dev_qp",
        ),
        (
            "GDAKI_MAX_INLINE",
            gdaki_device::MAX_INLINE as u64,
            "u",
            "most bytes put_inline carries",
        ),
        (
            "GDAKI_BLOCK_SCRATCH_BYTES",
            gdaki_device::scope::BLOCK_SCRATCH_BYTES as u64,
            "u",
            "size of gdaki_block_scratch",
        ),
        (
            "GDAKI_POST_DEFER",
            ffi::POST_DEFER as u64,
            "u",
            "post flag: ring later (commit)",
        ),
        (
            "GDAKI_POST_FENCE",
            ffi::POST_FENCE as u64,
            "u",
            "post flag: after earlier gets and atomics",
        ),
        (
            "GDAKI_QP_ATOMIC_REPLY_HOST_ORDER",
            handle::QP_ATOMIC_REPLY_HOST_ORDER as u64,
            "u",
            "flags: fetched values in host order",
        ),
        (
            "GDAKI_QP_FLUSH_AFTER_FETCH",
            handle::QP_FLUSH_AFTER_FETCH as u64,
            "u",
            "flags: reads and atomics end with a fenced DUMP",
        ),
        (
            "GDAKI_QP_RINGS_IN_GPU_MEMORY",
            handle::QP_RINGS_IN_GPU_MEMORY as u64,
            "u",
            "flags: rings in GPU memory",
        ),
        (
            "GDAKI_DOORBELL_GPU",
            DoorbellKind::Gpu as u64,
            "u",
            "doorbell_kind: the poster rings",
        ),
        (
            "GDAKI_DOORBELL_CPU_PROXY",
            DoorbellKind::CpuProxy as u64,
            "u",
            "doorbell_kind: a CPU proxy rings",
        ),
        (
            "GDAKI_DOORBELL_CPU_ASSISTED",
            DoorbellKind::CpuAssisted as u64,
            "u",
            "doorbell_kind: the poster rings a host word, a CPU proxy forwards it",
        ),
        (
            "GDAKI_ERROR_VALID",
            handle::ERROR_VALID,
            "ull",
            "gdaki_dev_cq.error holds an error",
        ),
        (
            "GDAKI_DEV_SOCKET_VERSION",
            DEV_SOCKET_VERSION as u64,
            "u",
            "version word of gdaki_dev_socket",
        ),
        (
            "GDAKI_DEV_SOCKET_SERVICE_VERSION",
            DEV_SOCKET_SERVICE_VERSION as u64,
            "u",
            "version word of gdaki_dev_socket_service",
        ),
        (
            "GDAKI_DEV_RQ_VERSION",
            handle::DEV_RQ_VERSION as u64,
            "u",
            "gdaki_dev_rq.version of this layout",
        ),
        (
            "GDAKI_MAX_SEND_INLINE",
            gdaki_device::MAX_SEND_INLINE as u64,
            "u",
            "most bytes a send_inline carries",
        ),
        ("GDAKI_RECV_SEND", 0, "u", "poll_recv kind: a SEND"),
        (
            "GDAKI_RECV_SEND_IMM",
            1,
            "u",
            "poll_recv kind: a SEND with immediate data",
        ),
        (
            "GDAKI_RECV_WRITE_IMM",
            2,
            "u",
            "poll_recv kind: an RDMA WRITE with immediate data",
        ),
        ("GDAKI_OK", status::CODE_OK as u64, "u", "success"),
        (
            "GDAKI_CODE_TIMEOUT",
            status::CODE_TIMEOUT as u64,
            "u",
            "a completion wait timed out",
        ),
        (
            "GDAKI_CODE_INLINE_TOO_LONG",
            status::CODE_INLINE_TOO_LONG as u64,
            "u",
            "inline data too long",
        ),
        (
            "GDAKI_CODE_BAD_HANDLE",
            status::CODE_BAD_HANDLE as u64,
            "u",
            "null handle or wrong version",
        ),
        (
            "GDAKI_CODE_BAD_COUNT",
            status::CODE_BAD_COUNT as u64,
            "u",
            "a reservation of 0 or more than the ring",
        ),
        (
            "GDAKI_CODE_BAD_SCOPE",
            status::CODE_BAD_SCOPE as u64,
            "u",
            "warp scope from a partial warp",
        ),
        (
            "GDAKI_CODE_FLAG_TIMEOUT",
            status::CODE_FLAG_TIMEOUT as u64,
            "u",
            "a signal wait timed out",
        ),
        (
            "GDAKI_CODE_MISALIGNED",
            status::CODE_MISALIGNED as u64,
            "u",
            "atomic target not 8-byte aligned",
        ),
        (
            "GDAKI_CODE_CQE_FORMAT",
            status::CODE_CQE_FORMAT as u64,
            "u",
            "a CQE format gdaki does not read",
        ),
        (
            "GDAKI_CODE_BAD_ARGUMENT",
            status::CODE_BAD_ARGUMENT as u64,
            "u",
            "unknown flags, null scratch or data",
        ),
        (
            "GDAKI_CODE_TOO_LONG",
            status::CODE_TOO_LONG as u64,
            "u",
            "a message longer than one WQE takes",
        ),
        (
            "GDAKI_CODE_TOO_MANY_BUFS",
            status::CODE_TOO_MANY_BUFS as u64,
            "u",
            "more receive buffers than the stride",
        ),
        (
            "GDAKI_CODE_WOULD_BLOCK",
            status::CODE_WOULD_BLOCK as u64,
            "u",
            "a socket call would block",
        ),
        (
            "GDAKI_CODE_RESET",
            status::CODE_RESET as u64,
            "u",
            "a socket's connection was reset",
        ),
        (
            "GDAKI_CODE_CLOSED",
            status::CODE_CLOSED as u64,
            "u",
            "a send after the socket's shutdown",
        ),
        (
            "GDAKI_CODE_REFUSED",
            status::CODE_REFUSED as u64,
            "u",
            "a socket service refused the call (no listener, address or port)",
        ),
        (
            "GDAKI_CODE_CQE_ERROR",
            status::CODE_CQE_ERROR as u64,
            "u",
            "an error CQE; the low byte is the syndrome",
        ),
    ]
}

/// The structs, through cbindgen.
fn structs(workspace: &Path) -> Result<String, HeaderError> {
    let crate_dir = workspace.join("shared-layout");
    let mut cfg = cbindgen::Config {
        language: cbindgen::Language::C,
        no_includes: true,
        style: cbindgen::Style::Both,
        documentation_style: cbindgen::DocumentationStyle::Doxy,
        ..Default::default()
    };
    cfg.export.include = vec![
        "DevQp".into(),
        "DevRq".into(),
        "DevRemote".into(),
        "DevSocket".into(),
        "DevSocketService".into(),
    ];
    cfg.export.item_types = vec![cbindgen::ItemType::Structs];
    cfg.layout.aligned_n = Some("GDAKI_ALIGNED".into());
    Ok(cbindgen_on(&crate_dir, cfg)?.trim().to_string())
}

/// The field names of C struct `name` in cbindgen's output.
fn c_fields(structs: &str, name: &str) -> Vec<String> {
    let open = format!(" {name} {{");
    let Some(start) = structs.find(&open) else {
        return vec![];
    };
    let body = &structs[start + open.len()..];
    let body = &body[..body.find("\n}").unwrap_or(body.len())];
    body.lines()
        .map(str::trim)
        .filter(|l| l.ends_with(';'))
        .filter_map(|l| {
            let decl = l.trim_end_matches(';');
            let decl = decl.split('[').next()?;
            decl.rsplit(' ').next().map(str::to_string)
        })
        .collect()
}

/// A C declaration's parameter list for one scope: the handle (`gdaki_dev_qp *qp`, say), the
/// scratch in block scope, then the operation's own.
fn c_params(handle: &str, op: &ffi::Operation, scope: &str) -> String {
    let mut params = vec![handle.to_string()];
    if scope == "block" {
        params.push("gdaki_block_scratch *block_scratch".into());
    }
    params.extend(op.params.iter().map(|p| {
        let sep = if p.c_type.ends_with('*') { "" } else { " " };
        format!("{}{sep}{}", p.c_type, p.name)
    }));
    params.join(", ")
}

/// The scoped operations' tables: each with its handle parameter, the comment that introduces
/// it in the header (none for the queue pair's, which the header's opening describes), and its
/// operations.
fn scoped_tables() -> [(&'static str, &'static str, &'static [ffi::Operation]); 2] {
    [
        ("gdaki_dev_qp *qp", "", OPERATIONS),
        (
            "gdaki_dev_socket *socket",
            "\n/* Sockets (gdaki_dev_socket, from gdaki_socket_export_gpu): byte streams in every\n \
             * scope, POSIX results (bytes moved through the out-pointer, 0 from a receive at the\n \
             * end of the stream); the mode is the socket queue pair's. See docs/sockets.md. */\n",
            ffi::socket::OPERATIONS,
        ),
    ]
}

/// Every function the header declares, as `(scope, mode, name)` (the receive-queue functions,
/// per thread in every scope, as thread scope).
pub fn functions() -> Vec<(&'static str, &'static str, String)> {
    let mut all = vec![];
    for op in scoped_tables().iter().flat_map(|(_, _, ops)| ops.iter()) {
        for scope in ffi::SCOPES {
            for mode in ffi::MODES {
                all.push((scope, mode, format!("gdaki_{}_{scope}_{mode}", op.name)));
            }
        }
    }
    for op in ffi::RECV_OPERATIONS {
        for mode in ffi::MODES {
            all.push(("thread", mode, format!("gdaki_{}_{mode}", op.name)));
        }
    }
    for op in ffi::socket::SERVICE_OPERATIONS {
        for scope in ffi::SCOPES {
            all.push((scope, "", format!("gdaki_{}_{scope}", op.name)));
        }
    }
    all
}

/// A receive-queue function's parameter list: the handle, then the operation's own.
fn c_recv_params(op: &ffi::Operation) -> String {
    let mut params = vec!["gdaki_dev_rq *rq".to_string()];
    params.extend(op.params.iter().map(|p| {
        let sep = if p.c_type.ends_with('*') { "" } else { " " };
        format!("{}{sep}{}", p.c_type, p.name)
    }));
    params.join(", ")
}

const GENERATED: &str = "Generated by `cargo run -p gdaki-tools --bin gen-headers` from gdaki's Rust sources: do not \
                         edit.";

/// Generates both headers.
pub fn generate(workspace: &Path) -> Result<Headers, HeaderError> {
    let structs = structs(workspace)?;
    let layouts = layouts();
    for l in &layouts {
        let rust = c_fields(&structs, l.c_name);
        let table: Vec<&str> = l.fields.iter().map(|f| f.0).collect();
        if rust != table {
            return Err(HeaderError::Fields {
                name: l.c_name,
                rust,
                table,
            });
        }
    }
    Ok(Headers {
        device: device_header(&structs),
        layout_check: layout_check_header(&layouts),
        host: host_header(workspace)?,
    })
}

/// `gdaki.h`: cbindgen over `gdaki-capi`, whose items are written in C's names already.
fn host_header(workspace: &Path) -> Result<String, HeaderError> {
    let crate_dir = workspace.join("host/capi");
    let mut cfg = cbindgen::Config {
        language: cbindgen::Language::C,
        header: Some(format!(
            "/* gdaki.h: gdaki's host C API (libgdaki.so, libgdaki.a; pkg-config: gdaki).\n \
             * {GENERATED}\n \
             *\n \
             * Every function returns a gdaki_status; on failure nothing changed and gdaki_last_error()\n \
             * says what, with the values. Outputs go through out-pointers; every handle has a\n \
             * _destroy that takes NULL. The data path is gdaki_device.h's. See docs/c-api.md. */"
        )),
        include_guard: Some("GDAKI_H".into()),
        no_includes: true,
        after_includes: Some("#include <stddef.h>\n#include <stdint.h>\n\n#include \"gdaki_device.h\"".into()),
        cpp_compat: true,
        usize_is_size_t: true,
        style: cbindgen::Style::Both,
        documentation_style: cbindgen::DocumentationStyle::Doxy,
        ..Default::default()
    };
    cfg.enumeration.rename_variants = cbindgen::RenameRule::ScreamingSnakeCase;
    cfg.enumeration.prefix_with_name = true;
    cbindgen_on(&crate_dir, cfg)
}

/// What cbindgen writes for the crate at `crate_dir` with `cfg`. The shared structs keep their
/// C names in both headers.
fn cbindgen_on(crate_dir: &Path, mut cfg: cbindgen::Config) -> Result<String, HeaderError> {
    for (rust, c) in [
        ("DevQp", "gdaki_dev_qp"),
        ("DevCq", "gdaki_dev_cq"),
        ("DevRq", "gdaki_dev_rq"),
        ("DevRemote", "gdaki_remote_region"),
        ("DevSocket", "gdaki_dev_socket"),
        ("DevSocketService", "gdaki_dev_socket_service"),
    ] {
        cfg.export.rename.insert(rust.into(), c.into());
    }
    let bindings = cbindgen::Builder::new()
        .with_config(cfg)
        .with_crate(crate_dir)
        .generate()
        .map_err(|e| HeaderError::Cbindgen {
            crate_dir: crate_dir.display().to_string(),
            why: e.to_string(),
        })?;
    let mut out = Vec::new();
    bindings.write(&mut out);
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// Writes `decls` of `scope`: warp and block scope inside `#ifdef GDAKI_CUDA` (host builds
/// declare thread scope only).
fn in_scope(h: &mut String, scope: &str, decls: impl FnOnce(&mut String)) {
    let gpu_only = scope != "thread";
    if gpu_only {
        h.push_str("#ifdef GDAKI_CUDA\n");
    }
    decls(h);
    if gpu_only {
        h.push_str("#endif\n");
    }
}

fn device_header(structs: &str) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        r#"/* gdaki_device.h: gdaki's data path for CUDA C++ (and C on the host, in CPU mode).
 * {GENERATED}
 *
 * Functions are named gdaki_<operation>_<scope>_<mode>: scope thread, warp (all 32 lanes,
 * converged) or block (every thread, with a gdaki_block_scratch in shared or global memory);
 * mode exclusive (one poster owns the QP), cta (posters of one block) or gpu (posters of any
 * block). Each returns GDAKI_OK or a GDAKI_CODE_*; out-pointers may be NULL. In warp and block
 * scope every member calls with the same handle, flags and scratch, and its own buffers.
 * Host builds (no CUDA) declare thread scope only. See docs/cuda-cpp.md. */
#ifndef GDAKI_DEVICE_H
#define GDAKI_DEVICE_H

#if defined(__CUDACC_RTC__)
/* NVRTC has no <stdint.h>: libcu++'s when the CUDA include directory is on the path, else the
 * LP64 types it would define. */
#if __has_include(<cuda/std/cstdint>)
#include <cuda/std/cstdint>
typedef cuda::std::uint8_t uint8_t;
typedef cuda::std::uint32_t uint32_t;
typedef cuda::std::uint64_t uint64_t;
#else
typedef unsigned char uint8_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
#endif
#else
#include <stdint.h>
#endif

#if defined(__CUDACC__) || defined(__CUDA__)
#define GDAKI_CUDA 1
#define GDAKI_DEVICE_FN __device__
#else
#define GDAKI_DEVICE_FN
#endif
#define GDAKI_ALIGNED(n) __attribute__((aligned(n)))

#ifdef __cplusplus
extern "C" {{
#endif

"#
    );
    for (name, value, suffix, doc) in constants() {
        let _ = writeln!(h, "/** {doc} */\n#define {name} {value}{suffix}");
    }
    let _ = write!(
        h,
        "\n{structs}\n\n/** Scratch memory of a block's collectives (block scope). */\n\
         typedef struct GDAKI_ALIGNED(16) gdaki_block_scratch {{\n  uint64_t words[GDAKI_BLOCK_SCRATCH_BYTES / 8];\n\
         }} gdaki_block_scratch;\n"
    );
    for (handle, intro, ops) in scoped_tables() {
        h.push_str(intro);
        for op in ops {
            let doc: Vec<&str> = op.doc.lines().map(str::trim).collect();
            let _ = write!(h, "\n/** {}: {}", op.name, doc.join("\n * "));
            let _ = writeln!(h, " */");
            for scope in ffi::SCOPES {
                in_scope(&mut h, scope, |h| {
                    for mode in ffi::MODES {
                        let _ = writeln!(
                            h,
                            "GDAKI_DEVICE_FN uint32_t gdaki_{}_{scope}_{mode}({});",
                            op.name,
                            c_params(handle, op, scope)
                        );
                    }
                });
            }
        }
    }
    h.push_str(
        "\n/* The receive queue (gdaki_dev_rq, from gdaki_qp_host_receive_handle or\n \
         * gdaki_gpu_qp_receive_handle): each thread posts and polls its own receives, in every\n \
         * scope; functions are named gdaki_<operation>_<mode>. See docs/two-sided.md. */\n",
    );
    for op in ffi::RECV_OPERATIONS {
        let doc: Vec<&str> = op.doc.lines().map(str::trim).collect();
        let _ = writeln!(h, "\n/** {}: {} */", op.name, doc.join("\n * "));
        for mode in ffi::MODES {
            let _ = writeln!(
                h,
                "GDAKI_DEVICE_FN uint32_t gdaki_{}_{mode}({});",
                op.name,
                c_recv_params(op)
            );
        }
    }
    h.push_str(
        "\n/* The socket service (gdaki_dev_socket_service, from gdaki_socket_service_handle):\n \
         * connection set-up from kernels, as GPUnet's gconnect_in and gaccept, served by a host\n \
         * thread; functions are named gdaki_socket_<operation>_<scope>, with no mode (they post\n \
         * to no queue pair). See docs/sockets.md. */\n",
    );
    for op in ffi::socket::SERVICE_OPERATIONS {
        let doc: Vec<&str> = op.doc.lines().map(str::trim).collect();
        let _ = writeln!(h, "\n/** {}: {} */", op.name, doc.join("\n * "));
        for scope in ffi::SCOPES {
            in_scope(&mut h, scope, |h| {
                let _ = writeln!(
                    h,
                    "GDAKI_DEVICE_FN uint32_t gdaki_{}_{scope}({});",
                    op.name,
                    c_params("const gdaki_dev_socket_service *service", op, scope)
                );
            });
        }
    }
    h.push_str("\n#ifdef __cplusplus\n}\n#endif\n\n#endif /* GDAKI_DEVICE_H */\n");
    h
}

fn layout_check_header(layouts: &[Layout]) -> String {
    let mut h = format!(
        "/* gdaki_layout_check.h: sizes, alignments and offsets of gdaki's shared structs as Rust lays them \
         out.\n * {GENERATED}\n * Include it once in any translation unit: it compiles to nothing, or fails. */\n\
         #ifndef GDAKI_LAYOUT_CHECK_H\n#define GDAKI_LAYOUT_CHECK_H\n\n#include \"gdaki_device.h\"\n\n\
         #ifdef __cplusplus\n#define GDAKI_ASSERT(e, m) static_assert(e, m)\n#define GDAKI_ALIGNOF(t) alignof(t)\n\
         #else\n#define GDAKI_ASSERT(e, m) _Static_assert(e, m)\n#define GDAKI_ALIGNOF(t) _Alignof(t)\n#endif\n\
         /* NVRTC has no offsetof: there, sizes and alignments are checked, offsets are not. */\n\
         #if defined(__CUDACC_RTC__)\n#define GDAKI_OFFSET_CHECK(t, f, n)\n#else\n\
         #define GDAKI_OFFSET_CHECK(t, f, n) GDAKI_ASSERT(__builtin_offsetof(t, f) == n, \"offset of \" #t \".\" #f);\n\
         #endif\n\n"
    );
    for l in layouts {
        let c = l.c_name;
        let _ = writeln!(h, "GDAKI_ASSERT(sizeof({c}) == {}, \"size of {c}\");", l.size);
        let _ = writeln!(
            h,
            "GDAKI_ASSERT(GDAKI_ALIGNOF({c}) == {}, \"alignment of {c}\");",
            l.align
        );
        for (f, off) in &l.fields {
            let _ = writeln!(h, "GDAKI_OFFSET_CHECK({c}, {f}, {off})");
        }
    }
    let scratch = gdaki_device::scope::BLOCK_SCRATCH_BYTES;
    let _ = writeln!(
        h,
        "GDAKI_ASSERT(sizeof(gdaki_block_scratch) == {scratch}, \"size of gdaki_block_scratch\");\n\
         GDAKI_ASSERT(GDAKI_ALIGNOF(gdaki_block_scratch) == 16, \"alignment of gdaki_block_scratch\");\n\
         GDAKI_ASSERT(GDAKI_DEV_QP_VERSION == {}u, \"handle version\");\n\
         GDAKI_ASSERT(GDAKI_DEV_SOCKET_VERSION == {}u, \"socket handle version\");\n\n#endif /* GDAKI_LAYOUT_CHECK_H */",
        handle::DEV_QP_VERSION,
        DEV_SOCKET_VERSION
    );
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_from_cbindgen_output() {
        let text = "typedef struct GDAKI_ALIGNED(64) x {\n  uint64_t a;\n  uint8_t pad[2];\n  struct y cq;\n} x;";
        assert_eq!(c_fields(text, "x"), ["a", "pad", "cq"]);
        assert!(c_fields(text, "z").is_empty());
    }

    #[test]
    fn every_operation_has_every_scope_and_mode() {
        assert_eq!(
            functions().len(),
            (OPERATIONS.len() + ffi::socket::OPERATIONS.len()) * 9
                + ffi::RECV_OPERATIONS.len() * 3
                + ffi::socket::SERVICE_OPERATIONS.len() * 3
        );
        let put = OPERATIONS.iter().find(|o| o.name == "put").unwrap();
        assert_eq!(
            c_params("gdaki_dev_qp *qp", put, "block"),
            "gdaki_dev_qp *qp, gdaki_block_scratch *block_scratch, uint64_t dst, uint32_t rkey, uint64_t src, \
             uint32_t lkey, uint64_t len, uint32_t flags, uint64_t *ticket"
        );
    }
}
