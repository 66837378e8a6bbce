#!/usr/bin/env bash
# The main job end to end: install what is missing, build, start xdfsd on localhost with a
# default root (./xdfs-root) and state directory (./xdfs-state), authorize this user's xduc key
# (made on first use in ~/.config/xdfs), copy a file up and back down with xduc -p 4, compare.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
./scripts/build.sh Release
root="${XDFS_ROOT:-$PWD/xdfs-root}"
state="${XDFS_STATE:-$PWD/xdfs-state}"
work="$(mktemp -d)"
mkdir -p "$root" "$state"
# Every channel is authenticated: authorize this user's client key on the demo server.
key="$(./build/examples/xduc keygen)"
grep -qxF "$key rw" "$state/authorized_keys" 2>/dev/null || echo "$key rw" >>"$state/authorized_keys"
./build/examples/xdfsd --root "$root" --state-dir "$state" --listen 127.0.0.1:0 --port-file "$work/port" \
  2>"$work/xdfsd.log" &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$work"' EXIT
for _ in $(seq 100); do [ -s "$work/port" ] && break; sleep 0.05; done
port="$(cat "$work/port")"
echo "xdfsd serving $root on 127.0.0.1:$port"
head -c $((256 << 20)) /dev/urandom >"$work/sample.bin"
./build/examples/xduc -p 4 --json "$work/sample.bin" "xdfs://127.0.0.1:$port/sample.bin"
./build/examples/xduc -p 4 --json "xdfs://127.0.0.1:$port/sample.bin" "$work/sample.back"
cmp "$work/sample.bin" "$work/sample.back"
cmp "$work/sample.bin" "$root/sample.bin"
echo "OK: 256 MiB uploaded and downloaded byte-identically; server log:"
sed 's/^/  /' "$work/xdfsd.log"
