#!/usr/bin/env bash
# Captures two software RNICs talking RoCEv2 across network namespaces, over IPv4 and IPv6,
# and checks every captured packet's ICRC against an implementation of RoCEv2's rule written
# in the test (transport/rnic/tests/icrc_capture.rs). The veth devices take one segment per
# send (gso_max_segs 1), so the kernel segments GSO sends before the wire and the capture
# holds every segment with the IP header it really had (identifications 0, 1, 2, ...).
#
#   scripts/roce-capture.sh [OUT_DIR]        default: target/roce-capture
#
# Leaves OUT_DIR/roce.pcap for Wireshark (port 4791 decodes as RoCEv2 without "Decode As";
# the checked run uses free ports, so use Decode As UDP -> RoCE there). Needs root, iproute2
# and tcpdump. Cleans up its namespaces on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-target/roce-capture}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

. scripts/lib-netns.sh
netns_prepare roce-capture tcpdump tcpdump
TAG="bexc$$"
netns_pair "$TAG" 10.198.0.1 10.198.0.2 fd98::1 fd98::2
# One segment per send: the kernel segments GSO sends before the wire.
ip -n "$NA" link set "$DA" gso_max_segs 1; ip -n "$NB" link set "$DB" gso_max_segs 1

ip netns exec "$NA" tcpdump -i "$DA" -s 0 -U -w "$OUT/roce.pcap" udp 2>"$OUT/tcpdump.log" &
dump=$!
sleep 1

status=0
run() { # server_ip client_ip control
    local port=$((7700 + RANDOM % 200))
    ip netns exec "$NB" "$BIN" server --bind "$1" --control "$3:$port" >"$OUT/server.log" 2>&1 &
    local server=$!
    if ! ip netns exec "$NA" "$BIN" client --bind "$2" --control "$3:$port" \
        --messages 400 --max-len 32768 --mtu 4096 --seed 3 >"$OUT/client.log" 2>&1; then
        status=1; cat "$OUT/client.log" >&2
    fi
    wait "$server" || { status=1; cat "$OUT/server.log" >&2; }
    grep -h '{' "$OUT/server.log" "$OUT/client.log" | grep -v ready || true
    # The receiver checks every ICRC too (the IPv4 identification of a segment included).
    if ! grep -q '"bad_icrc":0,' "$OUT/server.log"; then
        echo "roce-capture: the receiver refused ICRCs over $1" >&2; status=1
    fi
}
run 10.198.0.2 10.198.0.1 10.198.0.2
run fd98::2 fd98::1 '[fd98::2]'
sleep 0.5
kill -INT "$dump"; wait "$dump" || true
cat "$OUT/tcpdump.log" >&2

BEX_ROCE_PCAP="$OUT/roce.pcap" cargo test --release --locked -q -p bex-rnic --test icrc_capture \
    -- --ignored --nocapture || status=1
if [ "$status" = 0 ]; then echo "roce-capture: PASS ($OUT/roce.pcap)"; else echo "roce-capture: FAIL" >&2; fi
exit "$status"
