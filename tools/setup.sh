#!/usr/bin/env bash
# Installs what building and testing gdaki needs on Debian (12 or newer), idempotently: a second
# run installs nothing and takes about a second. Says what it did and checks versions.
#
#   tools/setup.sh            install what is missing, then check
#   tools/setup.sh --check    only check; exit 1 if something is missing
set -euo pipefail

check_only=0
[[ "${1:-}" == "--check" ]] && check_only=1

# Debian packages and why each is needed.
packages=(
  rustc-web        # rustc 1.96 with the NVPTX backend: builds gdaki-device to PTX
  cargo-web        # its cargo, for -Zbuild-std
  rust-web-src     # the core library sources -Zbuild-std compiles for nvptx64
  libibverbs-dev   # verbs and mlx5dv headers: the mlx5 provider and the golden layout tests
  librdmacm-dev    # rdma-sys builds against it
  libclang-dev     # bindgen (rdma-sys, mlx5-sys)
  ibverbs-providers # libmlx5.so.1 at run time
  gcc              # the golden tests compile a C program against mlx5dv.h
  g++              # the generated headers are checked as C++
  clang-22         # ... and as CUDA, in device-only mode (no CUDA toolkit needed)
  libc6-dev
  pkg-config
  make             # builds the SHMEM-style example (examples/shmem)
  openmpi-bin      # ... and runs it under mpirun
  libopenmpi-dev   # ... with its MPI bootstrap
  valgrind         # the C API test runs its C program under memcheck
  python3-pip      # fetches NVIDIA's ptxas and nvlink (PyPI) for the register test
)

say() { printf 'setup: %s\n' "$*" >&2; }

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  if ((check_only)); then
    say "missing Debian packages: ${missing[*]} (run tools/setup.sh)"
    exit 1
  fi
  command -v apt-get >/dev/null || { say "apt-get not found: install ${missing[*]} by hand"; exit 1; }
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { say "not root and no sudo: install ${missing[*]} as root"; exit 1; }
    sudo=(sudo)
  fi
  say "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  "${sudo[@]}" apt-get update -qq
  if ! "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; then
    say "apt-get install failed. rustc-web/cargo-web/rust-web-src come from Debian's security suite"
    say "(bookworm-security); make sure it is in /etc/apt/sources.list(.d)."
    exit 1
  fi
  say "installed ${#missing[@]} package(s)"
else
  say "Debian packages: all ${#packages[@]} present, nothing installed"
fi

# The kernel's mlx5 command layouts (include/linux/mlx5/mlx5_ifc.h), which the PRM golden test
# compares gdaki's against. Debian ships them in linux-headers-<version>-common, whose name
# changes with every kernel upload: take whichever is installed, else the newest available.
if compgen -G '/usr/src/linux-headers-*-common/include/linux/mlx5/mlx5_ifc.h' >/dev/null; then
  say "kernel mlx5 headers: $(compgen -G '/usr/src/linux-headers-*-common/include/linux/mlx5/mlx5_ifc.h' | tail -1)"
elif ((check_only)); then
  say "missing the kernel's mlx5_ifc.h (a linux-headers-*-common package; run tools/setup.sh)"
  exit 1
else
  headers=$(apt-cache pkgnames linux-headers- 2>/dev/null | grep -E '^linux-headers-[0-9.]+-[0-9]+-common$' | sort -V | tail -1)
  if [[ -z "$headers" ]]; then
    say "no linux-headers-*-common package in the apt sources (needed for the kernel's mlx5_ifc.h)"
    exit 1
  fi
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
  say "installing $headers (the kernel's mlx5_ifc.h, for the PRM golden test)"
  export DEBIAN_FRONTEND=noninteractive
  if ! "${sudo[@]}" apt-get install -y -qq --no-install-recommends "$headers" >/dev/null 2>&1; then
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "$headers" >/dev/null
  fi
fi

# The PTX compiler pair: version, NVPTX target, library sources.
ptx_rustc=/usr/bin/rustc
ver=$($ptx_rustc --version 2>/dev/null | awk '{print $2}')
if [[ -z "$ver" ]]; then say "$ptx_rustc does not run"; exit 1; fi
IFS=. read -r major minor _ <<<"$ver"
if ((major < 1 || (major == 1 && minor < 90))); then
  say "$ptx_rustc is $ver; the PTX build needs rustc-web 1.90 or newer"; exit 1
fi
if ! $ptx_rustc --print target-list | grep -qx nvptx64-nvidia-cuda; then
  say "$ptx_rustc has no nvptx64-nvidia-cuda target"; exit 1
fi
src="$($ptx_rustc --print sysroot)/lib/rustlib/src/rust/library/core"
[[ -d "$src" ]] || { say "library sources missing at $src (package rust-web-src)"; exit 1; }
say "PTX compiler: $ptx_rustc $ver (nvptx64 target, library sources present)"

# The host toolchain (rustup's, or any cargo on PATH) with rustfmt and clippy.
if ! command -v cargo >/dev/null; then
  say "no cargo on PATH: install Rust (https://rustup.rs), then rerun"; exit 1
fi
for tool in fmt clippy; do
  if ! cargo "$tool" --version >/dev/null 2>&1; then
    say "cargo $tool missing: rustup component add $([[ $tool == fmt ]] && echo rustfmt || echo clippy)"; exit 1
  fi
done
say "host toolchain: $(cargo --version), $(cargo clippy --version), rustfmt $(cargo fmt --version | awk '{print $2}')"

# NVIDIA's ptxas and nvlink from PyPI's nvidia-cuda-nvcc (CUDA 13.0, as on the device machine),
# unpacked into ~/.cache/gdaki (nothing installed system-wide): the register test
# (tools/tests/registers.rs) assembles the CUDA C++ data path with them. Optional: where PyPI is
# unreachable that test says SKIPPED.
nvcc_version=13.0.88
nvcc_dir="$HOME/.cache/gdaki/cuda-nvcc-$nvcc_version"
if [[ ! -x $nvcc_dir/nvidia/cu13/bin/ptxas || ! -x $nvcc_dir/nvidia/cu13/bin/nvlink ]]; then
  if (( check_only )); then
    say "ptxas/nvlink missing (optional: the register test will say SKIPPED)"
  else
    say "unpacking ptxas and nvlink of nvidia-cuda-nvcc $nvcc_version (PyPI) into $nvcc_dir"
    tmp=$(mktemp -d)
    if python3 -m pip download -q --no-deps "nvidia-cuda-nvcc==$nvcc_version" -d "$tmp" >/dev/null 2>&1 &&
      python3 -m zipfile -e "$tmp"/nvidia_cuda_nvcc-*.whl "$tmp/x" >/dev/null 2>&1; then
      mkdir -p "$nvcc_dir/nvidia/cu13/bin"
      install -m 0755 "$tmp/x/nvidia/cu13/bin/ptxas" "$tmp/x/nvidia/cu13/bin/nvlink" "$nvcc_dir/nvidia/cu13/bin/"
    else
      say "could not fetch nvidia-cuda-nvcc from PyPI: the register test will be skipped"
    fi
    rm -rf "$tmp"
  fi
fi
[[ -x $nvcc_dir/nvidia/cu13/bin/ptxas ]] && say "ptxas: $("$nvcc_dir/nvidia/cu13/bin/ptxas" --version | tail -1)"

# Miri (nightly), which checks the copies that may race the HCA for undefined behaviour. Optional:
# where rustup cannot fetch it, tools/test.sh says that step was skipped.
if command -v rustup >/dev/null && ! cargo +nightly miri --version >/dev/null 2>&1; then
  say "installing Miri (rustup: nightly with miri and rust-src)"
  rustup toolchain install nightly --profile minimal --component miri,rust-src >/dev/null 2>&1 ||
    say "Miri could not be installed: its test step will be skipped"
fi
if cargo +nightly miri --version >/dev/null 2>&1; then
  say "Miri: $(cargo +nightly miri --version)"
fi
say "ready"
