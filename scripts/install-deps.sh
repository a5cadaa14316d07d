#!/usr/bin/env bash
# Installs everything the tests and demos need on a fresh Debian machine (as root), and
# checks the Rust toolchain components. Idempotent.
#   iproute2, iptables   network namespaces, veth links and loss for the netns tests
#   tcpdump              the RoCE capture test (scripts/roce-capture.sh)
#   + the verbs build dependencies (scripts/install-verbs-deps.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(iproute2 iptables tcpdump)
if [ "$(id -u)" -eq 0 ]; then
    missing=()
    for p in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$' || missing+=("$p")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
    scripts/install-verbs-deps.sh >/dev/null
else
    echo "install-deps: not root; assuming system packages are present" >&2
fi

for component in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^$component"; then
        rustup component add "$component"
    fi
done
