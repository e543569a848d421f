#!/usr/bin/env bash
# Print the path of a Chromium binary (headless screenshots of the dashboard, its e2e test).
# Installs Debian's `chromium` package when none is on PATH; running it again changes nothing.
#   scripts/chromium.sh      e.g. /usr/bin/chromium
set -euo pipefail

find_chromium() {
    local name
    for name in chromium chromium-browser google-chrome-stable google-chrome; do
        command -v "$name" && return 0
    done
    return 1
}

install() {
    local sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine may have no package lists yet: update only when the install needs it.
    $sudo apt-get install -y -qq chromium >/dev/null 2>&1 \
        || { $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq chromium >/dev/null; }
}

if find_chromium; then
    exit 0
fi
command -v apt-get >/dev/null || { echo "chromium.sh: no chromium on PATH and no apt-get to install it" >&2; exit 1; }
install >&2
find_chromium || { echo "chromium.sh: installed the chromium package, yet no chromium binary is on PATH" >&2; exit 1; }
