#!/usr/bin/env bash
# Runs a doctest suite of xdfs_tests inside a user namespace, so that cases that depend on
# privilege run the same whether the test suite runs as root or not:
#   root: mapped to root of a new user and mount namespace (may mount a small tmpfs);
#   user: mapped to an ordinary user (uid 1000), whom file permissions stop;
#   net:  mapped to root of a new user and network namespace (its own loopback, addresses of
#         its own on it).
#   tests/in_namespace.sh root|user|net TEST_BINARY SUITE
# Exits 77 (CTest: skipped) only where the kernel forbids user namespaces, and says why.
set -uo pipefail
kind="$1" bin="$2" suite="$3"
case "$kind" in
  root) ns=(unshare --user --map-root-user --mount) ;;
  user) ns=(unshare --user --map-user=1000 --map-group=1000) ;;
  net) ns=(unshare --user --map-root-user --net) ;;
  *) echo "in_namespace.sh: root, user or net, not '$kind'" >&2; exit 2 ;;
esac
if ! why=$("${ns[@]}" true 2>&1); then
  echo "skipped: this kernel does not let this user make a user namespace: $why"
  exit 77
fi
export XDFS_IN_NAMESPACE="$kind"
exec "${ns[@]}" "$bin" --test-suite="$suite" --force-colors=0
