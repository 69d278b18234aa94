#!/usr/bin/env bash
# The main job for a newcomer: set the machine up, then run put_bw in loopback on the default
# provider (the soft HCA where there is no ConnectX NIC), posted by GPU kernels if a usable GPU
# is there, else by CPU threads. Arguments go to put_bw (e.g. -a, --json, --scope warp);
# `cargo run --release -p gdaki-tools --bin doctor` says what this machine can do.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/tools/setup.sh"
# Not quiet: a first build takes minutes, and cargo's progress says what it is doing. write_lat
# is built too (the README's next command). put_bw then says on stderr which mode `auto` chose
# and why, before the run. It runs where the user is, so a relative --plot path lands there.
echo "run: building put_bw and write_lat (release; minutes the first time) ..." >&2
manifest=(--manifest-path "$root/Cargo.toml")
cargo build --release --locked "${manifest[@]}" -p gdaki-examples --bin put_bw --bin write_lat
exec cargo run --release --locked "${manifest[@]}" -p gdaki-examples --bin put_bw -- "$@"
