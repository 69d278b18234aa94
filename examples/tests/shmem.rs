//! The SHMEM-style example library (`examples/shmem`) as an embedder builds and runs it: gdaki's
//! C API is installed into a scratch prefix (`tools/capi/install.sh`), gshmem and its programs
//! are built by its Makefile with g++ (CPU mode: host threads play the kernels), and run as
//! several processes: one PE alone, two through the TCP rendezvous, two and three under
//! `mpirun`. Every PE verifies its data; a rank whose rendezvous never answers fails with a
//! clear error. The CUDA build of the same programs runs on the GPU machine (see
//! examples/shmem/README.md). Needs make, g++ and Open MPI (tools/setup.sh installs them);
//! without mpirun the MPI runs say SKIPPED.
mod common;

use common::free_port;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn must(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} (run tools/setup.sh: it installs make, g++ and Open MPI)"));
    assert!(
        out.status.success(),
        "{cmd:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn has(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// A line on the terminal while the test runs: written to stderr itself, past the harness's
/// capture (which takes only `eprintln!`), so that a minute of building says what it is.
fn say(what: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "    shmem: {what}");
}

/// Installs this build's C API and builds gshmem's CPU programs: their folder.
fn build(scratch: &Path) -> PathBuf {
    say("installing the C API and building gshmem with make (up to a minute on 2 cores)");
    let prefix = scratch.join("prefix");
    let mut install = Command::new(workspace().join("tools/capi/install.sh"));
    install.arg("--prefix").arg(&prefix);
    // The profile of this test, so the install reuses what cargo already built.
    let exe = std::env::current_exe().unwrap();
    if !exe.ancestors().any(|p| p.file_name().is_some_and(|n| n == "release")) {
        install.arg("--debug");
    }
    must(&mut install);
    let out = scratch.join("build");
    let mpi = if has("mpicc") { "1" } else { "0" };
    must(
        Command::new("make")
            .arg("-C")
            .arg(workspace().join("examples/shmem"))
            .arg(format!("GDAKI_PREFIX={}", prefix.display()))
            .arg(format!("BUILD={}", out.display()))
            .arg(format!("MPI={mpi}"))
            .arg("cpu"),
    );
    out.join("cpu")
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Every PE's summary line says it passed all its checks.
fn all_passed(out: &str, pes: usize) {
    let lines: Vec<&str> = out.lines().filter(|l| l.starts_with("gshmem_test: PE")).collect();
    assert_eq!(lines.len(), pes, "one summary per PE:\n{out}");
    for l in lines {
        assert!(l.ends_with(", 0 failed"), "{l}\n{out}");
    }
}

/// `n` PEs through the TCP rendezvous, each its own process.
fn tcp_job(program: &Path, n: usize, args: &[&str]) -> Vec<Output> {
    let addr = format!("127.0.0.1:{}", free_port());
    let children: Vec<_> = (0..n)
        .map(|rank| {
            Command::new(program)
                .args(args)
                .env("GSHMEM_BOOTSTRAP", "tcp")
                .env("GSHMEM_TCP_ADDR", &addr)
                .env("GSHMEM_RANK", rank.to_string())
                .env("GSHMEM_NRANKS", n.to_string())
                .env("GSHMEM_TIMEOUT_MS", "30000")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
}

fn mpirun(n: usize, program: &Path, args: &[&str]) -> Option<Output> {
    if !has("mpirun") {
        eprintln!("SKIPPED: mpirun -np {n} (no mpirun: tools/setup.sh installs Open MPI)");
        return None;
    }
    Some(
        Command::new("mpirun")
            .args(["--oversubscribe", "-np", &n.to_string()])
            .arg(program)
            .args(args)
            // Containers and CI run as root, which Open MPI refuses unless told.
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .output()
            .unwrap(),
    )
}

#[test]
fn gshmem_runs_on_one_two_and_three_pes_in_cpu_mode() {
    let scratch = std::env::temp_dir().join(format!("gdaki-shmem-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let bin = build(&scratch);
    let test = bin.join("shmem_test");
    say("running 1 PE, 2 through the TCP rendezvous, 2 and 3 under mpirun");

    // One PE: every operation goes through its loopback queue pair.
    let out = must(Command::new(&test).env_remove("GSHMEM_NRANKS"));
    all_passed(&text(&out), 1);

    // Two PEs through the TCP rendezvous.
    let outs = tcp_job(&test, 2, &[]);
    let joined: String = outs.iter().map(text).collect();
    assert!(outs.iter().all(|o| o.status.success()), "{joined}");
    all_passed(&joined, 2);
    assert!(joined.contains("tcp bootstrap"), "{joined}");

    // A rank whose rank 0 never comes says so, within its timeout.
    let started = std::time::Instant::now();
    let out = Command::new(&test)
        .env("GSHMEM_BOOTSTRAP", "tcp")
        .env("GSHMEM_TCP_ADDR", format!("127.0.0.1:{}", free_port()))
        .env("GSHMEM_RANK", "1")
        .env("GSHMEM_NRANKS", "2")
        .env("GSHMEM_TIMEOUT_MS", "300")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(text(&out).contains("rank 0 is not listening"), "{}", text(&out));
    assert!(started.elapsed().as_secs() < 20, "the timeout was not kept");
    // A bad rank is refused before anything listens.
    let out = Command::new(&test)
        .env("GSHMEM_BOOTSTRAP", "tcp")
        .env("GSHMEM_RANK", "2")
        .env("GSHMEM_NRANKS", "2")
        .output()
        .unwrap();
    assert!(
        !out.status.success() && text(&out).contains("rank 2 of 2"),
        "{}",
        text(&out)
    );

    // MPI: two and three PEs (three on two cores: oversubscribed).
    for n in [2, 3] {
        if let Some(out) = mpirun(n, &test, &[]) {
            assert!(out.status.success(), "{}", text(&out));
            all_passed(&text(&out), n);
            assert!(text(&out).contains("mpi bootstrap"), "{}", text(&out));
        }
    }

    // The all-to-all, verified on every PE, with its JSON.
    let a2a = bin.join("alltoall");
    // Three pieces a block: pieces of whole 16-byte units and a short last one, 100 bytes
    // included (16 + 16 + ... the last piece ends early).
    let args = ["-n", "5", "-w", "1", "-s", "64,100,4096,65536", "-b", "3", "--json"];
    let outs = match mpirun(2, &a2a, &args) {
        Some(out) => vec![out],
        None => tcp_job(&a2a, 2, &args),
    };
    for out in &outs {
        assert!(out.status.success(), "{}", text(out));
    }
    let stdout: String = outs
        .iter()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .collect();
    let json: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(json["pes"], 2);
    assert_eq!(json["verified"], true);
    let rows = json["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4);
    // CPU mode reaches every heap through queue pairs.
    assert_eq!(json["load_store_pes"], 0);
    for r in rows {
        assert_eq!(r["pieces"], 3);
        assert!(r["alltoall_us"].as_f64().unwrap() > 0.0 && r["copy_us"].as_f64().unwrap() > 0.0);
    }
    // The same exchange against the GIN-shaped handle is CUDA C++: the CPU build says so, and an
    // unknown API is named.
    for (api, says) in [("gin", "needs the GPU build"), ("nccl", "use gshmem or gin")] {
        let out = Command::new(&a2a)
            .args(["--api", api])
            .env_remove("GSHMEM_NRANKS")
            .output()
            .unwrap();
        assert!(
            !out.status.success() && text(&out).contains(says),
            "{api}: {}",
            text(&out)
        );
    }
    // So is the kernel written for NCCL's GIN (gdaki_nccl_gin.cuh), and its flags are checked.
    for (args, says) in [
        (&[][..], "needs the GPU build"),
        (&["-s", "0"][..], "out of range"),
        (&["--nccl"][..], "unknown argument"),
    ] {
        let out = Command::new(bin.join("gin_nccl")).args(args).output().unwrap();
        assert!(
            out.status.code() == Some(2) && text(&out).contains(says),
            "gin_nccl {args:?}: {}",
            text(&out)
        );
    }
    let _ = std::fs::remove_dir_all(&scratch);
}
