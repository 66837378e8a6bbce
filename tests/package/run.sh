#!/usr/bin/env bash
# Installs the build tree into a scratch prefix, builds tests/package against it, runs it.
set -euo pipefail
build="$1"
src="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export XDFS_CONFIG_DIR="$work/config"   # the consumer's client key is made here
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
mkdir "$work/root"
head -c 100000 /dev/urandom >"$work/file"
"$work/build/consumer" "$work/root" "$work/file"
cmp "$work/file" "$work/root/copy"
cmp "$work/file" "$work/root/copy2"
echo "package OK"
