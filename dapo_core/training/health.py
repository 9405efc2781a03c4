"""Training-health alerts: detect the failure modes the DAPO paper describes, when they start.

- entropy collapse (Sec. 3.1): actor/entropy falls below ``entropy_floor_frac`` of its early value;
- length explosion: response_length/mean grows past ``length_factor`` x its early value, or most responses
  are truncated (response_length/clip_ratio >= ``clip_ratio_max``);
- clip-fraction blow-up: actor/pg_clipfrac above ``clipfrac_max`` (the policy moves too far per rollout);
- no signal: ``zero_var_steps`` consecutive steps whose generation batches had only zero-variance groups
  (train/zero_std_groups_frac == 1) — nothing to learn from.
Each alert fires once when its condition starts and re-arms when it clears.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Alert:
    name: str
    step: int
    message: str


@dataclass
class HealthMonitor:
    warmup_steps: int = 3  # steps averaged for the "early value"
    entropy_floor_frac: float = 0.2
    length_factor: float = 2.0
    clip_ratio_max: float = 0.5
    clipfrac_max: float = 0.2
    zero_var_steps: int = 3
    _early: dict[str, list[float]] = field(default_factory=dict)
    _active: set[str] = field(default_factory=set)
    _zero_run: int = 0

    def _baseline(self, key: str, value: float | None) -> float | None:
        hist = self._early.setdefault(key, [])
        if value is not None and len(hist) < self.warmup_steps:
            hist.append(value)
            return None
        return sum(hist) / len(hist) if len(hist) >= self.warmup_steps else None

    def update(self, step: int, metrics: dict[str, float]) -> list[Alert]:
        """Feed one step's metrics; returns the alerts that start at this step."""
        conditions: dict[str, str | None] = {}
        ent = metrics.get("actor/entropy")
        base = self._baseline("entropy", ent)
        conditions["entropy_collapse"] = (
            f"entropy {ent:.4g} < {self.entropy_floor_frac:g} x early value {base:.4g}"
            if ent is not None and base is not None and ent < self.entropy_floor_frac * base
            else None
        )
        length = metrics.get("response_length/mean")
        base_len = self._baseline("length", length)
        clip_ratio = metrics.get("response_length/clip_ratio", 0.0)
        if length is not None and base_len is not None and length > self.length_factor * base_len:
            conditions["length_explosion"] = f"mean length {length:.1f} > {self.length_factor:g} x early {base_len:.1f}"
        elif clip_ratio >= self.clip_ratio_max:
            conditions["length_explosion"] = f"{clip_ratio:.0%} of responses truncated"
        else:
            conditions["length_explosion"] = None
        cf = metrics.get("actor/pg_clipfrac")
        conditions["clipfrac_blowup"] = (
            f"pg_clipfrac {cf:.3f} > {self.clipfrac_max:g}" if cf is not None and cf > self.clipfrac_max else None
        )
        if metrics.get("train/zero_std_groups_frac", 0.0) >= 1.0:
            self._zero_run += 1
        else:
            self._zero_run = 0
        conditions["zero_variance_run"] = (
            f"{self._zero_run} consecutive steps with only zero-variance groups"
            if self._zero_run >= self.zero_var_steps
            else None
        )
        started = []
        for name, message in conditions.items():
            if message is not None and name not in self._active:
                self._active.add(name)
                started.append(Alert(name=name, step=step, message=message))
            elif message is None:
                self._active.discard(name)
        return started

    def state_dict(self) -> dict[str, Any]:
        return {"early": self._early, "active": sorted(self._active), "zero_run": self._zero_run}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._early = {k: list(v) for k, v in state.get("early", {}).items()}
        self._active = set(state.get("active", []))
        self._zero_run = int(state.get("zero_run", 0))
