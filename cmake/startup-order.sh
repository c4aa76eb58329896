#!/bin/sh
# Helper of TesseraStartupOrder.cmake, run at configure time on a probe executable.
#   startup-order.sh providers <probe> <log>  the libraries the probe's symbol lookups bind to,
#                                             most lookups first, one path a line
#   startup-order.sh same <probe-a> <probe-b> <log>  exit 0 when every symbol reference of probe-b
#                                             binds as in probe-a, or to another copy of a weak
#                                             definition (C++ inline and template code, which each
#                                             library carries); else exit 1 and print, a line each,
#                                             "<library> <library whose strong definition it took>"
# glibc's loader writes one line a binding under LD_DEBUG=bindings:
#   binding file <from> [0] to <to> [0]: normal symbol `<name>' [<version>]
set -eu
bindings() {  # bindings <probe> <log>: "<from> <name> <to>" a line, the probe's own path as "probe"
  rm -f "$2".run.*
  LD_DEBUG=bindings LD_DEBUG_OUTPUT="$2.run" "$1"
  sed -n 's/.*binding file \([^ ]*\) \[0\] to \([^ ]*\) \[0\]: normal symbol `\([^'"'"']*\)'"'"'.*/\1 \3 \2/p' "$2".run.* |
    sed "s|^$1 |probe |"
}
case "$1" in
  providers)
    bindings "$2" "$3" | awk '{print $3}' | LC_ALL=C sort | uniq -c | sort -rn | awk '{print $2}' ;;
  same)
    # probe-a's bindings once for all rounds (kept while newer than probe-a)
    [ -s "$4.a" ] && [ "$4.a" -nt "$2" ] || bindings "$2" "$4" > "$4.a"
    bindings "$3" "$4" > "$4.b"
    [ -s "$4.a" ] && [ -s "$4.b" ] || exit 1
    # "<symbol> <library before> <library after>" for each reference that binds elsewhere now
    awk 'NR == FNR {before[$1 " " $2] = $3; next} ($1 " " $2) in before && before[$1 " " $2] != $3 {
      print $2, before[$1 " " $2], $3}' "$4.a" "$4.b" > "$4.moved"
    for library in $(awk '{print $2; print $3}' "$4.moved" | LC_ALL=C sort -u); do
      nm -D --defined-only "$library" | awk -v l="$library" '$2 ~ /^[WVuwv]$/ {sub(/@.*/, "", $3); print l, $3}'
    done > "$4.weak"
    awk 'NR == FNR {weak[$0]; next} !(($2 " " $1) in weak && ($3 " " $1) in weak) {print $3, $2}' "$4.weak" "$4.moved" |
      LC_ALL=C sort -u > "$4.strong"
    cat "$4.strong"
    [ ! -s "$4.strong" ] ;;
  *) echo "usage: $0 providers <probe> <log> | same <probe-a> <probe-b> <log>" >&2; exit 2 ;;
esac
