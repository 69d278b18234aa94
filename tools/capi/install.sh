#!/usr/bin/env bash
# Installs gdaki's C API for C and C++ programs: libgdaki.so (SONAME libgdaki.so.<ABI>) and
# libgdaki.a, gdaki.h with the device headers (gdaki_device.h, gdaki_layout_check.h and the
# CUDA C++ ones, gdaki_gin.cuh and gdaki_p2p.cuh), the C data path's PTX (for
# run-time linking with NVRTC), libgdaki_device.a where nvcc exists (for nvcc -rdc), and
# lib/pkgconfig/gdaki.pc.
#
#   tools/capi/install.sh [--prefix DIR] [--debug] [--from DIR]
#       --prefix DIR  where to install (default /usr/local)
#       --debug       install the debug build (default: release)
#       --from DIR    take the libraries already built in DIR (e.g. target/debug), and the C
#                     PTX when DIR has gdaki_device_c.ptx; no cargo
#
# Then:  cc app.c $(pkg-config --cflags --libs gdaki)
#        static: cc app.c $(pkg-config --cflags gdaki) -l:libgdaki.a $(pkg-config --static --libs-only-other --libs-only-l gdaki | sed 's/-lgdaki //')
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
prefix=/usr/local profile=release from=
while (($#)); do
  case $1 in
    --prefix) prefix=$2; shift 2 ;;
    --debug) profile=debug; shift ;;
    --from) from=$2; shift 2 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "install: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
say() { printf 'install: %s\n' "$*" >&2; }
if [[ -z $from ]]; then
  flag=(); [[ $profile == release ]] && flag=(--release)
  say "building gdaki-capi ($profile)"
  (cd "$root" && cargo build "${flag[@]}" -p gdaki-capi)
  from=$root/target/$profile
fi
[[ -s $from/libgdaki.so ]] || { say "$from/libgdaki.so is missing: build gdaki-capi first (or drop --from)"; exit 1; }
abi=$(sed -n 's/^#define GDAKI_ABI_VERSION \([0-9]*\)$/\1/p' "$root/host/capi/include/gdaki.h")
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml" | head -1)
[[ -n $abi && -n $version ]] || { say "cannot read the ABI version or the package version"; exit 1; }
lib=$prefix/lib inc=$prefix/include share=$prefix/share/gdaki
mkdir -p "$lib/pkgconfig" "$inc" "$share"
install -m 0755 "$from/libgdaki.so" "$lib/libgdaki.so.$version"
ln -sf "libgdaki.so.$version" "$lib/libgdaki.so.$abi"
ln -sf "libgdaki.so.$abi" "$lib/libgdaki.so"
# A --from folder may carry the shared library alone (the static one is large).
if [[ -s $from/libgdaki.a ]]; then
  install -m 0644 "$from/libgdaki.a" "$lib/libgdaki.a"
else
  say "$from has no libgdaki.a: the static library is not installed"
fi
install -m 0644 "$root/host/capi/include/gdaki.h" "$root"/device/include/* "$inc/"
# The C PTX beside the libraries of --from, else where the build leaves it.
ptx=$root/target/ptx/gdaki_device_c.ptx
[[ -s $from/gdaki_device_c.ptx ]] && ptx=$from/gdaki_device_c.ptx
if [[ -s $ptx ]]; then
  install -m 0644 "$ptx" "$share/gdaki_device_c.ptx"
  if command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]]; then
    "$root/tools/cuda/build-device-lib.sh" "$ptx" "$lib"
  else
    say "no nvcc: libgdaki_device.a not built (run tools/cuda/build-device-lib.sh where nvcc is)"
  fi
else
  say "no $ptx: the device library is not installed (build gdaki with the PTX toolchain)"
fi
# What a static libgdaki.a needs from the system (Rust's std on Linux; libdl for the CUDA driver
# and libibverbs, which are loaded at run time).
cat > "$lib/pkgconfig/gdaki.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include
ptxdir=\${prefix}/share/gdaki

Name: gdaki
Description: kernel-initiated RDMA runtime: host C API (gdaki.h) and device declarations (gdaki_device.h)
URL: https://github.com/gdaki/gdaki
Version: $version
Libs: -L\${libdir} -lgdaki
Libs.private: -lgcc_s -lutil -lrt -lpthread -lm -ldl -lc
Cflags: -I\${includedir}
PC
say "installed gdaki $version (C ABI $abi) into $prefix"
