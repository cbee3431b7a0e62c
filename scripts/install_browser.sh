#!/usr/bin/env bash
# Headless Chromium and ChromeDriver for the dashboard's browser tests (tests/client/serve/test_dashboard_page.py),
# from Debian's packages `chromium` and `chromium-driver`. Does nothing when both are on PATH.
# Needs root or password-less sudo to install; otherwise says what to run and fails, so the
# browser tests never pass by being skipped.
set -euo pipefail
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    SUDO=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
    SUDO=(sudo -n)
else
    echo "the browser tests need Chromium and ChromeDriver: run" >&2
    echo "  sudo apt-get update && sudo apt-get install -y chromium chromium-driver" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null; then
    echo "no apt-get here: install Chromium and a matching ChromeDriver, both on PATH" >&2
    exit 1
fi
"${SUDO[@]}" apt-get update -qq
DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends chromium chromium-driver
