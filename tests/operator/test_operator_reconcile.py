"""reconcile.apply_children against a recording fake of the API layer: who sends
Deployment replicas in each autoscaling mode; and what the operator's pruning deletes (the
real server-side apply and deletion semantics are exercised in test_operator_cluster.py)."""

from __future__ import annotations

import copy
import gc
import threading
from typing import Any

import kopf
import pytest
from splitserve_operator.children import desired_children
from splitserve_operator.config import FIELD_MANAGER, REPLICAS_FIELD_MANAGER, OperatorConfig
from splitserve_operator.handlers import WARNING_REPEAT_SECONDS, Operator, pending_change
from splitserve_operator.kube import Kube, KubeError, Ref
from splitserve_operator.reconcile import ChildConflict, apply_children
from splitserve_operator.spec import parse_spec


class RecordingKube:
    """Stores applied objects by reference; merges `spec.replicas` like the API server."""

    def __init__(self) -> None:
        self.objects: dict[Ref, dict[str, Any]] = {}
        self.calls: list[tuple[str, str, dict[str, Any]]] = []
        self.version = 0

    def get(self, ref: Ref) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get(ref))

    def apply(self, obj: dict[str, Any], manager: str, force: bool = True) -> dict[str, Any]:
        ref = Ref.of(obj)
        self.calls.append((manager, str(ref), copy.deepcopy(obj)))
        live = self.objects.get(ref)
        merged = copy.deepcopy(live) if live else {"metadata": {}, "spec": {}}
        merged.update({k: v for k, v in obj.items() if k not in ("metadata", "spec")})
        merged["metadata"].update(copy.deepcopy(obj["metadata"]))
        merged.setdefault("spec", {}).update(copy.deepcopy(obj.get("spec", {})))
        if merged != live:
            self.version += 1
            merged["metadata"]["resourceVersion"] = str(self.version)
        self.objects[ref] = merged
        return copy.deepcopy(merged)


def children(mode: str, decode_replicas: int = 2) -> list[dict[str, Any]]:
    spec: dict[str, Any] = {
        "model": {"name": "m", "path": "/models/m"},
        "prefill": {"replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 4}},
        "decode": {
            "replicas": decode_replicas,
            "autoscaling": {"minReplicas": 1, "maxReplicas": 4},
        },
        "autoscaling": {"mode": mode},
    }
    return desired_children("chat", "ns", "uid", parse_spec(spec), OperatorConfig(), False)


DECODE = Ref("apps/v1", "Deployment", "ns", "chat-decode")


def decode_calls(kube: RecordingKube) -> list[tuple[str, Any]]:
    return [(m, o["spec"].get("replicas")) for m, ref, o in kube.calls if ref == str(DECODE)]


def test_creation_sets_replicas_in_every_mode() -> None:
    for mode in ("Off", "Builtin", "HPA"):
        kube = RecordingKube()
        outcome = apply_children(kube, children(mode), mode)  # type: ignore[arg-type]
        assert decode_calls(kube) == [
            (FIELD_MANAGER, 2),
            (REPLICAS_FIELD_MANAGER, 2),
            (FIELD_MANAGER, None),
        ]
        assert kube.objects[DECODE]["spec"]["replicas"] == 2
        assert str(DECODE) in outcome.created
        assert set(outcome.deployments) == {"router", "prefill", "decode"}


def test_hpa_mode_never_sends_replicas_after_creation() -> None:
    kube = RecordingKube()
    apply_children(kube, children("HPA"), "HPA")  # type: ignore[arg-type]
    kube.objects[DECODE]["spec"]["replicas"] = 4  # the HPA scaled up
    kube.calls.clear()
    outcome = apply_children(kube, children("HPA", decode_replicas=3), "HPA")  # type: ignore[arg-type]
    assert decode_calls(kube) == [(FIELD_MANAGER, None)]
    assert kube.objects[DECODE]["spec"]["replicas"] == 4
    assert outcome.created == [] and outcome.updated == []


def test_hpa_mode_restarts_a_pool_left_at_zero() -> None:
    # Builtin or KEDA scaled decode to zero, then the mode became HPA: an HPA never scales a
    # Deployment up from zero, so the pool restarts at spec.decode.replicas, once.
    kube = RecordingKube()
    apply_children(kube, children("KEDA"), "KEDA")  # type: ignore[arg-type]
    kube.objects[DECODE]["spec"]["replicas"] = 0
    apply_children(kube, children("KEDA"), "KEDA")  # type: ignore[arg-type]
    assert kube.objects[DECODE]["spec"]["replicas"] == 0  # KEDA's zero stands in mode KEDA
    kube.calls.clear()
    hpa = children("HPA", decode_replicas=3)
    apply_children(kube, hpa, "HPA", wake_from_zero=True)  # type: ignore[arg-type]
    assert decode_calls(kube) == [(FIELD_MANAGER, None), (REPLICAS_FIELD_MANAGER, 3)]
    assert kube.objects[DECODE]["spec"]["replicas"] == 3
    # A resync leaves a zero alone: scaling an HPA's target to zero pauses the HPA.
    kube.objects[DECODE]["spec"]["replicas"] = 0
    apply_children(kube, hpa, "HPA")  # type: ignore[arg-type]
    assert kube.objects[DECODE]["spec"]["replicas"] == 0


def test_off_mode_enforces_spec_replicas_through_the_replicas_manager() -> None:
    kube = RecordingKube()
    apply_children(kube, children("Off"), "Off")  # type: ignore[arg-type]
    kube.objects[DECODE]["spec"]["replicas"] = 7  # someone ran kubectl scale
    kube.calls.clear()
    outcome = apply_children(kube, children("Off"), "Off")  # type: ignore[arg-type]
    assert decode_calls(kube) == [(FIELD_MANAGER, None), (REPLICAS_FIELD_MANAGER, 2)]
    assert kube.objects[DECODE]["spec"]["replicas"] == 2
    assert str(DECODE) in outcome.updated
    kube.calls.clear()
    apply_children(kube, children("Off"), "Off")  # type: ignore[arg-type]
    assert decode_calls(kube) == [(FIELD_MANAGER, None)]  # nothing to correct: one call


class BusyControllerKube(RecordingKube):
    """A controller writes status (and so a new resourceVersion) right after every GET, before
    the operator's apply lands: what a Deployment mid-rollout or a PDB counting pods does."""

    def get(self, ref: Ref) -> dict[str, Any] | None:
        live = super().get(ref)
        if ref in self.objects:
            self.version += 1
            self.objects[ref]["metadata"]["resourceVersion"] = str(self.version)
            self.objects[ref]["status"] = {"observedGeneration": self.version}
        return live


def test_status_writes_by_controllers_are_not_reported_as_changes() -> None:
    kube = BusyControllerKube()
    apply_children(kube, children("Off"), "Off")  # type: ignore[arg-type]
    outcome = apply_children(kube, children("Off"), "Off")  # type: ignore[arg-type]
    assert outcome.created == [] and outcome.updated == []
    # A hand edit is still a change, under the same status churn.
    kube.objects[DECODE]["spec"]["template"]["spec"]["containers"][0]["image"] = "hand:edit"
    outcome = apply_children(kube, children("Off"), "Off")  # type: ignore[arg-type]
    assert outcome.updated == [str(DECODE)]


class DeletingKube:
    """GET and DELETE (with a uid precondition) on stored objects; `on_get` runs after a GET,
    to change the object between the operator's read and its delete."""

    def __init__(self, objects: dict[Ref, dict[str, Any]]) -> None:
        self.objects = objects
        self.on_get: dict[Ref, Any] = {}

    def get(self, ref: Ref) -> dict[str, Any] | None:
        live = copy.deepcopy(self.objects.get(ref))
        if ref in self.on_get:
            self.on_get.pop(ref)()
        return live

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> None:
        assert method == "DELETE"
        ref = next((r for r in self.objects if r.path() == path), None)
        if ref is None:
            raise KubeError(404, method, path, "not found")
        if body["preconditions"]["uid"] != self.objects[ref]["metadata"]["uid"]:
            raise KubeError(409, method, path, "Precondition failed: UID")
        del self.objects[ref]


def monitor(kind: str, name: str, uid: str, owner: str | None) -> tuple[Ref, dict[str, Any]]:
    owners = [{"kind": "LLMService", "uid": owner}] if owner else []
    meta = {"name": name, "uid": uid, "ownerReferences": owners}
    return Ref("monitoring.coreos.com/v1", kind, "ns", name), {"metadata": meta}


def test_prune_deletes_only_what_the_llmservice_owns() -> None:
    ours, theirs, gone, replaced, unserved = (
        monitor("ServiceMonitor", "chat-router", "m1", owner="uid"),
        monitor("ServiceMonitor", "other", "m2", owner="someone-else"),
        monitor("PodMonitor", "chat-workers", "m3", owner="uid"),
        monitor("ServiceMonitor", "chat-again", "m4", owner="uid"),
        monitor("PodMonitor", "never-made", "m5", owner="uid"),
    )
    kube = DeletingKube(dict([ours, theirs, gone, replaced]))
    # Deleted by someone else between the read and the delete: gone all the same.
    kube.on_get[gone[0]] = lambda: kube.objects.pop(gone[0])
    # Replaced by a namesake someone else made between the read and the delete: it stays.
    namesake = monitor("ServiceMonitor", "chat-again", "m6", owner=None)[1]
    kube.on_get[replaced[0]] = lambda: kube.objects.update({replaced[0]: namesake})
    operator = Operator(kube, OperatorConfig())  # type: ignore[arg-type]
    # unserved: a kind the cluster does not serve reads as absent (GET answers 404).
    refs = [ours[0], theirs[0], gone[0], replaced[0], unserved[0]]
    assert operator.prune(refs, "uid") == [str(ours[0]), str(gone[0])]
    assert kube.objects == {theirs[0]: theirs[1], replaced[0]: namesake}


ROUTER = Ref("apps/v1", "Deployment", "ns", "chat-router")


def test_router_replicas_follow_the_spec_in_every_mode() -> None:
    # Nothing autoscales the router: a hand-made scale (here to zero) is undone in every mode,
    # while the pools' replicas stay with their autoscaler outside mode Off.
    for mode in ("Builtin", "HPA", "KEDA"):
        kube = RecordingKube()
        apply_children(kube, children(mode), mode)  # type: ignore[arg-type]
        kube.objects[ROUTER]["spec"]["replicas"] = 0
        kube.objects[DECODE]["spec"]["replicas"] = 4
        apply_children(kube, children(mode), mode)  # type: ignore[arg-type]
        assert kube.objects[ROUTER]["spec"]["replicas"] == 1, mode
        assert kube.objects[DECODE]["spec"]["replicas"] == 4, mode


def test_an_object_it_does_not_control_stops_the_apply_before_any_change() -> None:
    kube = RecordingKube()
    objs = children("Off")
    config = next(o for o in objs if o["kind"] == "ConfigMap")
    ref = Ref.of(config)
    kube.objects[ref] = {"metadata": {"name": ref.name, "namespace": "ns"}, "data": {"k": "v"}}
    with pytest.raises(ChildConflict) as err:
        apply_children(kube, objs, "Off")  # type: ignore[arg-type]
    assert f"{ref} (it has no controller)" in str(err.value)
    assert kube.calls == []  # nothing applied, the user's object untouched
    # Controlled by an earlier LLMService of the same name (its garbage not collected yet).
    earlier = copy.deepcopy(config["metadata"]["ownerReferences"])
    earlier[0]["uid"] = "older-uid"
    kube.objects[ref]["metadata"]["ownerReferences"] = earlier
    with pytest.raises(ChildConflict, match="waiting for the garbage collector") as err:
        apply_children(kube, objs, "Off")  # type: ignore[arg-type]
    assert err.value.gc_pending
    # Its own child (same uid) is applied over as usual.
    kube.objects[ref]["metadata"]["ownerReferences"] = config["metadata"]["ownerReferences"]
    apply_children(kube, objs, "Off")  # type: ignore[arg-type]
    assert kube.calls


def test_a_lasting_warning_is_posted_once_per_repeat_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # kopf posts a new Event per call: a fault retried every 10 s (or met at every resync)
    # used to add ~70 Warnings in 5 minutes. The event sink is replaced by a recorder here.
    posted: list[tuple[str, str]] = []
    monkeypatch.setattr("kopf.warn", lambda body, reason, message: posted.append((reason, message)))
    operator = Operator(RecordingKube(), OperatorConfig())  # type: ignore[arg-type]
    body = kopf.Body({"metadata": {"namespace": "ns", "name": "chat", "uid": "u1"}})  # type: ignore[typeddict-item]
    other = kopf.Body({"metadata": {"namespace": "ns", "name": "other", "uid": "u2"}})  # type: ignore[typeddict-item]
    for _ in range(5):
        operator.warn(body, "ApplyFailed", "HTTP 422: bad toleration")
    operator.warn(other, "ApplyFailed", "HTTP 422: bad toleration")  # another LLMService
    operator.warn(body, "ApplyFailed", "HTTP 422: another fault")  # a new message
    assert posted == [("ApplyFailed", "HTTP 422: bad toleration")] * 2 + [
        ("ApplyFailed", "HTTP 422: another fault")
    ]
    # After the repeat period the same warning is posted again.
    key = ("u1", "ApplyFailed")
    message, at = operator._warned[key]
    operator._warned[key] = (message, at - WARNING_REPEAT_SECONDS)
    operator.warn(body, "ApplyFailed", "HTTP 422: another fault")
    assert len(posted) == 4
    # A namesake LLMService (another uid) is warned at once; so is a fault that comes back
    # after a clean apply (_settled).
    namesake = kopf.Body({"metadata": {"namespace": "ns", "name": "chat", "uid": "u3"}})  # type: ignore[typeddict-item]
    operator.warn(namesake, "ApplyFailed", "HTTP 422: another fault")
    assert len(posted) == 5
    operator._settled(body)
    operator.warn(body, "ApplyFailed", "HTTP 422: another fault")
    assert len(posted) == 6


def test_per_service_state_does_not_outlive_the_service() -> None:
    # An operator that has seen thousands of LLMServices come and go keeps nothing for them:
    # the per-service lock lives only while someone holds it, and deletion drops the rest.
    operator = Operator(RecordingKube(), OperatorConfig())  # type: ignore[arg-type]
    held = operator._serialized("ns", "chat")
    entered = threading.Event()

    def repair() -> None:  # a child's repair while a reconcile holds the service's lock
        with operator._serialized("ns", "chat"):
            entered.set()

    with held:
        assert operator._serialized("ns", "chat") is held  # one lock per service while in use
        t = threading.Thread(target=repair)
        t.start()
        assert not entered.wait(0.2)  # serialized behind the reconcile
    t.join(5)
    assert entered.is_set()
    assert operator._serialized("ns", "other") is not held
    for i in range(100):
        with operator._serialized("ns", f"svc-{i}"):
            pass
    del held
    gc.collect()
    assert len(operator._reconciling) == 0
    operator._faults[("ns", "chat")] = ("ApplyFailed", "HTTP 422")
    operator._faults[("ns", "other")] = ("ApplyFailed", "HTTP 422")
    operator._collect_failed["u1"] = 1.0
    operator.forget("ns", "chat", "u1")
    assert operator._faults == {("ns", "other"): ("ApplyFailed", "HTTP 422")}
    assert operator._collect_failed == {}


def test_its_own_orphans_are_adopted_and_strangers_are_not() -> None:
    # `kubectl delete llms chat --cascade=orphan` strips the owner references; re-created,
    # the LLMService takes its children back (their labels say whose they are).
    kube = RecordingKube()
    objs = children("Off")
    apply_children(kube, objs, "Off")  # type: ignore[arg-type]
    for live in kube.objects.values():
        live["metadata"].pop("ownerReferences")
    adopted = copy.deepcopy(objs)
    for obj in adopted:
        obj["metadata"]["ownerReferences"][0]["uid"] = "new-uid"
    apply_children(kube, adopted, "Off")  # type: ignore[arg-type]
    assert all(
        live["metadata"]["ownerReferences"][0]["uid"] == "new-uid" for live in kube.objects.values()
    )
    # The same name with another instance's labels (or none) is a stranger's.
    config = next(o for o in objs if o["kind"] == "ConfigMap")
    ref = Ref.of(config)
    kube.objects[ref]["metadata"]["ownerReferences"] = []
    kube.objects[ref]["metadata"]["labels"]["app.kubernetes.io/instance"] = "someone-else"
    with pytest.raises(ChildConflict, match="no controller"):
        apply_children(kube, adopted, "Off")  # type: ignore[arg-type]


def test_a_refused_child_is_named_in_the_error() -> None:
    # What status and the ApplyFailed Event say: which child, in the server's words, not the
    # request line ("PATCH /apis/apps/v1/namespaces/ns/deployments/chat-decode: HTTP 422: ...").
    # The refusal is injected: the CRD's rules now keep such specs from the API server.
    class RefusingKube(RecordingKube):
        def apply(self, obj: dict[str, Any], manager: str, force: bool = True) -> dict[str, Any]:
            if Ref.of(obj) == DECODE:
                raise KubeError(
                    422, "PATCH", DECODE.path(), 'Deployment.apps "chat-decode" is invalid'
                )
            return super().apply(obj, manager, force)

    with pytest.raises(KubeError) as err:
        apply_children(RefusingKube(), children("Off"), "Off")  # type: ignore[arg-type]
    assert str(err.value) == (
        'applying Deployment ns/chat-decode: Deployment.apps "chat-decode" is invalid (HTTP 422)'
    )
    assert err.value.status == 422


class VanishingKube(RecordingKube):
    """`doomed` is deleted right after apply_children reads it (someone's kubectl delete)."""

    doomed: Ref | None = None

    def get(self, ref: Ref) -> dict[str, Any] | None:
        live = super().get(ref)
        if ref == self.doomed:
            del self.objects[ref]  # deleted right after this read
        return live

    def apply(self, obj: dict[str, Any], manager: str, force: bool = True) -> dict[str, Any]:
        new = Ref.of(obj) not in self.objects
        result = super().apply(obj, manager, force)
        if new:  # the API server gives every new object its own uid
            self.objects[Ref.of(obj)]["metadata"]["uid"] = f"uid-{self.version}"
            result["metadata"]["uid"] = f"uid-{self.version}"
        return result


def test_a_deployment_deleted_after_the_read_comes_back_with_the_spec_replicas() -> None:
    # apply_children reads every child first; a Deployment deleted before its own apply is
    # made anew by that apply, with the API server's default of one replica. Outside mode Off
    # nothing would set them later (they belong to the autoscaler), so the apply does.
    kube = VanishingKube()
    apply_children(kube, children("Builtin"), "Builtin")  # type: ignore[arg-type]
    kube.doomed = DECODE
    outcome = apply_children(kube, children("Builtin"), "Builtin")  # type: ignore[arg-type]
    assert kube.objects[DECODE]["spec"]["replicas"] == 2
    assert str(DECODE) in outcome.created


def test_a_child_deleted_after_the_read_is_reported_as_created_not_updated() -> None:
    # A Service (or ConfigMap, PDB) deleted between apply_children's read and its apply is
    # made anew by the apply: the Events must say it was created, not "applied" as an update.
    router = Ref("v1", "Service", "ns", "chat-router")
    kube = VanishingKube()
    apply_children(kube, children("Off"), "Off")  # type: ignore[arg-type]
    kube.doomed = router
    outcome = apply_children(kube, children("Off"), "Off")  # type: ignore[arg-type]
    assert router in kube.objects
    assert str(router) in outcome.created and str(router) not in outcome.updated


def test_one_refused_child_does_not_hold_back_the_others() -> None:
    """A Service the API server refuses (say, a hand-renumbered port) used to stop the apply,
    leaving a hand-set Deployment image unrepaired for as long as the Service failed."""
    kube = RecordingKube()
    objs = children("Off")
    apply_children(kube, objs, "Off")  # type: ignore[arg-type]
    refused = next(o for o in objs if o["kind"] == "ConfigMap")
    real_apply = kube.apply

    def apply(obj: dict[str, Any], manager: str, force: bool = True) -> dict[str, Any]:
        if Ref.of(obj) == Ref.of(refused):
            raise KubeError(422, "PATCH", "/x", "ConfigMap is invalid")
        return real_apply(obj, manager, force)

    kube.apply = apply  # type: ignore[method-assign]
    kube.calls.clear()
    with pytest.raises(KubeError, match="applying ConfigMap"):
        apply_children(kube, objs, "Off")  # type: ignore[arg-type]
    assert any(Ref.of(o).kind == "Deployment" for o in objs)
    assert len(kube.calls) >= len(objs) - 1  # every other child was still applied


def test_a_child_it_may_not_read_does_not_hold_back_the_others() -> None:
    """A newer operator before its chart's RBAC (the PrometheusRule new to it, say): the
    403 on reading that one child stopped every other, so not even the new config ConfigMaps
    and Deployments were applied; now only that child is left out, and named."""
    spec = {
        "model": {"name": "m", "path": "/models/m"},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
    }
    objs = desired_children(
        "chat", "ns", "uid", parse_spec(spec), OperatorConfig(), True, rules_available=True
    )
    rule = Ref("monitoring.coreos.com/v1", "PrometheusRule", "ns", "chat-slo")
    assert rule in [Ref.of(o) for o in objs]

    class ForbiddingKube(RecordingKube):
        def get(self, ref: Ref) -> dict[str, Any] | None:
            if ref == rule:
                raise KubeError(403, "GET", ref.path(), 'prometheusrules "chat-slo" is forbidden')
            return super().get(ref)

    kube = ForbiddingKube()
    with pytest.raises(KubeError) as err:
        apply_children(kube, objs, "Off")  # type: ignore[arg-type]
    assert str(err.value) == (
        'reading PrometheusRule ns/chat-slo: prometheusrules "chat-slo" is forbidden (HTTP 403)'
    )
    assert err.value.status == 403
    assert rule not in kube.objects  # not applied: whose it is could not be told
    assert set(kube.objects) == {Ref.of(o) for o in objs} - {rule}


def test_a_busy_api_server_reading_a_child_changes_nothing() -> None:
    """A transient error reading a child (a 503, a 429) is no reason to go on: the new config
    ConfigMap unread (so not applied), the Deployments were rolled onto it all the same and
    their new pods could not mount it. Nothing changes; the retry reads everything again."""

    def objs(path: str) -> list[dict[str, Any]]:
        spec = {"model": {"name": "m", "path": path}, "prefill": {}, "decode": {}}
        return desired_children("chat", "ns", "uid", parse_spec(spec), OperatorConfig(), False)

    class BusyKube(RecordingKube):
        busy: set[Ref] = set()

        def get(self, ref: Ref) -> dict[str, Any] | None:
            if ref in self.busy:
                raise KubeError(503, "GET", ref.path(), "the server is currently unable")
            return super().get(ref)

    kube = BusyKube()
    apply_children(kube, objs("/models/a"), "Off")  # type: ignore[arg-type]
    before = copy.deepcopy(kube.objects)
    new = objs("/models/b")
    kube.busy = {Ref.of(o) for o in new if o["kind"] == "ConfigMap"} - set(kube.objects)
    assert kube.busy
    with pytest.raises(KubeError) as err:
        apply_children(kube, new, "Off")  # type: ignore[arg-type]
    assert err.value.status == 503 and str(err.value).startswith("reading ConfigMap ns/chat-")
    assert kube.objects == before


def test_a_deployment_is_not_rolled_onto_a_config_map_that_was_refused() -> None:
    """A new config ConfigMap the API server refuses (a quota on ConfigMaps, say): the
    Deployments that would mount it keep their config instead of rolling onto pods that cannot
    start; the other children are applied."""

    def objs(path: str) -> list[dict[str, Any]]:
        spec = {"model": {"name": "m", "path": path}, "prefill": {}, "decode": {}}
        return desired_children("chat", "ns", "uid", parse_spec(spec), OperatorConfig(), False)

    class QuotaKube(RecordingKube):
        refused: set[Ref] = set()

        def apply(self, obj: dict[str, Any], manager: str, force: bool = True) -> dict[str, Any]:
            if Ref.of(obj) in self.refused:
                raise KubeError(403, "PATCH", Ref.of(obj).path(), "exceeded quota: configmaps")
            return super().apply(obj, manager, force)

    kube = QuotaKube()
    apply_children(kube, objs("/models/a"), "Off")  # type: ignore[arg-type]
    before = copy.deepcopy(kube.objects)
    new = objs("/models/b")
    kube.refused = {Ref.of(o) for o in new if o["kind"] == "ConfigMap"} - set(kube.objects)
    with pytest.raises(KubeError) as err:
        apply_children(kube, new, "Off")  # type: ignore[arg-type]
    assert "exceeded quota" in str(err.value)
    for ref, obj in kube.objects.items():
        if ref.kind == "Deployment":
            assert obj == before[ref], ref  # still on the config it has
    assert not kube.refused & set(kube.objects)


class CachingKube(Kube):
    """The API server's list semantics for config collection: a list with resourceVersion=0
    answers from its kind's watch cache (`cached`, per plural, when it lags), one without
    from the live state; DELETE with a uid precondition."""

    def __init__(self, live: dict[str, list[dict[str, Any]]]) -> None:
        self.live = live
        self.cached: dict[str, list[dict[str, Any]]] = {}

    def request(self, method: str, path: str, *, query: Any = None, body: Any = None,
                **_: Any) -> Any:  # fmt: skip
        plural = path.rsplit("/", 2)[-1] if method == "GET" else path.rsplit("/", 2)[-2]
        if method == "GET":
            stale = ("resourceVersion", "0") in (query or [])
            items = self.cached.get(plural) if stale else None
            return {"items": copy.deepcopy(items if items is not None else self.live[plural])}
        assert method == "DELETE" and plural == "configmaps"
        name = path.rsplit("/", 1)[-1]
        (live,) = [m for m in self.live["configmaps"] if m["metadata"]["name"] == name]
        assert body["preconditions"]["uid"] == live["metadata"]["uid"]
        self.live["configmaps"].remove(live)
        return None


def test_a_config_version_is_never_collected_on_a_stale_read_of_its_users() -> None:
    def mounting(config: str, replicas: int | None = None) -> dict[str, Any]:
        pod_spec = {"volumes": [{"name": "config", "configMap": {"name": config}}]}
        if replicas is None:
            return {"spec": {"template": {"spec": pod_spec}}}
        return {"spec": {"replicas": replicas, "template": {"spec": pod_spec}}, "status": {}}

    def config(name: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "uid": f"u-{name}", "ownerReferences": [{"uid": "uid"}]}}

    # A reconcile made chat-config-b and pointed the pools' Deployments at it; the rollout has
    # begun. (chat-config-r: the router's, unchanged.)
    router = mounting("chat-config-r")
    kube = CachingKube(
        {
            "configmaps": [
                config("chat-config-a"),
                config("chat-config-b"),
                config("chat-config-r"),
            ],
            "deployments": [mounting("chat-config-b") for _ in range(2)] + [router],
            "replicasets": [mounting("chat-config-a", 1), mounting("chat-config-b", 1)],
            "pods": [{"spec": mounting("chat-config-a")["spec"]["template"]["spec"]}] * 3,
        }
    )
    # The configmaps cache has caught up; the deployments and replicasets caches are a moment
    # behind (each kind has its own): read from them, chat-config-b looks unused.
    kube.cached["deployments"] = [mounting("chat-config-a") for _ in range(2)] + [router]
    kube.cached["replicasets"] = [mounting("chat-config-a", 1)]
    operator = Operator(kube, OperatorConfig())
    assert operator.retire_configs("ns", "chat", "uid") == []
    assert [m["metadata"]["name"] for m in kube.live["configmaps"]] == [
        "chat-config-a",
        "chat-config-b",
        "chat-config-r",
    ]
    # Once the rollout is over, the old version goes.
    kube.cached.clear()
    kube.live["replicasets"][0]["spec"]["replicas"] = 0
    kube.live["pods"] = [{"spec": mounting("chat-config-b")["spec"]["template"]["spec"]}] * 3
    assert operator.retire_configs("ns", "chat", "uid") == ["ConfigMap ns/chat-config-a"]


def test_the_current_config_maps_alone_cost_one_list_call() -> None:
    # Config collection runs on every Deployment event. The router and the pools have a
    # ConfigMap each: two current versions are nothing to collect, and listing the
    # Deployments, ReplicaSets and every pod (consistent reads) to find that out each time was
    # what the one-list shortcut was there to avoid.
    objs = desired_children(
        "chat", "ns", "uid", parse_spec(
            {"model": {"name": "m", "path": "/m"}, "prefill": {}, "decode": {}}
        ), OperatorConfig(), False,
    )  # fmt: skip
    maps = [o for o in objs if o["kind"] == "ConfigMap"]
    assert len(maps) == 2
    kube = CachingKube({"configmaps": copy.deepcopy(maps)})
    lists: list[str] = []
    real = kube.request

    def request(method: str, path: str, **kw: Any) -> Any:
        lists.append(path.rsplit("/", 1)[-1])
        return real(method, path, **kw)

    kube.request = request  # type: ignore[method-assign]
    assert Operator(kube, OperatorConfig()).retire_configs("ns", "chat", "uid") == []
    assert lists == ["configmaps"]


def test_a_resync_that_meets_an_unapplied_spec_handles_it_as_a_change() -> None:
    def body(generation: int, observed: int | None) -> dict[str, Any]:
        status = {} if observed is None else {"observedGeneration": observed}
        return {"metadata": {"generation": generation}, "status": status}

    # The timer fired before the update handler (or the last change failed to apply).
    assert pending_change("resync", body(3, 2)) == "change"
    assert pending_change("resync", body(1, None)) == "change"  # never applied
    # Applied: what a resync finds changed is drift.
    assert pending_change("resync", body(3, 3)) == "resync"
    # Other callers keep their reason.
    assert pending_change("change", body(3, 3)) == "change"
    assert pending_change("child-deleted", body(3, 2)) == "child-deleted"


def test_a_config_collection_refused_by_rbac_is_logged_once_a_while() -> None:
    # An older ClusterRole without list/delete on configmaps: the operator keeps reconciling
    # and says it cannot collect, not at every resync and Deployment event.
    class Forbidden:
        def list_objects(self, *_: Any, **__: Any) -> list[dict[str, Any]]:
            raise KubeError(403, "GET", "/api/v1/namespaces/ns/configmaps", "forbidden")

    class Logger:
        def __init__(self) -> None:
            self.warnings: list[str] = []

        def warning(self, message: str) -> None:
            self.warnings.append(message)

    operator = Operator(Forbidden(), OperatorConfig())  # type: ignore[arg-type]
    log = Logger()
    for _ in range(5):
        operator.retire_configs_quietly("ns", "chat", "uid-1", log)  # type: ignore[arg-type]
    assert len(log.warnings) == 1 and "403" in log.warnings[0], log.warnings
    operator.retire_configs_quietly("ns", "other", "uid-2", log)  # type: ignore[arg-type]
    assert len(log.warnings) == 2
