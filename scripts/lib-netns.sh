# Two network namespaces joined by a veth pair, for the netns scripts (sourced, not run):
#   netns_pair TAG IPV4_A IPV4_B [IPV6_A IPV6_B]
# makes namespaces "${TAG}a" and "${TAG}b" (in $NA and $NB), devices "${TAG}x" in A and
# "${TAG}y" in B (in $DA and $DB) with the addresses (/24, /64), jumbo frames (a 4096-byte
# path MTU needs no IP fragmentation), up; and removes them, killing what runs inside, on
# any exit. Needs root and iproute2.
#   netns_prepare SCRIPT TOOL PACKAGE
# checks for root and TOOL (exit 2 naming PACKAGE), then builds the stream_check example
# into $BIN.
netns_prepare() {
    if [ "$(id -u)" != 0 ]; then echo "$1: needs root" >&2; exit 2; fi
    command -v "$2" >/dev/null || { echo "$1: $2 missing (apt-get install $3)" >&2; exit 2; }
    cargo build --release --locked -q --example stream_check
    BIN=target/release/examples/stream_check
}

netns_cleanup() {
    for ns in "${NA:-}" "${NB:-}"; do
        [ -n "$ns" ] || continue
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns" 2>/dev/null || true
    done
}

netns_pair() {
    local tag=$1
    NA="${tag}a"; NB="${tag}b"; DA="${tag}x"; DB="${tag}y"
    trap netns_cleanup EXIT INT TERM
    ip netns add "$NA"; ip netns add "$NB"
    ip link add "$DA" type veth peer name "$DB"
    ip link set "$DA" netns "$NA"; ip link set "$DB" netns "$NB"
    ip -n "$NA" addr add "$2/24" dev "$DA"
    ip -n "$NB" addr add "$3/24" dev "$DB"
    if [ $# -ge 5 ]; then
        ip -n "$NA" -6 addr add "$4/64" dev "$DA" nodad
        ip -n "$NB" -6 addr add "$5/64" dev "$DB" nodad
    fi
    ip -n "$NA" link set "$DA" mtu 9000 up; ip -n "$NB" link set "$DB" mtu 9000 up
    ip -n "$NA" link set lo up; ip -n "$NB" link set lo up
}
