//! The own-kernel example end to end: CPU mode everywhere, the GPU kernel where a GPU is usable
//! (SKIPPED otherwise, unless `GDAKI_REQUIRE_GPU=1`, which makes a missing GPU a failure).
use std::process::{Command, Output};

/// The binary: cargo's build, or `$GDAKI_BIN_DIR/own-kernel` in the GPU bundle.
fn run(args: &[&str]) -> Output {
    let bin = match std::env::var_os("GDAKI_BIN_DIR") {
        Some(dir) => std::path::PathBuf::from(dir).join("own-kernel"),
        None => env!("CARGO_BIN_EXE_own-kernel").into(),
    };
    Command::new(&bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn cpu_threads_run_the_kernel_body_and_the_data_arrives() {
    let out = run(&["--mode", "cpu", "--posters", "16", "--chunk", "1000"]);
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("16 chunks of 1000 B put by CPU threads running scatter and verified"),
        "{}",
        text(&out)
    );
}

#[test]
fn the_gpu_kernel_runs_with_typed_arguments_and_the_data_arrives() {
    let out = run(&["--mode", "gpu", "--posters", "256", "--chunk", "512"]);
    let required = std::env::var("GDAKI_REQUIRE_GPU").is_ok_and(|v| v == "1");
    if !out.status.success() && !required {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED (no usable GPU or no PTX): own-kernel --mode gpu: {}",
            text(&out).trim()
        );
        return;
    }
    assert!(out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("256 chunks of 512 B put by GPU kernel own_scatter"),
        "{}",
        text(&out)
    );
}

#[test]
fn bad_flags_are_errors() {
    let out = run(&["--posters", "0"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("--posters 1..=1024"), "{}", text(&out));
}
