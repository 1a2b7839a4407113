"""Renders an LLMService spec into the workers' ServingConfig (the operator <-> worker contract in
splitserve_workers.config), cut per component to the sections it reads, and hashes each: the
hash goes on the pod templates so a config change rolls the pools that read it, and only those
(a new SLO or router setting leaves the GPU pools running)."""

from __future__ import annotations

import hashlib

import yaml
from splitserve_workers.config import (
    DecodeSettings,
    ModelSettings,
    PrefillSettings,
    RouterSettings,
    ServingConfig,
    SLOSettings,
)

from .names import DECODE_PORT, PREFILL_PORT, pool_service_host
from .spec import Spec


def serving_config(spec: Spec, service: str, namespace: str, cluster_domain: str) -> ServingConfig:
    prefill = PrefillSettings(
        port=PREFILL_PORT, max_batch_tokens=spec.prefill.settings["maxBatchTokens"]
    )
    if "kvCacheMemoryBytes" in spec.prefill.settings:
        prefill.kv_cache_memory_bytes = spec.prefill.settings["kvCacheMemoryBytes"]
    prefill.kv_cache_memory_fraction = spec.prefill.settings.get("kvCacheMemoryFraction")
    decode = DecodeSettings(
        port=DECODE_PORT,
        max_batch_size=spec.decode.settings["maxBatchSize"],
        block_size=spec.decode.settings["blockSize"],
        speculative_tokens=spec.decode.settings["speculativeTokens"],
    )
    if "kvCacheMemoryBytes" in spec.decode.settings:
        decode.kv_cache_memory_bytes = spec.decode.settings["kvCacheMemoryBytes"]
    decode.kv_cache_memory_fraction = spec.decode.settings.get("kvCacheMemoryFraction")
    prefill_host = pool_service_host(service, "prefill", namespace, cluster_domain)
    decode_host = pool_service_host(service, "decode", namespace, cluster_domain)
    config = ServingConfig(
        service=service,
        model=ModelSettings(
            path=spec.model_path,
            name=spec.model_name,
            dtype=spec.model_dtype,
            max_model_len=spec.max_model_len,
        ),
        prefill=prefill,
        decode=decode,
        router=RouterSettings(
            port=spec.router.settings["port"],
            discovery="dns",
            prefill_service=f"{prefill_host}:{PREFILL_PORT}",
            decode_service=f"{decode_host}:{DECODE_PORT}",
            log_requests=spec.router.settings["logRequests"],
            tool_call_parser=spec.router.settings["toolCallParser"],
            reasoning_parser=spec.router.settings["reasoningParser"],
            admission_timeout_seconds=spec.router.settings["admissionTimeoutSeconds"],
            write_timeout_seconds=spec.router.settings["writeTimeoutSeconds"],
        ),
        slo=SLOSettings(
            ttft_seconds=spec.ttft_seconds,
            tpot_seconds=spec.tpot_seconds,
            percentile=spec.percentile,
        ),
    )
    config.validate()
    return config


# What each component reads of the ServingConfig (worker_runtime and router.app's
# options_from_args); a section left out takes its defaults there. The SLO is the operator's
# own: no pod reads it.
CONFIG_SECTIONS = {
    "router": ("service", "model", "router"),
    "prefill": ("service", "model", "prefill", "decode"),
    "decode": ("service", "model", "prefill", "decode"),
}
# ConfigMaps an LLMService's current config takes (components reading the same sections share
# one): more than that, and one is a superseded version.
CURRENT_CONFIG_MAPS = len(set(CONFIG_SECTIONS.values()))


def component_configs(config: ServingConfig) -> dict[str, str]:
    """Each component's config.yaml: the sections it reads (CONFIG_SECTIONS), rendered once
    per distinct list of sections."""
    data = config.to_dict()
    texts = {
        sections: yaml.safe_dump({k: data[k] for k in sections}, sort_keys=True)
        for sections in set(CONFIG_SECTIONS.values())
    }
    return {component: texts[sections] for component, sections in CONFIG_SECTIONS.items()}


def config_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
