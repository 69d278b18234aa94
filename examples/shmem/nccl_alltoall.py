#!/usr/bin/env python3
"""NCCL's all-to-all through PyTorch, timed as gshmem's alltoall is: the reference it is compared
with on the same GPUs in the same session (examples/shmem/vs-nccl.sh runs both).

    mpirun -np N python3 nccl_alltoall.py [-s BYTES[,BYTES...]] [-n ITERATIONS] [-w WARMUP] [--json]

One process per GPU (the host-local rank's GPU). For each block size, every rank sends BYTES to
every rank (itself included) with torch.distributed.all_to_all_single, ITERATIONS times back to
back on one stream, timed with CUDA events on rank 0; the data is checked on every rank. Output:
the same columns (or JSON fields) as alltoall. Progress on stderr.
"""
import argparse
import json
import os
import sys


def env_int(*names, default=0):
    for n in names:
        if os.environ.get(n):
            return int(os.environ[n])
    return default


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-s", default="4096,65536,1048576", help="block sizes in bytes, comma-separated")
    ap.add_argument("-n", type=int, default=50, help="iterations timed")
    ap.add_argument("-w", type=int, default=5, help="warm-up iterations")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    sizes = [int(x) for x in a.s.split(",")]
    if a.n < 1 or a.w < 0 or any(s < 1 for s in sizes):
        ap.error("sizes and -n must be positive")

    import torch
    import torch.distributed as dist

    rank = env_int("OMPI_COMM_WORLD_RANK", "RANK")
    world = env_int("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", default=1)
    local = env_int("OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK")
    torch.cuda.set_device(local % torch.cuda.device_count())
    port = os.environ.get("NCCL_A2A_PORT", "29561")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    dev = torch.device("cuda")
    rows, intact = [], True
    for size in sizes:
        if rank == 0:
            print(f"nccl_alltoall: {world} ranks, blocks of {size} bytes ...", file=sys.stderr)
        # Block q of rank r holds (r * 37 + q * 101 + i) mod 256 at byte i.
        i = torch.arange(size, device=dev, dtype=torch.int64)
        send = torch.cat([((rank * 37 + q * 101 + i) % 256).to(torch.uint8) for q in range(world)])
        recv = torch.zeros_like(send)
        for _ in range(a.w):
            dist.all_to_all_single(recv, send)
        torch.cuda.synchronize()
        dist.barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.n):
            dist.all_to_all_single(recv, send)
        stop.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(stop) * 1000.0 / a.n
        want = torch.cat([((s * 37 + rank * 101 + i) % 256).to(torch.uint8) for s in range(world)])
        intact &= bool(torch.equal(recv, want))
        rows.append({"block_bytes": size, "bytes_per_pe": size * world, "alltoall_us": us,
                     "alltoall_gb_s": size * world / us / 1e3})
        dist.barrier()
    ok = torch.tensor([1 if intact else 0], device=dev)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        if a.json:
            print(json.dumps({"program": "nccl-alltoall", "pes": world, "iterations": a.n,
                              "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                              "clock": "rank 0", "rows": rows, "verified": bool(ok.item())}))
        else:
            print(f"NCCL all_to_all_single: {world} ranks, {a.n} iterations (rank 0's clock), NCCL "
                  + ".".join(map(str, torch.cuda.nccl.version())))
            print(f" {'block [B]':>12} {'bytes per PE':>14} {'all-to-all [us]':>18}")
            for r in rows:
                print(f" {r['block_bytes']:>12} {r['bytes_per_pe']:>14} {r['alltoall_us']:>18.2f}")
            print(f" data on every rank: {'verified' if ok.item() else 'WRONG'}")
    dist.destroy_process_group()
    return 0 if ok.item() else 1


if __name__ == "__main__":
    sys.exit(main())
