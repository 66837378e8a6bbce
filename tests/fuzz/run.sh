#!/usr/bin/env bash
# Builds the libFuzzer harnesses with clang (ASan + UBSan) and runs each for SECONDS, seeded from
# the committed corpus (tests/fuzz/corpus/NAME) with a fixed seed:
#   tests/fuzz/run.sh BUILD_DIR [SECONDS] [HARNESS...]
# HARNESS: fuzz_wire fuzz_handshake fuzz_pathm fuzz_pack fuzz_session (default: all). BUILD_DIR is a
# configured build tree (for the generated Cap'n Proto code). Corpora and failing inputs go to
# $XDFS_FUZZ_DIR (default: a temporary directory, removed afterwards); XDFS_FUZZ_SEED sets the
# seed (default 1), XDFS_FUZZ_RUNS a number of executions instead of a time (-runs).
# XDFS_FUZZ_SANITIZE picks the sanitizers (default address,undefined; "undefined" runs a whole
# session about twice as fast, for long runs whose corpus is then replayed under the default).
# XDFS_FUZZ_REPLAY=DIR runs every input in DIR once instead of fuzzing (-runs=0). XDFS_FUZZ_OPT
# sets the optimization level (default 1; 2 is some 15% faster for fuzz_session).
# It fails when a fuzzer exits non-zero, leaves any failing input (crash, leak, timeout, oom,
# slow unit) or does not start, and prints the fuzzer's report and the input in hex.
set -uo pipefail
build="$(cd "$1" && pwd)"
seconds="${2:-20}"
shift 2 2>/dev/null || shift $#
harnesses=("$@")
((${#harnesses[@]})) || harnesses=(fuzz_wire fuzz_handshake fuzz_pathm fuzz_pack fuzz_session)
src="$(cd "$(dirname "$0")/../.." && pwd)"
work="${XDFS_FUZZ_DIR:-$(mktemp -d)}"
[ -n "${XDFS_FUZZ_DIR:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work"
cxx="$(command -v clang++-14 || command -v clang++)"
flags=(-std=c++20 -O"${XDFS_FUZZ_OPT:-1}" -g -fsanitize=fuzzer,"${XDFS_FUZZ_SANITIZE:-address,undefined}" -fno-sanitize-recover=undefined
       -Wno-\#pragma-messages
       -I"$src/include" -I"$src/framework/include" -I"$src/xftsm/include" -I"$src/pathm/include" -I"$src/relay/include"
       -I"$build/framework/schema" -I"$build/pathm/schema" -I"$build/pathm" -I/usr/include/botan-2)
parsers=("$src/framework/src/wire.cpp" "$src/framework/src/error.cpp" "$src/framework/src/types.cpp" "$src/framework/src/rate.cpp"
         "$src/framework/src/text.cpp" "$src/framework/src/budget.cpp" "$src/framework/src/ranges.cpp"
         "$src/framework/src/xsec.cpp" "$src/framework/src/xdsi.cpp" "$build/framework/schema/xdopi.capnp.c++"
         "$src/pathm/src/messages.cpp" "$build/pathm/schema/pathm.capnp.c++")
# A whole session also needs the disk side and both modes.
session=("$src/framework/src/piod.cpp" "$src/framework/src/manifest.cpp" "$src/framework/src/files.cpp" "$src/framework/src/session.cpp" "$src/framework/src/metrics.cpp" "$src/framework/src/session_fsm.cpp"
         "$src/xftsm/src/cfsm.cpp"
         "$src/xftsm/src/transfer.cpp" "$src/xftsm/src/file_operation.cpp" "$src/pathm/src/fsops.cpp"
         "$src/pathm/src/pool.cpp" "$src/pathm/src/path_fsm.cpp" "$src/pathm/src/server.cpp" "$src/pathm/src/operation.cpp"
         "$src/relay/src/relay_fsm.cpp" "$src/relay/src/forward.cpp" "$src/relay/src/server_mode.cpp" "$src/relay/src/master.cpp" "$src/relay/src/pack.cpp" "$src/relay/src/pull.cpp"
         "$src/xftsm/src/client.cpp" "$src/framework/src/client_session.cpp")
libs=(-lcapnp -lkj -lbotan-2 -lcrypto -lfmt -lpthread)
harness() {  # NAME: sets deps (the sources it links besides its own) and max_len (its inputs' limit)
  deps=("${parsers[@]}")
  max_len=4096
  case "$1" in
    fuzz_session) deps+=("${session[@]}"); max_len=16384 ;;
    fuzz_pathm) max_len=65536 ;;
    fuzz_pack) deps+=("$src/framework/src/files.cpp" "$src/framework/src/manifest.cpp" "$src/pathm/src/fsops.cpp"
                      "$src/relay/src/pack.cpp"); max_len=16384 ;;
  esac
}
object_of() { local rel="${1#"$src"/}"; rel="${rel#"$build"/}"; echo "$work/obj/${rel//\//_}.o"; }
# Every source is compiled once, whichever harnesses share it, one clang invocation per source on
# every core: built whole, one invocation per harness, fuzz_session alone took minutes on one core.
mkdir -p "$work/obj"
rm -f "$work/obj/failed"
printf '%s\0' "${flags[@]}" >"$work/obj/flags"
declare -A wanted=()
for name in "${harnesses[@]}"; do
  harness "$name"
  for f in "$src/tests/fuzz/$name.cpp" "${deps[@]}"; do wanted["$f"]=1; done
done
compile_one() {  # SOURCE: its object, or its name in obj/failed and its errors in OBJECT.log
  local obj flags
  obj="$(object_of "$1")"
  mapfile -d '' -t flags <"$work/obj/flags"
  "$cxx" "${flags[@]}" -c "$1" -o "$obj" >"$obj.log" 2>&1 || echo "$1" >>"$work/obj/failed"
}
export -f compile_one object_of
export src build work cxx
printf '%s\0' "${!wanted[@]}" | xargs -0 -n 1 -P "$(nproc 2>/dev/null || echo 2)" bash -c 'compile_one "$1"' _
if [ -s "$work/obj/failed" ]; then
  while read -r f; do
    echo "fuzzer source $f did not build:"
    tail -n 40 "$(object_of "$f").log"
  done <"$work/obj/failed"
  exit 1
fi
status=0
for name in "${harnesses[@]}"; do
  harness "$name"
  objects=()
  for f in "$src/tests/fuzz/$name.cpp" "${deps[@]}"; do objects+=("$(object_of "$f")"); done
  if ! "$cxx" "${flags[@]}" "${objects[@]}" "${libs[@]}" -o "$work/$name" >"$work/$name.build.log" 2>&1; then
    echo "fuzzer $name did not link:"
    tail -n 40 "$work/$name.build.log"
    exit 1
  fi
  corpus="$work/corpus-$name"
  mkdir -p "$corpus"
  if [ -d "$src/tests/fuzz/corpus/$name" ]; then cp -n "$src/tests/fuzz/corpus/$name/"* "$corpus/" 2>/dev/null; fi
  budget=(-max_total_time="$seconds")
  [ -n "${XDFS_FUZZ_RUNS:-}" ] && budget=(-runs="$XDFS_FUZZ_RUNS")
  amount="${seconds}s"
  [ -n "${XDFS_FUZZ_RUNS:-}" ] && amount="$XDFS_FUZZ_RUNS runs"
  extra=()
  if [ -n "${XDFS_FUZZ_REPLAY:-}" ]; then
    budget=(-runs=0)
    extra=("$XDFS_FUZZ_REPLAY")
    amount="replay of $(ls "$XDFS_FUZZ_REPLAY" | wc -l) inputs from $XDFS_FUZZ_REPLAY"
  fi
  echo "== $name: $amount, seed ${XDFS_FUZZ_SEED:-1}, $(ls "$corpus" | wc -l) inputs to start from"
  (cd "$work" && "./$name" "${budget[@]}" -seed="${XDFS_FUZZ_SEED:-1}" -max_len="$max_len" -timeout=30 \
     -rss_limit_mb=2560 -print_final_stats=1 "$corpus" "${extra[@]}" >"$work/$name.log" 2>&1)
  rc=$?
  grep -E "^(#[0-9]+ *DONE|stat::number_of_executed_units|==|SUMMARY)" "$work/$name.log"
  # Every kind of failing input libFuzzer writes, each pattern on its own.
  found=$(compgen -G "$work/crash-*"; compgen -G "$work/leak-*"; compgen -G "$work/timeout-*";
          compgen -G "$work/oom-*"; compgen -G "$work/slow-unit-*")
  if [ "$rc" -ne 0 ] || [ -n "$found" ] || ! grep -q "stat::number_of_executed_units" "$work/$name.log"; then
    # Everything needed to reproduce it, even when the work directory goes away (CI): the
    # fuzzer's report and the input in hex (xxd -r -p turns it back into the file).
    echo "fuzzer $name failed (exit $rc):"
    # A hang's every thread (fuzz_session has gdb print them after 20 s), then the report.
    sed -n '/^== all threads/,/^== end of threads/p' "$work/$name.log" | head -n 600
    tail -n 60 "$work/$name.log"
    for f in $found; do echo "$f:"; od -An -v -tx1 "$f" | tr -d ' \n' | fold -w 64; echo; done
    status=1
    break
  fi
done
[ "$status" -eq 0 ] && echo "fuzz OK"
exit "$status"
