#!/usr/bin/env bash
# Builds the CUDA C++ echo (echo.cu) with nvcc against a release build of gdaki's C API and runs
# it on one GPU over the soft HCA: C++ server and C++ client (rings pinned, then in GPU
# memory), and, given the Rust `sock_echo`, each against the other (CPU clients of the C++
# server, C++ clients of the Rust GPU server). For a machine with a GPU and nvcc, Rust or not.
#
#   examples/sockets/gpu-run.sh GDAKI_DIR [SOCK_ECHO] [OUT]
#
# GDAKI_DIR holds libgdaki.so and gdaki_device_c.ptx (tools/gpu-bundle.sh packs them as
# gpu-bundle/capi); SOCK_ECHO is the Rust program (gpu-bundle/bin/sock_echo); OUT (default
# target/echo-gpu) gets the install, the build and logs/.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
[[ $# -ge 1 && -s $1/libgdaki.so ]] || { sed -n '2,11p' "$0" >&2; exit 2; }
from=$(cd "$1" && pwd)
rust=${2:-}
out=${3:-$root/target/echo-gpu}
mkdir -p "$out/logs"
"$root/tools/capi/install.sh" --prefix "$out/prefix" --from "$from" >/dev/null
make -s -C "$root/examples/sockets" GDAKI_PREFIX="$out/prefix" BUILD="$out/build" ARCH="${ARCH:-sm_90}"
echo=$out/build/echo
fails=0
pair() { # NAME SERVER... -- CLIENT...: runs both (the client retries until the server listens)
  local name=$1; shift
  local server=() client=()
  while [[ $1 != -- ]]; do server+=("$1"); shift; done; shift; client=("$@")
  local port=$((29300 + RANDOM % 400))
  echo "== $name" >&2
  timeout 120 "${server[@]}" -p "$port" >"$out/logs/$name.server.log" 2>&1 & local s=$!
  local ok=0
  for _ in $(seq 100); do
    if timeout 120 "${client[@]}" -p "$port" >"$out/logs/$name.client.log" 2>&1; then ok=1; break; fi
    grep -qiE "connect|refused" "$out/logs/$name.client.log" || break
    sleep 0.2
  done
  if wait "$s" && [[ $ok == 1 ]]; then
    cat "$out/logs/$name.client.log"
  else
    fails=$((fails + 1)); echo "FAILED: $name" >&2
    tail -n 20 "$out/logs/$name.server.log" "$out/logs/$name.client.log" >&2
  fi
}
for mem in pinned device; do
  pair "c++-c++-$mem" "$echo" --server -c 4 --mem "$mem" -- "$echo" 127.0.0.1 -c 4 -s 3000 -n 200 --mem "$mem"
done
if [[ -n $rust ]]; then
  pair "c++-server-rust-cpu-clients" "$echo" --server -c 3 -- "$rust" 127.0.0.1 --mode cpu -c 3 -s 3000 -n 200
  pair "rust-gpu-server-c++-clients" "$rust" --server --mode gpu -c 3 -- "$echo" 127.0.0.1 -c 3 -s 3000 -n 200
fi
echo "echo runs failed: $fails" >&2
[[ $fails == 0 ]]
