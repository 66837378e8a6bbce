#!/usr/bin/env bash
# Installs what building and testing xDFS needs, from Debian packages, only if missing.
set -euo pipefail
pkgs=(g++ cmake ninja-build pkg-config libboost-dev libbotan-2-dev libssl-dev libfmt-dev capnproto libcapnp-dev doctest-dev
      clang libclang-rt-14-dev spin gdb iproute2 util-linux python3
      libcli11-dev libtomlplusplus-dev libsystemd-dev
      help2man systemd bash-completion dpkg-dev lintian man-db strace)  # packaging/ and its tests
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
