#!/usr/bin/env bash
# Makes the real pyverbs data classes (Debian's python3-pyverbs, rdma-core) importable in the
# project's venv, so that the RDMA code's verbs calls are checked against the real module
# (tests/cachestore/test_pyverbs_contract.py) and the emulated device builds its work requests and
# attributes with it. There is no RDMA device here: only the parameter objects are used.
#
# Debian installs it for the system Python; the venv sees it through a folder that holds just a
# `pyverbs` symlink (not all of dist-packages), named in a .pth file of the venv, and only when the
# module was built for the venv's Python version. Idempotent and quick when present; never fails
# CI: without root, apt or a matching build it says why and exits 0 (the tests that need it skip).
#   usage: scripts/install_pyverbs.sh [VENV]   (default: .venv)
set -uo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
python="$venv/bin/python"
system_pkg=/usr/lib/python3/dist-packages/pyverbs

if [ ! -x "$python" ]; then
    echo "install_pyverbs: no $python; skipping"
    exit 0
fi
if [ ! -d "$system_pkg" ]; then
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
        echo "install_pyverbs: python3-pyverbs missing and no root/apt to install it (its tests will skip)"
        exit 0
    fi
    echo "install_pyverbs: installing python3-pyverbs"
    if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-pyverbs >/dev/null 2>&1 &&
       ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
           apt-get install -y -qq --no-install-recommends python3-pyverbs >/dev/null 2>&1; }; then
        echo "install_pyverbs: apt-get failed; continuing without pyverbs (its tests will skip)"
        exit 0
    fi
fi
tag=$("$python" -c 'import sys; print(f"cpython-{sys.version_info[0]}{sys.version_info[1]}")')
if ! ls "$system_pkg"/*."$tag"-*.so >/dev/null 2>&1; then
    echo "install_pyverbs: Debian's pyverbs is not built for the venv's $tag; skipping"
    exit 0
fi
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
link_dir=$(cd "$venv" && pwd -P)/pyverbs-path
mkdir -p "$link_dir"
ln -sfn "$system_pkg" "$link_dir/pyverbs"
echo "$link_dir" > "$site/pdserve-pyverbs.pth"
if "$python" -c 'import pyverbs.wr, pyverbs.addr, pyverbs.qp' 2>/dev/null; then
    echo "install_pyverbs: pyverbs importable in $venv (data classes only: no RDMA device here)"
else
    echo "install_pyverbs: pyverbs does not import in $venv; removing the path (its tests will skip)"
    rm -f "$site/pdserve-pyverbs.pth"
fi
