//! The C API as a C program uses it: `tools/capi/install.sh` installs this build's libraries
//! and headers into a scratch prefix, `tests/c/api_test.c` is compiled against it through
//! pkg-config (linked to libgdaki.so, and again to libgdaki.a), and both programs run every
//! call's success and error paths on the soft HCA in CPU mode. Needs a C compiler and
//! pkg-config (tools/setup.sh installs them).
use std::path::{Path, PathBuf};
use std::process::Command;

/// target/<profile> of this test, with libgdaki.so and libgdaki.a built there: cargo builds a
/// library's cdylib and staticlib for its tests only when they link it as an rlib, which this
/// one cannot be (its name is the Rust library's).
fn build_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(Path::parent).unwrap().to_path_buf();
    let mut cargo = Command::new(env!("CARGO"));
    cargo.args(["build", "-p", "gdaki-capi"]);
    if dir.file_name().is_some_and(|p| p == "release") {
        cargo.arg("--release");
    }
    // Same target directory, features and profile as this test: only gdaki-capi links.
    run(cargo.current_dir(workspace()));
    dir
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e} (run tools/setup.sh: it installs gcc and pkg-config)"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

fn pkg_config(prefix: &Path, args: &[&str]) -> Vec<String> {
    let out = run(Command::new("pkg-config")
        .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig"))
        .args(args)
        .arg("gdaki"));
    out.split_whitespace().map(str::to_string).collect()
}

/// A line on the terminal while the test runs: written to stderr itself, past the harness's
/// capture (which takes only `eprintln!`), so that the installs and compiles say what they are.
fn say(what: &str) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stderr(), "    c_api: {what}");
}

#[test]
fn the_c_test_program_passes_linked_dynamically_and_statically() {
    say("installing the C API, compiling api_test.c against libgdaki.so and libgdaki.a, running both");
    let prefix = std::env::temp_dir().join(format!("gdaki-capi-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&prefix);
    run(Command::new(workspace().join("tools/capi/install.sh"))
        .arg("--prefix")
        .arg(&prefix)
        .arg("--from")
        .arg(build_dir()));
    let soname = run(Command::new("readelf").arg("-d").arg(prefix.join("lib/libgdaki.so")));
    assert!(
        soname.contains("[libgdaki.so.1]"),
        "SONAME is not libgdaki.so.<GDAKI_ABI_VERSION>:\n{soname}"
    );

    let src = workspace().join("host/capi/tests/c/api_test.c");
    let warnings = ["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic"];
    let cflags = pkg_config(&prefix, &["--cflags"]);
    let dynamic = prefix.join("api_test_dynamic");
    run(Command::new("cc")
        .args(warnings)
        .args(&cflags)
        .arg(&src)
        .arg("-o")
        .arg(&dynamic)
        .args(pkg_config(&prefix, &["--libs"]))
        .arg("-lpthread")
        .arg(format!("-Wl,-rpath,{}", prefix.join("lib").display())));
    // Static: the archive by name, and what it needs from the system (Libs.private).
    let libs: Vec<String> = pkg_config(&prefix, &["--static", "--libs"])
        .into_iter()
        .map(|l| if l == "-lgdaki" { "-l:libgdaki.a".into() } else { l })
        .collect();
    let fixed = prefix.join("api_test_static");
    run(Command::new("cc")
        .args(warnings)
        .args(&cflags)
        .arg(&src)
        .arg("-o")
        .arg(&fixed)
        .args(libs)
        .arg("-lpthread"));
    let needed = run(Command::new("readelf").arg("-d").arg(&fixed));
    assert!(
        !needed.contains("libgdaki.so"),
        "the static build links libgdaki.so:\n{needed}"
    );

    // docs/c-api.md's link lines, as written there (its prefix, /opt/gdaki, replaced by this
    // one's; app.c by the test program).
    let doc = std::fs::read_to_string(workspace().join("docs/c-api.md")).unwrap();
    let lines: Vec<&str> = doc
        .lines()
        .skip_while(|l| *l != "## Install and link")
        .take_while(|l| !l.starts_with("## Conventions"))
        .filter(|l| l.starts_with("cc app.c"))
        .collect();
    assert_eq!(lines.len(), 2, "docs/c-api.md's link lines:\n{doc}");
    let mut from_doc = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let program = prefix.join(format!("doc_app_{i}"));
        let command = line
            .replace("/opt/gdaki", &prefix.display().to_string())
            .replace("app.c", &src.display().to_string())
            .replace("-o app", &format!("-o {}", program.display()));
        run(Command::new("bash")
            .arg("-c")
            .arg(&command)
            .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")));
        from_doc.push(program);
    }
    // Every header the install puts in include/ is named in the doc.
    for header in std::fs::read_dir(prefix.join("include")).unwrap().flatten() {
        let name = header.file_name().to_string_lossy().into_owned();
        assert!(
            doc.contains(&format!("`{name}`")),
            "docs/c-api.md does not name the installed {name}"
        );
    }
    let needed = run(Command::new("readelf").arg("-d").arg(&from_doc[1]));
    assert!(
        !needed.contains("libgdaki.so"),
        "the doc's static line links libgdaki.so:\n{needed}"
    );

    // Under valgrind too, where it is installed (tools/setup.sh installs it): the program
    // hands gdaki handles of the wrong kind and destroyed ones, and every check must read only
    // memory the handle owns (the tag check once read past small handles).
    if Command::new("valgrind")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        say("running api_test.c under valgrind (memcheck)");
        let out = run(Command::new("valgrind")
            .args(["-q", "--error-exitcode=97", "--leak-check=no", "--track-origins=no"])
            .arg(&dynamic)
            .env("RUST_LOG", "off"));
        assert!(out.contains(", 0 failed"), "under valgrind: {out}");
    } else {
        println!("SKIPPED: the C program under valgrind (no valgrind here; tools/setup.sh installs it)");
    }
    for program in [dynamic, fixed].into_iter().chain(from_doc) {
        let out = run(Command::new(&program).env("RUST_LOG", "off"));
        eprint!("{out}");
        assert!(out.contains(", 0 failed"), "{}: {out}", program.display());
    }
    let _ = std::fs::remove_dir_all(&prefix);
}
