#!/usr/bin/env bash
# Installs the Debian packages moec needs, skipping what is there: `apt-get update` once, then
# `apt-get install -y` of the missing ones (as root, else through sudo). The Makefile runs it
# before anything is configured or compiled, in every entry point (make, make demo, make test).
#
#   mk/deps.sh PACKAGE...
set -euo pipefail
if ! command -v dpkg-query >/dev/null; then
  echo "# no dpkg here: not a Debian machine; install the equivalents of: $*" >&2
  exit 0
fi
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "# dependencies present"
  exit 0
fi
echo "# installing: ${missing[*]}"
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
$SUDO apt-get update -q
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
