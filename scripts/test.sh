#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite with CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./perf/install-peers.sh   # iperf3, GridFTP, rsync, matplotlib for the perf_smoke test
XDFS_BUILD_PERF=ON XDFS_BUILD_DIR="${XDFS_BUILD_DIR:-build-test}" ./scripts/build.sh RelWithDebInfo
ctest --test-dir "${XDFS_BUILD_DIR:-build-test}" --output-on-failure
