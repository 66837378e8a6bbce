#!/usr/bin/env bash
# Configures and builds into build/ (or $XDFS_BUILD_DIR) with the given build type; with
# XDFS_BUILD_PERF=ON the micro-benchmarks of perf/micro too (libbenchmark-dev).
set -euo pipefail
cd "$(dirname "$0")/.."
type="${1:-Release}"
dir="${XDFS_BUILD_DIR:-build}"
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE="$type" -DXDFS_BUILD_PERF="${XDFS_BUILD_PERF:-OFF}" >/dev/null
cmake --build "$dir"
