"""`ManagerSettings`: what the expert manager is tuned by, resolved once from a `MiraConfig`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .config import MiraConfig, PredictorConfig
from .errors import ConfigError
from .heat import HeatConfig
from .policies import PriorityConfig
from .registry import POLICIES


@dataclass(frozen=True)
class ManagerSettings:
    """Everything the manager is tuned by, resolved from a `MiraConfig` (`from_config`). The defaults
    (for a manager built by hand: tests, offline replays) are MiraConfig's nested configs' with two
    exceptions: `policy` "lru" (the plain demand cache) and `split_min_bytes` 0 (every record that can
    split does)."""

    policy: str = "lru"  # a name in mira_hf.registry.POLICIES
    stage_fraction: float = 0.25  # CacheConfig.stage_fraction
    demand_inflight_bytes: int = 64 * 2**20  # CacheConfig.demand_inflight_bytes
    ring_bytes: int = 128 * 2**20  # LoaderConfig.staging_ring_bytes
    copy_timeout_s: float = 60.0  # LoaderConfig.copy_timeout_s
    split_copies: bool = True  # LoaderConfig.split_copies
    split_min_bytes: int = 0  # LoaderConfig.split_min_bytes
    heat: HeatConfig = field(default_factory=HeatConfig)
    priority: PriorityConfig = field(default_factory=PriorityConfig)
    predictor_config: PredictorConfig = field(default_factory=PredictorConfig)
    warmup_steps: int = 3  # first forward steps: prefetches only fill free slots, nothing is evicted
    quantization: str | None = None  # the transfer format in use (MiraConfig.quantization, "auto" resolved)
    host_compute: str = "off"  # MiraConfig.host_compute

    def __post_init__(self) -> None:
        POLICIES.get(self.policy)  # a ConfigError naming the registered policies

    def replaced(self, **fields) -> ManagerSettings:
        """These settings with the given fields replaced (a field given as None keeps its value here);
        a name that is not a field is a ConfigError (`ExpertManager(..., **fields)`)."""
        names = {f.name for f in dataclasses.fields(ManagerSettings)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ConfigError(f"ExpertManager got unknown settings {unknown}; ManagerSettings has {sorted(names)}.")
        fields = {k: v for k, v in fields.items() if v is not None}
        return dataclasses.replace(self, **fields)

    @classmethod
    def from_config(cls, cfg: MiraConfig) -> ManagerSettings:
        """The settings of a resolved config (`quantization` no longer "auto")."""
        return cls(
            policy=cfg.policy,
            stage_fraction=cfg.cache.stage_fraction,
            demand_inflight_bytes=cfg.cache.demand_inflight_bytes,
            ring_bytes=cfg.loader.staging_ring_bytes,
            copy_timeout_s=cfg.loader.copy_timeout_s,
            split_copies=cfg.loader.split_copies,
            split_min_bytes=cfg.loader.split_min_bytes,
            heat=cfg.heat,
            priority=cfg.priority,
            predictor_config=cfg.prediction,
            quantization=cfg.quantization,
            host_compute=cfg.host_compute,
        )
