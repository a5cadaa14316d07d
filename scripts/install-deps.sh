#!/usr/bin/env bash
# Installs everything the tests and demos need on a fresh Debian machine (as root), and
# checks the Rust toolchain components. Idempotent.
#   iproute2, iptables   network namespaces, veth links and loss for the netns tests
#   tcpdump              the RoCE capture test (scripts/roce-capture.sh)
#   debootstrap          the container base image (scripts/docker.sh)
#   docker.io, docker-compose   unless a Docker Engine / Compose is already installed
#   kubernetes-client    kubectl (kustomize), unless a kubectl is installed
#   python3-venv, python3-yaml  a venv in target/py (from PyPI: kubernetes-validate, and numpy
#                        and pytest for the bex Python package) and the checks
#   + the verbs build dependencies (scripts/install-verbs-deps.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(iproute2 iptables tcpdump debootstrap python3-venv python3-yaml curl)
command -v docker >/dev/null || packages+=(docker.io)
docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null || packages+=(docker-compose)
command -v kubectl >/dev/null || packages+=(kubernetes-client)
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

# One venv for the Python tools: kubernetes-validate (the Kubernetes schemas, offline once
# installed), and numpy and pytest for the bex package (python/; pip fetches maturin to
# build it).
if [ ! -x target/py/bin/kubernetes-validate ] || [ ! -x target/py/bin/pytest ]; then
    python3 -m venv target/py
    target/py/bin/pip install -q kubernetes-validate numpy pytest
fi

for component in rustfmt clippy; do
    if ! rustup component list --installed 2>/dev/null | grep -q "^$component"; then
        rustup component add "$component"
    fi
done
