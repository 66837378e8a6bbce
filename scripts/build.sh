#!/usr/bin/env bash
# Configures and builds into build/ (or $XDFS_BUILD_DIR) with the given build type.
set -euo pipefail
cd "$(dirname "$0")/.."
type="${1:-Release}"
dir="${XDFS_BUILD_DIR:-build}"
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE="$type" >/dev/null
cmake --build "$dir"
