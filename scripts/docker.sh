#!/usr/bin/env bash
# Builds the bex image from the repository's Dockerfile, as a user would, on a machine that
# may reach no container registry: the two bases the Dockerfile names are made here first
# when absent — debian:bookworm-slim by `debootstrap --variant=minbase bookworm` from Debian's
# packages and `docker import`, rust:<version>-slim-bookworm from it plus this machine's Rust
# toolchain and local certificate authorities — then `docker build`. Then checks the image
# runs (ps-server --help, the verbs library present). As root.
#   scripts/docker.sh [TAG]                     default TAG: bex:dev
#   scripts/docker.sh --prebuilt DIR [TAG]      the Dockerfile's runtime stage around the
#       binaries in DIR (e.g. target/release) instead of compiling them again in the build
#       stage: what CI does, since that compile took 6-9 minutes of a 2-core run (no BuildKit
#       here, and the legacy builder runs every stage, so one Dockerfile cannot skip it). DIR's
#       binaries have the `verbs` feature only if they were built with it.
set -euo pipefail
cd "$(dirname "$0")/.."
prebuilt=
if [[ ${1:-} == --prebuilt ]]; then
    prebuilt=${2:?--prebuilt needs a directory of binaries}
    shift 2
fi
tag=${1:-bex:dev}
rust_version=$(sed -n 's/^ARG RUST_IMAGE=rust:\([0-9.]*\)-slim-bookworm$/\1/p' Dockerfile)
rust_image="rust:${rust_version}-slim-bookworm"
work=target/docker
mkdir -p "$work"

have() { docker image inspect "$1" >/dev/null 2>&1; }

if ! have debian:bookworm-slim; then
    command -v debootstrap >/dev/null || {
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
    }
    rootfs="$work/bookworm-rootfs"
    rm -rf "$rootfs"
    echo "docker.sh: debootstrap --variant=minbase bookworm (Debian's packages)"
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >"$work/debootstrap.log"
    # As the official slim image: no docs or caches.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/usr/share/doc/*
    tar -C "$rootfs" -c . | docker import \
        --change 'CMD ["bash"]' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        - debian:bookworm-slim >/dev/null
    rm -rf "$rootfs"
fi

if [[ -z $prebuilt ]] && ! have "$rust_image"; then
    sysroot=$(rustc +"$rust_version" --print sysroot 2>/dev/null || rustc --print sysroot)
    have_version=$("$sysroot/bin/rustc" --version | awk '{print $2}')
    case "$have_version" in
    "$rust_version" | "$rust_version".*) ;;
    *)
        echo "docker.sh: the Dockerfile wants Rust $rust_version, this machine has $have_version" >&2
        exit 1
        ;;
    esac
    echo "docker.sh: $rust_image from debian:bookworm-slim and $sysroot"
    # This machine's own certificate authorities go in too: behind a TLS-inspecting proxy
    # (as here) cargo in the image reaches crates.io only if it trusts what the host trusts.
    rm -rf "$work/ca-certificates"
    mkdir -p "$work/ca-certificates"
    find /usr/local/share/ca-certificates -name '*.crt' -exec cp {} "$work/ca-certificates/" \; 2>/dev/null || true
    # The context: the toolchain without its documentation (share/), the local CAs, and the
    # Dockerfile.
    tar -cf - -C "$sysroot" bin lib libexec -C "$PWD/$work" ca-certificates \
        -C "$PWD/deploy/docker" rust-base.Dockerfile |
        docker build -q -t "$rust_image" -f rust-base.Dockerfile - >/dev/null
fi

if [[ -n $prebuilt ]]; then
    # One runtime stage, the Dockerfile's: from its last FROM on, the build stage's output
    # replaced by DIR's binaries (the ones the build stage copies out).
    ctx="$work/prebuilt"
    rm -rf "$ctx"
    mkdir -p "$ctx/out"
    bins=$(grep -o 'target/release/[a-z-]*' Dockerfile | sed 's#target/release/##' | sort -u)
    for b in $bins; do
        cp "$prebuilt/$b" "$ctx/out/" || { echo "docker.sh: no $b in $prebuilt" >&2; exit 1; }
    done
    cp -r configs "$ctx/"
    runtime=$(grep -n '^FROM \${RUNTIME_IMAGE}' Dockerfile | tail -1 | cut -d: -f1)
    { grep '^ARG RUNTIME_IMAGE=' Dockerfile; tail -n +"$runtime" Dockerfile; } |
        sed 's#^COPY --from=build /out/ #COPY out/ #' >"$ctx/Dockerfile"
    grep -q '^COPY out/ ' "$ctx/Dockerfile" || {
        echo "docker.sh: the Dockerfile's runtime stage no longer copies /out/ from the build stage" >&2
        exit 1
    }
    echo "docker.sh: docker build -t $tag: the Dockerfile's runtime stage around $prebuilt's $(echo $bins | wc -w) binaries"
    docker build --network host --force-rm -t "$tag" "$ctx" >"$work/build.log" 2>&1 || {
        tail -40 "$work/build.log" >&2
        exit 1
    }
else
    echo "docker.sh: docker build -t $tag ."
    docker build --network host --force-rm -t "$tag" . >"$work/build.log" 2>&1 || {
        tail -40 "$work/build.log" >&2
        exit 1
    }
fi
# The legacy builder keeps the build stage (3 GB) as an untagged image.
docker image prune -f --filter label=bex.stage=build >/dev/null
# The whole help read before it is looked at: `| head -1` closed the pipe while docker still
# wrote, and under pipefail its "broken pipe" failed the check now and then.
help=$(docker run --rm "$tag" ps-server --help)
[[ "${help%%$'\n'*}" == "usage: ps-server"* ]] || {
    echo "docker.sh: $tag: ps-server --help does not start with its usage line" >&2
    exit 1
}
docker run --rm "$tag" sh -c 'ls /usr/lib/x86_64-linux-gnu/libibverbs.so.1 >/dev/null \
    && ls /usr/lib/x86_64-linux-gnu/libibverbs/ | grep -q .'
echo "docker.sh: $tag built ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.0f MB", $1/1e6}')), runs, has libibverbs and its providers"
