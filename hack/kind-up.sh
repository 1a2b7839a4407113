#!/usr/bin/env bash
# A local Kubernetes cluster with splitserve for users with Docker: a kind cluster with the tiny
# model mounted into its node, the worker and operator images built and loaded, the Helm chart
# installed, and the tiny CPU example applied. Needs docker, kind, kubectl and helm on PATH.
# Re-running reuses the cluster and upgrades the release. Remove with:
#   kind delete cluster --name "${KIND_CLUSTER:-splitserve}"
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cluster=${KIND_CLUSTER:-splitserve}
namespace=${NAMESPACE:-splitserve}
models=${SPLITSERVE_MODELS:-$root/.models}
for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "kind-up: $tool is not on PATH" >&2; exit 1; }
done
log() { echo "[kind-up] $*" >&2; }

# The tiny random-weight model, built once on the host with the project's own tool.
if [ ! -f "$models/tiny-llama/config.json" ]; then
  log "building the tiny-llama model into $models/tiny-llama"
  venv=$(bash "$root/hack/venv.sh")
  mkdir -p "$models"
  "$venv/bin/splitserve" make-model --preset tiny-llama --out "$models/tiny-llama"
fi

if ! kind get clusters | grep -qx "$cluster"; then
  log "creating kind cluster $cluster"
  kind create cluster --name "$cluster" --config - <<KIND
kind: Cluster
apiVersion: kind.x-k8s.io/v1alpha4
nodes:
  - role: control-plane
    extraMounts:
      - hostPath: $models
        containerPath: /var/lib/splitserve/models
        readOnly: true
KIND
fi
kubectl config use-context "kind-$cluster" >/dev/null

log "building images splitserve/worker:dev and splitserve/operator:dev"
docker build -f "$root/Dockerfile.worker" -t splitserve/worker:dev "$root"
docker build -f "$root/Dockerfile.operator" -t splitserve/operator:dev "$root"
kind load docker-image --name "$cluster" splitserve/worker:dev splitserve/operator:dev

log "installing the chart into $namespace"
helm upgrade --install splitserve "$root/charts/splitserve" --namespace "$namespace" \
  --create-namespace --wait --timeout 5m

log "applying the tiny CPU example"
# Images loaded into kind are used as they are: tag "dev" means pull policy IfNotPresent.
kubectl apply -n "$namespace" -f "$root/manifests/examples/tiny-cpu.yaml"
kubectl wait -n "$namespace" llmservice/tiny --for=condition=Ready --timeout=10m
kubectl get llms -n "$namespace"
cat >&2 <<DONE
[kind-up] ready. Try:
  kubectl port-forward -n $namespace svc/tiny-router 8000:8000 &
  curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
    -d '{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 16}'
DONE
