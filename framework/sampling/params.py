"""Per-request sampling parameters and their validation."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from framework.errors import RequestError

if TYPE_CHECKING:
    from framework.config import SamplingConfig


# below this a temperature's logits / temperature overflow float32: such requests are greedy (vLLM does the same)
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos")

    @classmethod
    def from_request(cls, defaults: SamplingConfig, overrides: dict[str, Any]) -> "SamplingParams":
        """Defaults from the config, overridden by the request's own fields (None means "not given")."""
        values = {k: getattr(defaults, k) for k in cls.FIELDS if hasattr(defaults, k)}
        values.update({k: v for k, v in overrides.items() if k in cls.FIELDS and v is not None})
        params = cls(**{k: v for k, v in values.items()})
        params.validate()
        return params

    def validate(self) -> None:
        def bad(name: str, value: Any, allowed: str) -> RequestError:
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:60] + f"... ({len(shown)} characters)"
            return RequestError(f"{name}={shown} is not allowed; expected {allowed}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise bad("max_tokens", self.max_tokens, "an integer > 0")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", self.temperature, "a finite number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "a finite number in (0, 1]")
        # NOTE: top_k and seed become int64 tensors: a larger value would fail the whole batch's step
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**63:
            raise bad("top_k", self.top_k, "0 or -1 (off) or an integer >= 1 that fits in 64 bits")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2**63 <= self.seed < 2**63):
            raise bad("seed", self.seed, "an integer that fits in 64 bits")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "a string or a list of non-empty strings")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of integers")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", self.ignore_eos, "true or false")
        if self.top_k == -1:
            self.top_k = 0
        self.temperature = float(self.temperature) if self.temperature >= MIN_TEMPERATURE else 0.0
        self.top_p = float(self.top_p)

    def resolved_seed(self) -> int:
        """The request's seed, or a fresh random one (so an unseeded request still samples on device)."""
        return self.seed if self.seed is not None else random.getrandbits(31)


def _is_number(x: Any) -> bool:
    """A finite int or float (not a bool, NaN, infinity, or an int too large for a float)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False
