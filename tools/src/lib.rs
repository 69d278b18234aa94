//! `gdaki-tools`: the project's tools. Binaries: `doctor` (can this machine run gdaki, and
//! how), `gen-headers` (the C and CUDA C++ headers, from the Rust sources: [`headers`]); what the
//! CUDA C++ data path costs a kernel in registers ([`registers`], measured by a test). The scripts beside this crate (`setup.sh`, `test.sh`, `run.sh`, `gpu-bundle.sh`) set up
//! a machine, run the test suite, run the main job, and package the GPU tests for a GPU machine
//! without Rust.
#![warn(missing_docs)]

pub mod headers;
pub mod registers;

/// Installs a `tracing` subscriber writing to stderr, filtered by `RUST_LOG` (default `warn`,
/// or `info` with `verbose`). Shared by the tools so they all log alike.
pub fn init_tracing(verbose: bool) {
    let default = if verbose { "info" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only for a terminal: piped logs stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
