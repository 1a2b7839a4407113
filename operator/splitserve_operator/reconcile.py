"""Brings the cluster to the desired children of one LLMService by server-side apply, and says
what it changed. Level-based: it runs the same way on create, update, resume and every resync,
so a deleted child is recreated and a hand-edited field is taken back.

An object that has a child's name but is not this LLMService's (made by hand, by another
controller) is never taken over: the apply stops before changing anything (ChildConflict).

Replicas: the main field manager never keeps spec.replicas of a Deployment. A second manager
(REPLICAS_FIELD_MANAGER) sets it: always in mode Off and for the router (nothing autoscales
it), only at creation for the pools in Builtin, HPA and KEDA,
so the autoscaler's (or an HPA's) value is never overwritten and dropping the field from the
main apply never resets it. One exception: on a spec change in mode HPA (`wake_from_zero`), a
pool at zero (scaled there by Builtin or KEDA before the mode changed) restarts at
spec.<pool>.replicas, since an HPA does not scale a Deployment up from zero; on a resync a zero
stands (scaling an HPA's target to zero is how one pauses it)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from .children import mounted_config_maps
from .config import FIELD_MANAGER, REPLICAS_FIELD_MANAGER
from .kube import Kube, KubeError, Ref


@dataclass
class Outcome:
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)  # component -> live
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    # "Deployment ns/x: kubectl-set: spec.template.spec.containers[decode].env[EVIL]": pod
    # template fields another field manager added, which a forced apply does not remove.
    foreign: list[str] = field(default_factory=list)


# Managers whose pod-template fields are expected: `kubectl rollout restart`'s annotation.
_BENIGN_TEMPLATE_FIELDS = {("f:metadata", "f:annotations", "f:kubectl.kubernetes.io/restartedAt")}


def _leaves(tree: dict[str, Any], path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The owned leaves of a managedFields fieldsV1 tree (`.` marks the element itself)."""
    out: list[tuple[str, ...]] = []
    for key, sub in tree.items():
        if key == ".":
            continue
        # A keyed list element another manager added (an env var, a container) is one field,
        # unless this manager only set some fields inside an element it did not add.
        added = key.startswith("k:") and isinstance(sub, dict) and "." in sub
        if not added and isinstance(sub, dict) and any(k != "." for k in sub):
            out.extend(_leaves(sub, (*path, key)))
        else:
            out.append((*path, key))
    return out


def _readable(path: tuple[str, ...]) -> str:
    parts: list[str] = []
    for key in path:
        if key.startswith("f:"):
            parts.append(key[2:])
        elif key.startswith("k:"):  # k:{"name":"decode"} -> [decode]
            parts[-1] += "[" + ",".join(str(v) for v in json.loads(key[2:]).values()) + "]"
        else:
            parts[-1] += f"[{key}]"
    return ".".join(parts)


def foreign_template_fields(result: dict[str, Any]) -> list[str]:
    """Pod-template fields of a Deployment owned by a manager other than the operator's:
    a server-side apply takes back fields the operator sets, but keeps what others added (an
    env var from `kubectl set env`, a sidecar container, a serviceAccountName), so the pods
    run with them while the operator reports nothing."""
    found: list[str] = []
    for entry in result["metadata"].get("managedFields") or []:
        manager = entry.get("manager", "")
        if manager in (FIELD_MANAGER, REPLICAS_FIELD_MANAGER) or entry.get("subresource"):
            continue
        template = ((entry.get("fieldsV1") or {}).get("f:spec") or {}).get("f:template") or {}
        leaves = [p for p in _leaves(template) if p not in _BENIGN_TEMPLATE_FIELDS]
        if leaves:
            shown = ", ".join(_readable(("f:spec", "f:template", *p)) for p in leaves[:5])
            more = f" and {len(leaves) - 5} more" if len(leaves) > 5 else ""
            found.append(f"{manager}: {shown}{more}")
    return found


def replicas_patch(obj: dict[str, Any], replicas: int) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
        "spec": {"replicas": replicas},
    }


def without_replicas(obj: dict[str, Any]) -> dict[str, Any]:
    body = copy.deepcopy(obj)
    body["spec"].pop("replicas", None)
    return body


def changed(live: dict[str, Any], result: dict[str, Any]) -> bool:
    """Did an apply change `live`? Not by resourceVersion: a controller's status write between
    our GET and our apply (a Deployment mid-rollout, a PDB counting pods) bumps it too, and
    would be reported as drift. Compare what a writer of the object's desired state can
    change: everything but status and the server's bookkeeping."""

    def content(obj: dict[str, Any]) -> dict[str, Any]:
        meta = {
            k: v
            for k, v in obj.get("metadata", {}).items()
            if k not in ("resourceVersion", "managedFields")
        }
        return {**{k: v for k, v in obj.items() if k != "status"}, "metadata": meta}

    return content(live) != content(result)


_EARLIER_WHY = "it belongs to the deleted LLMService of this name"
_EARLIER = f" ({_EARLIER_WHY})"


class ChildConflict(Exception):
    """Objects with the names of this LLMService's children exist and are not its own: the
    operator will not take them over (their owner reference would hand them to the garbage
    collector with the LLMService)."""

    def __init__(self, conflicts: list[str]) -> None:
        # Every one the child of a namesake deleted a moment ago (`kubectl delete` then
        # `apply`): nothing to do but wait for the garbage collector, so say that, and look
        # again soon rather than in 30 s.
        self.gc_pending = all(c.endswith(_EARLIER) for c in conflicts)
        if self.gc_pending:
            super().__init__(
                f"waiting for the garbage collector to delete {len(conflicts)} children of the"
                " deleted LLMService of this name (first: "
                + conflicts[0].removesuffix(_EARLIER)
                + ")"
            )
            return
        super().__init__(
            "refusing to take over "
            + "; ".join(conflicts)
            + ": rename the LLMService, or delete or rename those objects"
        )


# An object without a controller is adopted when these labels match the child's: the
# operator's own orphan (same instance, same component), never a stranger's object.
_ADOPTION_LABELS = (
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/component",
)


def _owner_uid(obj: dict[str, Any]) -> str:
    (owner,) = obj["metadata"]["ownerReferences"]
    return str(owner["uid"])


def not_ours(live: dict[str, Any], desired: dict[str, Any]) -> str | None:
    """Why `live` is not a child of the LLMService `desired` belongs to; None when it is, or
    when it is an orphan of that LLMService's name (its labels say the operator made it for
    that instance: `kubectl delete --cascade=orphan` and a re-create), which is adopted."""
    meta = live.get("metadata", {})
    refs = meta.get("ownerReferences") or []
    controller = next((r for r in refs if r.get("controller")), None)
    if controller is not None and controller.get("uid") == _owner_uid(desired):
        return None
    if controller is None:
        labels = meta.get("labels") or {}
        wanted = desired["metadata"]["labels"]
        if all(wanted.get(k) and labels.get(k) == wanted[k] for k in _ADOPTION_LABELS):
            return None
        return "it has no controller"
    if controller.get("kind") == "LLMService" and controller.get("name") == desired["metadata"][
        "labels"
    ].get("app.kubernetes.io/instance"):
        # A namesake LLMService deleted a moment ago: the garbage collector is removing it.
        return _EARLIER_WHY
    return f"it belongs to {controller.get('kind')} {controller.get('name')}"


def apply_deployment(
    kube: Kube,
    obj: dict[str, Any],
    mode: str,
    outcome: Outcome,
    wake_from_zero: bool = False,
    live: dict[str, Any] | None = None,
) -> None:
    """`live`: the Deployment as read just before (None: it does not exist yet)."""
    ref = Ref.of(obj)
    desired = int(obj["spec"]["replicas"])
    component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
    # Nothing sizes the router, whatever the mode: its replicas are always the spec's.
    sized_by_spec = mode == "Off" or component == "router"
    if live is None:
        # Created with its replicas, then the replicas manager takes the field and the main
        # manager lets go of it, so later main applies are no-ops (no managedFields churn).
        kube.apply(obj, FIELD_MANAGER)
        kube.apply(replicas_patch(obj, desired), REPLICAS_FIELD_MANAGER)
        result = kube.apply(without_replicas(obj), FIELD_MANAGER)
        outcome.created.append(str(ref))
    else:
        result = kube.apply(without_replicas(obj), FIELD_MANAGER)
        # Deleted after it was read: the apply made a new one, with the API server's default
        # of one replica. It gets the spec's, as a creation does.
        recreated = result["metadata"].get("uid") != live["metadata"].get("uid")
        live_replicas = int(result["spec"].get("replicas", -1))
        if (
            (sized_by_spec and live_replicas != desired)
            or (mode == "HPA" and wake_from_zero and live_replicas == 0 and desired > 0)
            or (recreated and live_replicas != desired)
        ):
            result = kube.apply(replicas_patch(obj, desired), REPLICAS_FIELD_MANAGER)
        if recreated:
            outcome.created.append(str(ref))
        elif changed(live, result):
            outcome.updated.append(str(ref))
    outcome.deployments[component] = result
    outcome.foreign.extend(f"{ref} ({why})" for why in foreign_template_fields(result))


def apply_children(
    kube: Kube, objects: list[dict[str, Any]], mode: str, wake_from_zero: bool = False
) -> Outcome:
    """Raises ChildConflict, before changing anything, when an object of a child's name exists
    that this LLMService does not control."""
    # One child the API server refuses must not hold back the others: a Service it cannot
    # repair used to leave a hand-set Deployment image (and every later child) unrepaired.
    # That holds for reading too: a kind the operator's Role does not cover yet (a newer
    # operator before its chart's RBAC, e.g. the PrometheusRule) stopped every child, the new
    # config and Deployments included. A child it may not read (403) is not applied (whose it
    # is cannot be told), and is reported with the other failures. Any other read error (a
    # 5xx, a 429: the API server busy) stops the apply before it changes anything, as a
    # transport error does: the retry reads every child again.
    failures: list[KubeError] = []
    lives: list[dict[str, Any] | None] = []
    readable: list[dict[str, Any]] = []
    # Config ConfigMaps that may not exist (not readable, or new and refused): a Deployment
    # mounting one is not rolled onto it (its new pods could not start, e.g. under a quota on
    # ConfigMaps); it keeps the config it has until the retry.
    missing_configs: set[str] = set()
    for obj in objects:
        ref = Ref.of(obj)
        try:
            lives.append(kube.get(ref))
            readable.append(obj)
        except KubeError as e:
            if e.status != 403:
                raise e.applying(str(ref), doing="reading") from e
            failures.append(e.applying(str(ref), doing="reading"))
            if obj["kind"] == "ConfigMap":
                missing_configs.add(ref.name)
    conflicts = [
        f"{Ref.of(obj)} ({why})"
        for obj, live in zip(readable, lives, strict=True)
        if live is not None and (why := not_ours(live, obj))
    ]
    if conflicts:
        raise ChildConflict(conflicts)
    outcome = Outcome()
    for obj, live in zip(readable, lives, strict=True):
        ref = Ref.of(obj)
        try:
            if obj["kind"] == "Deployment":
                if mounted_config_maps(obj["spec"]["template"]["spec"]) & missing_configs:
                    continue  # the ConfigMap's failure is reported; it is tried again first
                apply_deployment(kube, obj, mode, outcome, wake_from_zero, live)
                continue
            try:
                result = kube.apply(obj, FIELD_MANAGER)
            except KubeError as e:
                if not (e.status == 422 and live is not None and obj["kind"] == "Service"):
                    raise
                # A hand edit that renumbered a port leaves that entry owned by another field
                # manager, which a forced apply keeps: the merged list then holds two ports
                # named `http` (422, at every retry). Replace the list, then apply again.
                kube.request(
                    "PATCH",
                    ref.path(),
                    query=[("fieldManager", FIELD_MANAGER)],
                    body={"spec": {"ports": obj["spec"]["ports"]}},
                    content_type="application/merge-patch+json",
                )
                result = kube.apply(obj, FIELD_MANAGER)
        except KubeError as e:
            failures.append(e.applying(str(ref)))
            if obj["kind"] == "ConfigMap" and live is None:
                missing_configs.add(ref.name)
            continue
        # Deleted after it was read (a user's `kubectl delete` racing the reconcile): the apply
        # made a new one, which the Events must call a creation, not an update.
        if live is None or result["metadata"].get("uid") != live["metadata"].get("uid"):
            outcome.created.append(str(ref))
        elif changed(live, result):
            outcome.updated.append(str(ref))
    if failures:
        first = failures[0]
        if len(failures) > 1:
            first.args = ("; ".join(str(f) for f in failures),)
        raise first
    return outcome
