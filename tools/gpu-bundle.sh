#!/usr/bin/env bash
# Packages everything the GPU tests need for a machine that has an NVIDIA GPU but no Rust:
# the release test executables, the tool and example binaries, the PTX, and a runner.
#
#   tools/gpu-bundle.sh [DIR]        (default DIR: gpu-bundle, ignored by git)
#   then, on the GPU machine:        DIR/run.sh [FILTER]
#
# With the device tool of this workplace: build here, then (the packed copy stays well under
# the tool's 64 MiB carry limit; every binary embeds the PTX)
#   run(command="tar xzf gpu-bundle.tgz && gpu-bundle/run.sh", carry=["gpu-bundle.tgz"])
# GDAKI_BUNDLE_SKIP, an extended regular expression, leaves out the test executables and
# binaries whose bundle names match it (say 'bench-' when only the tests are to run and the
# packed bundle and the working tree would pass the carry limit together).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpu-bundle}
tools/setup.sh --check >/dev/null || tools/setup.sh

rm -rf "$dir"; mkdir -p "$dir/tests" "$dir/bin"
skipped() { [[ -n ${GDAKI_BUNDLE_SKIP:-} && $1 =~ $GDAKI_BUNDLE_SKIP ]]; }
echo "gpu-bundle: building release test executables and binaries" >&2
cargo build --release --locked --workspace --bins -q
cargo test --release --locked --workspace --no-run --message-format=json -q 2>/dev/null \
  | python3 -c '
import json, os, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        t = m["target"]
        # The golden layout tests compile C against the rdma-core headers of the build machine at
        # paths fixed at build time, and the header tests check the sources: they check the
        # build, not the GPU, and run in CI instead; so do the C API and gshmem tests, which
        # install the libraries with cargo and compile C and C++ programs (the gshmem CUDA build
        # runs on the GPU machine through examples/shmem/gpu-run.sh instead).
        if t["name"] in ("golden", "wqe_golden", "prm_golden", "layout", "headers", "c_api", "shmem"):
            continue
        crate_dir = os.path.basename(os.path.dirname(m["manifest_path"]))
        # Crates with no GPU code (their tests check layouts, the build, tools and the lock
        # file), and the loom model, which needs --cfg loom: CI runs them; the bundle stays
        # within the 64 MiB the device tool carries.
        if crate_dir in ("shared-layout", "devx", "mlx5-sys", "build", "tools") or t["name"] == "loom":
            continue
        print(m["executable"], crate_dir + "-" + t["kind"][0] + "-" + t["name"])
' | while read -r exe name; do
  skipped "$name" || cp "$exe" "$dir/tests/$name"
done
for bin in target/release/*; do
  # gen-headers writes the source tree's headers: nothing to do on a GPU machine.
  [[ -f $bin && -x $bin && ! $bin == *.d && ! $bin == *.so && ${bin##*/} != gen-headers ]] && ! skipped "${bin##*/}" &&
    cp "$bin" "$dir/bin/"
done
cp target/ptx/gdaki_device.ptx "$dir/"
# The C API's shared library and the C PTX, for the CUDA C++ programs built on the GPU machine
# (examples/shmem/gpu-run.sh gpu-bundle/capi); the static library stays behind (60 MB).
cargo build --release --locked -p gdaki-capi -q
mkdir -p "$dir/capi"
cp target/release/libgdaki.so target/ptx/gdaki_device_c.ptx "$dir/capi/"
strip --strip-debug "$dir/capi/libgdaki.so"
# Host benchmarks travel too: the device machine has more cores and less noise than CI.
cargo bench --locked -p gdaki-device -p gdaki -p gdaki-proxy --no-run --message-format=json -q 2>/dev/null \
  | tools/bench-executables.py | while read -r exe name; do
  skipped "bench-$name" || cp "$exe" "$dir/bin/bench-$name"
done
# The posting benchmark's C++ kernels inlined by clang, for `bench-gpu_posting --clang-ptx`
# (the device machine has no clang).
if ! skipped bench-gpu_posting && command -v clang-22 >/dev/null; then
  tools/cuda/clang-kernel.sh host/benches/cuda/post_rate.cu "$dir/bin/post_rate_clang.ptx" ||
    echo "gpu-bundle: the posting benchmark goes without its clang-inlined kernels" >&2
fi
strip --strip-debug "$dir"/tests/* "$dir"/bin/* 2>/dev/null || true

cat > "$dir/run.sh" <<'RUNNER'
#!/usr/bin/env bash
# Runs every packaged test executable with GPU tests required (a missing GPU fails them instead
# of skipping), then doctor --require gpu, and prints a summary. Optional FILTER: only test
# executables whose name contains it. Logs: logs/<name>.log beside this script; the logs of
# failed executables are also copied to $OUT/ when that is set (the device tool's return folder).
cd "$(dirname "$0")"
filter=${1:-}
logs=logs; mkdir -p "$logs"
# Tests that run binaries find them here instead of at their build-machine path.
export GDAKI_REQUIRE_GPU=1 RUST_BACKTRACE=1 GDAKI_BIN_DIR="$PWD/bin"
pass=0; fail=0; summary=()
for t in tests/*; do
  name=$(basename "$t")
  [[ -n $filter && $name != *"$filter"* ]] && continue
  if "$t" --test-threads=4 >"$logs/$name.log" 2>&1; then r=ok; pass=$((pass+1)); else r=FAILED; fail=$((fail+1)); fi
  counts=$(grep -E '^test result' "$logs/$name.log" | tail -1 | sed 's/test result: //')
  skipped=$(grep -c '^SKIPPED' "$logs/$name.log")
  summary+=("$(printf '%-7s %-45s %s%s' "$r" "$name" "$counts" "$([[ $skipped != 0 ]] && echo ", $skipped SKIPPED")")")
  if [[ $r == FAILED ]]; then
    tail -40 "$logs/$name.log"
    [[ -n ${OUT:-} ]] && cp "$logs/$name.log" "$OUT/"
  fi
done
echo; echo "== ptxas -arch=sm_90 (every entry point assembles)"
if command -v ptxas >/dev/null || [[ -x /usr/local/cuda/bin/ptxas ]]; then
  px=$(command -v ptxas || echo /usr/local/cuda/bin/ptxas)
  if "$px" -arch=sm_90 -v gdaki_device.ptx -o "$logs/gdaki_device.cubin" >"$logs/ptxas.log" 2>&1; then
    echo "ptxas: ok, $(grep -c 'Compiling entry' "$logs/ptxas.log") entries; registers per entry:"
    grep -o 'Used [0-9]* registers' "$logs/ptxas.log" | awk '{print $2}' | sort -n | uniq -c | awk '{printf "  %s x %s\n", $1, $2}'
  else
    tail -20 "$logs/ptxas.log"; fail=$((fail+1))
  fi
else
  echo "ptxas: not found, skipped"
fi
echo; echo "== doctor --require gpu"
if bin/doctor --require gpu; then d=ok; else d=FAILED; fail=$((fail+1)); fi
echo; echo "== summary ($(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1))"
printf '%s\n' "${summary[@]}"
echo "doctor: $d"
echo "executables: $pass passed, $fail failed"
[[ $fail == 0 ]]
RUNNER
chmod +x "$dir/run.sh"
echo "gpu-bundle: $(du -sh "$dir" | cut -f1) in $dir ($(ls "$dir/tests" | wc -l) test executables, $(ls "$dir/bin" | wc -l) binaries)" >&2
tar czf "$dir.tgz" "$dir"
echo "gpu-bundle: packed as $dir.tgz ($(du -sh "$dir.tgz" | cut -f1))" >&2
