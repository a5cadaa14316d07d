#!/usr/bin/env bash
# The 2 × 2 cluster of deploy/compose/compose.yaml in containers (one per host, on a private
# network, servers addressed by name), with a ranker, two trainers and a canary running while
#   t+3 s  ps-p1-s0 is killed (SIGKILL)     t+6 s  it is started again, on another IP address
#   t+8 s  ps-p1-s1 is cut off the network   t+12 s it is reconnected
# (peers and clients reach the restarted server only by resolving its name again)
# then `bex-chaos verify` checks the chaos run's invariants (no acknowledged canary push lost or
# applied twice, replicas converged), and every client must have exited 0 with work done.
#   scripts/compose-chaos.sh [IMAGE] [OUT]     defaults: bex:dev, target/compose
set -euo pipefail
cd "$(dirname "$0")/.."
image=${1:-bex:dev}
out=${2:-target/compose}
seconds=${BEX_SECONDS:-20}
if docker compose version >/dev/null 2>&1; then compose=(docker compose); else compose=(docker-compose); fi
project=bexci$$
dc() { "${compose[@]}" -f deploy/compose/compose.yaml -p "$project" "$@"; }
# Compose v1 names containers project_service_1, v2 project-service-1.
container() { docker ps -aq --filter "label=com.docker.compose.project=$project" \
    --filter "label=com.docker.compose.service=$1" | head -1; }

rm -rf "$out"
mkdir -p "$out/out"
chmod 777 "$out/out"
export BEX_IMAGE=$image BEX_RUN_DIR=$PWD/$out BEX_SECONDS=$seconds
BEX_SECRET=$(head -c 32 /dev/urandom | base64)
export BEX_SECRET
docker run --rm -v "$PWD/configs:/c:ro" "$image" bex-cluster config --config /c/chaos.toml \
    --set 'cluster.server_host=ps-p{pod}-s{shard}' --set cluster.base_port=17000 \
    --set cluster.data_dir=/var/lib/bex/data >"$out/cluster.toml"

finish() {
    dc --profile clients --profile verify logs --no-color >"$out/compose.log" 2>&1 || true
    dc --profile clients --profile verify down -v -t 5 >/dev/null 2>&1 || true
}
trap finish EXIT

servers=(ps-p0-s0 ps-p0-s1 ps-p1-s0 ps-p1-s1)
dc up -d "${servers[@]}"
wait_healthy() {
    local deadline=$((SECONDS + 120))
    for s in "$@"; do
        until [ "$(docker inspect -f '{{.State.Health.Status}}' "$(container "$s")")" = healthy ]; do
            [ $SECONDS -lt $deadline ] || { echo "compose-chaos: $s not healthy in 120 s" >&2; exit 1; }
            sleep 0.5
        done
    done
}
wait_healthy "${servers[@]}"
echo "compose-chaos: 4 servers healthy"

clients=(ranker trainer-2 trainer-3 canary-4)
dc --profile clients up -d "${clients[@]}"
t0=$SECONDS
at() { while [ $((SECONDS - t0)) -lt "$1" ]; do sleep 0.2; done; }
network="${project}_bex"
victim=$(container ps-p1-s0)
cut=$(container ps-p1-s1)
before_ip=$(docker inspect -f "{{(index .NetworkSettings.Networks \"$network\").IPAddress}}" "$cut")
ip_of() { docker inspect -f "{{(index .NetworkSettings.Networks \"$network\").IPAddress}}" "$1"; }
victim_before=$(ip_of "$victim")
at 3;  docker kill "$victim" >/dev/null;  echo "compose-chaos: t=3 s  killed ps-p1-s0 ($victim_before)"
# It comes back on another address, as a rescheduled pod does: everyone must resolve its name
# again (peers and clients hold the old address until they reconnect).
docker network disconnect "$network" "$victim"
docker network connect --ip "${victim_before%.*}.200" --alias ps-p1-s0 "$network" "$victim"
at 6;  docker start "$victim" >/dev/null
victim_after=$(ip_of "$victim")
echo "compose-chaos: t=6 s  restarted ps-p1-s0 at $victim_after"
at 8;  docker network disconnect "$network" "$cut"
echo "compose-chaos: t=8 s  cut ps-p1-s1 ($before_ip) off the network"
# Back at its address (the process listens there) and under its name.
at 12; docker network connect --ip "$before_ip" --alias ps-p1-s1 "$network" "$cut"
after_ip=$(docker inspect -f "{{(index .NetworkSettings.Networks \"$network\").IPAddress}}" "$cut")
echo "compose-chaos: t=12 s reconnected ps-p1-s1 at $after_ip"

failed=0
for c in "${clients[@]}"; do
    code=$(docker wait "$(container "$c")")
    echo "compose-chaos: $c exited $code"
    [ "$code" = 0 ] || failed=1
done
wait_healthy "${servers[@]}"
set +e
dc --profile verify run --rm verify
verify=$?
set -e
python3 - "$out/out" "$failed" "$verify" "$before_ip" "$after_ip" "$victim_before" "$victim_after" <<'PY'
import json, pathlib, sys
out, failed, verify = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
before, after, vb, va = sys.argv[4:8]
problems = []
if failed != "0":
    problems.append("a client exited non-zero")
v = json.loads((out / "verify.json").read_text()) if (out / "verify.json").exists() else None
if verify != "0" or not v or not v.get("ok"):
    problems.append(f"bex-chaos verify: exit {verify}, report {v and v.get('invariants')}")
r = json.loads((out / "ranker-1.json").read_text())
if not r.get("ok", 0) > 0:
    problems.append(f"the ranker answered no request: {r.get('ok')}")
for t in ("trainer-2", "trainer-3"):
    rep = json.loads((out / f"{t}.json").read_text())
    if rep.get("steps", 0) - rep.get("errors", 0) <= 0:
        problems.append(f"{t} made no successful step")
c = json.loads((out / "canary-4.json").read_text())
summary = {
    "ranker_ok": r.get("ok"), "ranker_errors": r.get("errors"),
    "canary_acked": c.get("acked"), "canary_failed": c.get("failed"),
    "verify_ok": v and v.get("ok"), "converged_after_s": v and v.get("converged_after_s"),
    "ps_p1_s1_ip": [before, after],
    "ps_p1_s0_ip": [vb, va],
}
(out.parent / "summary.json").write_text(json.dumps({"problems": problems, **summary}, indent=2))
print("compose-chaos:", json.dumps(summary))
if vb == va:
    problems.append(f"ps-p1-s0 came back on its old address {va}: names were not re-resolved")
if problems:
    print("compose-chaos: FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
    sys.exit(1)
print("compose-chaos: every invariant holds")
PY
