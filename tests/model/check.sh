#!/usr/bin/env bash
# Model-checks the state tables with spin (docs/model.md):
#   tests/model/check.sh XDFS_MODEL
# For each configuration, xdfs_model writes the Promela model, spin and cc build the verifier,
# and the exhaustive search must find no error (no deadlock, no unspecified reception, no
# session failing without a fault), reach every final state, and take every modelled row (but
# the few the model makes unreachable by construction, listed below). Then it drops rows the
# protocol needs, one at a time, and spin must report the failure: the check can fail.
set -uo pipefail
gen="$(realpath "$1")"
command -v spin >/dev/null || { echo "spin is not installed (scripts/install-deps.sh installs it)"; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
status=0

# Rows no run of the model can take: the receiver's failures while it sends its confirming EOFRs
# (a send is one atomic step here), and the join's timeout and lost channel (the model's client
# sends its negotiation on every channel at once). The path server's ending and closing states
# are left at once here: the model's client is the real one, which ends only once every request
# has its answer (so nothing is left to answer, and no reply leaves, in ending), and the EOFRs
# leave in one step. A hostile client that ends with requests outstanding does reach them; the
# server then waits for its workers and replies (tests/test_hostile.cpp covers it).
by_construction="client-download:23 client-download:24 client-download:25 server-upload:19 server-upload:20 server-upload:21 session-server:6 session-server:7 
 server-path:9 server-path:11 server-path:12 server-path:13 server-path:14 server-path:16 server-path:17 server-path:18 server-path:19"

verify() {  # NAME ARGS... -> runs the search; leaves NAME.out
  local name="$1"; shift
  "$gen" "$@" > "$name.pml" || { echo "FAIL $name: xdfs_model $*"; return 1; }
  spin -a "$name.pml" > "$name.spin" 2>&1 || { echo "FAIL $name: spin -a"; cat "$name.spin"; return 1; }
  cc -O2 -DSAFETY -DNOREDUCE -DVECTORSZ=4096 -o "$name.pan" pan.c 2> "$name.cc" || { echo "FAIL $name: cc"; cat "$name.cc"; return 1; }
  "./$name.pan" -m200000 -w24 > "$name.out" 2>&1
  grep -q "errors: 0" "$name.out"
}

# Each search runs in its own directory NAME (spin writes pan.c where it runs): its report in
# NAME/report, NAME/failed if it failed, and for a configuration the rows it took in NAME/covered.
check_config() {  # "N B K F"
  local n b k f name label line states row
  read -r n b k f <<< "$1"
  name="n${n}b${b}k${k}f${f}"
  mkdir "$name" && cd "$name" || return
  : > covered
  exec > report 2>&1
  if ! verify "$name" --channels "$n" --blocks "$b" --operations "$k" --faults "$f"; then
    echo "FAIL $name: spin found an error; the trail:"
    grep -E "pan:|assert|errors" "$name.out" | head -5
    spin -t -p -g "$name.pml" 2>&1 | tail -40
    touch failed
    return
  fi
  # Every final state is reached: its label's line is not among the unreached.
  for label in c_done c_failed s_done s_failed; do
    line=$(grep -n "^$label:" "$name.pml" | cut -d: -f1)
    if grep -q "$name.pml:$line," "$name.out"; then
      if [ "$label" = c_failed ] || [ "$label" = s_failed ]; then [ "$f" = 0 ] && continue; fi
      echo "FAIL $name: final state $label is never reached"; touch failed
    fi
  done
  states=$(grep -o "[0-9]* states, stored" "$name.out")
  echo "ok   $name (N=$n channels, B=$b blocks, K=$k operations, $f fault): $states, no error"
  # Rows taken in this run: every ROW marker not listed as unreached.
  for row in $(grep -o 'ROW [a-z-]*:[0-9]*' "$name.pml" | cut -d' ' -f2 | sort -u); do
    grep -q "ROW $row\\\\n" "$name.out" || echo "$row" >> covered
  done
}

# The check can fail: without a row the protocol needs, it cannot finish, and spin must say so.
check_drop() {  # ROW
  local row="$1" name="drop-${1/:/-}"
  mkdir "$name" && cd "$name" || return
  exec > report 2>&1
  if verify "$name" --faults 0 --drop "$row"; then
    echo "FAIL $name: spin found nothing wrong with row $row dropped"; touch failed
  elif ! grep -qE "errors: [1-9]" "$name.out" 2>/dev/null; then
    echo "FAIL $name: the model with row $row dropped was not checked"; touch failed
  else
    echo "ok   without row $row: $(grep -oE 'pan:1: [^(]*' "$name.out" | head -1)"
  fi
}

configs=("2 2 2 0" "2 2 2 1" "1 2 2 1" "3 2 2 0" "2 2 3 0")
drops=(server-upload:17 server-download:10 server-download:17 client-path:3 client-path:9 server-path:4 server-path:10
       server-path:15 session-server:9 session-server:11
       session-client:1 session-client:2 session-client:6 session-client:9)
# Every search is its own process in its own directory: they run on every core at once.
export gen
export -f verify check_config check_drop
{ printf 'check_config "%s"\n' "${configs[@]}"; printf 'check_drop %s\n' "${drops[@]}"; } |
  xargs -d '\n' -n 1 -P "$(nproc 2>/dev/null || echo 2)" bash -c 'eval "$1"' _

report() {  # NAME: prints the search's report; false if it failed or did not run
  [ -s "$1/report" ] || { echo "FAIL $1: the search did not run"; return 1; }
  cat "$1/report"
  [ ! -e "$1/failed" ]
}
covered=""
for config in "${configs[@]}"; do
  read -r n b k f <<< "$config"
  name="n${n}b${b}k${k}f${f}"
  report "$name" || status=1
  [ -e "$name/covered" ] && covered="$covered $(tr '\n' ' ' < "$name/covered")"
done
for row in $(grep -o 'ROW [a-z-]*:[0-9]*' n2b2k2f1/n2b2k2f1.pml | cut -d' ' -f2 | sort -u); do
  case " $covered " in *" $row "*) continue ;; esac
  case " $by_construction " in *" $row "*) continue ;; esac
  echo "FAIL: row $row is never taken in any configuration"; status=1
done
for row in "${drops[@]}"; do
  report "drop-${row/:/-}" || status=1
done
exit $status
