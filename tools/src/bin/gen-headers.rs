//! Writes gdaki's generated C / CUDA C++ headers (`gdaki_tools::headers`) into the workspace,
//! or with `--check` fails if they are not current.
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;

/// Generate gdaki_device.h, gdaki_layout_check.h and gdaki.h from the Rust sources.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Change nothing; exit 1 (naming the files) if a header is not what generation gives.
    #[arg(long)]
    check: bool,
    /// The workspace root (default: this crate's workspace).
    #[arg(long)]
    workspace: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let root = args
        .workspace
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".."));
    let headers = gdaki_tools::headers::generate(&root)?;
    let stale = headers.stale(&root);
    if !args.check {
        for (path, text) in headers.files() {
            if !stale.contains(&path) {
                continue;
            }
            let file = root.join(path);
            std::fs::create_dir_all(file.parent().context("a header path has a directory")?)?;
            std::fs::write(&file, text).with_context(|| format!("writing {}", file.display()))?;
            eprintln!("gen-headers: wrote {path}");
        }
        return Ok(());
    }
    if !stale.is_empty() {
        bail!(
            "not current: {} (run `cargo run -p gdaki-tools --bin gen-headers`)",
            stale.join(", ")
        );
    }
    Ok(())
}
