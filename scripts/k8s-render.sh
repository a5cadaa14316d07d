#!/usr/bin/env bash
# Renders every Kustomize tree of deploy/kubernetes offline (`kubectl kustomize`) and validates
# each manifest: built-in kinds against the Kubernetes schemas (kubernetes-validate --strict),
# the custom resources (Volcano Job, PodMonitor) by the checks below, the cluster file in the
# ConfigMap by bex-cluster, and the image against the one scripts/docker.sh builds.
#   scripts/k8s-render.sh [OUT]    rendered YAML in OUT (default target/k8s)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/k8s}
validate=${KUBERNETES_VALIDATE:-kubernetes-validate}
bex_cluster=${BEX_CLUSTER:-target/release/bex-cluster}
rm -rf "$out"
mkdir -p "$out"
# A copy with a throwaway secret.env, so the checkout is not touched.
cp -r deploy/kubernetes "$out/src"
echo "BEX_SECRET=$(head -c 32 /dev/urandom | base64)" >"$out/src/base/secret.env"
"$bex_cluster" config --config deploy/kubernetes/base/cluster.toml >/dev/null
for tree in base volcano monitoring rdma; do
    kubectl kustomize "$out/src/$tree" >"$out/$tree.yaml" 2>"$out/$tree.err" || {
        cat "$out/$tree.err" >&2
        exit 1
    }
    "$validate" --strict --quiet "$out/$tree.yaml" >"$out/$tree.validate" 2>&1 || {
        cat "$out/$tree.validate" >&2
        exit 1
    }
    python3 - "$tree" "$out/$tree.yaml" "$out/$tree.validate" <<'PY'
import sys, yaml
tree, path, report = sys.argv[1], sys.argv[2], open(sys.argv[3]).read()
docs = [d for d in yaml.safe_load_all(open(path)) if d]
kinds = sorted(f"{d['apiVersion']}/{d['kind']}" for d in docs)
problems = []
# Only the custom resources may lack a schema.
custom = {"batch.volcano.sh/v1alpha1/Job", "monitoring.coreos.com/v1/PodMonitor"}
for line in report.splitlines():
    if "Couldn't find schema" in line and not any(
        f"kind {c.rsplit('/', 1)[1]} with api version {c.rsplit('/', 1)[0]}" in line for c in custom):
        problems.append(line)
def pods(d):
    spec = d.get("spec", {})
    if d["kind"] == "Job" and d["apiVersion"].startswith("batch.volcano.sh"):
        return [t["template"]["spec"] for t in spec["tasks"]]
    return [spec["template"]["spec"]] if "template" in spec else []
containers = [c for d in docs for p in pods(d) for c in p["containers"]]
images = {c["image"] for c in containers}
if images != {"bex:dev"}:
    problems.append(f"images {images}: expected the one scripts/docker.sh builds, bex:dev")
names = {d["metadata"]["name"] for d in docs}
for c in containers:
    for e in c.get("env", []):
        ref = e.get("valueFrom", {})
        for k in ("secretKeyRef", "configMapKeyRef"):
            if k in ref and ref[k]["name"] not in names:
                problems.append(f"{c['name']}: {k} {ref[k]['name']} is not in the tree")
    if not any(e["name"] == "BEX_SECRET" for e in c.get("env", [])):
        problems.append(f"{c['name']}: no BEX_SECRET")
# An added capability reaches the effective set only of uid 0 (Kubernetes sets no ambient
# capabilities): IPC_LOCK granted to the image's uid 10001 did nothing.
for d in docs:
    for p in pods(d):
        for c in p["containers"]:
            sc = c.get("securityContext", {})
            if sc.get("capabilities", {}).get("add"):
                uid = sc.get("runAsUser", p.get("securityContext", {}).get("runAsUser"))
                if uid != 0:
                    problems.append(f"{c['name']}: capabilities {sc['capabilities']['add']} "
                                    f"added for uid {uid}, which never has them")
                elif "ALL" not in sc["capabilities"].get("drop", []):
                    problems.append(f"{c['name']}: runs as root without dropping ALL")
statefulsets = [d for d in docs if d["kind"] == "StatefulSet"]
services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
if len(statefulsets) != 2:
    problems.append(f"{len(statefulsets)} StatefulSets, expected one per mini-pod (2)")
for s in statefulsets:
    svc = services.get(s["spec"]["serviceName"])
    if not svc or svc["spec"].get("clusterIP") != "None":
        problems.append(f"{s['metadata']['name']}: no headless Service")
    c = s["spec"]["template"]["spec"]["containers"][0]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if probe not in c:
            problems.append(f"{s['metadata']['name']}: no {probe}")
    if c["readinessProbe"]["httpGet"]["path"] != "/health":
        problems.append(f"{s['metadata']['name']}: readiness is not /health")
    if c["livenessProbe"].get("httpGet", {}).get("path") != "/health/live":
        problems.append(f"{s['metadata']['name']}: liveness is not /health/live")
    if not s["spec"].get("volumeClaimTemplates"):
        problems.append(f"{s['metadata']['name']}: no PersistentVolumeClaim for data_dir")
    # The two copies of a shard (one per mini-pod) must not share a node.
    pod = s["spec"]["template"]["metadata"]["labels"].get("bex.io/pod")
    anti = s["spec"]["template"]["spec"].get("affinity", {}).get("podAntiAffinity", {})
    required = anti.get("requiredDuringSchedulingIgnoredDuringExecution", [])
    if not any(t.get("topologyKey") == "kubernetes.io/hostname" and
               {"key": "bex.io/pod", "operator": "NotIn", "values": [pod]} in
               t.get("labelSelector", {}).get("matchExpressions", []) for t in required):
        problems.append(f"{s['metadata']['name']}: nothing keeps it off the other mini-pod's nodes")
budgets = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
if statefulsets and not any(
        b["spec"].get("maxUnavailable") == 1 and
        b["spec"]["selector"]["matchLabels"].get("app.kubernetes.io/name") == "ps-server"
        for b in budgets):
    problems.append("no PodDisruptionBudget keeping voluntary disruptions to one server")
for d in docs:
    if d["kind"] == "Job" and d["apiVersion"].startswith("batch.volcano.sh"):
        spec = d["spec"]
        total = sum(t["replicas"] for t in spec["tasks"])
        if spec.get("schedulerName") != "volcano" or not 0 < spec["minAvailable"] <= total:
            problems.append(f"Volcano Job: scheduler {spec.get('schedulerName')}, minAvailable {spec['minAvailable']} of {total}")
    if d["kind"] == "PodMonitor":
        ports = {p["name"] for c in containers for p in c.get("ports", [])}
        for ep in d["spec"]["podMetricsEndpoints"]:
            if ep["port"] not in ports:
                problems.append(f"PodMonitor: no container port {ep['port']}")
        sel = d["spec"]["selector"]["matchLabels"]
        labelled = [d2 for d2 in docs if any(
            all(p2.get("metadata", {}).get("labels", {}).get(k) == v for k, v in sel.items())
            for p2 in ([d2["spec"]["template"]] if "template" in d2.get("spec", {}) else
                       [t["template"] for t in d2.get("spec", {}).get("tasks", [])]))]
        if not labelled:
            problems.append("PodMonitor selects no workload")
if problems:
    print(f"k8s-render: {tree}: FAILED\n  " + "\n  ".join(problems), file=sys.stderr)
    sys.exit(1)
print(f"k8s-render: {tree}: {len(docs)} manifests valid ({', '.join(sorted(set(d['kind'] for d in docs)))})")
PY
done
# A user's image (the README's first step edits the base's `images:`) reaches every workload
# of every tree, the Volcano Job's too.
cp -r "$out/src" "$out/retag"
sed -i 's|^    newName: bex$|    newName: registry.example.com/bex|; s|^    newTag: dev$|    newTag: "7"|' \
    "$out/retag/base/kustomization.yaml"
for tree in base volcano monitoring rdma; do
    images=$(kubectl kustomize "$out/retag/$tree" 2>/dev/null | grep -E '^ *image:' | sed 's/^ *//' | sort -u)
    if [ "$images" != "image: registry.example.com/bex:7" ]; then
        echo "k8s-render: $tree: a retagged base gives images: $images" >&2
        exit 1
    fi
done
echo "k8s-render: a retagged base's image reaches every workload of every tree"
