"""The kopf shell: thin handlers that parse the spec, build the desired children
(children.desired_children), apply them (reconcile.apply_children), and write status and Events.
create/update/resume and a resync timer all run the same level-based reconcile; a watch on the
children's Deployments refreshes status as soon as pods become ready, and a deleted Deployment or
Service is recreated as soon as the watch sees it go. In mode Builtin a daemon per LLMService runs
the autoscaler (scaling.py). register() wires them into a registry with the operator's
settings."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import logging
import threading
import time
import weakref
from typing import Any, cast

import kopf
from splitserve_workers.config import ConfigError

from . import GROUP, PLURAL, VERSION
from .children import HPA, desired_children, superseded_configs, unwanted_children
from .config import OperatorConfig
from .keda import SCALED_OBJECT, SCALED_OBJECTS_PLURAL, keda_hpa_name, keda_problem
from .kube import Kube, KubeError, Ref
from .names import APP, MANAGED_BY, child_name, selector_labels
from .reconcile import ChildConflict, apply_children
from .scaling import WAKE_SECONDS, Scaler, ScalerState
from .spec import POOLS, Spec, SpecError, parse_spec
from .status import compute_status, invalid_status, now_rfc3339, pod_trouble
from .workerconfig import CURRENT_CONFIG_MAPS

MONITORING_GROUP_VERSION = "monitoring.coreos.com/v1"
MONITORING_PLURALS = ("servicemonitors", "podmonitors")
RULES_PLURAL = "prometheusrules"  # served apart: a cluster may have the monitors without it
MONITORING_TTL_SECONDS = 60.0
# Threads for autoscaler evaluations (each a few Prometheus queries and API calls).
AUTOSCALER_THREADS = 4
# The same Warning (reason and message) for the same LLMService is posted again only after
# this long: a lasting fault retried every few seconds, or met again at every resync, would
# otherwise add an Event each time (kopf posts a new Event per call, never a count).
WARNING_REPEAT_SECONDS = 600.0
# Warnings about applying the children; a clean apply ends them.
APPLY_FAULTS = ("ApplyFailed", "ChildConflict", "InvalidSpec")

log = logging.getLogger("splitserve.operator")


class Operator:
    """What the handlers share: the API layer, the settings, a cached discovery answer."""

    def __init__(self, kube: Kube, config: OperatorConfig) -> None:
        self.kube = kube
        self.config = config
        self._served: dict[tuple[str, tuple[str, ...]], tuple[float, bool]] = {}
        self._lock = threading.Lock()
        # Per (namespace, name): held while reconciling or repairing. Weak values: a lock goes
        # once nobody holds it, so names created and deleted for months do not pile up (a
        # deleted LLMService's children, collected after it, still take its lock to repair).
        self._reconciling: weakref.WeakValueDictionary[tuple[str, str], Any] = (
            weakref.WeakValueDictionary()
        )
        # Per LLMService uid and reason: the last Warning posted and when.
        self._warned: dict[tuple[str, str], tuple[str, float]] = {}
        # Per (namespace, name): the apply fault of the last reconcile, (reason, message), so a
        # status write between reconciles (a child Deployment changed) keeps saying it.
        self._faults: dict[tuple[str, str], tuple[str, str]] = {}
        # Per LLMService uid: when a failed config collection was last logged.
        self._collect_failed: dict[str, float] = {}

    def warn(self, body: kopf.Body, reason: str, message: str) -> None:
        """A Warning Event, unless this LLMService (this uid) got the same one in the last
        WARNING_REPEAT_SECONDS (status carries the fault meanwhile)."""
        key = (str(body.meta.get("uid")), reason)
        now = time.monotonic()
        with self._lock:
            last = self._warned.get(key)
            if last is not None and last[0] == message and now - last[1] < WARNING_REPEAT_SECONDS:
                return
            # Entries of deleted LLMServices go once they could no longer hold anything back.
            stale = [k for k, (_, at) in self._warned.items() if now - at >= WARNING_REPEAT_SECONDS]
            for k in stale:
                del self._warned[k]
            self._warned[key] = (message, now)
        kopf.warn(body, reason=reason, message=message)

    def _settled(self, body: kopf.Body) -> None:
        """The LLMService's children applied cleanly: a fault that comes back later is new, and
        warned about again at once."""
        uid = str(body.meta.get("uid"))
        with self._lock:
            for key in [k for k in self._warned if k[0] == uid and k[1] in APPLY_FAULTS]:
                del self._warned[key]
            self._faults.pop((body.meta["namespace"], body.meta["name"]), None)

    def _serves(self, group_version: str, plurals: tuple[str, ...]) -> bool:
        """Whether the cluster serves these kinds (a discovery answer cached for a minute)."""
        with self._lock:
            cached = self._served.get((group_version, plurals))
            if cached and time.monotonic() - cached[0] < MONITORING_TTL_SECONDS:
                return cached[1]
        try:
            found = self.kube.serves(group_version, plurals)
        except Exception as e:  # noqa: BLE001 - an error status or a transport failure alike
            # Discovery failing (a 5xx, a timeout) says nothing: keep the last answer.
            log.warning("cannot tell whether %s is served: %s", group_version, e)
            return bool(cached and cached[1])
        with self._lock:
            self._served[(group_version, plurals)] = (time.monotonic(), found)
        return found

    def monitoring_available(self) -> bool:
        if self.config.monitoring == "off":
            return False
        return self._serves(MONITORING_GROUP_VERSION, MONITORING_PLURALS)

    def rules_available(self) -> bool:
        if self.config.monitoring == "off":
            return False
        return self._serves(MONITORING_GROUP_VERSION, (RULES_PLURAL,))

    def keda_available(self) -> bool:
        return self._serves(SCALED_OBJECT[0], (SCALED_OBJECTS_PLURAL,))

    def _serialized(self, namespace: str, name: str) -> Any:
        """One lock per LLMService: kopf serializes its own handlers per object, but a repair
        runs in the handler of a child, so it must not interleave with them. The caller's
        reference keeps it alive while in use."""
        with self._lock:
            lock = self._reconciling.get((namespace, name))
            if lock is None:
                lock = self._reconciling[(namespace, name)] = threading.RLock()
            return lock

    def forget(self, namespace: str, name: str, uid: str) -> None:
        """Drop what was kept about a deleted LLMService: its last apply fault and when its
        failed config collection was last logged (its Warnings age out by themselves)."""
        with self._lock:
            self._faults.pop((namespace, name), None)
            self._collect_failed.pop(uid, None)

    def reconcile(
        self,
        body: kopf.Body,
        logger: logging.Logger | kopf.Logger,
        why: str,
        wake_from_zero: bool = False,
    ) -> None:
        meta = body.meta
        with self._serialized(meta["namespace"], meta["name"]):
            self._reconcile(body, logger, why, wake_from_zero)

    def _reconcile(
        self,
        body: kopf.Body,
        logger: logging.Logger | kopf.Logger,
        why: str,
        wake_from_zero: bool = False,
    ) -> None:
        meta = body.meta
        name, namespace = meta["name"], meta["namespace"]
        generation = int(meta.get("generation") or 0)
        why = pending_change(why, body)
        try:
            spec = parse_spec(dict(body.spec))
            keda = spec.autoscaling_mode == "KEDA" and self.keda_available()
            monitoring = self.monitoring_available()
            objects = desired_children(
                name,
                namespace,
                meta["uid"],
                spec,
                self.config,
                monitoring,
                keda,
                rules_available=monitoring and spec.alerts_enabled and self.rules_available(),
            )
        except (SpecError, ConfigError) as e:
            # ConfigError: the worker config built from the spec fails its own validation (a
            # value the schema let through); without this it escaped as a bare exception that
            # kopf retried forever, leaving no status and no Event.
            self.write_status(namespace, name, invalid=str(e))
            self.warn(body, "InvalidSpec", str(e))
            raise kopf.PermanentError(str(e)) from e
        if why == "change":
            # What rules a child out is a spec change (or, after a restart, a resume): no need
            # to look on every resync. Before the apply: a mode change from HPA to KEDA must
            # drop the operator's HPA first (KEDA's admission webhook refuses a ScaledObject
            # for a Deployment another HPA scales).
            # A failed delete does not hold the apply back; the handler is retried after it.
            prune_error: KubeError | None = None
            for because, unwanted in unwanted_children(name, spec, self.config).items():
                refs = [Ref(av, kind, namespace, child) for av, kind, child in unwanted]
                try:
                    deleted = self.prune(refs, meta["uid"])
                except KubeError as e:
                    prune_error = prune_error or e
                    continue
                if deleted:
                    message = f"deleted {', '.join(deleted)}: {because}"
                    kopf.info(body, reason="Deleted", message=message)
        try:
            # The change into mode HPA restarts a pool left at zero (by Builtin or KEDA before
            # the change); any other time a zero is someone's choice (it pauses the HPA), kept
            # across resyncs, operator restarts and later edits alike.
            outcome = apply_children(
                self.kube, objects, spec.autoscaling_mode, wake_from_zero=wake_from_zero
            )
            if why == "change" and prune_error is not None:
                raise prune_error
        except ChildConflict as e:
            self._fault(namespace, name, "ChildConflict", str(e))
            if e.gc_pending:
                # Expected right after `kubectl delete` + `apply`: a few seconds, no Warning.
                raise kopf.TemporaryError(str(e), delay=5) from e
            self.warn(body, "ChildConflict", str(e))
            # Waits on someone freeing the name (which raises no event the operator watches).
            raise kopf.TemporaryError(str(e), delay=30) from e
        except KubeError as e:
            self._fault(namespace, name, "ReconcileFailed", str(e))
            self.warn(body, "ApplyFailed", str(e))
            # Short: kopf keeps a pending retry's delay even when the spec changes, so this is
            # also how long a user's fix waits.
            raise kopf.TemporaryError(str(e), delay=10) from e
        self._settled(body)
        # Missing at a resync or after a child's deletion, a child was deleted by someone
        # (ConfigMaps and PDBs are not watched: the resync finds them). Monitors, rules and
        # ScaledObjects are the exception: they appear at a resync when the Prometheus
        # operator or KEDA was installed later.
        repaired = [
            c
            for c in outcome.created
            if why != "change"
            and not c.startswith(
                ("ServiceMonitor ", "PodMonitor ", "PrometheusRule ", "ScaledObject ")
            )
        ]
        created = [c for c in outcome.created if c not in repaired]
        if repaired:
            kopf.info(body, reason="DriftRepaired", message="recreated " + ", ".join(repaired))
        if created:
            kopf.info(body, reason="Created", message="created " + ", ".join(created))
        if outcome.updated:
            # On a resync nothing in the spec changed: a change means someone edited a child.
            reason = "DriftRepaired" if why == "resync" else "Updated"
            kopf.info(body, reason=reason, message="applied " + ", ".join(outcome.updated))
        if outcome.foreign:
            self.warn(
                body,
                "ForeignChanges",
                "pod template fields set by someone else, which the operator does not remove: "
                + "; ".join(outcome.foreign)
                + ": remove them, or delete the Deployment to have it recreated",
            )
        if outcome.created or outcome.updated:
            logger.info(
                f"{why}: created {len(outcome.created)}, updated {len(outcome.updated)} children"
            )
        if spec.autoscaling_mode == "KEDA":
            problem = keda_problem(spec, self.config, keda)
            if problem:
                self.warn(body, *problem)
        self.write_status(namespace, name, applied_generation=generation)
        self.retire_configs_quietly(namespace, name, meta["uid"], logger)

    def repair(
        self, namespace: str, service: str, uid: str, logger: logging.Logger | kopf.Logger
    ) -> None:
        """A child of LLMService `service` (uid `uid`) was deleted: reconcile that LLMService
        now instead of at the next resync (the resync stays the backstop). It is read under its
        lock, so a user's update applied meanwhile is what gets applied, never an older spec.
        Nothing to do when it is going away or is gone (the garbage collector deletes its
        children) or was replaced by a namesake (its own create handler builds its children)."""
        ref = Ref(f"{GROUP}/{VERSION}", "LLMService", namespace, service)
        with self._serialized(namespace, service):
            try:
                body = self.kube.get(ref)
                if body is None:
                    return
                meta = body["metadata"]
                if meta.get("deletionTimestamp") or meta.get("uid") != uid:
                    return
                self._reconcile(kopf.Body(cast(kopf.RawBody, body)), logger, why="child-deleted")
            except (kopf.PermanentError, kopf.TemporaryError, KubeError) as e:
                # Said in status and Events where it could be; the resync retries either way
                # (an event handler's error is never retried by kopf).
                logger.warning(f"repairing {namespace}/{service}: {e}")

    def pool_trouble(
        self, namespace: str, service: str, deployments: dict[str, dict[str, Any] | None]
    ) -> dict[str, str]:
        """Per pool whose Deployment has not settled (fewer ready or updated replicas than it
        asks for, or old pods left: a rollout under way), why its pods are not running
        (unschedulable, image pull, crash loop), read from the pods themselves, so the Ready
        message says it long before the Deployment's progress deadline does. A rollout whose
        new pods cannot start while the old ones still serve is the common case: a resources or
        image edit. Settled pools cost no API call."""
        trouble: dict[str, str] = {}
        for pool, dep in deployments.items():
            if dep is None:
                continue
            want = int((dep.get("spec") or {}).get("replicas") or 0)
            st = dep.get("status") or {}
            if (
                int(st.get("readyReplicas") or 0) >= want
                and int(st.get("updatedReplicas") or 0) >= want
                and int(st.get("replicas") or 0) <= want
            ):
                continue
            try:
                pods = self.kube.list_objects(
                    "v1", "pods", namespace, selector_labels(service, pool)
                )
            except KubeError as e:
                # An older install's RBAC without `list pods`: status simply says less.
                log.debug("cannot list %s pods of %s/%s: %s", pool, namespace, service, e)
                continue
            why = pod_trouble(pods)
            if why:
                trouble[pool] = why
        return trouble

    def hpas(self, namespace: str, service: str) -> dict[str, dict[str, Any] | None]:
        return {
            pool: self.kube.get(Ref(*HPA, namespace, child_name(service, pool)))
            for pool in ("prefill", "decode")
        }

    def scalers(self, namespace: str, service: str, spec: Spec) -> dict[str, Any]:
        """compute_status's arguments for whoever sizes the pools outside mode Builtin: the
        operator's HPAs (HPA); the ScaledObjects, the HPAs KEDA made for them and why there
        are none (KEDA)."""
        if spec.autoscaling_mode == "HPA":
            return {"hpas": self.hpas(namespace, service)}
        if spec.autoscaling_mode != "KEDA":
            return {}
        problem = keda_problem(spec, self.config, self.keda_available())
        if problem:
            return {"keda_problem": problem}
        scaled = {
            pool: self.kube.get(Ref(*SCALED_OBJECT, namespace, child_name(service, pool)))
            for pool in ("prefill", "decode")
        }
        hpas = {
            pool: self.kube.get(Ref(*HPA, namespace, keda_hpa_name(obj))) if obj else None
            for pool, obj in scaled.items()
        }
        return {"scaled_objects": scaled, "hpas": hpas}

    def prune(self, refs: list[Ref], uid: str) -> list[str]:
        """Delete those of `refs` that the LLMService with this uid owns (never a namesake
        someone else made); returns what went. A kind the cluster does not serve (the
        Prometheus operator's CRDs removed, say) reads as absent."""
        deleted = []
        for ref in refs:
            try:
                live = self.kube.get(ref)
            except KubeError as e:
                if e.status != 403:
                    raise
                # An older ClusterRole without this kind: nothing of it can have been made.
                log.warning("cannot read %s to prune it: %s", ref, e)
                continue
            meta = (live or {}).get("metadata") or {}
            if not any(o.get("uid") == uid for o in meta.get("ownerReferences") or []):
                continue
            if self._delete_unless_replaced(ref, str(meta.get("uid"))):
                deleted.append(str(ref))
        return deleted

    def _delete_unless_replaced(self, ref: Ref, uid: str) -> bool:
        """DELETE the object read with this uid; whether it is gone (False: it was replaced
        since the read, and the precondition keeps the namesake)."""
        try:
            self.kube.request("DELETE", ref.path(), body={"preconditions": {"uid": uid}})
        except KubeError as e:
            if e.status == 409:
                return False
            if e.status != 404:
                raise
        return True

    def retire_configs(self, namespace: str, service: str, uid: str) -> list[str]:
        """Delete this LLMService's config ConfigMaps that no Deployment, live ReplicaSet or pod
        mounts any more (children.superseded_configs); returns what went. Under the LLMService's
        lock, so never between a reconcile's creating a new one and its Deployments' naming it.
        One list call when there are only the current ones (the router's and the pools'): it
        runs on every Deployment event."""
        with self._serialized(namespace, service):
            maps = self.kube.list_objects("v1", "configmaps", namespace,
                                          selector_labels(service, "config"))  # fmt: skip
            if len(maps) <= CURRENT_CONFIG_MAPS:
                return []
            instance = {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": service}
            # Consistent reads: the configmaps list above may already show the version a
            # reconcile just made while the deployments cache does not yet show the
            # Deployments it just pointed at it, which would make it look unused.
            users = {
                plural: self.kube.list_objects(group, plural, namespace, instance, consistent=True)
                for group, plural in (
                    ("apps/v1", "deployments"),
                    ("apps/v1", "replicasets"),
                    ("v1", "pods"),
                )
            }
            stale = superseded_configs(
                maps, uid, users["deployments"], users["replicasets"], users["pods"]
            )
            uids = {m["metadata"]["name"]: str(m["metadata"]["uid"]) for m in maps}
            refs = [Ref("v1", "ConfigMap", namespace, name) for name in stale]
            return [str(r) for r in refs if self._delete_unless_replaced(r, uids[r.name])]

    def retire_configs_quietly(
        self, namespace: str, service: str, uid: str, logger: logging.Logger | kopf.Logger
    ) -> None:
        """retire_configs with an Event on the LLMService; a failure (an older ClusterRole
        without list/delete on configmaps, an API error) only costs a log line: the ConfigMaps
        wait for the next try."""
        try:
            deleted = self.retire_configs(namespace, service, uid)
        except KubeError as e:
            # It is tried again at every resync and Deployment event: say it once a while.
            now = time.monotonic()
            with self._lock:
                last = self._collect_failed.get(uid)
                if last is None or now - last >= WARNING_REPEAT_SECONDS:
                    self._collect_failed[uid] = now
                else:
                    return
            logger.warning(f"cannot collect superseded config ConfigMaps: {e}")
            return
        if deleted:
            body = {
                "apiVersion": f"{GROUP}/{VERSION}",
                "kind": "LLMService",
                "metadata": {"name": service, "namespace": namespace, "uid": uid},
            }
            kopf.info(
                kopf.Body(cast(kopf.RawBody, body)),
                reason="Deleted",
                message=f"deleted {', '.join(deleted)}: a superseded config no pod uses",
            )

    def _fault(self, namespace: str, service: str, reason: str, message: str) -> None:
        with self._lock:
            self._faults[(namespace, service)] = (reason, message)
        self.write_status(namespace, service)

    def write_status(
        self,
        namespace: str,
        service: str,
        applied_generation: int | None = None,
        invalid: str | None = None,
    ) -> None:
        """Recompute status from freshly read Deployments and write it, conditional on the
        LLMService's resourceVersion: writers (reconcile, the Deployment watch) race, and a
        conflict means someone wrote in between, so read again rather than overwrite newer
        state with older. applied_generation: the generation whose children were just applied
        (None keeps status.observedGeneration)."""
        ref = Ref(f"{GROUP}/{VERSION}", "LLMService", namespace, service)
        with self._lock:
            error_reason, error = self._faults.get((namespace, service), ("", None))
        for _ in range(5):
            body = self.kube.get(ref)
            if body is None or body["metadata"].get("deletionTimestamp"):
                return
            meta, status = body["metadata"], body.get("status") or {}
            generation = int(meta.get("generation") or 0)
            previous = status.get("conditions")
            if invalid is not None:
                fresh = invalid_status(invalid, generation, previous, now_rfc3339())
            else:
                try:
                    spec: Spec = parse_spec(body.get("spec"))
                except SpecError:
                    return  # the reconcile handler reports invalid specs
                observed = int(status.get("observedGeneration") or 0)
                if applied_generation is not None and error is None:
                    observed = max(observed, applied_generation)
                deployments = {
                    pool: self.kube.get(
                        Ref("apps/v1", "Deployment", namespace, child_name(service, pool))
                    )
                    for pool in POOLS
                }
                fresh = compute_status(
                    service=service,
                    namespace=namespace,
                    spec=spec,
                    generation=generation,
                    observed_generation=observed,
                    deployments=deployments,
                    previous_conditions=previous,
                    now=now_rfc3339(),
                    error=error,
                    error_reason=error_reason or "ReconcileFailed",
                    trouble=self.pool_trouble(namespace, service, deployments),
                    autoscaler=status.get("autoscaler"),
                    **self.scalers(namespace, service, spec),
                )
            if all(status.get(k) == v for k, v in fresh.items()):
                return
            try:
                self.kube.patch_status(ref, fresh, resource_version=meta["resourceVersion"])
                return
            except KubeError as e:
                if e.status != 409:
                    raise


def pending_change(why: str, body: kopf.Body | dict[str, Any]) -> str:
    """A resync that meets a spec newer than status.observedGeneration (its timer fired before
    kopf's update handler, or the change has not applied yet) handles that change as a change:
    it prunes what the new spec rules out, and its Events say Created/Updated, not
    DriftRepaired (a new config version read as a recreated ConfigMap)."""
    if why != "resync":
        return why
    generation = int((body.get("metadata") or {}).get("generation") or 0)
    observed = int((body.get("status") or {}).get("observedGeneration") or 0)
    return "change" if generation > observed else why


def owner_service(body: kopf.Body) -> tuple[str, str] | None:
    """(name, uid) of the LLMService that owns this child, if any."""
    for ref in body.meta.get("ownerReferences") or []:
        if ref.get("kind") == "LLMService" and ref.get("apiVersion", "").startswith(GROUP + "/"):
            return str(ref.get("name")), str(ref.get("uid"))
    return None


def keda_hpa_service(body: kopf.Body) -> str | None:
    """The LLMService an HPA that KEDA made for one of its ScaledObjects serves: KEDA copies
    the ScaledObject's labels, ours included, onto it."""
    refs = body.meta.get("ownerReferences") or []
    if not any(
        r.get("kind") == "ScaledObject" and str(r.get("apiVersion", "")).startswith("keda.sh/")
        for r in refs
    ):
        return None
    service = (body.meta.get("labels") or {}).get("app.kubernetes.io/instance")
    return str(service) if service else None


def register(registry: kopf.OperatorRegistry, operator: Operator) -> None:
    """Attach every handler to `registry`; the resync interval comes from the settings."""

    def on_change(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        operator.reconcile(body, logger, why="change")

    def on_update(body: kopf.Body, old: Any, logger: kopf.Logger, **_: Any) -> None:
        # Only the edit that enters mode HPA wakes a pool at zero: a resume (operator
        # restart), a label or any other edit in mode HPA leaves a `kubectl scale --replicas=0`
        # pause alone. (A mode change made while the operator was down reaches it as an
        # update, with the last handled spec as `old`.)
        before = ((old or {}).get("spec") or {}).get("autoscaling") or {}
        entered = before.get("mode", "Off") != "HPA"
        operator.reconcile(body, logger, why="change", wake_from_zero=entered)

    def on_resync(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        operator.reconcile(body, logger, why="resync")

    def on_delete(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        # Children carry owner references: the garbage collector deletes them.
        operator.forget(body.meta["namespace"], body.meta["name"], str(body.meta.get("uid")))
        logger.info("deleted; children are garbage-collected through their owner references")

    scaler = Scaler(
        operator.kube,
        operator.config,
        refresh_status=lambda namespace, name: operator.write_status(namespace, name),
        emit=lambda body, kind, reason, message: kopf.event(
            kopf.Body(cast(kopf.RawBody, body)), type=kind, reason=reason, message=message
        ),
    )

    # Evaluations run here, not in kopf's handler threads: a slow Prometheus delays only the
    # autoscaler, and many autoscaled LLMServices never starve reconciles.
    evaluations = concurrent.futures.ThreadPoolExecutor(
        max_workers=AUTOSCALER_THREADS, thread_name_prefix="autoscaler"
    )

    async def autoscale(stopped: kopf.DaemonStopped, name: str, namespace: str | None,
                        logger: kopf.Logger, **_: Any) -> None:  # fmt: skip
        # Async, so a waiting daemon holds no thread; each evaluation borrows one, with kopf's
        # context (kopf.event needs it).
        if not namespace:
            return
        state = ScalerState()
        loop = asyncio.get_running_loop()
        while not stopped:
            evaluate = functools.partial(scaler.evaluate, namespace, name, state, logger)
            future = loop.run_in_executor(evaluations, contextvars.copy_context().run, evaluate)
            try:
                wait = await asyncio.shield(future)
            except asyncio.CancelledError:
                # kopf is stopping the daemon (deletion, mode change, exit): let an evaluation
                # that may be scaling finish before the finalizer goes.
                await asyncio.wait([future])
                raise
            except Exception as e:  # noqa: BLE001 - one failed evaluation must not end the daemon
                logger.exception(f"autoscaler evaluation failed: {e}")
                wait = 15.0
            # At most WAKE_SECONDS: evaluate re-reads the spec, so a shortened interval counts
            # from the last evaluation instead of waiting out the old one.
            await stopped.wait(min(wait, WAKE_SECONDS))

    def builtin(spec: kopf.Spec, **_: Any) -> bool:
        return bool((spec.get("autoscaling") or {}).get("mode") == "Builtin")

    def on_child(
        body: kopf.Body, namespace: str | None, type: str | None, logger: kopf.Logger, **_: Any
    ) -> None:
        owner = owner_service(body)
        if owner is None and namespace and type != "DELETED":
            # The HPA KEDA made for a ScaledObject (mode KEDA): its verdicts reach status too.
            if service := keda_hpa_service(body):
                operator.write_status(namespace, service)
            return
        if not (owner and namespace):
            return
        service, uid = owner
        if type == "DELETED":
            operator.repair(namespace, service, uid, logger)
        elif body.get("kind") in ("Deployment", "HorizontalPodAutoscaler"):
            # Pods became (un)ready, or the HPA controller changed its mind.
            operator.write_status(namespace, service)
            if body.get("kind") == "Deployment":
                # A rollout that moved on may have left a config version no pod uses.
                operator.retire_configs_quietly(namespace, service, uid, logger)

    # kopf adds default login handlers only to its global registry; this one is our own.
    kopf.on.login(registry=registry)(kopf.login_via_client)
    resource = (GROUP, VERSION, PLURAL)
    kopf.on.create(*resource, registry=registry, id="reconcile-create")(on_change)
    kopf.on.update(*resource, registry=registry, id="reconcile-update")(on_update)
    kopf.on.resume(*resource, registry=registry, id="reconcile-resume")(on_change)
    # optional: this handler adds no finalizer of its own (the resync timer has kopf's one).
    kopf.on.delete(*resource, registry=registry, id="cleanup", optional=True)(on_delete)
    kopf.timer(
        *resource,
        registry=registry,
        id="resync",
        interval=operator.config.resync_seconds,
        initial_delay=operator.config.resync_seconds,
    )(on_resync)
    # Started when an LLMService is (or becomes) mode Builtin, stopped when it leaves it or goes.
    kopf.daemon(*resource, registry=registry, id="autoscaler", when=builtin,
                cancellation_timeout=10.0)(autoscale)  # fmt: skip
    # The children whose loss stops serving: a deleted Deployment or Service comes back at
    # once; the rest (ConfigMap, PodDisruptionBudget, monitors) at the next resync.
    managed = {"app.kubernetes.io/managed-by": MANAGED_BY}
    kopf.on.event("apps", "v1", "deployments", registry=registry, id="child-deployment",
                  labels=managed)(on_child)  # fmt: skip
    kopf.on.event("v1", "services", registry=registry, id="child-service",
                  labels=managed)(on_child)  # fmt: skip
    # Mode HPA: a deleted HPA comes back, and the HPA controller's verdicts reach status.
    kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", registry=registry,
                  id="child-hpa", labels=managed)(on_child)  # fmt: skip
