#!/usr/bin/env bash
# Streams messages between two software-RNIC processes in two network namespaces joined by a
# veth pair, with random UDP loss applied by `iptables -m statistic` in both directions, and
# fails unless every message arrives intact and in order.
#
#   scripts/netns-loss.sh [LOSS ...]        default: 0.01 0.05
#   MESSAGES=3000 MAX_LEN=32768 MTU=4096 scripts/netns-loss.sh 0.05
#
# Needs root, iproute2 and iptables. Cleans up its namespaces on any exit.
set -euo pipefail
cd "$(dirname "$0")/.."

MESSAGES=${MESSAGES:-3000}
MAX_LEN=${MAX_LEN:-32768}
MTU=${MTU:-4096}
LOSSES=("${@:-0.01 0.05}")
read -r -a LOSSES <<<"${LOSSES[*]}"

. scripts/lib-netns.sh
netns_prepare netns-loss iptables iptables
TAG="bexl$$"
netns_pair "$TAG" 10.199.0.1 10.199.0.2

status=0
for loss in "${LOSSES[@]}"; do
    for ns in "$NA" "$NB"; do
        ip netns exec "$ns" iptables -F OUTPUT
        ip netns exec "$ns" iptables -A OUTPUT -p udp -m statistic --mode random --probability "$loss" -j DROP
    done
    port=$((7700 + RANDOM % 200))
    ip netns exec "$NB" "$BIN" server --bind 10.199.0.2 --control "10.199.0.2:$port" >"/tmp/$TAG.server" 2>&1 &
    server=$!
    if ! ip netns exec "$NA" "$BIN" client --bind 10.199.0.1 --control "10.199.0.2:$port" \
        --messages "$MESSAGES" --max-len "$MAX_LEN" --mtu "$MTU" --seed 7 >"/tmp/$TAG.client" 2>&1; then
        status=1
    fi
    wait "$server" || status=1
    drops=$(ip netns exec "$NA" iptables -L OUTPUT -v -x -n | awk '/DROP/ {print $1}')
    drops_b=$(ip netns exec "$NB" iptables -L OUTPUT -v -x -n | awk '/DROP/ {print $1}')
    echo "loss=$loss iptables_dropped=$((drops + drops_b))"
    # The run proves recovery only if packets were lost and resent: a rule that never
    # matched would pass as a clean run.
    if [ $((drops + drops_b)) -eq 0 ]; then
        echo "netns-loss: loss=$loss: iptables dropped nothing" >&2
        status=1
    fi
    resent=$(grep -ho '"retransmitted_packets":[0-9]*' "/tmp/$TAG.client" | cut -d: -f2)
    if [ "${resent:-0}" -eq 0 ]; then
        echo "netns-loss: loss=$loss: the client retransmitted nothing" >&2
        status=1
    fi
    grep -h '{' "/tmp/$TAG.server" "/tmp/$TAG.client" | grep -v ready
    grep -h -v '{' "/tmp/$TAG.server" "/tmp/$TAG.client" >&2 || true
    rm -f "/tmp/$TAG.server" "/tmp/$TAG.client"
done
if [ "$status" = 0 ]; then echo "netns-loss: PASS"; else echo "netns-loss: FAIL" >&2; fi
exit "$status"
