//! `put_bw`, `write_lat`, `sock_bw` and `sock_lat` end to end, as users run them: loopback and server / client on
//! 127.0.0.1 in CPU mode (the table parses, data is validated, `--json` has the documented
//! keys), the errors users hit (flag mismatch, refused connection, bad flags), and the same on
//! a GPU where one is usable (SKIPPED otherwise, unless `GDAKI_REQUIRE_GPU=1`).
mod common;

use common::free_port;
use std::io::Write;
use std::process::{Command, Output, Stdio};

/// A perftest binary: cargo's build, or `$GDAKI_BIN_DIR/<name>` in the GPU bundle.
fn bin(name: &str) -> std::path::PathBuf {
    match std::env::var_os("GDAKI_BIN_DIR") {
        Some(dir) => std::path::PathBuf::from(dir).join(name),
        None => match name {
            "put_bw" => env!("CARGO_BIN_EXE_put_bw").into(),
            "write_lat" => env!("CARGO_BIN_EXE_write_lat").into(),
            "sock_bw" => env!("CARGO_BIN_EXE_sock_bw").into(),
            "sock_lat" => env!("CARGO_BIN_EXE_sock_lat").into(),
            "sock_echo" => env!("CARGO_BIN_EXE_sock_echo").into(),
            other => panic!("no perftest binary {other}"),
        },
    }
}

fn run(name: &str, args: &[&str]) -> Output {
    run_env(name, args, &[])
}

fn run_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(bin(name))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .unwrap_or_else(|e| panic!("run {name}: {e}"))
}

fn ok(name: &str, args: &[&str]) -> String {
    ok_env(name, args, &[])
}

fn ok_env(name: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let out = run_env(name, args, env);
    assert!(
        out.status.success(),
        "{name} {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The table rows: lines that start with a number, split into columns.
fn rows(stdout: &str) -> Vec<Vec<String>> {
    stdout
        .lines()
        .filter(|l| l.trim_start().chars().next().is_some_and(|c| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().map(String::from).collect())
        .collect()
}

fn num(s: &str) -> f64 {
    s.trim_end_matches('%')
        .parse()
        .unwrap_or_else(|_| panic!("not a number: {s}"))
}

/// The smallest put_bw run, in CPU mode: 5 messages of 8 bytes.
const SMALL: [&str; 6] = ["--mode", "cpu", "-s", "8", "-n", "5"];

/// `put_bw` as a [`SMALL`] client of a server at 127.0.0.1:`port`.
fn small_client(port: u16) -> Output {
    run(
        "put_bw",
        &[&["127.0.0.1", "-p", &port.to_string()][..], &SMALL].concat(),
    )
}

/// Runs `name --server` and `name 127.0.0.1` with their own flags; returns both outputs.
fn server_client(name: &str, server: &[&str], client: &[&str]) -> (Output, Output) {
    let port = free_port().to_string();
    // Bounded: a client that never arrives (another test's server took the port first, say)
    // fails this test instead of hanging the suite.
    let mut s = Command::new(bin(name))
        .args(["--server", "-p", &port, "--timeout", "60"])
        .args(server)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The client retries until the server listens (a refused connection is an error at once).
    let mut c = None;
    for _ in 0..400 {
        let out = run(name, &[&["127.0.0.1", "-p", &port][..], client].concat());
        let refused = String::from_utf8_lossy(&out.stderr).contains("cannot connect");
        if !refused {
            c = Some(out);
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let c = c.expect("the server never listened");
    let _ = s.stdin.take().map(|mut i| i.flush());
    (s.wait_with_output().unwrap(), c)
}

/// Asserts that a server and its client both exited successfully; returns their stdouts.
fn both_succeeded(s: &Output, c: &Output) -> (String, String) {
    let (so, co) = (
        String::from_utf8_lossy(&s.stdout).into_owned(),
        String::from_utf8_lossy(&c.stdout).into_owned(),
    );
    assert!(
        c.status.success(),
        "client: {co}\n{}",
        String::from_utf8_lossy(&c.stderr)
    );
    assert!(
        s.status.success(),
        "server: {so}\n{}",
        String::from_utf8_lossy(&s.stderr)
    );
    (so, co)
}

// ------------------------------------------------------------------------------ put_bw

#[test]
fn put_bw_loopback_prints_a_perftest_table_and_validates() {
    let out = ok("put_bw", &["--mode", "cpu", "-s", "4096", "-n", "200", "-q", "2"]);
    assert!(out.contains("RDMA_Write BW Test"), "{out}");
    assert!(out.contains("#bytes     #iterations    BW peak[MiB/sec]    BW average[MiB/sec]   MsgRate[Mpps]"));
    let r = rows(&out);
    assert_eq!(r.len(), 1, "{out}");
    assert_eq!(r[0].len(), 7, "{:?}", r[0]);
    assert_eq!((num(&r[0][0]), num(&r[0][1])), (4096.0, 200.0));
    // Peak >= average > 0, and the message rate matches the average bandwidth.
    let (peak, avg, mpps) = (num(&r[0][2]), num(&r[0][3]), num(&r[0][4]));
    assert!(peak >= avg && avg > 0.0, "{out}");
    let from_bw = avg * (1 << 20) as f64 / 4096.0 / 1e6;
    assert!((mpps - from_bw).abs() / from_bw < 0.02, "{mpps} vs {from_bw}");
    assert!(out.contains("Validation: every size's data arrived intact"));
}

/// `-n` is what runs: 1001 messages per QP were once run (and reported) as 1004, 5 as 8.
#[test]
fn put_bw_runs_exactly_the_iterations_asked() {
    for n in ["5", "1001"] {
        let out = ok("put_bw", &["--mode", "cpu", "-s", "64", "-n", n, "-q", "2"]);
        let r = rows(&out);
        assert_eq!(num(&r[0][1]), num(n), "{out}");
        let json = ok("put_bw", &["--mode", "cpu", "-s", "64", "-n", n, "--json"]);
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["results"][0]["iterations"].as_u64(), Some(num(n) as u64), "{json}");
    }
}

/// JSON values are in the unit their keys and `bw_unit` name (MiB/s), with or without
/// `--report-gbits`, which changes the table only: it once labelled MiB/s values "Gb/s".
#[test]
fn put_bw_json_units_match_their_label() {
    let json = ok(
        "put_bw",
        &["--mode", "cpu", "-s", "64", "-n", "50", "--json", "--report-gbits"],
    );
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["params"]["bw_unit"], "MiB/s", "{json}");
    assert!(v["results"][0]["bw_avg_mib_s"].as_f64().unwrap() > 0.0, "{json}");
}

#[test]
fn put_bw_json_sweep_has_the_documented_schema() {
    let dir = std::env::temp_dir().join(format!("gdaki-put-bw-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("sweep.svg");
    let out = ok(
        "put_bw",
        &[
            "--mode",
            "cpu",
            "-a",
            "-n",
            "5",
            "--json",
            "--plot",
            svg.to_str().unwrap(),
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out).expect("stdout is one JSON object");
    assert_eq!(v["test"], "put_bw");
    assert_eq!(v["validation"], "ok");
    for key in ["provider", "mode", "scope", "qps", "tx_depth", "iterations", "sizes"] {
        assert!(v["params"].get(key).is_some(), "params.{key} missing: {v}");
    }
    assert!(v["reference"]["what"].as_str().unwrap().contains("memcpy"));
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 23, "2 B .. 8 MiB");
    for (i, r) in results.iter().enumerate() {
        assert_eq!(r["bytes"], 2u64 << i);
        for key in [
            "iterations",
            "bw_peak_mib_s",
            "bw_avg_mib_s",
            "msg_rate_mpps",
            "ref_bw_mib_s",
            "bw_vs_ref",
        ] {
            assert!(r[key].as_f64().is_some_and(|x| x > 0.0), "{key} in {r}");
        }
    }
    let doc = std::fs::read_to_string(&svg).unwrap();
    assert!(
        doc.starts_with("<svg") && doc.matches("<polyline").count() == 6,
        "{doc}"
    );
    // One size: a table, not a plot of one point.
    let one = dir.join("one.svg");
    ok("put_bw", &[&SMALL[..], &["--plot", one.to_str().unwrap()]].concat());
    let doc = std::fs::read_to_string(&one).unwrap();
    assert!(doc.contains(">#bytes<") && !doc.contains("<polyline"), "{doc}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn put_bw_server_and_client_validate_across_processes() {
    let (s, c) = server_client(
        "put_bw",
        &["-s", "1000", "-n", "50", "-q", "2"],
        &["--mode", "cpu", "-s", "1000", "-n", "50", "-q", "2"],
    );
    let (so, co) = both_succeeded(&s, &c);
    assert!(so.contains("data received correctly"), "{so}");
    assert_eq!(rows(&co).len(), 1, "{co}");
    // perftest's address lines, each side's remote ones the other's local ones.
    assert_eq!(addresses(&co, "remote address").len(), 2, "{co}");
    assert_eq!(
        addresses(&co, "remote address"),
        addresses(&so, "local address"),
        "{co}\n{so}"
    );
    assert_eq!(
        addresses(&so, "remote address"),
        addresses(&co, "local address"),
        "{co}\n{so}"
    );
    assert!(co.contains("RKey 0x") && so.contains("VAddr 0x"), "{co}\n{so}");
    // The server prints the client's result table too, as perftest's server does, with the
    // reference its last column is measured against (it printed no Ref line).
    assert_eq!(rows(&so), rows(&co), "{co}\n{so}");
    let reference = |out: &str| out.lines().find(|l| l.starts_with(" Ref: ")).map(str::to_string);
    let theirs = reference(&co).map(|r| format!("{r} (the client's)"));
    assert!(theirs.is_some() && reference(&so) == theirs, "{co}\n{so}");
}

/// A whole sweep across processes: the server prints the client's 23 rows (their JSON once
/// outgrew one handshake frame's 4096 bytes, and both sides failed after the last size).
#[test]
fn put_bw_sweeps_every_size_across_processes() {
    let (s, c) = server_client("put_bw", &["-a", "-n", "5"], &["--mode", "cpu", "-a", "-n", "5"]);
    let (so, co) = both_succeeded(&s, &c);
    assert_eq!(rows(&co).len(), 23, "{co}");
    assert_eq!(rows(&so), rows(&co), "{co}\n{so}");
}

/// Where cores are fewer than the spinning threads, write_lat's header says so and names the
/// knob that gives the soft HCA's core back (it named none).
#[test]
fn write_lat_on_few_cores_names_the_engine_spin() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let out = ok("write_lat", &["--mode", "cpu", "-s", "8", "-n", "20"]);
    if cores < 3 {
        assert!(out.contains("GDAKI_SOFT_IDLE_SPIN_US=0"), "{out}");
    }
}

/// Diagnostics piped to a file or another program come without terminal colour codes.
#[test]
fn logs_piped_elsewhere_carry_no_colour_codes() {
    let out = run_env("put_bw", &SMALL, &[("RUST_LOG", "gdaki=debug")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && err.contains("DEBUG"), "{err}");
    assert!(!err.contains('\u{1b}'), "{err}");
}

/// perftest's address lines of `which` ("local address", "remote address"): QPN and PSN each.
fn addresses(out: &str, which: &str) -> Vec<String> {
    out.lines()
        .filter(|l| l.trim_start().starts_with(which))
        .map(|l| {
            l.split(": ")
                .nth(1)
                .unwrap_or("")
                .split(" RKey")
                .next()
                .unwrap()
                .to_string()
        })
        .collect()
}

/// write_lat's header names both ends as perftest's does: one local and one remote address in
/// loopback (it printed two local ones), and across processes each side's remote address is
/// the other's local one (only the local one was printed).
#[test]
fn write_lat_names_the_local_and_the_remote_queue_pair() {
    let out = ok("write_lat", &["--mode", "cpu", "-s", "8", "-n", "20"]);
    let (local, remote) = (addresses(&out, "local address"), addresses(&out, "remote address"));
    assert!(local.len() == 1 && remote.len() == 1 && local != remote, "{out}");
    assert!(out.contains("RKey 0x"), "{out}");

    let flags = ["--mode", "cpu", "-s", "8", "-n", "20"];
    let (s, c) = server_client("write_lat", &flags, &flags);
    let (so, co) = both_succeeded(&s, &c);
    assert_eq!(addresses(&so, "local address").len(), 1, "{so}");
    assert_eq!(
        addresses(&co, "remote address"),
        addresses(&so, "local address"),
        "{co}\n{so}"
    );
    assert_eq!(
        addresses(&so, "remote address"),
        addresses(&co, "local address"),
        "{co}\n{so}"
    );
}

/// `--read` streams RDMA READs (perftest's `ib_read_bw`): the data comes from the target into
/// the poster's buffer, which the poster validates, in loopback and from a server that fills
/// its buffer; a server without `--read` refuses such a client.
#[test]
fn put_bw_reads_in_loopback_and_from_a_server() {
    let out = ok(
        "put_bw",
        &["--read", "--mode", "cpu", "-s", "4096", "-n", "200", "-q", "2"],
    );
    assert!(out.contains("RDMA_Read BW Test (gdaki put_bw --read)"), "{out}");
    assert_eq!(rows(&out).len(), 1, "{out}");
    assert!(out.contains("Validation: every size's data arrived intact"), "{out}");
    let json = ok("put_bw", &["--read", "--mode", "cpu", "-s", "64", "-n", "20", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["params"]["op"], "read", "{json}");

    let flags = ["--read", "-s", "1000", "-n", "50", "-q", "2"];
    let (s, c) = server_client("put_bw", &flags, &[&["--mode", "cpu"][..], &flags].concat());
    let (so, co) = both_succeeded(&s, &c);
    assert!(so.contains("read by the client intact"), "{so}");
    assert_eq!(rows(&so), rows(&co), "{co}\n{so}");

    let (s, c) = server_client(
        "put_bw",
        &["-s", "1000", "-n", "50"],
        &["--read", "--mode", "cpu", "-s", "1000", "-n", "50"],
    );
    assert!(!s.status.success() && !c.status.success());
    for out in [&s, &c] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("the client runs put_bw --read, this server put_bw"),
            "{err}"
        );
    }
}

/// `--send` streams SENDs that receives take (perftest's `ib_send_bw`): in loopback with one
/// receiving thread per QP, from a server that posts the receives, for -D rounds, with a
/// receive depth of one (so SENDs wait out RNR), and with clear refusals.
#[test]
fn put_bw_sends_through_receives_in_loopback_and_to_a_server() {
    let out = ok("put_bw", &["--send", "--mode", "cpu", "-a", "-n", "40", "-q", "2"]);
    assert!(out.contains("Send BW Test (gdaki put_bw --send)"), "{out}");
    assert!(out.contains("RX depth"), "{out}");
    assert_eq!(rows(&out).len(), 23, "{out}");
    assert!(out.contains("Validation: every size's data arrived intact"), "{out}");
    let json = ok(
        "put_bw",
        &["--send", "--mode", "cpu", "-s", "64", "-n", "300", "-r", "1", "--json"],
    );
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        (v["params"]["op"].as_str(), v["params"]["rx_depth"].as_u64()),
        (Some("send"), Some(1))
    );
    assert_eq!(v["results"][0]["iterations"], 300, "{json}");

    let flags = ["--send", "-s", "3000", "-n", "100", "-q", "2", "-D", "1"];
    let (s, c) = server_client("put_bw", &flags, &[&["--mode", "cpu"][..], &flags].concat());
    let (so, co) = both_succeeded(&s, &c);
    assert!(so.contains("every message received whole"), "{so}");
    let said = String::from_utf8_lossy(&s.stderr);
    assert!(said.contains("the server posts receives (512 per QP"), "{said}");
    assert_eq!(rows(&so), rows(&co), "{co}\n{so}");
    // -D ran rounds: more than one round's 100 messages (plus the warm-up's 100) per QP.
    assert!(num(&rows(&co)[0][1]) > 200.0, "{co}");

    let (s, c) = server_client(
        "put_bw",
        &["-s", "64", "-n", "50"],
        &["--send", "--mode", "cpu", "-s", "64", "-n", "50"],
    );
    assert!(!s.status.success() && !c.status.success());
    let err = String::from_utf8_lossy(&c.stderr);
    assert!(err.contains("put_bw --send"), "{err}");

    for (args, want) in [
        (
            &["--mode", "cpu", "-r", "8"][..],
            "--rx-depth 8: receives are posted only with --send",
        ),
        (
            &["--mode", "cpu", "--send", "-r", "0"],
            "--rx-depth 0: 1 to 32768 receives",
        ),
        (&["--mode", "cpu", "--send", "--read"], "cannot be used with"),
    ] {
        let out = run("put_bw", args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(want), "{args:?}: {err}");
    }
}

/// `-D SECONDS` runs each size for that long, in rounds of `-n`, as perftest's duration mode:
/// in loopback, and across processes (write_lat's server runs the rounds its client decides).
#[test]
fn duration_mode_runs_each_size_for_the_time_asked() {
    use std::time::{Duration, Instant};
    let started = Instant::now();
    let out = ok("put_bw", &["--mode", "cpu", "-s", "64", "-n", "40", "-D", "1"]);
    assert!(started.elapsed() >= Duration::from_secs(1), "{out}");
    assert!(out.contains("for 1 s per size (-D), in rounds of 40 per QP"), "{out}");
    let n = num(&rows(&out)[0][1]);
    assert!(n > 40.0 && n % 40.0 == 0.0, "{out}");

    let started = Instant::now();
    // Both sides in CPU mode: a GPU-mode write_lat server answers only once its kernels load.
    let flags = ["--mode", "cpu", "-s", "8", "-n", "20", "-D", "1"];
    let (s, c) = server_client("write_lat", &flags, &flags);
    let (so, co) = (String::from_utf8_lossy(&s.stdout), String::from_utf8_lossy(&c.stdout));
    assert!(
        s.status.success() && c.status.success(),
        "{so}\n{co}\n{}\n{}",
        String::from_utf8_lossy(&s.stderr),
        String::from_utf8_lossy(&c.stderr)
    );
    assert!(started.elapsed() >= Duration::from_secs(1));
    let (ns, nc) = (num(&rows(&so)[0][1]), num(&rows(&co)[0][1]));
    assert!(nc > 20.0 && nc % 20.0 == 0.0 && ns == nc, "{so}\n{co}");
    assert!(
        co.contains("for 1 s per size (-D), in rounds of 20 round trips"),
        "{co}"
    );

    // Both sides must agree on -D, as on -n.
    let (s, _c) = server_client("put_bw", &SMALL, &[&SMALL[..], &["-D", "1"]].concat());
    let err = String::from_utf8_lossy(&s.stderr);
    assert!(
        !s.status.success() && err.contains("client -D 1 vs server no -D"),
        "{err}"
    );
}

#[test]
fn put_bw_flag_mismatch_is_a_clear_error_on_both_sides() {
    let (s, c) = server_client(
        "put_bw",
        &["-s", "4096", "-n", "50"],
        &["--mode", "cpu", "-s", "8", "-n", "50"],
    );
    assert!(!s.status.success() && !c.status.success());
    for out in [&s, &c] {
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("test flags differ: client -s 8 vs server -s 4096"),
            "{err}"
        );
    }
}

/// The server connects its QPs to the addresses in the client's endpoints: they must be the
/// client's own (the host the setup connection comes from), or a client could make the server
/// open connections anywhere. Such a hello is refused before the server says anything about
/// its own QPs and buffer.
#[test]
fn a_client_naming_another_host_is_refused_before_the_server_answers() {
    use gdaki::handshake::{Channel, Hello};
    use std::net::{SocketAddr, TcpListener};
    use std::time::Duration;
    let port = free_port();
    let server = Command::new(bin("put_bw"))
        .args(["--server", "-p", &port.to_string(), "--timeout", "60"])
        .args(SMALL)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Somewhere else the server should never be made to connect to.
    let elsewhere = TcpListener::bind("127.0.0.2:0").unwrap();
    elsewhere.set_nonblocking(true).unwrap();
    // Everything the hello needs is made before connecting: the server waits for it only its
    // --timeout (10 s), which a loaded machine once spent between the connect and the send.
    let ctx = gdaki::Context::open(gdaki::Provider::Soft).unwrap();
    ctx.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let cq = ctx.create_cq(1024).unwrap();
    let qp = ctx.create_qp(&cq, Default::default()).unwrap();
    let endpoint = gdaki::Endpoint {
        addr: Some(elsewhere.local_addr().unwrap()),
        ..qp.endpoint()
    };
    let flags = gdaki_examples::session::Symmetric {
        test: "put_bw".into(),
        sizes: vec![8],
        iters: 5,
        qps: 1,
        duration_s: None,
        buffers_gpu: None,
    };
    let hello = Hello {
        app: serde_json::to_vec(&flags).unwrap(),
        endpoints: vec![endpoint],
        regions: vec![],
    };
    let at: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut ch = (0..400)
        .find_map(|_| {
            let ch = Channel::connect(at, Duration::from_secs(10)).ok();
            if ch.is_none() {
                std::thread::sleep(Duration::from_millis(50));
            }
            ch
        })
        .expect("the server never listened");
    let answer = ch.send(&hello).and_then(|()| ch.receive());
    let out = server.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    match answer {
        Err(gdaki::Error::Rejected { reason, .. }) => assert!(reason.contains("127.0.0.2"), "{reason}"),
        other => panic!("expected a rejection, got {other:?}; server: {err}"),
    }
    assert!(!out.status.success() && err.contains("127.0.0.2"), "{err}");
    assert!(elsewhere.accept().is_err(), "the server connected elsewhere");
}

/// The other way round: a server whose answer names queue pairs on another host than the one
/// the client connected to is refused by the client, which never connects there (it sent its
/// Connect, with the secret, wherever the server pointed).
#[test]
fn a_server_naming_another_host_is_refused_by_the_client() {
    use gdaki::handshake::{Channel, Hello};
    use std::net::TcpListener;
    use std::time::Duration;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let elsewhere = TcpListener::bind("127.0.0.2:0").unwrap();
    elsewhere.set_nonblocking(true).unwrap();
    let to = elsewhere.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let ctx = gdaki::Context::open(gdaki::Provider::Soft).unwrap();
        ctx.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let cq = ctx.create_cq(1024).unwrap();
        let qp = ctx.create_qp(&cq, Default::default()).unwrap();
        let region = ctx.alloc_region(1 << 20, gdaki::Access::ALL).unwrap();
        let mut ch = Channel::accept(&listener, Duration::from_secs(30)).unwrap();
        let theirs = ch.receive().unwrap();
        let answer = Hello {
            app: theirs.app.clone(),
            endpoints: vec![gdaki::Endpoint {
                addr: Some(to),
                ..qp.endpoint()
            }],
            regions: vec![region.remote_region()],
        };
        ch.send(&answer).unwrap();
        // What the client says next (a rejection, or the first sync if it went ahead).
        let next = ch.receive();
        drop((region, qp, cq, ctx));
        next
    });
    let out = Command::new(bin("put_bw"))
        .args(["127.0.0.1", "-p", &port.to_string(), "--timeout", "20"])
        .args(SMALL)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("127.0.0.2"), "{err}");
    assert!(
        elsewhere.accept().is_err(),
        "the client connected where the server pointed"
    );
    match server.join().unwrap() {
        Err(gdaki::Error::Rejected { reason, .. }) => assert!(reason.contains("127.0.0.2"), "{reason}"),
        other => panic!("the client did not reject the answer: {other:?}"),
    }
}

/// Library errors carry their cause in their text and as their source; a binary prints each
/// cause once ("X: X" was printed for every device and socket error).
#[test]
fn errors_say_each_cause_once() {
    use gdaki::handshake::{Channel, Hello};
    use gdaki::wire::RemoteRegion;
    use std::net::TcpListener;
    use std::time::Duration;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Nobody listens there: the client's queue pair cannot reach the "server's".
    let nobody = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let mut ch = Channel::accept(&listener, Duration::from_secs(20)).unwrap();
        let theirs = ch.receive().unwrap();
        let endpoints = theirs
            .endpoints
            .iter()
            .map(|e| gdaki::Endpoint {
                gid: [9; 16],
                addr: Some(nobody),
                ..*e
            })
            .collect();
        let regions = vec![RemoteRegion {
            addr: 0x10000,
            len: 1 << 20,
            rkey: 1,
        }];
        let _ = ch.send(&Hello {
            app: theirs.app,
            endpoints,
            regions,
        });
        let _ = ch.sync(1);
    });
    let out = small_client(port);
    server.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert_eq!(err.matches("RTR2RTS_QP failed").count(), 1, "{err}");
}

/// `--server -p 0` says the port the system chose, so a client can be pointed at it.
#[test]
fn a_server_on_port_0_says_its_real_port() {
    use std::io::{BufRead, BufReader};
    let mut server = Command::new(bin("put_bw"))
        .args(["--server", "-p", "0"])
        .args(SMALL)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    let mut err = BufReader::new(server.stderr.take().unwrap());
    while !line.contains("waiting for a client") && err.read_line(&mut line).unwrap() > 0 {}
    let port: u16 = line
        .split("on port ")
        .nth(1)
        .and_then(|t| t.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    assert_ne!(port, 0, "{line}");
    let client = small_client(port);
    assert!(client.status.success(), "{}", String::from_utf8_lossy(&client.stderr));
    assert!(server.wait().unwrap().success());
}

/// A server waits for its client as long as `--timeout` says, then gives up with the reason;
/// without the flag it waits for ever, as perftest's servers do (not tested: it would not end).
#[test]
fn a_server_gives_up_waiting_for_a_client_after_its_timeout() {
    for name in ["put_bw", "write_lat"] {
        let mut server = Command::new(bin(name))
            .args(["--server", "-p", "0", "--timeout", "2"])
            .args(SMALL)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let started = std::time::Instant::now();
        let status = loop {
            if let Some(s) = server.try_wait().unwrap() {
                break Some(s);
            }
            if started.elapsed() > std::time::Duration::from_secs(60) {
                let _ = server.kill();
                let _ = server.wait();
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut server.stderr.take().unwrap(), &mut err).unwrap();
        let status = status.unwrap_or_else(|| panic!("{name} --server --timeout 2 still waited after 60 s: {err}"));
        assert!(!status.success(), "{err}");
        assert!(
            err.contains("waiting for a client") && err.contains("2s"),
            "{name}: {err}"
        );
    }
}

/// What ib_write_bw / ib_write_lat users type: accepted where it means something here, a clear
/// error where it does not, and never clap's wrong tip ("to pass '-D' as a value, use '-- -D'").
#[test]
fn perftest_flags_are_understood() {
    for name in ["put_bw", "write_lat"] {
        // Accepted: -F (no cycle counter is used), -x 0, -c RC, --size=N.
        let out = ok(
            name,
            &["--mode", "cpu", "-n", "5", "-F", "-x", "0", "-c", "RC", "--size=64"],
        );
        assert_eq!(num(&rows(&out)[0][0]), 64.0, "{out}");
        for (args, says) in [
            (&["-c", "UD"][..], "only RC"),
            (&["-c", "UC"], "only RC"),
            (&["-R"], "not supported"),
            (&["--rdma_cm"], "not supported"),
            (&["-D", "0"], "-D 0: a duration from 1"),
            (&["-x", "3"], "GID index 3"),
            (&["-s", "-1"], "-1"),
        ] {
            let out = run(name, &[&["--mode", "cpu", "-n", "5"][..], args].concat());
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{name} {args:?}");
            assert!(err.contains(says), "{name} {args:?}: {err}");
            assert!(!err.contains("use '--"), "{name} {args:?}: {err}");
        }
        // GDAKI_GID_INDEX serves a ConnectX; the soft device still has one GID, so -x 3 stays
        // refused there (it used to run when the variable agreed with -x).
        for provider in ["soft", "auto"] {
            let out = run_env(
                name,
                &["--mode", "cpu", "-n", "5", "-x", "3", "--provider", provider],
                &[("GDAKI_GID_INDEX", "3")],
            );
            let err = String::from_utf8_lossy(&out.stderr);
            let mlx5 = std::fs::read_dir("/sys/class/infiniband")
                .is_ok_and(|d| d.flatten().any(|e| e.file_name().to_string_lossy().starts_with("mlx5")));
            if provider == "auto" && mlx5 {
                continue; // a machine with a ConnectX: auto picks it, and -x 3 is its to judge
            }
            assert!(
                !out.status.success(),
                "{name} -x 3 --provider {provider} ran on the soft device"
            );
            assert!(err.contains("the soft device has one GID"), "{name}: {err}");
        }
    }
}

/// Before the run, one line on stderr says which mode `auto` chose and why (a first run once
/// went into CPU mode without a word).
#[test]
fn auto_mode_says_what_it_chose_and_why() {
    for name in ["put_bw", "write_lat"] {
        let out = run(name, &["-n", "5", "-s", "8"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        let line = err
            .lines()
            .find(|l| l.contains("mode (auto:"))
            .unwrap_or_else(|| panic!("{name}: {err}"));
        assert!(
            line.contains("CPU mode (auto: no usable GPU: ") || line.contains("GPU mode (auto: GPU 0 is usable"),
            "{line}"
        );
    }
}

#[test]
fn refused_connections_and_bad_flags_are_clear_errors() {
    let port = free_port().to_string();
    for name in ["put_bw", "write_lat"] {
        let out = run(name, &["127.0.0.1", "-p", &port, "--mode", "cpu", "-n", "5"]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("cannot connect to the server"), "{err}");
        // The cause once, after what failed (it read "...: Connection refused (os error 111) is
        // not reachable").
        assert!(err.contains("is not reachable: Connection refused"), "{err}");
        // --mode gpu where no GPU is usable fails before it announces GPU mode.
        if gdaki::cuda::why_unusable(0).is_some() {
            let out = run(name, &["--mode", "gpu", "-n", "5"]);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{err}");
            assert!(!err.contains("GPU mode on GPU"), "{err}");
            assert!(err.contains("--mode gpu: GPU 0 is not usable"), "{err}");
        }
    }
    for (args, says) in [
        (&["-s", "0"][..], "at least 1 byte"),
        (&["-t", "3"], "power of two"),
        (&["-n", "2"], "at least 5"),
        (&["-a", "-s", "8"], "exclude each other"),
        (&["--mode", "cpu", "--scope", "warp"], "--scope warp: "),
        (&["--cpu-proxy", "--proxy-threads", "0"], "1 to 64"),
        (&["-d", "mlx5_0"], "the soft provider has one device"),
        (&["--plot", "x.png"], "SVG"),
        (
            &["--plot", "/no/such/dir/x.svg", "-n", "100000000"],
            "cannot be written",
        ),
        (
            &["--mode", "cpu", "--mem", "device"],
            "--mem device: GPU memory needs --mode gpu",
        ),
        // Pinned memory is host memory the GPU maps, not GPU memory.
        (
            &["--mode", "cpu", "--mem", "pinned"],
            "--mem pinned: memory mapped into a GPU needs --mode gpu",
        ),
        (&["-q", "0"], "1 to 64"),
        (&["--mode", "cpu", "--rings", "gpu"], "need --mode gpu"),
        // perftest flags gdaki does not serve: refused with the reason, not clap's "use -- -b".
        (&["-b"], "-b / --bidirectional is not supported"),
        (&["-e"], "-e / --events is not supported"),
        (&["-l", "8"], "-l 8 / --post_list is not supported"),
        (&["-m", "1024"], "-m 1024 / --mtu is not supported"),
        (&["--run_infinitely"], "use -D SECONDS"),
        (&["-i", "2"], "-i 2: port 2"),
        // The GPU launch's shape means nothing in CPU mode (it was silently ignored).
        (&["--mode", "cpu", "--blocks", "4"], "--blocks 4: CPU mode"),
        (&["--mode", "cpu", "--threads", "64"], "--threads 64: CPU mode"),
    ] {
        let out = run("put_bw", args);
        assert!(!out.status.success(), "{args:?} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

#[test]
fn both_perftests_run_with_the_cpu_proxy() {
    let out = ok(
        "put_bw",
        &["--mode", "cpu", "--cpu-proxy", "-s", "64", "-n", "2000", "-q", "2"],
    );
    assert!(out.contains("cpu-proxy (1 proxy thread)"), "{out}");
    assert!(out.contains(" Proxy: "), "{out}");
    assert_eq!(rows(&out).len(), 1, "{out}");
    // SENDs too: the proxy rings for them; receives need no doorbell.
    let out = ok(
        "put_bw",
        &[
            "--mode",
            "cpu",
            "--cpu-proxy",
            "--send",
            "-s",
            "64",
            "-n",
            "2000",
            "-q",
            "2",
        ],
    );
    assert!(out.contains(" Proxy: ") && out.contains("Send BW Test"), "{out}");
    let out = ok(
        "write_lat",
        &[
            "--mode",
            "cpu",
            "--cpu-proxy",
            "--proxy-threads",
            "2",
            "-n",
            "50",
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["handler"], "cpu-proxy");
}

/// `--reliable-doorbell`: queue pairs without a doorbell record, posters ringing (CPU threads
/// here; the GPU test below in kernels) and a CPU proxy ringing; the header and JSON say so.
#[test]
fn both_perftests_run_with_a_reliable_doorbell() {
    let out = ok(
        "put_bw",
        &[
            "--mode",
            "cpu",
            "--reliable-doorbell",
            "-s",
            "64",
            "-n",
            "2000",
            "-q",
            "2",
        ],
    );
    assert!(out.contains("reliable doorbell (no doorbell record)"), "{out}");
    assert_eq!(rows(&out).len(), 1, "{out}");
    let out = ok(
        "write_lat",
        &[
            "--mode",
            "cpu",
            "--reliable-doorbell",
            "--cpu-proxy",
            "-n",
            "50",
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["reliable_doorbell"], true, "{out}");
    assert_eq!(v["params"]["handler"], "cpu-proxy");
    let out = ok("write_lat", &["--mode", "cpu", "-n", "50", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["reliable_doorbell"], false, "{out}");
}

/// `--collapsed-cq`: send CQs of one entry, polled by the posters (the GPU test below: blocks
/// sharing QPs) and in the ping-pong; the header and JSON say so.
#[test]
fn both_perftests_run_with_a_collapsed_cq() {
    let out = ok(
        "put_bw",
        &["--mode", "cpu", "--collapsed-cq", "-s", "64", "-n", "20000", "-q", "2"],
    );
    assert!(out.contains("collapsed CQ"), "{out}");
    assert_eq!(rows(&out).len(), 1, "{out}");
    let out = ok("write_lat", &["--mode", "cpu", "--collapsed-cq", "-n", "200", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["collapsed_cq"], true, "{out}");
    let out = ok("put_bw", &["--mode", "cpu", "-s", "64", "-n", "100", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["collapsed_cq"], false, "{out}");
}

// ------------------------------------------------------------------------------ write_lat

/// `--blueflame`: each message rung by a BlueFlame write of its WQE, which the soft HCA takes
/// as a doorbell; the header and JSON say so, and a ring the poster does not do is refused.
#[test]
fn write_lat_rings_with_blueflame_writes() {
    let out = ok("write_lat", &["--mode", "cpu", "--blueflame", "-n", "200"]);
    assert!(out.contains("a BlueFlame write of each message's WQE"), "{out}");
    assert_eq!(rows(&out).len(), 1, "{out}");
    let out = ok(
        "write_lat",
        &[
            "--mode",
            "cpu",
            "--blueflame",
            "-s",
            "16",
            "-I",
            "16",
            "-n",
            "100",
            "--json",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["blueflame"], true, "{out}");
    let out = run(
        "write_lat",
        &["--mode", "cpu", "--blueflame", "--cpu-proxy", "-n", "10"],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("--blueflame") && err.contains("--cpu-proxy"), "{err}");
}

#[test]
fn write_lat_loopback_prints_a_perftest_table() {
    let out = ok("write_lat", &["--mode", "cpu", "-n", "100"]);
    assert!(out.contains("RDMA_Write Latency Test"), "{out}");
    assert!(out.contains("t_typical[usec]") && out.contains("99.9% percentile[usec]"));
    let r = rows(&out);
    assert_eq!(r.len(), 1, "{out}");
    assert_eq!(r[0].len(), 9, "{:?}", r[0]);
    let v: Vec<f64> = r[0].iter().map(|c| num(c)).collect();
    assert_eq!((v[0], v[1]), (2.0, 100.0));
    // min <= typical <= p99 <= p99.9 <= max, all positive.
    assert!(
        v[2] > 0.0 && v[2] <= v[4] && v[4] <= v[7] && v[7] <= v[8] && v[8] <= v[3],
        "{v:?}"
    );
    assert!(out.contains("thread <-> thread round trip"));
    assert!(out.contains("Validation: every size's messages arrived intact"));
}

#[test]
fn write_lat_json_and_server_client() {
    let out = ok("write_lat", &["--mode", "cpu", "-s", "64", "-n", "50", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["test"], "write_lat");
    let r = &v["results"][0];
    for key in [
        "t_min_us",
        "t_max_us",
        "t_typical_us",
        "t_avg_us",
        "t_stdev_us",
        "p99_us",
        "p999_us",
    ] {
        assert!(r[key].as_f64().is_some(), "{key} in {r}");
    }
    assert!(v["reference"]["thread_round_trip_us"].as_f64().is_some());

    let flags = ["--mode", "cpu", "-s", "300", "-n", "60"];
    let (s, c) = server_client("write_lat", &flags, &flags);
    assert!(c.status.success(), "client: {}", String::from_utf8_lossy(&c.stderr));
    assert!(s.status.success(), "server: {}", String::from_utf8_lossy(&s.stderr));
    for out in [&s, &c] {
        assert_eq!(rows(&String::from_utf8_lossy(&out.stdout)).len(), 1);
    }
}

/// `write_lat -I` (perftest's inline size): messages that fit are sent inline (up to 28 bytes
/// for a WRITE, 44 for a SEND), as the header and the JSON say; none by default; more than a
/// WQE carries, or any with `--stream`, is refused with the reason.
#[test]
fn write_lat_sends_small_messages_inline_with_dash_i() {
    let out = ok("write_lat", &["--mode", "cpu", "-s", "8", "-n", "50", "-I", "28"]);
    assert!(out.contains("messages of up to 28 bytes travel in their WQE"), "{out}");
    assert!(
        out.contains("Validation: every size's messages arrived intact"),
        "{out}"
    );
    let out = ok("write_lat", &["--mode", "cpu", "-s", "8", "-n", "50"]);
    assert!(out.contains("Inline data           : none"), "{out}");
    for (args, want) in [
        (&["-s", "8"][..], 0),
        (&["-s", "8", "--send", "-I", "44"], 44),
        (&["-s", "8", "-I", "0"], 0),
        (&["-s", "32", "-I", "16"], 16),
    ] {
        let mut all = vec!["--mode", "cpu", "-n", "50", "--json"];
        all.extend(args);
        let v: serde_json::Value = serde_json::from_str(&ok("write_lat", &all)).unwrap();
        assert_eq!(v["params"]["inline_size"], want, "{args:?}");
    }
    for (args, why) in [
        (&["-I", "29"][..], "at most 28 bytes inline for a WRITE"),
        (&["-I", "45", "--send"], "at most 44 bytes inline for a SEND"),
        (&["-I", "8", "--stream"], "--stream writes its WQEs ahead"),
    ] {
        let mut all = vec!["--mode", "cpu", "-s", "8", "-n", "50"];
        all.extend(args);
        let out = run("write_lat", &all);
        assert!(!out.status.success(), "{args:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(why), "{args:?}");
    }
}

/// `put_bw --stream`: messages posted from one CPU stream per QP, every verb, several QPs, a
/// sweep, JSON, server and client; shaping a kernel launch is refused.
#[test]
fn put_bw_stream_posts_from_streams() {
    for extra in [&[][..], &["--read"], &["--send"], &["-q", "3"]] {
        let mut args = vec!["--mode", "cpu", "--stream", "-s", "4096", "-n", "2000"];
        args.extend(extra);
        let out = ok("put_bw", &args);
        assert_eq!(rows(&out).len(), 1, "{out}");
        assert!(out.contains("one stream per QP, no kernel"), "{out}");
        assert!(out.contains("Validation"), "{out}");
    }
    let out = ok("put_bw", &["--mode", "cpu", "--stream", "-a", "-n", "100"]);
    assert_eq!(rows(&out).len(), 23, "{out}");
    let out = ok(
        "put_bw",
        &["--mode", "cpu", "--stream", "-s", "64", "-n", "500", "--json"],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["poster"].as_str(), Some("stream"));
    let flags = ["--mode", "cpu", "--stream", "-s", "65536", "-n", "500"];
    let (s, c) = server_client("put_bw", &["--mode", "cpu", "-s", "65536", "-n", "500"], &flags);
    let (_, c) = both_succeeded(&s, &c);
    assert_eq!(rows(&c).len(), 1, "{c}");
    let out = run("put_bw", &["--mode", "cpu", "--stream", "--blocks", "4"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("one stream per QP"));
}

/// `write_lat --stream`: the ping-pong posted from streams (CPU streams here), in loopback over
/// every size (odd ones too: the flag's word passes the message), as JSON, and across
/// processes, with WRITEs and with SENDs; a peer without --stream is refused.
#[test]
fn write_lat_stream_ping_pongs_from_streams() {
    let out = ok("write_lat", &["--mode", "cpu", "--stream", "-a", "-n", "20"]);
    assert!(
        out.contains("RDMA_Write Latency Test (gdaki write_lat --stream)"),
        "{out}"
    );
    assert!(out.contains("marked by each side's stream"), "{out}");
    assert!(rows(&out).len() > 10, "{out}");
    assert!(out.contains("Validation: every size's messages arrived intact"));
    for size in ["1", "3", "5", "4099"] {
        let out = ok("write_lat", &["--mode", "cpu", "--stream", "-s", size, "-n", "300"]);
        assert_eq!(rows(&out).len(), 1, "{out}");
    }
    let out = ok(
        "write_lat",
        &["--mode", "cpu", "--stream", "-s", "8", "-n", "100", "--json"],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["poster"].as_str(), Some("stream"));
    assert!(v["results"][0]["t_typical_us"].as_f64().unwrap_or(0.0) > 0.0, "{out}");
    let flags = ["--mode", "cpu", "--stream", "-s", "64", "-n", "100"];
    let (s, c) = server_client("write_lat", &flags, &flags);
    let (s, c) = both_succeeded(&s, &c);
    for out in [&s, &c] {
        assert_eq!(rows(out).len(), 1, "{out}");
    }
    let (s, c) = server_client("write_lat", &["--mode", "cpu", "-s", "64", "-n", "10"], &flags);
    assert!(!s.status.success() && !c.status.success());
    // SENDs from the streams, each arrival a receive's completion the stream waits for; the
    // receives outnumber the receive queue, so the CPU takes completions back as it goes.
    let out = ok("write_lat", &["--mode", "cpu", "--stream", "--send", "-a", "-n", "40"]);
    assert!(
        out.contains("Send Latency Test (gdaki write_lat --stream --send)"),
        "{out}"
    );
    assert!(rows(&out).len() > 10, "{out}");
    let flags = ["--mode", "cpu", "--stream", "--send", "-s", "64", "-n", "100"];
    let (s, c) = server_client("write_lat", &flags, &flags);
    let (s, c) = both_succeeded(&s, &c);
    for out in [&s, &c] {
        assert_eq!(rows(out).len(), 1, "{out}");
    }
    // A peer posting from kernels is another test: refused.
    let plain = ["--mode", "cpu", "--send", "-s", "64", "-n", "10"];
    let (s, c) = server_client("write_lat", &plain, &flags);
    assert!(!s.status.success() && !c.status.success());
}

/// `write_lat --send` (perftest's `ib_send_lat`): SENDs taken by receives, in loopback (every
/// size, so receives posted for one size take the next), as JSON, and across processes;
/// a client and a server that disagree on the verb are refused.
#[test]
fn write_lat_send_ping_pongs_sends_through_receives() {
    let out = ok("write_lat", &["--mode", "cpu", "--send", "-a", "-n", "10"]);
    assert!(out.contains("Send Latency Test"), "{out}");
    assert!(rows(&out).len() > 10, "{out}");
    assert!(out.contains("Validation: every size's messages arrived intact"));
    let out = ok(
        "write_lat",
        &["--mode", "cpu", "--send", "-s", "64", "-n", "50", "--json"],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["test"].as_str(), v["params"]["op"].as_str()),
        (Some("write_lat"), Some("send"))
    );
    let flags = ["--mode", "cpu", "--send", "-s", "300", "-n", "60"];
    let (s, c) = server_client("write_lat", &flags, &flags);
    let (s, c) = both_succeeded(&s, &c);
    for out in [&s, &c] {
        assert_eq!(rows(out).len(), 1, "{out}");
    }
    let (s, c) = server_client("write_lat", &["--mode", "cpu", "-s", "8", "-n", "10"], &flags);
    assert!(!s.status.success() && !c.status.success());
    assert!(
        String::from_utf8_lossy(&c.stderr).contains("write_lat --send"),
        "{}",
        String::from_utf8_lossy(&c.stderr)
    );
}

/// A --send ping-pong's receives are posted before its first round starts, as perftest's
/// are: the first SEND never meets "receiver not ready" (which costs the round an RNR timer,
/// seen only in t_max).
#[test]
fn write_lat_send_posts_its_receives_before_the_first_round() {
    let env = [("RUST_LOG", "gdaki_soft=debug")];
    for _ in 0..3 {
        let out = run_env("write_lat", &["--mode", "cpu", "--send", "-s", "8", "-n", "20"], &env);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{err}");
        assert!(!err.contains("receiver not ready"), "{err}");
    }
}

// ------------------------------------------------------------------------------ on a GPU

/// Whether a GPU test may run here; prints the skip otherwise (fails under GDAKI_REQUIRE_GPU=1).
fn gpu_or_skip(test: &str) -> bool {
    match gdaki::cuda::Gpu::open(0) {
        Ok(_) => true,
        Err(e) if std::env::var("GDAKI_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("GDAKI_REQUIRE_GPU=1 but no usable GPU: {e}")
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED (no usable GPU): {test}: {e}");
            false
        }
    }
}

#[test]
fn perftests_on_the_gpu_in_every_scope() {
    if !gpu_or_skip("perftests_on_the_gpu_in_every_scope") {
        return;
    }
    for scope in ["thread", "warp", "block"] {
        let out = ok(
            "put_bw",
            &["--mode", "gpu", "--scope", scope, "-s", "4096", "-n", "2000", "-q", "2"],
        );
        assert_eq!(rows(&out).len(), 1, "{out}");
        assert!(out.contains("gpu ("), "{out}");
        // SENDs from every scope, into receives CPU threads keep posted; 4 blocks on 2 QPs
        // share each QP across blocks.
        let out = ok(
            "put_bw",
            &[
                "--mode", "gpu", "--send", "--scope", scope, "-s", "4096", "-n", "2000", "-q", "2", "--blocks", "4",
            ],
        );
        assert_eq!(rows(&out).len(), 1, "{out}");
        assert!(out.contains("Send BW Test"), "{out}");
    }
    let out = ok("put_bw", &["--mode", "gpu", "--send", "-a", "-n", "500"]);
    assert_eq!(rows(&out).len(), 23, "{out}");
    let out = ok("write_lat", &["--mode", "gpu", "-s", "8", "-n", "200"]);
    assert_eq!(rows(&out).len(), 1, "{out}");
    assert!(out.contains("host-pinned memory"), "{out}");
    // Collapsed CQs: kernels sharing a QP (4 blocks on 2 QPs) and the ping-pong read one entry.
    let out = ok(
        "put_bw",
        &[
            "--mode",
            "gpu",
            "--collapsed-cq",
            "-s",
            "64",
            "-n",
            "20000",
            "-q",
            "2",
            "--blocks",
            "4",
        ],
    );
    assert_eq!(rows(&out).len(), 1, "{out}");
    let out = ok(
        "write_lat",
        &["--mode", "gpu", "--collapsed-cq", "-s", "8", "-n", "200"],
    );
    assert_eq!(rows(&out).len(), 1, "{out}");
    // No kernel: one stream per QP rings what the CPU wrote, into pinned and device memory.
    for mem in ["pinned", "device"] {
        let out = ok(
            "put_bw",
            &[
                "--mode", "gpu", "--stream", "--mem", mem, "-s", "65536", "-n", "2000", "-q", "2",
            ],
        );
        assert_eq!(rows(&out).len(), 1, "{out}");
    }
    // No kernel: the streams store the flags, ring and wait, into pinned and device memory.
    let out = ok("write_lat", &["--mode", "gpu", "--stream", "-a", "-n", "50"]);
    assert!(rows(&out).len() > 10, "{out}");
    assert!(out.contains("CUDA events"), "{out}");
    let out = ok(
        "write_lat",
        &["--mode", "gpu", "--stream", "--mem", "device", "-s", "8", "-n", "200"],
    );
    assert_eq!(rows(&out).len(), 1, "{out}");
    let out = ok(
        "write_lat",
        &["--mode", "gpu", "--stream", "--send", "-s", "8", "-n", "200"],
    );
    assert_eq!(rows(&out).len(), 1, "{out}");
    // Two-sided: the kernels post and poll receives.
    let out = ok("write_lat", &["--mode", "gpu", "--send", "-a", "-n", "20"]);
    assert!(rows(&out).len() > 10, "{out}");
    assert!(out.contains("Send Latency Test"), "{out}");
    // GPU device memory, moved by the soft HCA's GPU copier.
    let out = ok(
        "put_bw",
        &[
            "--mode", "gpu", "--mem", "device", "-s", "65536", "-n", "500", "--scope", "warp",
        ],
    );
    assert_eq!(rows(&out).len(), 1, "{out}");
    assert!(out.contains("GPU device memory"), "{out}");
    let out = ok(
        "put_bw",
        &[
            "--mode", "gpu", "--mem", "device", "-s", "65536", "-n", "500", "--scope", "warp", "--read",
        ],
    );
    assert_eq!(rows(&out).len(), 1, "{out}");
    assert!(out.contains("RDMA_Read BW Test"), "{out}");
    let out = ok(
        "write_lat",
        &["--mode", "gpu", "--mem", "device", "-s", "64", "-n", "100"],
    );
    assert_eq!(rows(&out).len(), 1, "{out}");
}

#[test]
fn perftests_on_the_gpu_through_the_cpu_proxy() {
    if !gpu_or_skip("perftests_on_the_gpu_through_the_cpu_proxy") {
        return;
    }
    // Asked for: --cpu-proxy. Data is validated by the programs (an error exit otherwise).
    for scope in ["thread", "warp"] {
        let out = ok(
            "put_bw",
            &[
                "--mode",
                "gpu",
                "--cpu-proxy",
                "--scope",
                scope,
                "-s",
                "4096",
                "-n",
                "2000",
                "-q",
                "2",
            ],
        );
        assert_eq!(rows(&out).len(), 1, "{out}");
        assert!(out.contains("cpu-proxy (1 proxy thread)"), "{out}");
        assert!(out.contains(" Proxy: "), "{out}");
    }
    let out = ok(
        "write_lat",
        &["--mode", "gpu", "--cpu-proxy", "-s", "8", "-n", "200", "--json"],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["handler"], "cpu-proxy");
    // Not asked for: the doorbell page cannot be mapped (modelled), so the library falls back.
    let unmappable = [("GDAKI_SOFT_UNMAPPABLE_DOORBELL", "1")];
    let out = ok_env(
        "put_bw",
        &["--mode", "gpu", "--scope", "warp", "-s", "64", "-n", "2000"],
        &unmappable,
    );
    assert_eq!(rows(&out).len(), 1, "{out}");
    assert!(out.contains("cpu-proxy-fallback (the doorbell page"), "{out}");
    assert!(out.contains(" Proxy: "), "{out}");
    let out = ok_env(
        "write_lat",
        &["--mode", "gpu", "-s", "8", "-n", "200", "--json"],
        &unmappable,
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["handler"], "cpu-proxy-fallback");
}

/// One process per GPU: put_bw's server on GPU 1 and its client on GPU 0, both with device
/// memory, read against a P2P copy between the two GPUs in the copy's direction (needs two GPUs
/// that reach each other; SKIPPED otherwise).
#[test]
fn put_bw_across_two_gpus_is_read_against_a_p2p_copy() {
    let test = "put_bw_across_two_gpus_is_read_against_a_p2p_copy";
    if !gpu_or_skip(test) {
        return;
    }
    let found = gdaki::cuda::probe().map_or(0, |i| i.gpus.len());
    if found < 2 {
        let _ = writeln!(std::io::stderr(), "SKIPPED (needs 2 GPUs, found {found}): {test}");
        return;
    }
    for (op, from, to) in [(None, 0, 1), (Some("--read"), 1, 0)] {
        let mut flags = vec!["--mode", "gpu", "--mem", "device", "-s", "65536", "-n", "2000"];
        flags.extend(op);
        let server = [&flags[..], &["--gpu", "1"]].concat();
        let client = [&flags[..], &["--gpu", "0", "--json"]].concat();
        let (s, c) = server_client("put_bw", &server, &client);
        let (_, out) = both_succeeded(&s, &c);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        let what = v["reference"]["what"].as_str().unwrap_or_default();
        assert!(
            what.contains(&format!(
                "P2P copy (cuMemcpyPeerAsync, peer access enabled) from GPU {from} to GPU {to}"
            )),
            "{what}"
        );
        let row = &v["results"][0];
        assert!(row["ref_bw_mib_s"].as_f64().unwrap_or(0.0) > 0.0, "{row}");
        // The text header says how the bytes travel.
        let text = String::from_utf8_lossy(&s.stdout);
        assert!(text.contains("copied GPU to GPU (P2P)"), "{text}");
    }
}

/// Two processes whose kernels wait for each other's WRITEs into device memory (one GPU each
/// where there are two). Each side's soft HCA maps the peer's allocation at its first WRITE
/// and restarts its GPU copier around that: a restart that waited on the legacy stream (for
/// the waiting kernel) held every message until the kernels' flag waits timed out.
#[test]
fn write_lat_across_processes_into_device_memory() {
    let test = "write_lat_across_processes_into_device_memory";
    if !gpu_or_skip(test) {
        return;
    }
    let server_gpu = match gdaki::cuda::probe().map_or(0, |i| i.gpus.len()) {
        2.. => "1",
        _ => "0",
    };
    let flags = ["--mode", "gpu", "--mem", "device", "-s", "8", "-n", "50"];
    let (s, c) = server_client(
        "write_lat",
        &[&flags[..], &["--gpu", server_gpu]].concat(),
        &[&flags[..], &["--gpu", "0"]].concat(),
    );
    let (_, out) = both_succeeded(&s, &c);
    assert_eq!(rows(&out).len(), 1, "{out}");
}

/// Posting from streams (no kernel) between two processes on the GPU: write_lat --stream into
/// pinned and device memory, and put_bw --stream, server and client each with CUDA streams
/// (the server on the second GPU where there is one).
#[test]
fn stream_posting_across_processes_on_the_gpu() {
    let test = "stream_posting_across_processes_on_the_gpu";
    if !gpu_or_skip(test) {
        return;
    }
    let server_gpu = match gdaki::cuda::probe().map_or(0, |i| i.gpus.len()) {
        2.. => "1",
        _ => "0",
    };
    for mem in ["pinned", "device"] {
        let flags = ["--mode", "gpu", "--stream", "--mem", mem, "-s", "8", "-n", "200"];
        let (s, c) = server_client(
            "write_lat",
            &[&flags[..], &["--gpu", server_gpu]].concat(),
            &[&flags[..], &["--gpu", "0"]].concat(),
        );
        let (s, c) = both_succeeded(&s, &c);
        for out in [&s, &c] {
            assert_eq!(rows(out).len(), 1, "{mem}: {out}");
        }
    }
    let flags = [
        "--mode", "gpu", "--stream", "--mem", "device", "-s", "65536", "-n", "2000",
    ];
    let (s, c) = server_client(
        "put_bw",
        &[&flags[..], &["--gpu", server_gpu]].concat(),
        &[&flags[..], &["--gpu", "0"]].concat(),
    );
    let (_, out) = both_succeeded(&s, &c);
    assert_eq!(rows(&out).len(), 1, "{out}");
}

/// `sock_bw` and `sock_lat` in CPU mode: a row per size next to the reference on the same
/// queue pairs (`put_bw`'s WRITEs, `write_lat`'s ping-pong), a sweep up to the ring, JSON, and
/// the refusals of sizes and placements that cannot work.
#[test]
fn socket_perftests_run_beside_their_references() {
    let flags = ["--mode", "cpu", "-s", "4096", "-n", "500", "--rx-bytes", "65536"];
    let out = ok("sock_bw", &flags);
    let r = rows(&out);
    assert_eq!(r.len(), 1, "{out}");
    assert_eq!((num(&r[0][0]), num(&r[0][1])), (4096.0, 500.0), "{out}");
    assert!(num(&r[0][2]) > 0.0 && num(&r[0][3]) > 0.0, "{out}");
    assert!(out.contains("Socket BW Test"), "{out}");
    // The calls run untimed unless asked: no Steps line.
    assert!(out.contains("not timed (--steps") && !out.contains(" Steps ("), "{out}");
    // Where each side's calls went, a line under the row.
    let out = ok("sock_bw", &[&flags[..], &["--steps"]].concat());
    assert!(
        out.contains(" Steps (4096 B, means): send: room ") && out.contains("(500 calls); receive: wait "),
        "{out}"
    );
    // A sweep stops at the ring.
    let out = ok("sock_bw", &["--mode", "cpu", "-a", "-n", "20", "--rx-bytes", "16384"]);
    assert_eq!(rows(&out).len(), 14, "2 B .. 16 KiB: {out}");
    // The same from registered memory, no copy (every byte received, or the run fails).
    let out = ok(
        "sock_bw",
        &["--mode", "cpu", "-a", "-n", "20", "--rx-bytes", "16384", "--zero-copy"],
    );
    assert_eq!(rows(&out).len(), 14, "2 B .. 16 KiB: {out}");
    assert!(out.contains("from registered memory, no copy"), "{out}");
    // The smallest send queue, sends from registered memory (one WQE a message, two where one
    // wraps the ring).
    let out = ok(
        "sock_bw",
        &[
            "--mode",
            "cpu",
            "-s",
            "3000",
            "-n",
            "200",
            "--rx-bytes",
            "16384",
            "-t",
            "8",
            "--zero-copy",
        ],
    );
    assert_eq!(rows(&out).len(), 1, "{out}");
    // Read in place at the receiver, and both sides without a copy.
    for extra in [&["--in-place"][..], &["--in-place", "--zero-copy"]] {
        let flags = ["--mode", "cpu", "-a", "-n", "20", "--rx-bytes", "16384"];
        let out = ok("sock_bw", &[&flags[..], extra].concat());
        assert_eq!(rows(&out).len(), 14, "2 B .. 16 KiB, {extra:?}: {out}");
        assert!(out.contains("read in place in the receive ring, no copy"), "{out}");
    }
    let out = ok(
        "sock_bw",
        &["--mode", "cpu", "-s", "100", "-n", "50", "--json", "--steps"],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["test"].as_str(), Some("sock_bw"));
    assert_eq!(v["results"][0]["bytes"].as_u64(), Some(100));
    assert!(v["results"][0]["put_bw_mib_s"].as_f64().unwrap_or(0.0) > 0.0, "{out}");
    // Each message fits the ring's room: a send call each. The receiver's last call sees the
    // end of the stream. The steps' means fit in the run.
    let (sender, receiver) = (&v["results"][0]["sender"], &v["results"][0]["receiver"]);
    assert_eq!(sender["calls"].as_u64(), Some(50), "{out}");
    assert!(
        receiver["calls"].as_u64().is_some_and(|c| (2..=51).contains(&c)),
        "{out}"
    );
    let run_us = 100.0 * 50.0 / (v["results"][0]["bw_mib_s"].as_f64().unwrap() * 1048576.0) * 1e6;
    let sent_us: f64 = [
        "room_us",
        "broadcast_us",
        "copy_us",
        "wqes_us",
        "doorbell_us",
        "result_us",
    ]
    .iter()
    .map(|k| sender[*k].as_f64().expect(k))
    .sum();
    assert!(
        sent_us >= 0.0 && sent_us * 50.0 <= run_us * 1.01,
        "{sent_us} us a call, {run_us} us in all: {out}"
    );
    assert!(
        [
            "wait_us",
            "broadcast_us",
            "copy_us",
            "consume_us",
            "credit_us",
            "result_us"
        ]
        .iter()
        .all(|k| receiver[*k].as_f64().is_some_and(|x| x >= 0.0)),
        "{out}"
    );
    // Latency: the socket's row, then write_lat's on the same path.
    let out = ok("sock_lat", &["--mode", "cpu", "-s", "64", "-n", "200", "--steps"]);
    let r = rows(&out);
    assert_eq!(r.len(), 2, "{out}");
    assert!(
        r.iter()
            .all(|row| num(&row[0]) == 64.0 && num(&row[1]) == 200.0 && num(&row[4]) > 0.0),
        "{out}"
    );
    assert!(out.contains(" Steps (64 B, means): ping send: room "), "{out}");
    let out = ok(
        "sock_lat",
        &["--mode", "cpu", "-s", "8", "-n", "100", "--json", "--steps"],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let row = &v["results"][0];
    assert!(row["socket_vs_write_lat"].as_f64().unwrap_or(0.0) > 0.0, "{out}");
    // Where a round trip goes: every side's calls, one a round each at 8 bytes.
    let steps = &row["steps"];
    for side in ["ping_send", "ping_receive", "pong_receive", "pong_send"] {
        assert_eq!(steps[side]["calls"].as_u64(), Some(100), "{side}: {out}");
    }
    assert!(steps["wire_us"].as_f64().is_some_and(f64::is_finite), "{out}");
    // Refused: a message larger than the ring, a ring that is not a power of two, -s with
    // -a, too few iterations, GPU memory without a GPU, send queues too small for a send's
    // WQEs or not a power of two.
    for args in [
        &["--mode", "cpu", "-s", "8192", "--rx-bytes", "4096"][..],
        &["--mode", "cpu", "-t", "4"],
        &["--mode", "cpu", "-t", "12"],
        &["--mode", "cpu", "--rx-bytes", "5000"],
        &["--mode", "cpu", "-s", "8", "-a"],
        &["--mode", "cpu", "-n", "1"],
        &["--mode", "cpu", "--mem", "device"],
    ] {
        let out = run("sock_bw", args);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(
            String::from_utf8_lossy(&out.stderr).starts_with("sock_bw: "),
            "{args:?}"
        );
    }
    // --zero-copy and --in-place are sock_bw's.
    for flag in ["--zero-copy", "--in-place"] {
        let out = run("sock_lat", &["--mode", "cpu", "-s", "8", flag]);
        assert!(!out.status.success(), "sock_lat {flag} was accepted");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(&format!("{flag} is sock_bw's")),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `sock_bw -q N`: N sockets streaming at once (their own connections and queue pairs), the
/// reference on the same N queue pairs; every socket's bytes arrive (the run fails
/// otherwise) and the steps count every socket's calls. In one process and across two.
#[test]
fn sock_bw_streams_several_sockets_at_once() {
    let out = ok(
        "sock_bw",
        &[
            "--mode",
            "cpu",
            "-s",
            "4096",
            "-n",
            "200",
            "-q",
            "3",
            "--rx-bytes",
            "65536",
            "--json",
            "--steps",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["params"]["qps"].as_u64(), Some(3), "{out}");
    let row = &v["results"][0];
    assert!(row["bw_mib_s"].as_f64().unwrap_or(0.0) > 0.0 && row["put_bw_mib_s"].as_f64().unwrap_or(0.0) > 0.0);
    // A send call a message on each socket. A receiver reads a message in two calls where it
    // wraps the ring's end (a dozen laps of a 64 KiB ring each), and its last call sees the
    // end of its stream.
    assert_eq!(row["sender"]["calls"].as_u64(), Some(600), "{out}");
    assert!(
        row["receiver"]["calls"]
            .as_u64()
            .is_some_and(|c| (603..=700).contains(&c)),
        "{out}"
    );
    let out = ok(
        "sock_bw",
        &["--mode", "cpu", "-s", "4096", "-n", "100", "-q", "2", "--steps"],
    );
    assert!(out.contains("2 pairs streaming at once"), "{out}");
    assert!(out.contains("(200 calls)"), "{out}");
    // Across processes: the client's connections of one run reach the server together.
    let flags = ["--mode", "cpu", "--rx-bytes", "65536"];
    let client = [&flags[..], &["-s", "8192", "-n", "100", "-q", "4", "--steps"]].concat();
    let (s, c) = server_client("sock_bw", &flags, &client);
    let (_, out) = both_succeeded(&s, &c);
    assert_eq!(rows(&out).len(), 1, "{out}");
    assert!(out.contains("4 connections at once"), "{out}");
    let server_err = String::from_utf8_lossy(&s.stderr);
    assert!(
        server_err.contains("served Recv, 8192 B x 100 on 4 socket(s)"),
        "{server_err}"
    );
    assert!(server_err.contains("usec a call (4"), "{server_err}");
    // The server's receivers read in place where the client asks (the role travels in its ask).
    let client = [&flags[..], &["-s", "8192", "-n", "100", "-q", "2", "--in-place"]].concat();
    let (s, c) = server_client("sock_bw", &flags, &client);
    let (_, out) = both_succeeded(&s, &c);
    assert_eq!(rows(&out).len(), 1, "{out}");
    let server_err = String::from_utf8_lossy(&s.stderr);
    assert!(
        server_err.contains("served RecvInPlace, 8192 B x 100 on 2 socket(s)"),
        "{server_err}"
    );
    // Refused: none, more than the most, and in the latency test.
    for (name, q, says) in [
        ("sock_bw", "0", "-q 0: 1 to 32"),
        ("sock_bw", "33", "-q 33: 1 to 32"),
        ("sock_lat", "2", "-q is sock_bw's"),
    ] {
        let out = run(name, &["--mode", "cpu", "-q", q]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{name} -q {q}: {err}");
    }
}

/// The socket perftests on the GPU: a block per side, rings in pinned and in GPU memory.
#[test]
fn socket_perftests_on_the_gpu() {
    if !gpu_or_skip("socket_perftests_on_the_gpu") {
        return;
    }
    for mem in ["pinned", "device"] {
        let out = ok("sock_bw", &["--mode", "gpu", "--mem", mem, "-s", "65536", "-n", "2000"]);
        assert_eq!(rows(&out).len(), 1, "{mem}: {out}");
        // Four sockets at once, a block each per side.
        let out = ok(
            "sock_bw",
            &[
                "--mode", "gpu", "--mem", mem, "-s", "65536", "-n", "500", "-q", "4", "--steps",
            ],
        );
        assert_eq!(rows(&out).len(), 1, "{mem}, -q 4: {out}");
        assert!(out.contains("(2000 calls)"), "{mem}, -q 4: {out}");
        let flags = ["--mode", "gpu", "--mem", mem, "-s", "65536", "-n", "2000"];
        let out = ok("sock_bw", &[&flags[..], &["--zero-copy"]].concat());
        assert_eq!(rows(&out).len(), 1, "{mem}, --zero-copy: {out}");
        let out = ok("sock_bw", &[&flags[..], &["--zero-copy", "--in-place"]].concat());
        assert_eq!(rows(&out).len(), 1, "{mem}, --zero-copy --in-place: {out}");
        let out = ok("sock_lat", &["--mode", "gpu", "--mem", mem, "-s", "64", "-n", "500"]);
        assert_eq!(rows(&out).len(), 2, "{mem}: {out}");
        // Into GPU memory the copier's view of both ping-pongs: a message's frame, one WRITE,
        // as write_lat's WRITE.
        assert_eq!(
            out.contains(" GPU copier (64 B): socket: 1.0 descriptors a look"),
            mem == "device",
            "{mem}: {out}"
        );
        assert_eq!(
            out.contains("; write_lat: 1.0 descriptors a look"),
            mem == "device",
            "{mem}: {out}"
        );
    }
    let out = ok("sock_bw", &["--mode", "gpu", "-a", "-n", "100", "--rx-bytes", "65536"]);
    assert_eq!(rows(&out).len(), 16, "{out}");
    // GPU to GPU between two processes (the server on the second GPU where there is one).
    let server_gpu = match gdaki::cuda::probe().map_or(0, |i| i.gpus.len()) {
        2.. => "1",
        _ => "0",
    };
    for (name, size, rows_per_size) in [("sock_bw", "65536", 1), ("sock_lat", "64", 2)] {
        let flags = ["--mode", "gpu", "--mem", "device", "-s", size, "-n", "200"];
        let (s, c) = server_client(
            name,
            &[&flags[..], &["--gpu", server_gpu]].concat(),
            &[&flags[..], &["--gpu", "0"]].concat(),
        );
        let (_, out) = both_succeeded(&s, &c);
        assert_eq!(rows(&out).len(), rows_per_size, "{name}: {out}");
    }
    // The echo example: a GPU server (a block per connection) for CPU clients, then for GPU
    // clients of another process (on the second GPU where there is one).
    for (server, client) in [
        (["--mode", "gpu"], ["--mode", "cpu"]),
        (["--mode", "gpu"], ["--mode", "gpu"]),
    ] {
        let (s, c) = server_client(
            "sock_echo",
            &[&server[..], &["-c", "4", "--gpu", server_gpu]].concat(),
            &[&client[..], &["-c", "4", "-s", "3000", "-n", "100", "--json"]].concat(),
        );
        let (_, out) = both_succeeded(&s, &c);
        let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
        assert_eq!(v["bytes_checked"], 4 * 3000 * 100, "{client:?}: {out}");
    }
}

/// `sock_echo` in CPU mode: a server serving three connections at once, clients checking every
/// byte of their echo; and its refusals.
#[test]
fn sock_echo_serves_many_connections_at_once() {
    let (s, c) = server_client(
        "sock_echo",
        &["--mode", "cpu", "-c", "3"],
        &["--mode", "cpu", "-c", "3", "-s", "3000", "-n", "200", "--json"],
    );
    let (_, out) = both_succeeded(&s, &c);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["bytes_checked"], 3 * 3000 * 200, "{out}");
    assert!(v["round_trips_per_s"].as_f64().unwrap() > 0.0, "{out}");
    let served = String::from_utf8_lossy(&s.stderr);
    for i in 0..3 {
        assert!(
            served.contains(&format!("connection {i} echoed 600000 bytes")),
            "{served}"
        );
    }
    // The plain-text summary.
    let (s, c) = server_client("sock_echo", &["--mode", "cpu"], &["--mode", "cpu", "-n", "10"]);
    let (_, out) = both_succeeded(&s, &c);
    assert!(out.contains("every byte echoed and checked"), "{out}");
    for (args, says) in [
        (&[][..], "give --server"),
        (&["--server", "127.0.0.1"][..], "choose one"),
        (&["127.0.0.1", "-s", "0"][..], "-s 0"),
        (&["--server", "-c", "0"][..], "-c 0"),
    ] {
        let out = run("sock_echo", &[&["--mode", "cpu"][..], args].concat());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{args:?}: {err}");
    }
}

/// `sock_bw` and `sock_lat` between two processes (CPU mode): the client asks the server for
/// each run through its connection, and tells it when it is done.
#[test]
fn socket_perftests_across_processes() {
    for (name, rows_per_size) in [("sock_bw", 1), ("sock_lat", 2)] {
        let flags = ["--mode", "cpu", "--rx-bytes", "65536"];
        let client = [&flags[..], &["-a", "-n", "50", "--steps"]].concat();
        let (s, c) = server_client(name, &flags, &client);
        let (_, out) = both_succeeded(&s, &c);
        let server_err = String::from_utf8_lossy(&s.stderr);
        assert_eq!(rows(&out).len(), 16 * rows_per_size, "{name}: {out}");
        assert!(out.contains("to the server at 127.0.0.1"), "{out}");
        if name == "sock_bw" {
            // The client has its sender's steps, the server says its receiver's.
            assert!(
                out.contains("): send: room ") && !out.contains("receive: wait"),
                "{out}"
            );
            assert!(server_err.contains("sock_bw: 65536 B, receive: wait "), "{server_err}");
        } else {
            // The client has its ping's steps (no trips: the pong's are the server's), the
            // server says its pong's.
            assert!(
                out.contains("): ping send: room ") && !out.contains("pong") && !out.contains("trips"),
                "{out}"
            );
            assert!(
                server_err.contains("sock_lat: 64 B, pong receive: wait "),
                "{server_err}"
            );
        }
    }
    // Unasked, the server times nothing and says no steps.
    let flags = ["--mode", "cpu", "--rx-bytes", "65536"];
    let (s, c) = server_client("sock_bw", &flags, &[&flags[..], &["-s", "4096", "-n", "50"]].concat());
    let (_, out) = both_succeeded(&s, &c);
    let server_err = String::from_utf8_lossy(&s.stderr);
    assert!(
        !out.contains(" Steps (") && !server_err.contains("receive: wait"),
        "{out}{server_err}"
    );
    // A server whose ring is smaller than what the client asks for refuses it.
    let (s, c) = server_client(
        "sock_bw",
        &["--mode", "cpu", "--rx-bytes", "4096"],
        &["--mode", "cpu", "-s", "65536"],
    );
    assert!(!s.status.success() && !c.status.success());
    assert!(
        String::from_utf8_lossy(&s.stderr).contains("ring holds 4096"),
        "{}",
        String::from_utf8_lossy(&s.stderr)
    );
}
