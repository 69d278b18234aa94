#!/usr/bin/env bash
# The perftest figures the README quotes: put_bw -a sweeps in thread and warp scope (tables,
# JSON, SVG plots), the 8-byte message rate in every scope, and write_lat -a, each with its
# reference measured in the same run.
#
#   tools/perftest-figures.sh [BIN_DIR] [OUT_DIR]   (defaults: target/release, perftest-figures)
#
# On a GPU machine without Rust: tools/gpu-bundle.sh here, then there
#   tools/perftest-figures.sh gpu-bundle/bin "$OUT"
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release}
out=${2:-perftest-figures}
mkdir -p "$out"
run() { # name args...
  local name=$1; shift
  echo "== $name: $*" | tee -a "$out/commands.txt" >&2
  "$bin/$name" "$@"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >"$out/gpu.txt" 2>/dev/null || echo "no GPU" >"$out/gpu.txt"
date -u +%Y-%m-%dT%H:%MZ >"$out/date.txt"
for scope in thread warp; do
  run put_bw -a --scope "$scope" --plot "$out/put_bw_$scope.svg" | tee "$out/put_bw_$scope.txt"
done
for scope in thread warp block; do
  run put_bw -s 8 -n 200000 --scope "$scope" --json >"$out/put_bw_8b_$scope.json"
done
run write_lat -a | tee "$out/write_lat.txt"
run write_lat -s 8 -n 10000 --json >"$out/write_lat_8b.json"
