#!/usr/bin/env bash
# Installs the benchmark peers and tools from Debian packages, only those that are missing.
# Idempotent: a second run installs nothing and does not touch the network.
set -euo pipefail
pkgs=(
  iperf3                       # TCP ceiling
  rsync                        # small-files peer (local rsync -a)
  globus-gridftp-server-progs  # globus-gridftp-server
  globus-gass-copy-progs       # globus-url-copy
  python3-matplotlib           # plots (for /usr/bin/python3)
  libbenchmark-dev             # Google Benchmark for perf/micro
  iproute2                     # ip netns, veth, tc (link mode, the relay test bed)
  uftp                         # multicast file transfer (relay.py)
  udpcast                      # multicast file transfer (relay.py)
  libglobus-xio-gridftp-multicast  # GridFTP's multicast driver: globus-url-copy -MC (relay.py)
  util-linux                   # unshare (relay.py runs GridFTP servers in a user namespace)
  ctorrent                     # BitTorrent client and torrent maker (pull.py)
  opentracker                  # BitTorrent tracker (pull.py)
  aria2                        # BitTorrent client (pull.py)
  procps                       # ps, pkill-free process inspection helpers
  linux-perf                   # perf stat: system calls per GiB (bench.py's counted runs, zerocopy.py)
  tar
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install-peers: installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  # iperf3 asks (debconf) whether to start a daemon: answer no, non-interactively.
  echo "iperf3 iperf3/start_daemon boolean false" | $sudo debconf-set-selections 2>/dev/null || true
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
