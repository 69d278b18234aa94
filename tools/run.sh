#!/usr/bin/env bash
# The main job for a newcomer: set the machine up, then run put_bw in loopback on the default
# provider (the soft HCA where there is no ConnectX NIC), posted by GPU kernels if a usable GPU
# is there, else by CPU threads. Arguments go to put_bw (e.g. -a, --json, --scope warp);
# `cargo run --release -p gdaki-tools --bin doctor` says what this machine can do.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
# Not quiet: a first build takes minutes, and cargo's progress says what it is doing. put_bw
# then says on stderr which mode `auto` chose and why, before the run.
echo "run: building put_bw (release; minutes the first time) ..." >&2
exec cargo run --release --locked -p gdaki-examples --bin put_bw -- "$@"
