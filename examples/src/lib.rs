//! `gdaki-examples`: the perftests people quote (`put_bw`, RDMA WRITE bandwidth and message
//! rate; `write_lat`, ping-pong latency), following perftest's `ib_write_bw` / `ib_write_lat`
//! conventions, and an example of embedding gdaki in an NVSHMEM-like CUDA C++ library. Shared
//! pieces of the perftests live here: flags ([`cli`]), setup and the two-process handshake
//! ([`session`]), output and statistics ([`report`]), and `--plot` ([`plot`]). The loops that
//! post are `gdaki_device::perf`'s, run by GPU kernels or by CPU threads.
//!
//! Where to start: `tools/run.sh` runs put_bw as a newcomer would; `put_bw --help` and
//! `write_lat --help` list the perftest flags. The statistics are the library's too:
//!
//! ```
//! use gdaki_examples::report::LatRow;
//! // Round trips in ns; a latency is half of one, as perftest reports it.
//! let row = LatRow::from_round_trips(8, &[4_000, 4_200, 3_800, 4_000, 30_000]);
//! assert_eq!(row.bytes, 8);
//! assert!(row.t_min_us <= row.t_typical_us && row.t_typical_us <= row.t_max_us);
//! ```
#![warn(missing_docs)]

pub mod cli;
pub mod plot;
pub mod report;
pub mod session;
pub mod sock;
pub mod stream;

/// `e` and its causes, each said once: gdaki's errors already include their cause in their
/// text (what a C caller's `gdaki_last_error` shows), so a cause a message already contains is
/// not repeated after it, as `{:#}` would.
pub fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let s = cause.to_string();
        if text.contains(&s) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&s);
    }
    text
}

/// Sets `tracing` up for a perftest: warnings and above on stderr unless `RUST_LOG` says more.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour only for a terminal: piped logs stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Writes one line of results to stdout. A reader that went away (`put_bw | head`) ends the
/// program quietly with the shell's code for SIGPIPE instead of a panic.
pub fn write_out(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if writeln!(std::io::stdout().lock(), "{args}").is_err() {
        std::process::exit(141);
    }
}

/// `println!` for results: see [`write_out`].
#[macro_export]
macro_rules! outln {
    ($($t:tt)*) => { $crate::write_out(format_args!($($t)*)) };
}
