#!/usr/bin/env bash
# Builds the Debian package (cpack -G DEB) and checks it. Usage: run.sh BUILD_DIR
#  - lintian --fail-on error (its warnings are printed);
#  - the files it must hold, the control files (conffiles, maintainer scripts, Depends);
#  - the xdfsd and xduc it holds run (--version), its manual pages render without warnings.
# The package comes from a build configured for it: -DCMAKE_INSTALL_PREFIX=/usr, Release or
# RelWithDebInfo. BUILD_DIR itself if it is one; otherwise BUILD_DIR/deb, configured here with
# Debian's build flags (dpkg-buildflags: hardening, -O2) and without the tests, and kept between
# runs so that only the first run builds the library (a few minutes on 2 cores), later ones
# only what changed.
set -euo pipefail
build="$(cd "$1" && pwd)"
src="$(cd "$(dirname "$0")/../.." && pwd)"
for tool in cmake cpack dpkg-deb dpkg-shlibdeps dpkg-buildflags lintian groff gzip; do
  command -v $tool >/dev/null || { echo "FAIL: $tool not found (scripts/install-deps.sh installs it)"; exit 1; }
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }
t0=$SECONDS

cache() { sed -n "s/^$1:[A-Z]*=//p" "$build/CMakeCache.txt"; }
# One run at a time on a build directory (two ctest runs at once).
exec 9>"$build/.deb-test.lock"
flock 9
if [ "$(cache CMAKE_INSTALL_PREFIX)" = /usr ] && [[ "$(cache CMAKE_BUILD_TYPE)" =~ ^(Release|RelWithDebInfo)$ ]]; then
  pkgbuild="$build"
  echo "== packaging $pkgbuild itself (install prefix /usr)"
else
  pkgbuild="$build/deb"
  echo "== configuring $pkgbuild (BUILD_DIR installs to $(cache CMAKE_INSTALL_PREFIX), not /usr)"
  export DEB_BUILD_MAINT_OPTIONS=hardening=+all DEB_CXXFLAGS_MAINT_STRIP=-g DEB_CFLAGS_MAINT_STRIP=-g
  cppflags="$(dpkg-buildflags --get CPPFLAGS)"
  generator=()
  [ -f "$pkgbuild/CMakeCache.txt" ] || generator=(-G "$(cache CMAKE_GENERATOR)")
  cmake -S "$src" -B "$pkgbuild" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX=/usr \
    -DXDFS_BUILD_TESTS=OFF -DXDFS_BUILD_PERF=OFF \
    -DCMAKE_CXX_FLAGS="$cppflags $(dpkg-buildflags --get CXXFLAGS)" -DCMAKE_CXX_FLAGS_RELEASE=-DNDEBUG \
    -DCMAKE_C_FLAGS="$cppflags $(dpkg-buildflags --get CFLAGS)" -DCMAKE_C_FLAGS_RELEASE=-DNDEBUG \
    -DCMAKE_EXE_LINKER_FLAGS="$(dpkg-buildflags --get LDFLAGS)" >"$work/configure.log" 2>&1 ||
    { cat "$work/configure.log"; echo "FAIL: configure"; exit 1; }
fi
echo "== building"
cmake --build "$pkgbuild" -j2 >"$work/build.log" 2>&1 || { tail -40 "$work/build.log"; echo "FAIL: build"; exit 1; }
echo "built in $((SECONDS - t0)) s"
rm -f "$pkgbuild"/xdfs_*.deb
(cd "$pkgbuild" && cpack -G DEB) >"$work/cpack.log" 2>&1 || { cat "$work/cpack.log"; echo "FAIL: cpack"; exit 1; }
debs=("$pkgbuild"/xdfs_*.deb)
[ -f "${debs[0]}" ] || { cat "$work/cpack.log"; echo "FAIL: cpack made no xdfs_*.deb"; exit 1; }
deb="${debs[0]}"
echo "$deb ($(du -k "$deb" | cut -f1) KiB), after $((SECONDS - t0)) s"
dpkg-deb -f "$deb"

echo "== lintian"
set +e
# As root lintian says so on standard error; keep what it says about the package.
TMPDIR="$work" lintian --fail-on error --tag-display-limit 0 "$deb" >"$work/lintian.log" 2>&1  # it leaves files in TMPDIR
rc=$?
set -e
grep -v 'running with root privileges' "$work/lintian.log" || true
echo "lintian: $(grep -c '^E: ' "$work/lintian.log") errors, $(grep -c '^W: ' "$work/lintian.log") warnings, exit $rc"
[ $rc -eq 0 ] || bad "lintian"

echo "== contents"
dpkg-deb -c "$deb" | awk '{ print $NF }' | sed 's|^\./|/|; s|/$||' | sort >"$work/files"
expected=(
  /usr/bin/xdfsd /usr/bin/xduc
  /usr/lib/systemd/system/xdfsd.service /usr/lib/systemd/system/xdfsd@.service
  /usr/lib/sysusers.d/xdfs.conf /usr/lib/tmpfiles.d/xdfs.conf
  /usr/share/man/man8/xdfsd.8.gz /usr/share/man/man1/xduc.1.gz
  /usr/share/bash-completion/completions/xduc
  /usr/share/doc/xdfs/copyright /usr/share/doc/xdfs/changelog.Debian.gz /usr/share/lintian/overrides/xdfs
  /usr/include/xdfs/xdfs.hpp
)
[ -f "$src/packaging/xdfsd.toml" ] && expected+=(/etc/xdfs/xdfsd.toml)
for f in "${expected[@]}"; do grep -qxF "$f" "$work/files" || bad "$f is not in the package"; done
for lib in xdfs_runtime xdfs_session xdfs_xftsm xdfs_pathm xdfs_relay xdfs_xsec xdfs_xdopi xdfs_piod xdfs_xdsi; do
  grep -qE "^/usr/lib/([^/]+/)?lib$lib\.a$" "$work/files" || bad "lib$lib.a is not in the package"
done
grep -qE '^/usr/lib/([^/]+/)?cmake/xdfs/xdfsConfig\.cmake$' "$work/files" || bad "the CMake package is not in it"
if grep -E '^/(usr/local|srv|home|tmp|opt)(/|$)|^/usr/etc(/|$)' "$work/files"; then bad "files where a package must not put them"; fi
echo "$(wc -l <"$work/files") paths"

echo "== control"
dpkg-deb -e "$deb" "$work/control"
for s in postinst prerm postrm; do [ -x "$work/control/$s" ] || bad "no executable $s"; done
if [ -f "$src/packaging/xdfsd.toml" ]; then
  grep -qx /etc/xdfs/xdfsd.toml "$work/control/conffiles" 2>/dev/null || bad "/etc/xdfs/xdfsd.toml is not a conffile"
fi
depends="$(dpkg-deb -f "$deb" Depends)"
for d in libc6 libstdc++6 libsystemd0 libssl3; do
  [[ ", $depends," == *", $d "* || ", $depends," == *", $d,"* ]] || bad "Depends lacks $d (dpkg-shlibdeps)"
done

echo "== the programs"
dpkg-deb -x "$deb" "$work/root"
for p in xdfsd xduc; do
  file "$work/root/usr/bin/$p" | grep -q ', stripped' || bad "$p is not stripped"
  if v="$("$work/root/usr/bin/$p" --version 2>&1)" && [[ $v =~ ^$p\ [0-9]+\.[0-9]+\.[0-9]+\ \(xDFS\ protocol\ [0-9]+\)$ ]]; then
    echo "$v"
  else
    bad "$p --version said: $v"
  fi
done

echo "== manual pages"
# The sections help2man makes from --help (OPTIONS: xdfsd's has an "Options:" heading) and
# those packaging/man/*.h2m add.
declare -A sections=([man8/xdfsd.8.gz]="OPTIONS" [man1/xduc.1.gz]="EXIT STATUS")
for page in man8/xdfsd.8.gz man1/xduc.1.gz; do
  path="$work/root/usr/share/man/$page"
  [ -f "$path" ] || continue
  warnings="$(zcat "$path" | groff -man -Tutf8 -ww -z 2>&1)" || bad "$page: groff failed"
  [ -z "$warnings" ] || { echo "$warnings"; bad "$page: groff has warnings"; }
  text="$(zcat "$path" | groff -man -Tutf8 2>/dev/null | col -bx)"
  for section in NAME SYNOPSIS DESCRIPTION FILES SIGNALS EXAMPLES "SEE ALSO" "${sections[$page]}"; do
    grep -q "^$section\$" <<<"$text" || bad "$page: no $section section"
  done
  echo "$page: $(wc -l <<<"$text") lines"
done
if command -v man >/dev/null; then
  for page in man8/xdfsd.8.gz man1/xduc.1.gz; do
    out="$(MANWIDTH=80 man --warnings -l "$work/root/usr/share/man/$page" 2>&1 >/dev/null)" || bad "man -l $page failed"
    [ -z "$out" ] || { echo "$out"; bad "man -l $page has warnings"; }
  done
fi

echo "deb: $((SECONDS - t0)) s"
if [ $fail -ne 0 ]; then
  echo "deb FAILED"
  exit 1
fi
echo "deb OK"
