#!/usr/bin/env bash
# Installs what building bex-rnic-verbs with its `verbs` feature needs on Debian (bookworm
# or newer), as root:
#   cmake, make, gcc, libc6-dev  build the bundled libibverbs shim of rdma-mummy-sys
#   libclang-dev                 bindgen generates the bindings (any libclang version)
# No rdma-core headers are needed: rdma-mummy-sys ships its own and dlopens libibverbs.
#
#   --runtime   also install what *running* against a real device needs
#               (libibverbs1 and the userspace drivers in ibverbs-providers).
#
# Idempotent: packages already installed are left as they are.
set -euo pipefail

packages=(cmake make gcc libc6-dev libclang-dev)
for arg in "$@"; do
    case "$arg" in
        --runtime) packages+=(libibverbs1 ibverbs-providers) ;;
        *) echo "usage: $0 [--runtime]" >&2; exit 2 ;;
    esac
done

if [ "$(id -u)" -ne 0 ]; then
    echo "$0: run as root (apt-get install)" >&2
    exit 1
fi

missing=()
for p in "${packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q '^install ok installed$'; then
        missing+=("$p")
    fi
done

if [ "${#missing[@]}" -eq 0 ]; then
    echo "verbs build dependencies already installed: ${packages[*]}"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y --no-install-recommends "${missing[@]}"
echo "installed: ${missing[*]}"
