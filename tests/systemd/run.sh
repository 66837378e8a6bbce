#!/usr/bin/env bash
# Checks packaging/'s systemd units and xduc's bash completion. Usage: run.sh BUILD_DIR
#  - systemd-analyze verify on xdfsd.service and xdfsd@.service (copies naming the built xdfsd):
#    no error and nothing said about them;
#  - systemd-analyze security --offline: the exposure of each at most MAX_EXPOSURE (printed);
#  - both units sandboxed alike, and the example config valid for the built xdfsd;
#  - the built xdfsd at work (copies both ways, path operations, SIGHUP, SIGTERM) under strace:
#    within the units' SystemCallFilter= and RestrictAddressFamilies=, no W+X memory, and
#    sd_notify READY=1, RELOADING=1, READY=1, STOPPING=1 (what systemd enforces or waits for,
#    short of running the units, which needs systemd as PID 1);
#  - the bash completion: `complete -p xduc`, a few completions, its options those of xduc --help.
# Exit 77 (skipped) only where systemd-analyze is absent. Works without systemd as PID 1
# (a container): verify and security --offline only read unit files.
set -euo pipefail
# What the units reach with systemd 252. Exposure comes in steps of 0.1 (an integer 0..100 inside
# systemd), so anything looser than now is above it: 1.2 and up.
MAX_EXPOSURE=1.1
# What systemd-analyze security may mark as exposed (✗): a server on the host's network, in its
# root file system, with local sockets (sd_notify, the journal), and ProtectClock='s read access
# to the RTC. IP addresses are for the administrator to restrict (IPAddressAllow= in a drop-in).
ALLOWED_EXPOSED=("RootDirectory=/RootImage=" "PrivateNetwork=" "IPAddressDeny=" "DeviceAllow="
                 "RestrictAddressFamilies=~AF_UNIX" "RestrictAddressFamilies=~AF_(INET|INET6)")

build="$(cd "$1" && pwd)"
src="$(cd "$(dirname "$0")/../.." && pwd)"
pkg="$src/packaging"
xdfsd="$build/examples/xdfsd"
xduc="$build/examples/xduc"
if ! command -v systemd-analyze >/dev/null; then
  echo "systemd-analyze not found (Debian: apt-get install systemd): skipped"
  exit 77
fi
for f in "$xdfsd" "$xduc"; do [ -x "$f" ] || { echo "FAIL: $f not built"; exit 1; }; done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail=0
bad() { echo "FAIL: $*"; fail=1; }

# --- The units, as installed but for ExecStart naming the built binary (verify wants it there).
mkdir "$work/units"
for unit in xdfsd.service xdfsd@.service; do
  grep -q '^ExecStart=/usr/bin/xdfsd ' "$pkg/$unit" || bad "$unit: ExecStart is not /usr/bin/xdfsd ..."
  sed "s|^ExecStart=/usr/bin/xdfsd |ExecStart=$xdfsd |" "$pkg/$unit" >"$work/units/$unit"
done

echo "== systemd-analyze verify"
# --man=no: Documentation=man:xdfsd(8) is not installed here. Anything said about our units
# (unknown keys, bad values are only warnings to systemd) counts as a failure.
set +e
out="$(cd "$work/units" && systemd-analyze verify --man=no --recursive-errors=no xdfsd.service xdfsd@.service 2>&1)"
rc=$?
set -e
[ -n "$out" ] && echo "$out"
[ $rc -eq 0 ] || bad "systemd-analyze verify exited with $rc"
if grep -q 'xdfsd' <<<"$out"; then bad "systemd-analyze verify has something to say about the units"; fi

echo "== systemd-analyze security --offline (at most $MAX_EXPOSURE)"
threshold=$(awk -v m="$MAX_EXPOSURE" 'BEGIN { printf "%d", m * 10 + 0.5 }')
for unit in xdfsd.service xdfsd@.service; do
  set +e
  report="$(cd "$work/units" && systemd-analyze security --offline=true --threshold="$threshold" "$unit" 2>&1)"
  rc=$?
  set -e
  score="$(sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p' <<<"$report")"
  if [ -z "$score" ]; then
    echo "$report"
    bad "$unit: no exposure level in systemd-analyze security's report"
    continue
  fi
  echo "$unit: exposure $score"
  if [ $rc -ne 0 ] || awk -v s="$score" -v m="$MAX_EXPOSURE" 'BEGIN { exit !(s > m) }'; then
    grep '✗' <<<"$report" || true
    bad "$unit: exposure $score is above $MAX_EXPOSURE"
  fi
  # Settings too light to move the rounded score (RemoveIPC=, UMask=, ...) must not go either:
  # only what a network file server cannot give up may be exposed.
  exposed="$(sed -n 's/^✗ \([^ ]*\) .*/\1/p' <<<"$report" | sort)"
  unexpected="$(comm -23 <(echo "$exposed") <(printf '%s\n' "${ALLOWED_EXPOSED[@]}" | sort))"
  if [ -n "$unexpected" ]; then
    grep -F "$unexpected" <<<"$report" || true
    bad "$unit: exposed where it was not: $(echo $unexpected)"
  fi
done

echo "== the units sandboxed alike, the example config valid"
if ! diff <(sed -n '/^# Sandboxing/,$p' "$pkg/xdfsd.service") <(sed -n '/^# Sandboxing/,$p' "$pkg/xdfsd@.service"); then
  bad "xdfsd.service and xdfsd@.service differ from '# Sandboxing' on"
fi
if [ -f "$pkg/xdfsd.toml" ]; then
  # As the units run it, but for the paths that exist on the target machine only.
  mkdir "$work/root" "$work/state"
  if out="$("$xdfsd" --config "$pkg/xdfsd.toml" --root "$work/root" --state-dir "$work/state" --check-config 2>&1)"; then
    echo "$out"
  else
    echo "$out"
    bad "the example config packaging/xdfsd.toml is not valid for $xdfsd"
  fi
else
  echo "(no packaging/xdfsd.toml yet)"
fi

echo "== xdfsd as the units run it: their system call filter, address families, W^X, sd_notify"
# What systemd would enforce, checked on the built xdfsd doing its work under strace: every
# system call it makes is in SystemCallFilter= (@system-service but @privileged @resources),
# its sockets are of RestrictAddressFamilies=, nothing is mapped writable and executable
# (MemoryDenyWriteExecute=), and it tells NOTIFY_SOCKET READY=1, RELOADING=1 and READY=1
# around a SIGHUP, and STOPPING=1 (Type=notify).
if ! command -v strace >/dev/null || ! command -v python3 >/dev/null; then
  echo "(strace or python3 not installed: not checked)"
elif ! strace -f -qq -o /dev/null true 2>/dev/null; then
  echo "(strace may not trace here, ptrace forbidden: not checked)"
else
  filter() {  # the system calls of a set (its sets expanded) or a system call
    if [[ $1 != @* ]]; then echo "$1"; return; fi
    systemd-analyze syscall-filter "$1" | tail -n +2 | sed 's/^ *//; /^#/d; /^$/d' | while read -r s; do
      filter "$s"
    done
  }
  # The unit's SystemCallFilter= lines: an allow list, then ~ lists taken out of it.
  allow=() deny=()
  while read -r value; do
    if [[ $value == "~"* ]]; then read -r -a more <<<"${value#\~}"; deny+=("${more[@]}")
    else read -r -a more <<<"$value"; allow+=("${more[@]}"); fi
  done < <(sed -n 's/^SystemCallFilter=//p' "$pkg/xdfsd.service")
  echo "SystemCallFilter: ${allow[*]} but ${deny[*]}"
  comm -23 <(for f in "${allow[@]}"; do filter "$f"; done | sort -u) \
           <(for f in "${deny[@]}"; do filter "$f"; done | sort -u) >"$work/allowed"
  run="$work/run" && mkdir -p "$run/root" "$run/state" "$run/client" "$run/tree/sub"
  python3 -c '
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
s.bind(sys.argv[1]); s.settimeout(60)
open(sys.argv[1] + ".ready", "w").close()
with open(sys.argv[2], "w") as out:
    while True:
        m = s.recv(4096).decode()
        out.write(" ".join(m.split()) + "\n"); out.flush()
        if "STOPPING=1" in m: break
' "$run/notify" "$run/notified" &
  listener=$!
  for _ in $(seq 100); do [ -e "$run/notify.ready" ] && break; sleep 0.1; done
  export XDFS_CONFIG_DIR="$run/client"
  key="$("$xduc" keygen 2>/dev/null | grep '^xdfs-x25519 ')" || true
  echo "$key rw" >"$run/state/authorized_keys"
  config=()
  [ -f "$pkg/xdfsd.toml" ] && config=(--config "$pkg/xdfsd.toml")
  NOTIFY_SOCKET="$run/notify" strace -f -qq -o "$run/trace" "$xdfsd" "${config[@]}" --root "$run/root" \
    --state-dir "$run/state" --listen 127.0.0.1:0 --port-file "$run/port" --loopback-sendfile 2>"$run/server.log" &
  tracer=$!
  for _ in $(seq 100); do [ -s "$run/port" ] && break; sleep 0.1; done
  server="$(ps -o pid= --ppid $tracer | tr -d ' ')"
  url="xdfs://127.0.0.1:$(cat "$run/port" 2>/dev/null)"
  head -c 5000000 /dev/urandom >"$run/tree/big" && echo small >"$run/tree/sub/small"
  ok=1
  {
    "$xduc" -q --protect clear "$run/tree/big" "$url/big" &&
    "$xduc" -q --protect clear --no-verify "$url/big" "$run/big.clear" &&  # by sendfile
    "$xduc" -q -p 4 "$run/tree/big" "$url/big4" && "$xduc" -q -p 4 "$url/big4" "$run/big.private" &&
    "$xduc" -q -r "$run/tree" "$url/" && "$xduc" -q -r "$url/tree" "$run/tree.back" &&
    "$xduc" mkdir "$url/d" && "$xduc" mv "$url/big4" d/big && "$xduc" sum --sha256 "$url/d/big" &&
    "$xduc" ls -r "$url/" && "$xduc" stat "$url/d" && "$xduc" rm -r "$url/d" &&
    cmp "$run/tree/big" "$run/big.clear" && cmp "$run/tree/big" "$run/big.private" && diff -r "$run/tree" "$run/tree.back/tree"
  } >"$run/client.log" 2>&1 || ok=0
  [ $ok = 1 ] || { cat "$run/client.log" "$run/server.log"; bad "copies to and from xdfsd under strace"; }
  if [ -n "$server" ]; then
    kill -HUP "$server" 2>/dev/null || true; sleep 0.5; kill -TERM "$server" 2>/dev/null || true
  else
    kill -TERM $tracer 2>/dev/null || true
  fi
  wait $tracer || bad "xdfsd exited with $? after SIGTERM"
  wait $listener || true
  sed -n 's/^[0-9]* *\([a-z0-9_]*\)(.*/\1/p' "$run/trace" | sort -u >"$run/used"
  echo "$(wc -l <"$run/used") distinct system calls made; the filter allows $(wc -l <"$work/allowed")"
  echo "among them: $(grep -xE 'sendfile|splice|copy_file_range|fdatasync|clone3|accept4?|renameat2?' "$run/used" | paste -sd' ')"
  outside="$(comm -23 "$run/used" "$work/allowed")"
  [ -z "$outside" ] || bad "system calls outside SystemCallFilter=: $(echo $outside)"
  families="$(grep -oE 'socket\(AF_[A-Z0-9]+' "$run/trace" | sed 's/socket(//' | sort -u)"
  echo "socket families: $(echo $families)"
  restricted=" $(sed -n 's/^RestrictAddressFamilies=//p' "$pkg/xdfsd.service" | tr '\n' ' ') "
  for f in $families; do [[ $restricted == *" $f "* ]] || bad "a socket of $f, outside RestrictAddressFamilies=$restricted"; done
  if grep -E 'PROT_WRITE\|PROT_EXEC|PROT_EXEC\|PROT_WRITE|(mprotect|pkey_mprotect)\(.*PROT_EXEC' "$run/trace"; then
    bad "writable and executable memory (MemoryDenyWriteExecute=)"
  fi
  notified="$(paste -sd, "$run/notified" 2>/dev/null)"
  echo "sd_notify: $notified"
  [[ $notified =~ ^([^,]*READY=1[^,]*),([^,]*RELOADING=1[^,]*),([^,]*READY=1[^,]*),([^,]*STOPPING=1[^,]*)$ ]] ||
    bad "sd_notify: not READY=1, RELOADING=1, READY=1, STOPPING=1"
fi

echo "== bash completion"
# Each case: the words, the word completed last, then what COMPREPLY must hold (in order).
cases=(
  'xduc m|mkdir mv'
  'xduc --prot|--protect'
  'xduc --protect p|private'
  'xduc --progress |json line none'
  'xduc -p 8 --block-s|--block-size'
  'xduc ls |'
  'xduc xdfs://host:7721/pa|'
  'xduc keygen |'
  'xduc --identity ab|abc.txt'
  'xduc ab|abc.txt'
  'xduc sum a|a file abc.txt'
)
mkdir "$work/files" && touch "$work/files/abc.txt" "$work/files/a file"
for with in plain bash-completion; do
  loader=""
  if [ $with = bash-completion ]; then
    [ -f /usr/share/bash-completion/bash_completion ] || { echo "(bash-completion not installed)"; continue; }
    loader="source /usr/share/bash-completion/bash_completion"
  fi
  out="$(cd "$work/files" && bash --norc --noprofile -c '
    '"$loader"'
    source "$1"; shift
    complete -p xduc || exit 1
    for c in "$@"; do
      line=${c%%|*} want=${c#*|}
      # As readline splits the line (COMP_WORDBREAKS: an xdfs:// URL is several words here).
      read -r -a COMP_WORDS <<<"$(sed "s/:/ : /g" <<<"$line")"
      [[ $line == *" " ]] && COMP_WORDS+=("")
      COMP_CWORD=$((${#COMP_WORDS[@]} - 1)) COMP_LINE=$line COMP_POINT=${#line}
      COMPREPLY=()
      _xduc xduc "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
      got="$(printf "%s\n" "${COMPREPLY[@]}" | LC_ALL=C sort | paste -sd" ")"
      [[ $got == "$want" ]] && echo "ok   [$line] -> [$got]" || echo "FAIL [$line] -> [$got], expected [$want]"
    done
  ' completion "$pkg/xduc.bash-completion" "${cases[@]}" 2>&1)" || bad "bash ($with): complete -p xduc failed"
  echo "$with:"
  echo "$out" | sed 's/^/  /'
  if grep -q '^FAIL' <<<"$out"; then bad "bash completion ($with)"; fi
done
# Every option xduc --help lists (at the start of a line) is completed.
# (the option part of a line: up to the first run of spaces before the description)
help_opts="$({ "$xduc" --help || true; } | grep -E '^ +-' | sed -E 's/^ +//; s/  +[^-].*$//' |
  grep -oE -- '(^|[ ,])--?[a-zA-Z][-a-zA-Z0-9]*' | sed 's/^[ ,]//' | sort -u)"
listed="$(bash -c 'source "$1"; tr -s " \n" "\n\n" <<<"$_xduc_options"' _ "$pkg/xduc.bash-completion" | sort -u)"
missing="$(comm -23 <(echo "$help_opts") <(echo "$listed"))"
[ -z "$(echo "$help_opts")" ] && bad "no options found in xduc --help"
[ -z "$missing" ] || bad "options of xduc --help the completion does not offer: $(echo $missing)"

if [ $fail -ne 0 ]; then
  echo "systemd FAILED"
  exit 1
fi
echo "systemd OK"
