#!/usr/bin/env bash
# The main job for a newcomer: set the machine up, then check what gdaki can do here.
# Arguments go to `doctor` (e.g. --json).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
exec cargo run --release --locked -q -p gdaki-tools --bin doctor -- "$@"
