#!/usr/bin/env bash
# gshmem's all-to-all next to NCCL's (PyTorch's all_to_all_single) on the same GPUs in the same
# session: one process per GPU under mpirun, every block size timed by both, then one table (or
# JSON lines with --json). gshmem runs twice: with load/store between the GPUs (GSHMEM_P2P=1)
# and with every byte through the soft HCA's queue pairs (GSHMEM_P2P=0); then the same exchange
# written against gdaki's GIN-shaped handle (alltoall --api gin, GSHMEM_P2P=1).
#
#   examples/shmem/vs-nccl.sh BIN_DIR [NP] [--json]
#
# BIN_DIR holds the GPU build's alltoall (gpu-run.sh builds it); NP processes (default: one per
# GPU). SIZES (default 4096,65536,1048576,16777216), ITERS (default 50) and WARMUP (default 5)
# apply to both programs.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
[[ $# -ge 1 && -x $1/alltoall ]] || { sed -n '2,12p' "$0" >&2; exit 2; }
bin=$1
gpus=$(nvidia-smi -L | grep -c '^GPU')
np=${2:-$gpus}
json=0; [[ ${3:-} == --json || ${2:-} == --json ]] && json=1
[[ $np == --json ]] && np=$gpus
sizes=${SIZES:-4096,65536,1048576,16777216}
iters=${ITERS:-50} warmup=${WARMUP:-5}
largest=$(tr , '\n' <<<"$sizes" | sort -n | tail -1)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Room for the send, receive and copy buffers of the largest block, and gshmem's own words.
export GSHMEM_HEAP_BYTES=$(( (2 * np + 2) * largest + (1 << 20) )) GSHMEM_GPU=local GSHMEM_HEAP=device
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
args=(-s "$sizes" -n "$iters" -w "$warmup" --json)
echo "vs-nccl: gshmem load/store ..." >&2
GSHMEM_P2P=1 mpirun --oversubscribe -x GSHMEM_P2P -np "$np" "$bin/alltoall" "${args[@]}" >"$out/p2p.json"
echo "vs-nccl: gshmem through queue pairs (GSHMEM_P2P=0) ..." >&2
GSHMEM_P2P=0 mpirun --oversubscribe -x GSHMEM_P2P -np "$np" "$bin/alltoall" "${args[@]}" >"$out/qp.json"
echo "vs-nccl: the GIN handle over gshmem (--api gin) ..." >&2
GSHMEM_P2P=1 mpirun --oversubscribe -x GSHMEM_P2P -np "$np" "$bin/alltoall" "${args[@]}" --api gin >"$out/gin.json"
echo "vs-nccl: NCCL ..." >&2
NCCL_A2A_PORT=$((29600 + RANDOM % 300)) mpirun --oversubscribe -x NCCL_A2A_PORT -np "$np" \
  python3 "$here/nccl_alltoall.py" "${args[@]}" >"$out/nccl.json"
python3 - "$out" "$json" <<'EOF'
import json, sys
out, as_json = sys.argv[1], sys.argv[2] == "1"
load = lambda name: json.loads(open(f"{out}/{name}.json").read().strip().splitlines()[-1])
p2p, qp, gin, nccl = load("p2p"), load("qp"), load("gin"), load("nccl")
ok = p2p["verified"] and qp["verified"] and gin["verified"] and nccl["verified"]
rows = []
for a, b, g, c in zip(p2p["rows"], qp["rows"], gin["rows"], nccl["rows"]):
    rows.append({"block_bytes": a["block_bytes"], "pieces": a["pieces"], "gshmem_load_store_us": a["alltoall_us"],
                 "gshmem_queue_pairs_us": b["alltoall_us"], "gin_handle_us": g["alltoall_us"],
                 "nccl_us": c["alltoall_us"], "nccl_over_gshmem": c["alltoall_us"] / a["alltoall_us"],
                 "nccl_over_gin": c["alltoall_us"] / g["alltoall_us"]})
if as_json:
    print(json.dumps({"program": "gshmem-vs-nccl", "pes": p2p["pes"], "iterations": p2p["iterations"],
                      "load_store_pes": p2p["load_store_pes"], "nccl": nccl["nccl"], "rows": rows,
                      "verified": ok}))
else:
    print(f"all-to-all, {p2p['pes']} PEs, one process each, {p2p['iterations']} iterations; per call, us "
          f"(gshmem: PE 0 loads and stores {p2p['load_store_pes']} of {p2p['pes']} heaps; NCCL {nccl['nccl']})")
    print(f" {'block [B]':>12} {'pieces':>7} {'gshmem load/store':>18} {'gshmem QPs':>12} {'GIN handle':>11} "
          f"{'NCCL':>10} {'NCCL/gshmem':>12} {'NCCL/GIN':>9}")
    for r in rows:
        print(f" {r['block_bytes']:>12} {r['pieces']:>7} {r['gshmem_load_store_us']:>18.2f} "
              f"{r['gshmem_queue_pairs_us']:>12.2f} {r['gin_handle_us']:>11.2f} {r['nccl_us']:>10.2f} "
              f"{r['nccl_over_gshmem']:>11.2f}x {r['nccl_over_gin']:>8.2f}x")
    print(f" data on every PE: {'verified' if ok else 'WRONG'}")
sys.exit(0 if ok else 1)
EOF
