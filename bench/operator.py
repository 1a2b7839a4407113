"""Operator benchmark: seconds from `kubectl apply` to every child created and status Ready, for
1 and for 50 LLMServices, and the operator's peak RSS. Runs a real control plane with kwok nodes
(hack/testplane), the Helm chart's RBAC, and `splitserve operator` as a subprocess.

    python bench/operator.py [--counts 1 50]

Prints a table and writes bench/results/operator.json. Not a test: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "hack" / "testplane"))
sys.path.insert(0, str(ROOT / "tests" / "operator"))

import plane  # noqa: E402
from operator_process import OperatorProcess, install_chart, is_ready  # noqa: E402

# 2 ConfigMaps (the router's and the GPU pools'), 3 Services, 3 Deployments, 3 PDBs
CHILDREN_PER_SERVICE = 11
NAMESPACES = 5


class PeakRSS:
    """Samples a process's resident memory every 50 ms in a thread; keeps the maximum."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(0.05)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def services(count: int, namespaces: list[str]) -> list[dict[str, Any]]:
    return [
        {
            "apiVersion": "splitserve.io/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": f"svc-{i}", "namespace": namespaces[i % len(namespaces)]},
            "spec": {"model": {"name": "m", "path": "/models/m"}, "prefill": {}, "decode": {}},
        }
        for i in range(count)
    ]


def count_children(api: Any, namespaces: list[str]) -> int:
    from kubernetes import client

    core, apps, policy = client.CoreV1Api(api), client.AppsV1Api(api), client.PolicyV1Api(api)
    sel = "app.kubernetes.io/managed-by=splitserve-operator"
    total = 0
    for ns in namespaces:
        total += len(core.list_namespaced_config_map(ns, label_selector=sel).items)
        total += len(core.list_namespaced_service(ns, label_selector=sel).items)
        total += len(apps.list_namespaced_deployment(ns, label_selector=sel).items)
        total += len(policy.list_namespaced_pod_disruption_budget(ns, label_selector=sel).items)
    return total


def measure(cp: plane.ControlPlane, kubeconfig: Path, count: int) -> dict[str, Any]:
    from kubernetes import client

    run = uuid.uuid4().hex[:5]
    namespaces = [cp.create_namespace(f"bench-{run}-{i}") for i in range(min(count, NAMESPACES))]
    log = cp.workdir / "logs" / f"bench-operator-{run}.log"
    operator = OperatorProcess(kubeconfig, ["--all-namespaces", "--peering=splitserve"], log)
    operator.start()
    assert operator.proc is not None
    rss = PeakRSS(operator.proc.pid)
    api = cp.api_client()
    custom = client.CustomObjectsApi(api)
    docs = services(count, namespaces)
    start = time.monotonic()
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    while True:
        items = custom.list_cluster_custom_object("splitserve.io", "v1alpha1", "llmservices")
        ours = [o for o in items["items"] if o["metadata"]["namespace"] in namespaces]
        if len(ours) == count and all(is_ready(o) for o in ours):
            if count_children(api, namespaces) == count * CHILDREN_PER_SERVICE:
                break
        if time.monotonic() - start > 1800:
            raise SystemExit(f"{count} services not Ready after 30 min\n{operator.tail()}")
        time.sleep(0.25)
    seconds = time.monotonic() - start
    peak = rss.stop()
    for ns in namespaces:
        cp.kubectl("delete", "llmservices", "--all", "-n", ns, "--wait=true", check=False)
        cp.delete_namespace(ns)
    operator.stop()
    api.close()
    return {"services": count, "seconds_to_ready": round(seconds, 2),
            "operator_peak_rss_bytes": peak}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 50])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "operator.json")
    args = parser.parse_args()
    rows = []
    with plane.ControlPlane(nodes=3) as cp:
        system = cp.create_namespace("splitserve-system")
        sa = install_chart(cp, "bench", system, "watch.allNamespaces=true")
        kubeconfig = cp.kubeconfig_for_service_account(system, sa)
        for count in args.counts:
            rows.append(measure(cp, kubeconfig, count))
            row = rows[-1]
            print(f"measured {count} services: {row['seconds_to_ready']} s", file=sys.stderr)
    print(f"{'services':>8}  {'seconds to Ready':>16}  {'operator peak RSS':>17}")
    for row in rows:
        mib = row["operator_peak_rss_bytes"] / 2**20
        print(f"{row['services']:>8}  {row['seconds_to_ready']:>16.2f}  {mib:>13.1f} MiB")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
