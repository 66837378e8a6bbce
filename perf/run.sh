#!/usr/bin/env bash
# The one benchmark command: installs the peers, builds xDFS (Release), runs every scenario for
# xDFS and its peers taking turns, writes OUT/records.jsonl, and renders RESULTS.md and plots.
#
#   perf/run.sh [--smoke] [--scenarios mem,disk,small,link,cached] [--reps N] [--out DIR]
#               [--no-build --xdfs-bin DIR] [--no-install] [--no-micro] [bench.py options...]
#
#   --smoke          tiny sizes, 2 repetitions, a few seconds; report goes to OUT only
#   --scenarios L    any of mem (a), disk (b), small (c), link (d), cached (e); default all five
#   --reps N         repetitions of every point (default 3)
#   --out DIR        results directory (default perf/out/<UTC timestamp>)
#   --no-build       use existing binaries: --xdfs-bin DIR must hold xdfsd and xduc
#   --no-install     do not run perf/install-peers.sh
#   --no-micro       skip the Google Benchmark micro-benchmarks (perf/micro.sh)
#   --no-publish     write RESULTS.md and plots into OUT instead of perf/
# Every other option goes to perf/bench.py (see /usr/bin/python3 perf/bench.py --help).
#
# A full run writes perf/RESULTS.md and perf/plots/*.png; a smoke run writes OUT/RESULTS.md and
# OUT/plots and fails if any run failed or a record is malformed (timings are never judged). A run
# stopped by a signal (Ctrl-C, SIGTERM) reports what ran into OUT only.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(dirname "$here")"
py=/usr/bin/python3   # Debian's python3-matplotlib is only visible to the system interpreter
export PYTHONDONTWRITEBYTECODE=1

smoke=0 build=1 install=1 micro=1 publish=1
out="" bin=""
pass=()
while (($#)); do
  case "$1" in
    --smoke) smoke=1; pass+=("$1"); shift ;;
    --no-build) build=0; shift ;;
    --xdfs-bin) bin="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --no-install) install=0; shift ;;
    --no-micro) micro=0; shift ;;
    --no-publish) publish=0; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) pass+=("$1"); shift ;;
  esac
done
if ((smoke)); then micro=0; publish=0; fi

[ -z "$out" ] && out="$here/out/$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"
out="$(cd "$out" && pwd)"

if ((install)); then "$here/install-peers.sh"; fi

if ((build)); then
  bdir="${XDFS_PERF_BUILD_DIR:-$root/build-perf}"
  echo "run.sh: building xDFS (Release) in $bdir" >&2
  XDFS_BUILD_DIR="$bdir" "$root/scripts/build.sh" Release >"$out/build.log" 2>&1 || {
    tail -30 "$out/build.log" >&2; echo "run.sh: build failed (log: $out/build.log)" >&2; exit 1; }
  [ -z "$bin" ] && bin="$bdir/examples"
fi
[ -n "$bin" ] || { echo "run.sh: --no-build needs --xdfs-bin DIR" >&2; exit 2; }

status=0
"$py" "$here/bench.py" --out "$out" --xdfs-bin "$bin" "${pass[@]}" || status=$?
# If the driver was killed outright, remove the namespaces and scratch files it left.
"$py" "$here/bench.py" --out "$out" --xdfs-bin "$bin" --sweep-only || true
# Stopped by a signal (128 + its number): what ran is reported into OUT only, never published
# over perf/RESULTS.md as if it were a whole run, and the micro-benchmarks are left out.
if [ "$status" -ge 128 ]; then
  echo "run.sh: the run was stopped (status $status): the report of what ran goes to $out only" >&2
  publish=0
  micro=0
fi

if ((micro)) && [ "$status" -ne 2 ]; then
  case " ${pass[*]} " in
    *" --scenarios "*) ;;   # a partial run leaves the micro-benchmarks out
    *) XDFS_PERF_BUILD_DIR="${XDFS_PERF_BUILD_DIR:-$root/build-perf}" \
         "$here/micro.sh" --out "$out/micro.json" >"$out/micro.log" 2>&1 ||
         echo "run.sh: micro-benchmarks failed (log: $out/micro.log)" >&2 ;;
  esac
fi

if [ -s "$out/records.jsonl" ]; then
  if ((publish)); then
    "$py" "$here/report.py" "$out" || status=1
    # Keep a copy beside the records too, so every results directory is self-contained.
    "$py" "$here/report.py" "$out" --md "$out/RESULTS.md" --plots "$out/plots" 2>/dev/null || status=1
  else
    "$py" "$here/report.py" "$out" --md "$out/RESULTS.md" --plots "$out/plots" || status=1
  fi
  if ((smoke)); then
    [ -s "$out/RESULTS.md" ] && ls "$out"/plots/*.png >/dev/null 2>&1 ||
      { echo "run.sh: the report did not render" >&2; status=1; }
  fi
else
  echo "run.sh: no records written" >&2
  status=1
fi
echo "run.sh: results in $out$( ((publish)) && echo "; report in $here/RESULTS.md")" >&2
exit "$status"
