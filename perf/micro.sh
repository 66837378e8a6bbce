#!/usr/bin/env bash
# Builds and runs the micro-benchmarks (perf/micro, Google Benchmark) and writes their JSON.
#   perf/micro.sh [--out FILE] [--no-build] [--filter REGEX] [extra benchmark flags...]
# Builds a Release tree in build-perf/ (override with XDFS_PERF_BUILD_DIR) with XDFS_BUILD_PERF=ON.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
bdir="${XDFS_PERF_BUILD_DIR:-$root/build-perf}"
out="$here/out/micro-$(date -u +%Y%m%dT%H%M%SZ).json"
build=1
filter=""
extra=()
while (($#)); do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    --filter) filter="$2"; shift 2 ;;
    -h|--help) sed -n '2,4p' "$0"; exit 0 ;;
    *) extra+=("$1"); shift ;;
  esac
done
if ((build)); then
  cmake -S "$root" -B "$bdir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DXDFS_BUILD_PERF=ON >/dev/null
  cmake --build "$bdir" --target xdfs_micro
fi
exe="$bdir/perf/xdfs_micro"
[ -x "$exe" ] || { echo "micro.sh: $exe not built (configure with -DXDFS_BUILD_PERF=ON)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
args=(--benchmark_out="$out" --benchmark_out_format=json --benchmark_repetitions=3
      --benchmark_report_aggregates_only=true --benchmark_min_time=0.2)
[ -n "$filter" ] && args+=(--benchmark_filter="$filter")
"$exe" "${args[@]}" "${extra[@]}"
echo "micro.sh: wrote $out" >&2
