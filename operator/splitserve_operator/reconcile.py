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
from dataclasses import dataclass, field
from typing import Any

from .config import FIELD_MANAGER, REPLICAS_FIELD_MANAGER
from .kube import Kube, KubeError, Ref


@dataclass
class Outcome:
    deployments: dict[str, dict[str, Any]] = field(default_factory=dict)  # component -> live
    created: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)


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


class ChildConflict(Exception):
    """Objects with the names of this LLMService's children exist and are not its own: the
    operator will not take them over (their owner reference would hand them to the garbage
    collector with the LLMService)."""

    def __init__(self, conflicts: list[str]) -> None:
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
    same_name = controller.get("kind") == "LLMService"
    held_by = f"{controller.get('kind')} {controller.get('name')}"
    # A namesake LLMService deleted a moment ago: the garbage collector is removing it.
    return f"it belongs to {held_by}" + (" (an earlier one of that name)" if same_name else "")


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


def apply_children(
    kube: Kube, objects: list[dict[str, Any]], mode: str, wake_from_zero: bool = False
) -> Outcome:
    """Raises ChildConflict, before changing anything, when an object of a child's name exists
    that this LLMService does not control."""
    lives = [kube.get(Ref.of(obj)) for obj in objects]
    conflicts = [
        f"{Ref.of(obj)} ({why})"
        for obj, live in zip(objects, lives, strict=True)
        if live is not None and (why := not_ours(live, obj))
    ]
    if conflicts:
        raise ChildConflict(conflicts)
    outcome = Outcome()
    for obj, live in zip(objects, lives, strict=True):
        ref = Ref.of(obj)
        try:
            if obj["kind"] == "Deployment":
                apply_deployment(kube, obj, mode, outcome, wake_from_zero, live)
                continue
            result = kube.apply(obj, FIELD_MANAGER)
        except KubeError as e:
            raise e.applying(str(ref)) from e
        if live is None:
            outcome.created.append(str(ref))
        elif changed(live, result):
            outcome.updated.append(str(ref))
    return outcome
