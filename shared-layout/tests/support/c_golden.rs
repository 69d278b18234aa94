//! Builds and runs a golden C program (a small encoder compiled against the system's rdma-core
//! headers), shared by the golden tests of gdaki-layout and gdaki-device. A missing compiler or
//! header fails the test with the fix: `tools/setup.sh` installs them (gcc, libibverbs-dev).
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Compiles `src` into `out` (`-Wall -Werror`), panicking with the set-up hint if it cannot.
#[allow(dead_code)] // each test binary uses one of the two
pub fn build(src: &Path, out: &Path) -> PathBuf {
    build_with(src, out, &[])
}

/// [`build`] with extra compiler arguments (`-D` definitions).
pub fn build_with(src: &Path, out: &Path, args: &[String]) -> PathBuf {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-std=gnu11", "-O1", "-Wall", "-Werror", "-o"])
        .arg(out)
        .args(args)
        .arg(src)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {cc} ({e}); run tools/setup.sh"));
    assert!(
        status.success(),
        "{cc} could not build {} against rdma-core's and the kernel's mlx5 headers: run tools/setup.sh",
        src.display()
    );
    out.to_path_buf()
}

/// Runs the program `bin` over `input`, returning its output lines.
pub fn run(bin: &Path, input: &str) -> Vec<String> {
    let mut child = Command::new(bin)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn golden");
    // Feed stdin from another thread: the program answers as it reads, and a full stdout pipe
    // would otherwise block it while we still write.
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_string();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(out.status.success(), "golden program failed: {:?}", out.status);
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect()
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A small deterministic generator (xorshift64*), so failures reproduce.
pub struct Rng(pub u64);
impl Rng {
    /// The next value.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}
