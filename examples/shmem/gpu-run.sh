#!/usr/bin/env bash
# Builds gshmem's CUDA programs with nvcc and runs them on one GPU over the soft HCA: shmem_test
# and the all-to-all as 2 and 4 processes under mpirun, and as 2 through the TCP rendezvous,
# with the symmetric heap in device memory and in pinned host memory. For a machine with a GPU,
# nvcc and Open MPI, Rust or not.
#
#   examples/shmem/gpu-run.sh GDAKI_DIR [OUT]
#
# GDAKI_DIR holds a release build's libgdaki.so and gdaki_device_c.ptx (tools/gpu-bundle.sh
# packs them as gpu-bundle/capi); OUT (default target/gshmem-gpu) gets the install, the build
# and logs/. Extra all-to-all arguments: A2A_ARGS (default "-n 20 -s 4096,65536,1048576");
# each run may take RUN_TIMEOUT seconds (default 300).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
[[ $# -ge 1 && -s $1/libgdaki.so ]] || { sed -n '2,13p' "$0" >&2; exit 2; }
from=$(cd "$1" && pwd)
out=${2:-$root/target/gshmem-gpu}
mkdir -p "$out/logs"
"$root/tools/capi/install.sh" --prefix "$out/prefix" --from "$from"
make -s -C "$root/examples/shmem" gpu GDAKI_PREFIX="$out/prefix" BUILD="$out/build" MPI=1 ARCH="${ARCH:-sm_90}"
bin=$out/build/gpu
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
read -r -a a2a <<<"${A2A_ARGS:--n 20 -s 4096,65536,1048576}"
fails=0 runs=0
run() { # NAME COMMAND...: runs it, logs it, counts a failure
  local name=$1; shift; runs=$((runs + 1))
  echo "== $name" >&2
  if timeout "${RUN_TIMEOUT:-300}" "$@" >"$out/logs/$name.log" 2>&1; then
    grep -E '^gshmem_test:|^ |^gshmem all-to-all|^\{' "$out/logs/$name.log" || true
  else
    fails=$((fails + 1)); echo "FAILED: $name" >&2; tail -30 "$out/logs/$name.log" >&2
  fi
}
tcp2() { # PROGRAM ARGS...: two PEs through the TCP rendezvous
  local port=$((29700 + RANDOM % 200))
  GSHMEM_BOOTSTRAP=tcp GSHMEM_TCP_ADDR=127.0.0.1:$port GSHMEM_NRANKS=2 GSHMEM_RANK=1 "$@" & local other=$!
  GSHMEM_BOOTSTRAP=tcp GSHMEM_TCP_ADDR=127.0.0.1:$port GSHMEM_NRANKS=2 GSHMEM_RANK=0 "$@"; local rc=$?
  wait "$other" && return $rc
}
for heap in device pinned; do
  export GSHMEM_HEAP=$heap
  for n in 2 4; do run "test-$heap-mpi$n" mpirun --oversubscribe -np "$n" "$bin/shmem_test"; done
  run "test-$heap-tcp2" bash -c "$(declare -f tcp2); tcp2 \"\$@\"" tcp2 "$bin/shmem_test"
  for n in 2 4; do run "alltoall-$heap-mpi$n" mpirun --oversubscribe -np "$n" "$bin/alltoall" "${a2a[@]}"; done
done
echo "gpu-run: $runs runs, $fails failed (logs in $out/logs)" >&2
exit $((fails > 0))
