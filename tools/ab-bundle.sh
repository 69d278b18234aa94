#!/usr/bin/env bash
# Before/after figures from one session: builds the perftests and GPU benchmarks of each given
# revision and packs them, small enough to carry to a GPU machine without Rust, with a runner
# that runs the revisions interleaved, round by round, so each figure has its counterpart
# measured minutes apart on the same machine (these machines are noisy: read pairs, not runs).
#
#   tools/ab-bundle.sh [-o DIR] REV...          (default DIR: ab-bundle, ignored by git)
#   then, on the GPU machine:
#   DIR/run.sh ROUNDS PROGRAM [ARGS...]         PROGRAM: put_bw, write_lat, sock_bw, sock_lat,
#                                               bench-gpu_posting, bench-gpu_copier
#
# With the device tool of this workplace (about 10 MB per revision: five fit in its carry):
#   run(command="ab-bundle/run.sh 3 put_bw -s 65536 -n 20000", carry=["ab-bundle"])
# Outputs go to $OUT/ab/<program>.<rev>.<round>.txt (stderr beside them, .err); run.sh prints the
# machine, then each run's figure lines (and the socket perftests' Steps and GPU copier lines).
# Each run stops after AB_TIMEOUT seconds (default 300; exit 124), so one revision that hangs
# leaves the others' figures in the device call. AB_TWO=1 runs each revision as two processes,
# a server (`--server -p PORT $AB_SERVER_ARGS`) and a client (`127.0.0.1 -p PORT $AB_CLIENT_ARGS`)
# whose output holds the figures: e.g. AB_SERVER_ARGS="--gpu 1" on two GPUs (on one GPU, start
# MPS first: nvidia-cuda-mps-control -d), what #44's aims and the cross-process figures read. A revision's first run includes the driver's
# compile of its PTX (60-100 s on a fresh machine), outside the timed part.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=ab-bundle
if [[ ${1:-} == -o ]]; then dir=$2; shift 2; fi
(($# > 0)) || { echo "usage: tools/ab-bundle.sh [-o DIR] REV..." >&2; exit 2; }
tools/setup.sh --check >/dev/null || tools/setup.sh

root=$PWD
# One target directory for every revision: a revision after the first rebuilds only what it
# changed.
export CARGO_TARGET_DIR=$root/target/ab
work=$(mktemp -d)
trap 'git -C "$root" worktree prune; rm -rf "$work"' EXIT
rm -rf "$dir"; mkdir -p "$dir"
revs=()
for rev in "$@"; do
  short=$(git rev-parse --short "$rev^{commit}")
  revs+=("$short")
  echo "ab-bundle: building $rev ($short)" >&2
  git worktree add -q --detach "$work/$short" "$short"
  (
    cd "$work/$short"
    cargo build --release --locked -q -p gdaki-examples --bin put_bw --bin write_lat
    cp "$CARGO_TARGET_DIR/release/put_bw" "$CARGO_TARGET_DIR/release/write_lat" "$work/"
    # The socket perftests, where the revision has them.
    for b in sock_bw sock_lat; do
      cargo build --release --locked -q -p gdaki-examples --bin $b 2>/dev/null \
        && cp "$CARGO_TARGET_DIR/release/$b" "$work/"
    done
    cargo bench --locked -q -p gdaki --bench gpu_posting --bench gpu_copier --no-run --message-format=json 2>/dev/null \
      | "$root/tools/bench-executables.py" | while read -r exe name; do cp "$exe" "$work/bench-$name"; done
  )
  mkdir -p "$dir/$short"
  for b in put_bw write_lat sock_bw sock_lat bench-gpu_posting bench-gpu_copier; do
    [[ -f $work/$b ]] || { echo "ab-bundle: $short has no $b" >&2; continue; }
    strip --strip-debug "$work/$b"
    gzip -c "$work/$b" >"$dir/$short/$b.gz"
    rm "$work/$b"
  done
  git worktree remove --force "$work/$short"
done
printf '%s\n' "${revs[@]}" >"$dir/revisions.txt"

cat >"$dir/run.sh" <<'RUNNER'
#!/usr/bin/env bash
# ROUNDS PROGRAM [ARGS...]: runs PROGRAM of every revision in revisions.txt, interleaved, ROUNDS
# times; outputs in ${OUT:-.}/ab/.
set -u
cd "$(dirname "$0")"
rounds=$1 program=$2; shift 2
# The driver caches each revision's compiled PTX; its default cache (256 MiB) held too few
# revisions of a 14 MB PTX, and runs compiled again inside their time limit.
export CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
out=${OUT:-$PWD}/ab; mkdir -p "$out"
bin=$(mktemp -d)
mapfile -t revs <revisions.txt
for rev in "${revs[@]}"; do
  [[ -f $rev/$program.gz ]] || { echo "$rev has no $program" >&2; exit 2; }
  gunzip -c "$rev/$program.gz" >"$bin/$program.$rev" && chmod +x "$bin/$program.$rev"
done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU"
two=""
[[ ${AB_TWO:-0} == 1 ]] && two=", two processes (server: ${AB_SERVER_ARGS:-}; client: ${AB_CLIENT_ARGS:-})"
echo "$program $* (revisions: ${revs[*]})$two"
# Two processes (AB_TWO=1): a port of their own for each run, from AB_PORT (default 19300).
port=${AB_PORT:-19300}
run_one() { # REV FILE ARGS...: one run of REV's program, its output in FILE.txt and FILE.err
  local exe=$bin/$program.$1 f=$2; shift 2
  if [[ ${AB_TWO:-0} == 1 ]]; then
    port=$((port + 1))
    # shellcheck disable=SC2086 # the extra arguments are words by design
    timeout "${AB_TIMEOUT:-300}" "$exe" --server -p "$port" ${AB_SERVER_ARGS:-} "$@" >"$f.server.txt" 2>"$f.server.err" &
    local server=$!
    sleep "${AB_SERVER_WAIT:-1}"
    # shellcheck disable=SC2086
    timeout "${AB_TIMEOUT:-300}" "$exe" 127.0.0.1 -p "$port" ${AB_CLIENT_ARGS:-} "$@" >"$f.txt" 2>"$f.err"
    local rc=$? src=0
    wait "$server" || src=$?
    ((rc == 0)) && rc=$src
    return "$rc"
  fi
  timeout "${AB_TIMEOUT:-300}" "$exe" "$@" >"$f.txt" 2>"$f.err"
}
for ((r = 1; r <= rounds; r++)); do
  for rev in "${revs[@]}"; do
    f=$out/$program.$rev.$r
    run_one "$rev" "$f" "$@"; rc=$?
    echo "== $rev round $r (exit $rc)"
    # The figure lines: a perftest's result rows and a socket perftest's Steps and GPU copier
    # lines, the posting benchmark's Rust rows.
    grep -E '^ +[0-9]+ +[0-9]|^ +rust |^ (Steps|GPU copier) ' "$f.txt" | head -24
  done
done
RUNNER
chmod +x "$dir/run.sh"
du -sh "$dir" >&2
