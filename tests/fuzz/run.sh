#!/usr/bin/env bash
# Builds the libFuzzer harnesses (wire, handshake, path messages) with clang (ASan + UBSan) and runs each for SECONDS.
#   tests/fuzz/run.sh BUILD_DIR [SECONDS]       (the test suite runs 20 s each; try 600+ by hand)
# BUILD_DIR is a configured build tree (for the generated Cap'n Proto code). Corpora and
# crash files go to $XDFS_FUZZ_DIR (default: a temporary directory, removed afterwards).
set -euo pipefail
build="$(cd "$1" && pwd)"
seconds="${2:-20}"
src="$(cd "$(dirname "$0")/../.." && pwd)"
work="${XDFS_FUZZ_DIR:-$(mktemp -d)}"
[ -n "${XDFS_FUZZ_DIR:-}" ] || trap 'rm -rf "$work"' EXIT
mkdir -p "$work"
cxx="$(command -v clang++-14 || command -v clang++)"
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined
       -I"$src/framework/include" -I"$src/pathm/include" -I"$build/framework/schema" -I"$build/pathm/schema"
       -I"$build/pathm" -I/usr/include/botan-2)
libsrc=("$src/framework/src/wire.cpp" "$src/framework/src/error.cpp" "$src/framework/src/types.cpp"
        "$src/framework/src/text.cpp" "$src/framework/src/budget.cpp" "$src/framework/src/ranges.cpp"
        "$src/framework/src/xsec.cpp" "$src/framework/src/xdsi.cpp" "$build/framework/schema/xdopi.capnp.c++"
        "$src/pathm/src/messages.cpp" "$build/pathm/schema/pathm.capnp.c++")
libs=(-lcapnp -lkj -lbotan-2 -lpthread)
for name in fuzz_wire fuzz_handshake fuzz_pathm; do
  "$cxx" "${flags[@]}" "$src/tests/fuzz/$name.cpp" "${libsrc[@]}" "${libs[@]}" -o "$work/$name"
  mkdir -p "$work/corpus-$name"
  echo "== $name: ${seconds}s"
  (cd "$work" && "./$name" -max_total_time="$seconds" -max_len=4096 -print_final_stats=1 "corpus-$name" \
     >"$work/$name.log" 2>&1) || true
  grep -E "^(#[0-9]+ *DONE|stat::number_of_executed_units|==|SUMMARY)" "$work/$name.log" || true
  # libFuzzer exits non-zero and leaves crash-* files when it finds something.
  # (Any one kind is enough: test each pattern on its own.)
  found=$(compgen -G "$work/crash-*"; compgen -G "$work/leak-*"; compgen -G "$work/timeout-*") || true
  if [ -n "$found" ]; then
    # Everything needed to reproduce it, even when the work directory goes away (CI): the
    # fuzzer's report and the input in hex (xxd -r -p turns it back into the file).
    echo "fuzzer $name found a failing input:"
    tail -n 40 "$work/$name.log"
    for f in $found; do echo "$f:"; od -An -v -tx1 "$f" | tr -d ' \n' | fold -w 64; echo; done
    exit 1
  fi
done
echo "fuzz OK"
