"""Worker configuration: the one contract between the operator and the workers.

The operator renders a `ServingConfig` into the ConfigMap mounted at /etc/splitserve/config.yaml;
every worker process (`splitserve prefill|decode|colocated|router --config FILE`) loads it back.
Local mode builds the same object in memory. Pure data: no torch, no network.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from splitserve_workers.engine.config import MAX_SPECULATIVE_TOKENS

CONFIG_PATH_IN_POD = "/etc/splitserve/config.yaml"


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def flag_or(flag: Any, configured: Any) -> Any:
    """A command-line flag given (0 and empty included) wins over the config file's value."""
    return configured if flag is None else flag


@dataclass
class ModelSettings:
    path: str = ""  # local Hugging Face-format directory
    name: str = ""  # the name clients use in the OpenAI API ("model" field)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    device: str = "auto"  # auto | cpu | cuda | cuda:N


@dataclass
class PrefillSettings:
    port: int = 50051
    max_batch_tokens: int = 8192  # prefill token budget per forward pass
    kv_cache_memory_bytes: int = 512 << 20
    # Instead of the bytes: this share, in (0, 1], of the memory free once the weights are
    # loaded (the GPU's free memory; on CPU MemAvailable capped by the cgroup limit).
    kv_cache_memory_fraction: float | None = None


@dataclass
class DecodeSettings:
    port: int = 50052
    max_batch_size: int = 128  # sequences per decode iteration (configured limit)
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_bytes: int = 1 << 30
    kv_cache_memory_fraction: float | None = None  # as PrefillSettings'
    reservation_lease_seconds: float = 30.0  # blocks of a transfer that never completes are freed
    # Speculative decoding by n-gram lookup in the prompt and output: draft tokens verified per
    # sequence per decode pass (0 = off). Also used by colocated workers.
    speculative_tokens: int = 0


@dataclass
class RouterSettings:
    port: int = 8000
    discovery: str = "static"  # static | dns
    prefill_endpoints: list[str] = field(default_factory=list)  # static: host:port
    decode_endpoints: list[str] = field(default_factory=list)
    prefill_service: str = ""  # dns: headless Service host:port
    decode_service: str = ""
    prefill_policy: str = "cache_aware"
    decode_policy: str = "cache_aware"
    max_request_bytes: int = 4 << 20
    log_requests: bool = False  # a JSON log line per generation request
    # tool_choice auto: auto (the chat template's format) | none | hermes | llama3_json
    tool_call_parser: str = "auto"
    # reasoning_content for thinking models: auto (the chat template's) | none | qwen3 |
    # deepseek_r1
    reasoning_parser: str = "auto"
    # Reserve sends the prompt, so a decode worker skips the KV its prefix cache holds.
    decode_kv_reuse: bool = True
    # How long a request may wait for free KV blocks on a decode worker before its 503.
    admission_timeout_seconds: float = 30.0
    # How long one write to a streaming client may wait before the client is cut (0: never).
    write_timeout_seconds: float = 60.0


@dataclass
class SLOSettings:
    ttft_seconds: float = 0.5
    tpot_seconds: float = 0.05
    percentile: float = 95.0


@dataclass
class ServingConfig:
    service: str = "local"
    model: ModelSettings = field(default_factory=ModelSettings)
    prefill: PrefillSettings = field(default_factory=PrefillSettings)
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    router: RouterSettings = field(default_factory=RouterSettings)
    slo: SLOSettings = field(default_factory=SLOSettings)

    def validate(self) -> None:
        if self.model.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(
                f"model.dtype: {self.model.dtype!r} is not one of auto, float32, bfloat16, float16"
            )
        checks: list[tuple[str, float, float]] = [
            ("prefill.max_batch_tokens", self.prefill.max_batch_tokens, 1),
            ("decode.max_batch_size", self.decode.max_batch_size, 1),
            ("decode.block_size", self.decode.block_size, 1),
            ("decode.reservation_lease_seconds", self.decode.reservation_lease_seconds, 0.1),
            ("slo.ttft_seconds", self.slo.ttft_seconds, 1e-6),
            ("slo.tpot_seconds", self.slo.tpot_seconds, 1e-6),
        ]
        for size in ("prefill.kv_cache_memory_bytes", "decode.kv_cache_memory_bytes"):
            checks.append((size, self._get(size), 1))
        for share in ("prefill.kv_cache_memory_fraction", "decode.kv_cache_memory_fraction"):
            value = self._get(share)
            if value is not None and not 0 < value <= 1:  # nan too
                raise ConfigError(f"{share}: {value!r} must be in (0, 1]")
        checks.append(("router.max_request_bytes", self.router.max_request_bytes, 1))
        checks.append(
            ("router.admission_timeout_seconds", self.router.admission_timeout_seconds, 0)
        )
        checks.append(("router.write_timeout_seconds", self.router.write_timeout_seconds, 0))
        if self.model.max_model_len is not None:
            checks.append(("model.max_model_len", self.model.max_model_len, 1))
        checks.append(("decode.speculative_tokens", self.decode.speculative_tokens, 0))
        if self.decode.speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"decode.speculative_tokens: {self.decode.speculative_tokens} is above the "
                f"maximum {MAX_SPECULATIVE_TOKENS}"
            )
        for name, value, minimum in checks:
            if not value >= minimum:  # nan too (YAML's .nan): every comparison with it is false
                raise ConfigError(f"{name}: {value} is below the minimum {minimum}")
        # 0 asks the OS for a free port (local mode and tests).
        for name in ("prefill.port", "decode.port", "router.port"):
            if not 0 <= self._get(name) <= 65535:
                raise ConfigError(f"{name}: {self._get(name)} must be in [0, 65535]")
        if not 0 < self.slo.percentile < 100:
            raise ConfigError(f"slo.percentile: {self.slo.percentile} must be in (0, 100)")
        if self.router.discovery not in ("static", "dns"):
            raise ConfigError(f"router.discovery: {self.router.discovery!r} is not static or dns")

    def _get(self, dotted: str) -> Any:
        section, name = dotted.split(".")
        return getattr(getattr(self, section), name)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServingConfig:
        sections = {f.name: f for f in dataclasses.fields(cls)}
        if not isinstance(data or {}, dict):
            raise ConfigError(f"config: expected a mapping of sections, got {_kind(data)}")
        kwargs: dict[str, Any] = {}
        for key, value in (data or {}).items():
            if key not in sections:
                raise ConfigError(f"{key}: unknown configuration section")
            if key == "service":
                _check_type(key, value, "str")
                kwargs[key] = value
                continue
            if not isinstance(value or {}, dict):
                raise ConfigError(f"{key}: expected a mapping of fields, got {_kind(value)}")
            section_type = type(getattr(cls(), key))
            types = {f.name: f.type for f in dataclasses.fields(section_type)}
            unknown = set(value or {}) - set(types)
            if unknown:
                raise ConfigError(f"{key}.{sorted(unknown)[0]}: unknown field")
            for name, item in (value or {}).items():
                _check_type(f"{key}.{name}", item, str(types[name]))
            kwargs[key] = section_type(**(value or {}))
        config = cls(**kwargs)
        config.validate()
        return config

    @classmethod
    def from_yaml(cls, text: str) -> ServingConfig:
        return cls.from_dict(yaml.load(text, Loader=_StrictLoader) or {})

    @classmethod
    def load(cls, path: str | Path) -> ServingConfig:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ConfigError(f"config: cannot read {path}: {e.strerror or e}") from e
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"config: {path} is not UTF-8 text: {e.reason} at byte {e.start}"
            ) from e
        try:
            return cls.from_yaml(text)
        except yaml.MarkedYAMLError as e:  # one line: what is wrong, and where
            mark = e.problem_mark
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            raise ConfigError(f"config: {path} is not valid YAML: {e.problem}{where}") from e
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {path} is not valid YAML: {e}") from e


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping: YAML's default keeps
    the last one silently, so a second `decode:` section dropped the first one's settings."""


def _mapping_without_repeats(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: keys written here win
            continue
        key = loader.construct_object(key_node)
        try:
            repeated = key in seen
        except TypeError:  # an unhashable key: construct_mapping says so
            continue
        if repeated:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark,
                f"the key {key!r} is given twice", key_node.start_mark,
            )  # fmt: skip
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _mapping_without_repeats,  # type: ignore[arg-type]
)


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# The field annotations used above (strings: this module uses postponed annotations).
_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "int | None": (int, type(None)),
    "float | None": (int, float, type(None)),
    "list[str]": (list,),
    "bool": (bool,),
}


def _check_type(name: str, value: Any, annotation: str) -> None:
    """A YAML value of the wrong type fails here, naming the field, rather than deep inside."""
    allowed = _TYPES[annotation]
    # Python's bool is an int: only a bool field takes true/false.
    ok = isinstance(value, allowed) and (isinstance(value, bool) == (annotation == "bool"))
    if ok and annotation == "list[str]":
        ok = all(isinstance(item, str) for item in value)
    if not ok:
        raise ConfigError(f"{name}: expected {annotation}, got {_kind(value)} {value!r}")
