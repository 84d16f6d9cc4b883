#!/usr/bin/env bash
# Headless Chromium and its WebDriver (Debian's chromium and chromium-driver)
# for the web console's browser test (tests/integration/test_web_browser.py)
# and scripts/screenshots.sh. Idempotent; called by scripts/bootstrap.sh.
set -euo pipefail

log() { printf 'browser.sh: %s\n' "$*" >&2; }

if command -v chromedriver >/dev/null 2>&1 && { command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; }; then
    exit 0
fi
if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    log "WARNING: chromium and chromium-driver are not installed; the browser test will fail until they are"
    exit 0
fi
log "installing chromium and chromium-driver (Debian packages) for the browser test"
# A fresh image may have no package lists yet, or stale ones.
apt-get update -qq >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    chromium chromium-driver fonts-dejavu-core >/dev/null
