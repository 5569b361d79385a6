#!/usr/bin/env bash
# Installs the real operations tools the ops tests use, from Debian apt:
#   prometheus (+ promtool)  - scrape tests, `promtool check|test rules`
#   podman, runc, debootstrap - build and run the container image offline (crun refuses CI's cgroups)
#   dnsmasq                  - a real DNS server for the k8s SRV discovery test (in `unshare --net`)
# Idempotent and quick when everything is present. Never fails CI: without root or apt it says
# why and exits 0, and the tests that need a missing tool skip with their own message.
set -uo pipefail

need=()
for pair in prometheus:prometheus promtool:prometheus podman:podman runc:runc debootstrap:debootstrap \
            dnsmasq:dnsmasq-base; do
    cmd=${pair%%:*} pkg=${pair#*:}
    if ! command -v "$cmd" >/dev/null 2>&1 && [ ! -x "/usr/sbin/$cmd" ]; then
        need+=("$pkg")
    fi
done
# de-duplicate (prometheus provides both prometheus and promtool)
mapfile -t need < <(printf '%s\n' "${need[@]}" | awk 'NF && !seen[$0]++')

if [ ${#need[@]} -eq 0 ]; then
    echo "install_ops_tools: prometheus, promtool, podman, runc, debootstrap, dnsmasq already installed"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install_ops_tools: not root; skipping install of: ${need[*]} (the tests that need them will skip)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_ops_tools: no apt-get; skipping install of: ${need[*]} (the tests that need them will skip)"
    exit 0
fi
echo "install_ops_tools: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
# --no-install-recommends keeps podman from pulling crun's alternatives and a full container stack;
# the services apt may start (prometheus, dnsmasq) are stopped: tests run their own instances.
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}"; }; then
    echo "install_ops_tools: apt-get failed; continuing without ${need[*]} (the tests that need them will skip)"
    exit 0
fi
for svc in prometheus dnsmasq; do
    if command -v systemctl >/dev/null 2>&1; then systemctl disable --now "$svc" >/dev/null 2>&1 || true; fi
done
echo "install_ops_tools: done"
