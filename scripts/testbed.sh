#!/usr/bin/env bash
# A test bed of real hosts on one machine: one source and K receivers, each in a network
# namespace of its own, joined by a bridge through veth pairs whose two ends are both limited by
# tbf (full duplex: RATE each way on every host's link).
#
#   scripts/testbed.sh [--hosts K] [--rate RATE] [--quiet] -- COMMAND [ARG...]
#
# RATE is tc's (e.g. 200mbit, 1gbit). COMMAND runs with these in its environment:
#   XTB_HOSTS=K  XTB_RATE=RATE
#   XTB_SRC=xtb-src   (namespace of the source, address 10.77.0.1)
#   XTB_NS_i=xtb-hi   XTB_ADDR_i=10.77.0.(10+i)   for i = 1..K
# and runs a program on a host with `ip netns exec xtb-hi PROGRAM...`; scripts/testbed.sh
# link NAME RATE (from inside COMMAND) changes the rate of that host's link both ways, and
# scripts/testbed.sh bytes NAME prints the bytes its link has sent and received.
#
# Everything lives in a private user, network and mount namespace made for the run, so nothing
# outside it changes, no traffic leaves it, and it is all gone when COMMAND ends (however it
# ends). Root is not needed where the kernel lets users make user namespaces; root works too.
# The exit status is COMMAND's (77 if the kernel allows no user namespace: skipped).
set -euo pipefail

bed_link() {  # NAME RATE: both directions of NAME's link (NAME: src or hN)
  local name="$1" rate="$2" ns="xtb-$1" burst
  burst=$(burst_for "$rate")
  tc -n "$ns" qdisc change dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
  tc -n xtb-br qdisc change dev "b-$name" root tbf rate "$rate" burst "$burst" latency 50ms
}

# tbf's bucket: a tenth of a millisecond... at least 64 KiB, and a hundredth of a second of the rate.
burst_for() {
  local rate="$1" bits
  bits=$(python3 -c "
import re,sys
m=re.fullmatch(r'(\d+(?:\.\d+)?)([kmg]?)(bit|bps)?', sys.argv[1].lower())
if not m: sys.exit('bad rate: '+sys.argv[1])
v=float(m.group(1))*{'':1,'k':1e3,'m':1e6,'g':1e9}[m.group(2)]
if m.group(3)=='bps': v*=8
print(int(v))" "$rate")
  local b=$((bits / 8 / 100))
  ((b < 65536)) && b=65536
  echo "${b}b"
}

if [[ "${1:-}" == link ]]; then
  bed_link "$2" "$3"
  exit 0
fi
if [[ "${1:-}" == bytes ]]; then
  ip -n "xtb-$2" -s -j link show eth0 | python3 -c "
import json,sys
s=json.load(sys.stdin)[0]['stats64']
print(s['tx']['bytes'], s['rx']['bytes'])"
  exit 0
fi

hosts=4 rate=200mbit quiet=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hosts) hosts="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --quiet) quiet=1; shift ;;
    --inside) inside=1; shift ;;
    --) shift; break ;;
    *) echo "testbed.sh: unknown argument '$1' (see the comment at its top)" >&2; exit 2 ;;
  esac
done
[[ $# -gt 0 ]] || { echo "testbed.sh: no COMMAND after --" >&2; exit 2; }
[[ "$hosts" =~ ^[0-9]+$ && "$hosts" -ge 1 && "$hosts" -le 200 ]] || { echo "testbed.sh: --hosts takes 1..200" >&2; exit 2; }
burst_for "$rate" >/dev/null

if [[ -z "${inside:-}" ]]; then
  for tool in ip tc unshare python3; do
    command -v "$tool" >/dev/null || { echo "testbed.sh: needs $tool (scripts/install-deps.sh installs it)" >&2; exit 2; }
  done
  if ! why=$(unshare --user --map-root-user --net --mount true 2>&1); then
    echo "skipped: this kernel does not let this user make a user namespace: $why"
    exit 77
  fi
  exec unshare --user --map-root-user --net --mount --propagation private \
    "$0" --inside --hosts "$hosts" --rate "$rate" $([[ $quiet == 1 ]] && echo --quiet) -- "$@"
fi

# Inside: a /run of our own for `ip netns`, then the bridge and the hosts.
mount -t tmpfs tmpfs /run
mkdir -p /run/netns
burst=$(burst_for "$rate")
ip netns add xtb-br
ip -n xtb-br link add name br0 type bridge
ip -n xtb-br link set br0 up
attach() {  # NAME ADDRESS
  local name="$1" addr="$2" ns="xtb-$1"
  ip netns add "$ns"
  ip link add "v-$name" type veth peer name "b-$name"
  ip link set "v-$name" netns "$ns"
  ip link set "b-$name" netns xtb-br
  ip -n "$ns" link set "v-$name" name eth0
  ip -n "$ns" addr add "$addr/24" brd + dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip -n xtb-br link set "b-$name" master br0
  ip -n xtb-br link set "b-$name" up
  tc -n "$ns" qdisc add dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
  tc -n xtb-br qdisc add dev "b-$name" root tbf rate "$rate" burst "$burst" latency 50ms
}
attach src 10.77.0.1
export XTB_HOSTS="$hosts" XTB_RATE="$rate" XTB_SRC=xtb-src
for ((i = 1; i <= hosts; i++)); do
  attach "h$i" "10.77.0.$((10 + i))"
  export "XTB_NS_$i=xtb-h$i" "XTB_ADDR_$i=10.77.0.$((10 + i))"
done
# Every host answers before COMMAND starts (a bridge port takes a moment to forward).
for ((i = 1; i <= hosts; i++)); do
  for _ in $(seq 50); do
    ip netns exec xtb-src python3 -c "
import socket,sys
s=socket.socket(); s.settimeout(0.2)
try: s.connect(('10.77.0.$((10 + i))', 9))
except ConnectionRefusedError: sys.exit(0)
except OSError: sys.exit(1)
" && break
    sleep 0.1
  done
done
[[ $quiet == 1 ]] || echo "testbed: source 10.77.0.1 and $hosts hosts 10.77.0.11.. on a bridge, $rate each way per link" >&2
set +e
"$@"
status=$?
exit $status
