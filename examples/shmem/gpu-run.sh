#!/usr/bin/env bash
# Builds gshmem's CUDA programs with nvcc and runs them on one GPU over the soft HCA: shmem_test
# and the all-to-all as 2 and 4 processes under mpirun, and as 2 through the TCP rendezvous,
# with the symmetric heap in device memory (kernels load and store each other's heaps, and
# again with GSHMEM_P2P=0: through queue pairs) and in pinned host memory (queue pairs). With
# two GPUs or more, also one process per GPU (load/store over P2P), two per GPU, and the
# all-to-all next to NCCL's (vs-nccl.sh). For a machine with a GPU, nvcc and Open MPI, Rust or
# not.
#
#   examples/shmem/gpu-run.sh GDAKI_DIR [OUT]
#
# GDAKI_DIR holds a release build's libgdaki.so and gdaki_device_c.ptx (tools/gpu-bundle.sh
# packs them as gpu-bundle/capi); OUT (default target/gshmem-gpu) gets the install, the build
# and logs/. Extra all-to-all arguments: A2A_ARGS (default "-n 20 -s 4096,65536,1048576");
# each run may take RUN_TIMEOUT seconds (default 300); RUNS, a regular expression, picks runs
# by name (test-device-mpi2, alltoall-gpus-mpi4, vs-nccl-2, ...).
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
run() { # NAME COMMAND...: runs it, logs it, counts a failure (only names matching RUNS, if set)
  local name=$1; shift
  [[ -z ${RUNS:-} || $name =~ $RUNS ]] || return 0
  runs=$((runs + 1))
  echo "== $name" >&2
  if timeout "${RUN_TIMEOUT:-300}" "$@" >"$out/logs/$name.log" 2>&1; then
    grep -E '^gshmem_test:|^gin_nccl:|^ |^gshmem all-to-all|^all-to-all|^\{' "$out/logs/$name.log" || true
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
# shmem_test checks that every PE takes the path GSHMEM_EXPECT_PATH names.
for heap in device pinned; do
  export GSHMEM_HEAP=$heap GSHMEM_EXPECT_PATH=queue_pair
  [[ $heap == device ]] && GSHMEM_EXPECT_PATH=load_store
  for n in 2 4; do run "test-$heap-mpi$n" mpirun --oversubscribe -np "$n" "$bin/shmem_test"; done
  run "test-$heap-tcp2" bash -c "$(declare -f tcp2); tcp2 \"\$@\"" tcp2 "$bin/shmem_test"
  for n in 2 4; do run "alltoall-$heap-mpi$n" mpirun --oversubscribe -np "$n" "$bin/alltoall" "${a2a[@]}"; done
  # The same exchange written against the GIN-shaped handle (load/store, or queue pairs).
  run "alltoall-gin-$heap-mpi2" mpirun --oversubscribe -np 2 "$bin/alltoall" "${a2a[@]}" --api gin
  # A kernel written for NCCL's GIN device API (gdaki_nccl_gin.cuh): one and two PEs.
  for n in 1 2; do run "gin-nccl-$heap-mpi$n" mpirun --oversubscribe -np "$n" "$bin/gin_nccl"; done
done
export GSHMEM_HEAP=device GSHMEM_P2P=0 GSHMEM_EXPECT_PATH=queue_pair
run "test-device-qp-mpi2" mpirun --oversubscribe -np 2 "$bin/shmem_test"
run "alltoall-device-qp-mpi2" mpirun --oversubscribe -np 2 "$bin/alltoall" "${a2a[@]}"
run "gin-nccl-device-qp-mpi2" mpirun --oversubscribe -np 2 "$bin/gin_nccl"
unset GSHMEM_P2P
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [[ ${gpus:-0} -ge 2 ]]; then
  # One process per GPU, then two per GPU: every heap loaded and stored over P2P.
  export GSHMEM_GPU=local GSHMEM_EXPECT_PATH=load_store
  for n in "$gpus" $((2 * gpus)); do
    run "test-gpus-mpi$n" mpirun --oversubscribe -np "$n" "$bin/shmem_test"
    run "alltoall-gpus-mpi$n" mpirun --oversubscribe -np "$n" "$bin/alltoall" "${a2a[@]}"
    run "alltoall-gin-gpus-mpi$n" mpirun --oversubscribe -np "$n" "$bin/alltoall" "${a2a[@]}" --api gin
    run "gin-nccl-gpus-mpi$n" mpirun --oversubscribe -np "$n" "$bin/gin_nccl"
  done
  unset GSHMEM_EXPECT_PATH
  run "vs-nccl-$gpus" "$root/examples/shmem/vs-nccl.sh" "$bin" "$gpus"
  unset GSHMEM_GPU
else
  echo "gpu-run: SKIPPED the runs across GPUs (needs two GPUs, found ${gpus:-0})" >&2
fi
echo "gpu-run: $runs runs, $fails failed (logs in $out/logs)" >&2
exit $((fails > 0))
