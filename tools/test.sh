#!/usr/bin/env bash
# The whole test suite, as CI runs it (.ci/run calls exactly this): setup, formatting, lints,
# docs, every test of the workspace (GPU tests say SKIPPED where there is no GPU), the loom model of
# the posting protocol, Miri on the copies that may race the HCA, and the PTX build.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
step() { printf '\n== %s\n' "$*" >&2; }

step "cargo fmt --check"
cargo fmt --all -- --check
step "cargo clippy --all-targets -- -D warnings"
cargo clippy --workspace --all-targets --locked -- -D warnings
step "cargo doc (warnings are errors: broken or private links)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked
step "cargo test (the C API and gshmem tests build C and C++ programs: they say so)"
cargo test --workspace --locked
step "loom model of the posting protocol (device/tests/loom.rs)"
# The model explores every interleaving (minutes) and depends only on the device crate, the
# layout crate, the manifests, the lock file and the compiler: once it has passed with exactly
# these, a second run says so and skips it (GDAKI_LOOM=always runs it anyway). A clean clone, as
# in CI, always runs it.
loom_inputs=$( { find device shared-layout -type f \( -name '*.rs' -o -name '*.toml' \) -print0 | sort -z |
  xargs -0 sha256sum; sha256sum Cargo.toml Cargo.lock; rustc -vV; } | sha256sum | cut -c1-16)
loom_stamp=target/loom/passed-$loom_inputs
if [[ -e $loom_stamp && ${GDAKI_LOOM:-} != always ]]; then
  echo "loom: passed before with these exact inputs ($loom_stamp); GDAKI_LOOM=always runs it again" >&2
else
  # Its own target dir: --cfg loom changes every crate's build, which must not evict the normal
  # one. --nocapture: each model says every 10 s how far it is, and what it explored in the end.
  RUSTFLAGS="--cfg loom" cargo test -p gdaki-device --test loom --release --locked --target-dir target/loom \
    -- --nocapture
  rm -f target/loom/passed-*
  touch "$loom_stamp"
fi
step "Miri: copies that race the HCA are defined behaviour (host/src/shared_copy.rs)"
if cargo +nightly miri --version >/dev/null 2>&1; then
  # Its own target dir, as for loom. Only this module: the rest calls the OS and CUDA.
  cargo +nightly miri test -p gdaki --lib --locked --target-dir target/miri shared_copy
else
  echo "SKIPPED: no Miri here (rustup toolchain install nightly --component miri,rust-src)" >&2
fi
step "PTX build"
ptx=target/ptx/gdaki_device.ptx
[[ -s $ptx ]] || { echo "test: $ptx was not built" >&2; exit 1; }
entries=$(grep -c '^\.visible \.entry\|^\.entry' "$ptx" || true)
echo "PTX: $ptx, $(wc -c <"$ptx") bytes, $entries entry points, $(grep -m1 '^\.target' "$ptx")" >&2
step "all passed"
