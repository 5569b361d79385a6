#!/usr/bin/env bash
# Installs Mooncake Store's client and master (the mooncake-transfer-engine-non-cuda wheel: no CUDA,
# TCP transport) into the venv, for the shared KV store's Mooncake backend tests
# (tests/engine/test_kv_mooncake_store.py). Never fails: without it those tests skip.
#   usage: scripts/install_mooncake.sh [VENV]   (default: .venv)
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
if [ ! -x "$venv/bin/python" ]; then
    echo "install_mooncake: no $venv/bin/python; skipping"
    exit 0
fi
if "$venv/bin/python" -c 'import mooncake.store' 2>/dev/null; then
    echo "install_mooncake: already importable in $venv"
    exit 0
fi
if ! "$venv/bin/pip" install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1" >/dev/null 2>&1; then
    echo "install_mooncake: pip install failed; continuing without it (its tests will skip)"
    exit 0
fi
echo "install_mooncake: mooncake $("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("mooncake-transfer-engine-non-cuda"))') in $venv"
