//! `doctor` end to end: it runs, says the truth about this machine, and its JSON is stable.
use std::process::Command;

/// The binary under test: cargo's build, or `$GDAKI_BIN_DIR/doctor` where the tests were moved
/// to another machine (the GPU bundle).
fn doctor(args: &[&str]) -> std::process::Output {
    let bin = std::env::var_os("GDAKI_BIN_DIR")
        .map(|dir| std::path::PathBuf::from(dir).join("doctor"))
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_doctor").into());
    Command::new(&bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", bin.display()))
}

#[test]
fn json_report_has_the_documented_keys_and_a_concrete_choice() {
    let out = doctor(&["--json", "--no-selftest"]);
    assert!(
        out.status.success(),
        "doctor failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    for key in [
        "cuda",
        "ptx",
        "libibverbs",
        "rdma_devices",
        "nvidia_peermem",
        "selection",
        "can_run",
    ] {
        assert!(v.get(key).is_some(), "missing key {key} in {v}");
    }
    let provider = v["selection"]["provider"].as_str().unwrap();
    assert!(
        provider == "soft" || provider == "mlx5",
        "auto must resolve, got {provider}"
    );
    let has_mlx5 = v["rdma_devices"].as_array().unwrap().iter().any(|d| d["mlx5"] == true);
    assert_eq!(
        provider == "mlx5",
        has_mlx5,
        "auto picks mlx5 exactly when an mlx5 device exists"
    );
    assert_eq!(v["can_run"], true);
    // The soft device is opened as a context opens it, and meets every requirement.
    let soft = v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == "soft")
        .expect("the soft device is listed");
    let reqs = soft["report"]["requirements"].as_array().expect("a report");
    assert!(reqs.len() >= 5, "{soft}");
    assert!(reqs.iter().all(|r| r["met"] == true), "{soft}");
    assert_eq!(soft["report"]["link_layer"], "Ethernet");
}

/// Probes read the same way everywhere: `{"ok": true, "value": ...}` or `{"ok": false,
/// "error": "..."}`, never Rust's `{"Ok": ...}` / `{"Err": ...}`; dma-buf is reported; the
/// doorbell handler has put_bw's names (`direct`, `cpu-proxy`).
#[test]
fn json_report_speaks_one_documented_vocabulary() {
    let out = doctor(&["--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!text.contains("\"Ok\"") && !text.contains("\"Err\""), "{text}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    for probe in [&v["cuda"], &v["ptx"]] {
        let ok = probe["ok"].as_bool().expect("an ok flag");
        assert_eq!(probe.get("value").is_some(), ok, "{probe}");
        assert_eq!(probe["error"].is_string(), !ok, "{probe}");
    }
    for t in v["selftests"].as_array().unwrap() {
        assert!(t["result"]["ok"].is_boolean(), "{t}");
    }
    assert!(v["dma_buf"].is_boolean(), "{v}");
    let handler = v["selection"]["handler"].as_str().unwrap();
    assert!(handler == "direct" || handler == "cpu-proxy", "{handler}");
}

#[test]
fn text_report_names_the_mode() {
    let out = doctor(&["--no-selftest"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("verdict: gdaki can run here"), "{text}");
    if !gdaki::cuda::driver_present() {
        assert!(text.contains("no NVIDIA driver"), "{text}");
        assert!(text.contains("CPU mode"), "{text}");
    }
}

/// Whether this machine has RDMA devices (which may meet an mlx5 requirement).
fn has_rdma_devices() -> bool {
    std::path::Path::new(gdaki::system::SYSFS_INFINIBAND)
        .read_dir()
        .is_ok_and(|mut d| d.next().is_some())
}

#[test]
fn unmet_requirement_fails_and_says_so() {
    if has_rdma_devices() {
        return;
    }
    let out = doctor(&["--require", "mlx5", "--no-selftest"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("required but unavailable: mlx5"));
}

/// The JSON verdict is the exit status, and says why. Where there is no mlx5 device, an mlx5
/// requirement or the mlx5 provider gives `can_run: false` (`--require mlx5` said true and
/// exited with 1) with `mlx5` among the failed requirements (`--provider mlx5` named none), and
/// the text verdict says that no mlx5 device exists.
#[test]
fn an_unmet_verdict_is_the_exit_status_and_names_its_cause() {
    if has_rdma_devices() {
        return;
    }
    for args in [&["--require", "mlx5"][..], &["--provider", "mlx5"]] {
        let out = doctor(&[args, &["--no-selftest", "--json"]].concat());
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert_eq!(json["can_run"], false, "{args:?}: {json}");
        assert_eq!(json["failed_requirements"], serde_json::json!(["mlx5"]), "{args:?}");
    }
    let out = doctor(&["--provider", "mlx5", "--no-selftest"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("no mlx5 RDMA device"), "{text}");
}

#[test]
fn bad_flag_is_a_usage_error() {
    let out = doctor(&["--provider", "mlx4"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("mlx4"));
}
