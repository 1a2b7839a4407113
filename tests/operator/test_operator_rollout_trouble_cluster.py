"""A rollout whose new pods cannot start while the old ones still serve (a resources edit
beyond what any node has, a bad image): the Ready message quotes the new pods' cause, as it
does for a pool's first pods, instead of an unexplained "1/1 ready, 1/1 updated"."""

from __future__ import annotations

from typing import Any

import pytest
from operator_process import OperatorProcess, conditions, wait_until
from test_operator_cluster import apply, llms, tiny, wait_ready

pytestmark = pytest.mark.cluster


def test_ready_message_says_why_a_rollout_is_stuck(
    control_plane: Any, operator: OperatorProcess, namespace: str
) -> None:
    cp = control_plane
    obj = tiny()
    apply(cp, namespace, obj)
    wait_ready(cp, namespace, "tiny")
    # kwok nodes have 32 CPUs: the new prefill pod stays Pending; the old one keeps serving.
    obj["spec"]["prefill"]["resources"] = {"requests": {"cpu": "100"}}
    apply(cp, namespace, obj)

    def stuck_message() -> str | None:
        ready = conditions(llms(cp, namespace, "tiny") or {}).get("Ready") or {}
        message = str(ready.get("message", ""))
        return message if "Insufficient cpu" in message else None

    message = wait_until(stuck_message, "Ready message naming the CPU shortage", 60)
    assert "prefill 1/1 ready" in message and "1 pod unschedulable:" in message
    assert "decode" not in message and "router" not in message
    obj["spec"]["prefill"]["resources"] = {"requests": {"cpu": "500m"}}
    apply(cp, namespace, obj)
    assert "Insufficient" not in conditions(wait_ready(cp, namespace, "tiny"))["Ready"]["message"]
