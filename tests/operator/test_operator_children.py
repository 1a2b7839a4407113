"""children.desired_children: the objects one LLMService becomes, checked without a cluster."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from splitserve_operator.children import (
    desired_children,
    superseded_configs,
    unwanted_children,
)
from splitserve_operator.config import OperatorConfig
from splitserve_operator.names import CONFIG_HASH_ANNOTATION
from splitserve_operator.podtemplate import container_args
from splitserve_operator.spec import SpecError, parse_spec
from splitserve_operator.workerconfig import config_hash
from splitserve_workers.config import CONFIG_PATH_IN_POD, ServingConfig

REPO_ROOT = Path(__file__).resolve().parents[2]

SPEC: dict[str, Any] = {
    "model": {
        "name": "tiny-llama",
        "path": "/models/tiny-llama",
        "dtype": "float32",
        "volume": {"persistentVolumeClaim": {"claimName": "models"}},
    },
    "prefill": {
        "replicas": 2,
        "maxBatchTokens": 2048,
        "kvCacheMemory": "256Mi",
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "nodeSelector": {"gpu": "yes"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                    ]
                }
            }
        },
    },
    "decode": {
        "replicas": 3,
        "maxBatchSize": 64,
        "speculativeTokens": 4,
        "topologySpread": {"enabled": False},
    },
    "slo": {"ttft": "300ms", "tpot": "40ms", "percentile": 99},
}


def build(spec: dict[str, Any] = SPEC, served: bool = False, **config: Any) -> dict:
    """served: whether the cluster serves monitoring.coreos.com."""
    objs = desired_children(
        "chat",
        "team-a",
        "uid-1",
        parse_spec(spec),
        OperatorConfig(**config),
        served,
        rules_available=served,
    )
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def config_map_name(objs: dict, component: str = "decode") -> str:
    """The ConfigMap a component's pods mount (its name carries the config's hash)."""
    pod = objs[("Deployment", f"chat-{component}")]["spec"]["template"]["spec"]
    volume = {v["name"]: v for v in pod["volumes"]}["config"]
    sources = volume["projected"]["sources"] if "projected" in volume else [volume]
    return str(next(s["configMap"]["name"] for s in sources if "configMap" in s))


def config_map(objs: dict, component: str = "decode") -> dict[str, Any]:
    return objs[("ConfigMap", config_map_name(objs, component))]  # type: ignore[no-any-return]


def serving(spec: dict[str, Any] = SPEC, component: str = "decode") -> ServingConfig:
    """The ServingConfig a component's pods read."""
    return ServingConfig.from_yaml(config_map(build(spec), component)["data"]["config.yaml"])


def test_every_child_has_owner_reference_and_common_labels() -> None:
    objs = build(served=True)
    assert set(objs) == {
        ("ConfigMap", config_map_name(objs, "router")),
        ("ConfigMap", config_map_name(objs)),  # the prefill and decode pools': one
        ("Service", "chat-router"),
        ("Service", "chat-prefill"),
        ("Service", "chat-decode"),
        ("Deployment", "chat-router"),
        ("Deployment", "chat-prefill"),
        ("Deployment", "chat-decode"),
        ("PodDisruptionBudget", "chat-router"),
        ("PodDisruptionBudget", "chat-prefill"),
        ("PodDisruptionBudget", "chat-decode"),
        ("ServiceMonitor", "chat-router"),
        ("PodMonitor", "chat-workers"),
        ("PrometheusRule", "chat-slo"),
        ("NetworkPolicy", "chat-workers"),
    }
    for obj in objs.values():
        meta = obj["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "splitserve.io/v1alpha1",
                "kind": "LLMService",
                "name": "chat",
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        labels = meta["labels"]
        assert labels["app.kubernetes.io/name"] == "splitserve"
        assert labels["app.kubernetes.io/instance"] == "chat"
        assert labels["app.kubernetes.io/managed-by"] == "splitserve-operator"
        assert labels["app.kubernetes.io/part-of"] == "splitserve"
        assert labels["app.kubernetes.io/component"]


def test_monitors_only_when_the_cluster_serves_them_and_not_disabled() -> None:
    assert ("PodMonitor", "chat-workers") not in build(served=False)
    off = copy.deepcopy(SPEC)
    off["monitoring"] = {"enabled": False}
    assert ("ServiceMonitor", "chat-router") not in build(off, served=True)
    assert ("ServiceMonitor", "chat-router") not in build(served=True, monitoring="off")


def test_disabled_monitoring_rules_out_the_monitors_unless_the_operator_leaves_them_alone() -> None:
    off = copy.deepcopy(SPEC)
    off["monitoring"] = {"enabled": False}
    unwanted = unwanted_children("chat", parse_spec(off), OperatorConfig())
    assert unwanted["monitoring.enabled is false"] == [
        ("monitoring.coreos.com/v1", "ServiceMonitor", "chat-router"),
        ("monitoring.coreos.com/v1", "PodMonitor", "chat-workers"),
        ("monitoring.coreos.com/v1", "PrometheusRule", "chat-slo"),
    ]
    # Exactly the monitors and rule desired_children makes when monitoring is on.
    made = [
        k for k in build(served=True) if k[0] in ("ServiceMonitor", "PodMonitor", "PrometheusRule")
    ]
    assert sorted(made) == sorted((k, n) for _, k, n in unwanted["monitoring.enabled is false"])
    # Enabled: nothing to delete. --monitoring off: the operator neither makes nor deletes them.
    assert "monitoring.enabled is false" not in unwanted_children(
        "chat", parse_spec(SPEC), OperatorConfig()
    )
    assert "monitoring.enabled is false" not in unwanted_children(
        "chat", parse_spec(off), OperatorConfig(monitoring="off")
    )


def test_hpas_and_scaled_objects_are_ruled_out_outside_their_mode() -> None:
    hpas = [
        ("autoscaling/v2", "HorizontalPodAutoscaler", "chat-prefill"),
        ("autoscaling/v2", "HorizontalPodAutoscaler", "chat-decode"),
    ]
    scaled = [
        ("keda.sh/v1alpha1", "ScaledObject", "chat-prefill"),
        ("keda.sh/v1alpha1", "ScaledObject", "chat-decode"),
    ]
    unwanted = unwanted_children("chat", parse_spec(SPEC), OperatorConfig())
    assert unwanted == {"autoscaling.mode is Off": hpas + scaled}
    for mode, gone in (("HPA", scaled), ("KEDA", hpas)):
        spec = copy.deepcopy(SPEC)
        spec["autoscaling"] = {"mode": mode}
        for pool in ("prefill", "decode"):
            spec[pool]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
        assert unwanted_children("chat", parse_spec(spec), OperatorConfig()) == {
            f"autoscaling.mode is {mode}": gone
        }


def test_kv_cache_memory_percentage_reaches_the_workers_as_a_fraction() -> None:
    spec = copy.deepcopy(SPEC)
    spec["decode"]["kvCacheMemory"] = "85%"
    config = serving(spec)
    assert config.decode.kv_cache_memory_fraction == pytest.approx(0.85)
    assert config.prefill.kv_cache_memory_fraction is None  # prefill keeps its 256Mi
    assert config.prefill.kv_cache_memory_bytes == 256 << 20


def test_config_map_is_the_worker_contract_with_dns_discovery() -> None:
    config = serving()
    assert config.service == "chat"
    assert config.model.path == "/models/tiny-llama" and config.model.dtype == "float32"
    assert config.prefill.max_batch_tokens == 2048
    assert config.prefill.kv_cache_memory_bytes == 256 << 20
    assert config.prefill.kv_cache_memory_fraction is None
    assert config.decode.max_batch_size == 64
    assert config.decode.speculative_tokens == 4
    assert serving(component="prefill") == config
    router = serving(component="router")
    assert (router.service, router.model) == (config.service, config.model)
    assert router.router.discovery == "dns"
    assert router.router.prefill_service == "chat-prefill.team-a.svc.cluster.local:50051"
    assert router.router.decode_service == "chat-decode.team-a.svc.cluster.local:50052"
    assert router.router.log_requests is False
    spec = copy.deepcopy(SPEC)
    spec["router"] = {"logRequests": True}
    assert serving(spec, "router").router.log_requests is True
    spec["router"] = {"logRequests": "yes"}  # stored before the schema (which refuses it)
    with pytest.raises(SpecError, match=r"^spec\.router\.logRequests: "):
        parse_spec(spec)
    assert router.router.tool_call_parser == "auto"
    spec["router"] = {"toolCallParser": "hermes", "reasoningParser": "qwen3"}
    settings = serving(spec, "router").router
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("hermes", "qwen3")
    spec["router"] = {"toolCallParser": "xml"}
    with pytest.raises(SpecError, match=r"^spec\.router\.toolCallParser: "):
        parse_spec(spec)
    assert (router.router.admission_timeout_seconds, router.router.write_timeout_seconds) == (
        30.0,
        60.0,
    )
    spec["router"] = {"admissionTimeout": "2m", "writeTimeout": "0s"}
    settings = serving(spec, "router").router
    assert (settings.admission_timeout_seconds, settings.write_timeout_seconds) == (120.0, 0.0)
    # Stored before the schema's rules (which refuse these): the spec parser refuses them too.
    for field, value in (("admissionTimeout", "0s"), ("writeTimeout", "2h"), ("writeTimeout", "x")):
        spec["router"] = {field: value}
        with pytest.raises(SpecError, match=rf"^spec\.router\.{field}: "):
            parse_spec(spec)


def test_each_component_reads_only_its_sections_so_other_changes_do_not_roll_it() -> None:
    # The SLO is the operator's own (no pod reads it): a new objective rolls nothing. A router
    # setting rolls the router alone; a worker setting the two GPU pools, not the router.
    objs = build()
    for component in ("router", "prefill", "decode"):
        text = config_map(objs, component)["data"]["config.yaml"]
        assert "slo" not in yaml.safe_load(text)
    assert "router" not in yaml.safe_load(config_map(objs)["data"]["config.yaml"])
    assert {"prefill", "decode"}.isdisjoint(
        yaml.safe_load(config_map(objs, "router")["data"]["config.yaml"])
    )

    def rolled(change: dict[str, Any]) -> set[str]:
        spec = copy.deepcopy(SPEC)
        for path, value in change.items():
            *parents, key = path.split(".")
            node = spec
            for parent in parents:
                node = node.setdefault(parent, {})
            node[key] = value
        after = build(spec)
        return {
            c
            for c in ("router", "prefill", "decode")
            if after[("Deployment", f"chat-{c}")]["spec"]["template"]
            != objs[("Deployment", f"chat-{c}")]["spec"]["template"]
        }

    assert rolled({"slo.ttft": "1s", "slo.percentile": 90}) == set()
    assert rolled({"router.logRequests": True}) == {"router"}
    assert rolled({"router.writeTimeout": "5s"}) == {"router"}
    assert rolled({"decode.maxBatchSize": 32}) == {"prefill", "decode"}
    assert rolled({"prefill.maxBatchTokens": 4096}) == {"prefill", "decode"}
    assert rolled({"model.maxModelLen": 64}) == {"router", "prefill", "decode"}


def test_a_pool_that_may_scale_to_zero_keeps_the_router_ready() -> None:
    # Otherwise the router leaves its Service when the pool is at zero, and the requests that
    # would wake the pool never arrive; they wait out the cold start. Router arguments, not
    # worker configuration: only the router restarts when this changes.
    def router_args(mode: str, decode_min: int) -> list[str]:
        spec = copy.deepcopy(SPEC)
        spec["autoscaling"] = {"mode": mode}
        spec["prefill"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
        spec["decode"]["autoscaling"] = {"minReplicas": decode_min, "maxReplicas": 4}
        spec["decode"]["replicas"] = max(decode_min, 1)
        return container_args("router", parse_spec(spec))

    sleeping = ["--ready-without-workers", "--empty-pool-wait", "300"]
    assert router_args("Builtin", 0)[-3:] == sleeping
    assert router_args("KEDA", 0)[-3:] == sleeping
    assert "--ready-without-workers" not in router_args("Builtin", 1)
    assert "--ready-without-workers" not in router_args("Off", 0)


def test_only_the_router_and_prefill_pool_reach_the_worker_grpc_ports() -> None:
    # The gRPC ports are unauthenticated (Reserve holds blocks, Prefill dials any address).
    policy = build()[("NetworkPolicy", "chat-workers")]["spec"]
    selector = policy["podSelector"]
    assert selector["matchLabels"]["app.kubernetes.io/instance"] == "chat"
    assert selector["matchExpressions"] == [
        {"key": "app.kubernetes.io/component", "operator": "In", "values": ["prefill", "decode"]}
    ]
    assert policy["policyTypes"] == ["Ingress"]

    def source(rule: dict) -> str | None:
        (peer,) = rule.get("from", [{}]) or [{}]
        labels = peer.get("podSelector", {}).get("matchLabels", {})
        if labels:
            assert labels["app.kubernetes.io/instance"] == "chat"
        return labels.get("app.kubernetes.io/component")

    admitted = {(source(r), p["port"]) for r in policy["ingress"] for p in r["ports"]}
    assert admitted == {("router", 50051), ("router", 50052), ("prefill", 50052), (None, 9100)}
    assert "NetworkPolicy" not in {kind for kind, _ in build(network_policies="off")}


@pytest.mark.parametrize(
    ("grace", "drain"), [(180, "175"), (30, "25"), (8, "4"), (4, "2"), (2, "0"), (1, "0")]
)
def test_every_container_drains_within_the_pods_grace_period(grace: int, drain: str) -> None:
    # The kubelet SIGKILLs at the grace period: a drain that outlasts it ends streams with no
    # error event; one far shorter cuts requests the pod had time for.
    spec = copy.deepcopy(SPEC)
    spec["terminationGracePeriodSeconds"] = grace
    children = build(spec)
    for component in ("router", "prefill", "decode"):
        pod = children[("Deployment", f"chat-{component}")]["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == grace
        args = pod["containers"][0]["args"]
        assert args[args.index("--drain-timeout") + 1] == drain
        assert float(drain) <= grace - 1  # the exit path needs its second or two


@pytest.mark.parametrize(
    ("component", "args"),
    [
        (
            "prefill",
            ["prefill", "--config", CONFIG_PATH_IN_POD, "--port", "50051", "--metrics-port", "9100",
             "--drain-timeout", "115"],
        ),
        (
            "decode",
            ["decode", "--config", CONFIG_PATH_IN_POD, "--port", "50052", "--metrics-port", "9100",
             "--drain-timeout", "115"],
        ),
        ("router", ["router", "--config", CONFIG_PATH_IN_POD, "--port", "8000",
                    "--drain-timeout", "115"]),
    ],
)  # fmt: skip
def test_worker_container_contract(component: str, args: list[str]) -> None:
    dep = build()[("Deployment", f"chat-{component}")]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["splitserve"] and container["args"] == args
    assert container["image"] == "splitserve/worker:dev"
    port = "http" if component == "router" else "metrics"
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": port}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": port}
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["config"] == {"name": "config", "mountPath": "/etc/splitserve", "readOnly": True}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}
    volumes = {v["name"]: v for v in pod["volumes"]}
    digest = dep["spec"]["template"]["metadata"]["annotations"]["splitserve.io/config-hash"]
    assert volumes["config"]["configMap"]["name"] == f"chat-config-{digest}"
    assert volumes["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert pod["terminationGracePeriodSeconds"] == 120
    selector = dep["spec"]["selector"]["matchLabels"]
    assert selector == {
        "app.kubernetes.io/name": "splitserve",
        "app.kubernetes.io/instance": "chat",
        "app.kubernetes.io/component": component,
    }
    assert selector.items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_router_api_keys_come_from_the_secret_in_the_config_volume() -> None:
    # Projected into the config volume (no mount of its own for a model volume to collide
    # with); kubelet updates it in place when the Secret changes, and the router re-reads it.
    spec = copy.deepcopy(SPEC)
    spec["router"] = {"apiKeySecret": {"name": "router-keys"}}
    objs = build(spec)
    pod = objs[("Deployment", "chat-router")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["config"]["projected"]["sources"] == [
        {"configMap": {"name": config_map_name(objs, "router")}},
        {"secret": {"name": "router-keys", "items": [{"key": "api-key", "path": "api-keys"}]}},
    ]
    args = pod["containers"][0]["args"]
    assert args[args.index("--api-key-file") + 1] == "/etc/splitserve/api-keys"
    # Only the router gets the keys; without the field nothing changes.
    for component in ("prefill", "decode"):
        worker = build(spec)[("Deployment", f"chat-{component}")]["spec"]["template"]["spec"]
        assert {v["name"]: v for v in worker["volumes"]}["config"] == {
            "name": "config",
            "configMap": {"name": config_map_name(objs)},
        }
    plain = build()[("Deployment", "chat-router")]["spec"]["template"]["spec"]
    assert "--api-key-file" not in plain["containers"][0]["args"]


def test_pods_are_hardened() -> None:
    for component in ("router", "prefill", "decode"):
        pod = build()[("Deployment", f"chat-{component}")]["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        sc = pod["containers"][0]["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert pod["automountServiceAccountToken"] is False
        # The only writable path is bounded: a runaway writer is evicted, the node's disk kept.
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["tmp"] == {"name": "tmp", "emptyDir": {"sizeLimit": "8Gi"}}


def test_pods_run_as_the_worker_images_user() -> None:
    # The pod's user and the image's USER agree, so files the image owns stay readable.
    dockerfile = (REPO_ROOT / "Dockerfile.worker").read_text()
    (user_line,) = [line for line in dockerfile.splitlines() if line.startswith("USER ")]
    uid, gid = (int(x) for x in user_line.split()[1].split(":"))
    pod = build()[("Deployment", "chat-decode")]["spec"]["template"]["spec"]
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid)


def test_scheduling_fields_pass_through_and_spread_is_default() -> None:
    objs = build()
    prefill = objs[("Deployment", "chat-prefill")]["spec"]["template"]["spec"]
    assert prefill["nodeSelector"] == SPEC["prefill"]["nodeSelector"]
    assert prefill["tolerations"] == SPEC["prefill"]["tolerations"]
    assert prefill["affinity"] == SPEC["prefill"]["affinity"]
    assert prefill["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    (spread,) = prefill["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill"
    decode = objs[("Deployment", "chat-decode")]["spec"]["template"]["spec"]
    assert "topologySpreadConstraints" not in decode  # disabled in this spec
    assert objs[("Deployment", "chat-decode")]["spec"]["replicas"] == 3


def test_config_hash_rolls_pods_only_when_the_config_changes() -> None:
    def hashes(spec: dict) -> set[str]:
        objs = build(spec)
        return {
            objs[("Deployment", f"chat-{c}")]["spec"]["template"]["metadata"]["annotations"][
                CONFIG_HASH_ANNOTATION
            ]
            for c in ("router", "prefill", "decode")
        }

    first = hashes(SPEC)
    assert len(first) == 2  # the router's, and the two GPU pools' (the same sections)
    more_replicas = copy.deepcopy(SPEC)
    more_replicas["decode"]["replicas"] = 5
    assert hashes(more_replicas) == first
    bigger_batch = copy.deepcopy(SPEC)
    bigger_batch["decode"]["maxBatchSize"] = 32
    assert hashes(bigger_batch) != first


def test_services_router_clusterip_and_headless_pools() -> None:
    objs = build()
    router = objs[("Service", "chat-router")]["spec"]
    assert router["type"] == "ClusterIP" and "clusterIP" not in router
    assert router["ports"] == [
        {"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}
    ]
    for component, port in (("prefill", 50051), ("decode", 50052)):
        svc = objs[("Service", f"chat-{component}")]["spec"]
        assert svc["clusterIP"] == "None"
        assert svc["ports"][0]["port"] == port
        assert svc["selector"]["app.kubernetes.io/component"] == component
        pdb = objs[("PodDisruptionBudget", f"chat-{component}")]["spec"]
        assert pdb["maxUnavailable"] == 1
        assert pdb["selector"]["matchLabels"] == svc["selector"]


def test_spec_image_wins_over_operator_default() -> None:
    spec = copy.deepcopy(SPEC)
    spec["image"] = "registry.example/worker:1.2"
    dep = build(spec, worker_image="other:tag")[("Deployment", "chat-decode")]
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "registry.example/worker:1.2"
    dep = build(worker_image="other:tag")[("Deployment", "chat-decode")]
    assert dep["spec"]["template"]["spec"]["containers"][0]["image"] == "other:tag"


def test_each_config_version_is_its_own_immutable_config_map() -> None:
    objs = build()
    for pool in ("router", "prefill", "decode"):
        cm = config_map(objs, pool)
        assert cm["immutable"] is True
        template = objs[("Deployment", f"chat-{pool}")]["spec"]["template"]
        digest = template["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
        assert cm["metadata"]["name"] == f"chat-config-{digest}"
        assert digest == config_hash(cm["data"]["config.yaml"])
    # The same spec names the same version; a config change names a new one; a change that
    # leaves the worker config alone (replicas) keeps it.
    assert config_map_name(build()) == config_map_name(objs)
    spec = copy.deepcopy(SPEC)
    spec["decode"]["maxBatchSize"] = 32
    assert config_map_name(build(spec)) != config_map_name(objs)
    spec = copy.deepcopy(SPEC)
    spec["decode"]["replicas"] = 5
    assert config_map_name(build(spec)) == config_map_name(objs)


def _mounting(kind: str, name: str, replicas: int | None = None, projected: bool = False):
    volume = (
        {"name": "config", "projected": {"sources": [{"configMap": {"name": name}}]}}
        if projected
        else {"name": "config", "configMap": {"name": name}}
    )
    pod_spec = {"volumes": [volume, {"name": "tmp", "emptyDir": {}}]}
    if kind == "Pod":
        return {"spec": pod_spec}
    obj: dict[str, Any] = {"spec": {"template": {"spec": pod_spec}}}
    if replicas is not None:
        obj["spec"]["replicas"] = replicas
        obj["status"] = {"replicas": 0}
    return obj


def _cm(name: str, uid: str = "uid-1") -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": f"cm-{name}", "ownerReferences": [{"uid": uid}]}}


def test_superseded_configs_are_those_nothing_can_mount() -> None:
    maps = [_cm("c-old"), _cm("c-mid"), _cm("c-new"), _cm("c-legacy"), _cm("c-other", "uid-2")]
    deployments = [
        _mounting("Deployment", "c-new"),
        _mounting("Deployment", "c-new", projected=True),
    ]
    # Mid-rollout: the old ReplicaSet still wants a pod (it may replace one that dies), the
    # pod of an emptied ReplicaSet is still terminating; the rollout history keeps nothing.
    live_rs = _mounting("ReplicaSet", "c-mid", replicas=1)
    history = _mounting("ReplicaSet", "c-old", replicas=0)
    terminating = _mounting("Pod", "c-legacy")
    assert superseded_configs(maps, "uid-1", deployments, [live_rs, history], [terminating]) == [
        "c-old"
    ]
    # Once the pod is gone and the ReplicaSet empty, only the current one stays; another
    # LLMService's ConfigMap is never touched.
    live_rs["spec"]["replicas"] = 0
    assert superseded_configs(maps, "uid-1", deployments, [live_rs, history], []) == [
        "c-legacy",
        "c-mid",
        "c-old",
    ]
    # A ReplicaSet scaled to zero whose pods are still counted keeps its version.
    live_rs["status"]["replicas"] = 1
    assert "c-mid" not in superseded_configs(maps, "uid-1", deployments, [live_rs], [])
    # No Deployment (being created, or deleted and about to be repaired): nothing is judged.
    assert superseded_configs(maps, "uid-1", [], [], []) == []


def test_a_pod_that_ended_keeps_no_config_version() -> None:
    # An evicted pod (phase Failed) lingers until pod garbage collection, which by default
    # waits for thousands of terminated pods: it never starts again, so its version can go.
    maps = [_cm("c-old"), _cm("c-new")]
    deployments = [_mounting("Deployment", "c-new")]
    evicted = _mounting("Pod", "c-old")
    evicted["status"] = {"phase": "Failed", "reason": "Evicted"}
    assert superseded_configs(maps, "uid-1", deployments, [], [evicted]) == ["c-old"]
    running = _mounting("Pod", "c-old")
    running["status"] = {"phase": "Running"}
    assert superseded_configs(maps, "uid-1", deployments, [], [evicted, running]) == []
