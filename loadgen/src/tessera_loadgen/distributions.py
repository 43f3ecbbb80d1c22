"""Length and think-time distributions used in workload files.

Each distribution is a small pydantic model with a ``kind`` discriminator and a ``sample(rng)`` method.
A bare number in YAML means a constant: ``output_tokens: 64`` is ``{kind: constant, value: 64}``.
"""

from __future__ import annotations

import math
import random
from statistics import NormalDist
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

UNBOUNDED_QUANTILE = 0.999
"""What stands for the largest value of a distribution without one (see ``_Dist.upper``)."""


class _Dist(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    def sample(self, rng: random.Random) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def upper(self) -> tuple[float, bool]:  # pragma: no cover - abstract
        """The largest value a sample takes and ``True``; for a distribution without a largest value, its
        ``UNBOUNDED_QUANTILE`` quantile and ``False``."""
        raise NotImplementedError

    def sample_int(self, rng: random.Random, minimum: int = 1) -> int:
        """A sample rounded to an integer and clamped below at ``minimum`` (token counts, turns)."""
        return max(minimum, round(self.sample(rng)))


class Constant(_Dist):
    """Always the same value."""

    kind: Literal["constant"] = Field("constant", description="Discriminator.")
    value: float = Field(..., ge=0, description="The value every sample takes.")

    def sample(self, rng: random.Random) -> float:
        return self.value

    def upper(self) -> tuple[float, bool]:
        return self.value, True


class Uniform(_Dist):
    """Uniform between ``low`` and ``high`` (inclusive for integer use)."""

    kind: Literal["uniform"] = Field("uniform", description="Discriminator.")
    low: float = Field(..., ge=0, description="Smallest value.")
    high: float = Field(..., ge=0, description="Largest value.")

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        if self.high < self.low:
            raise ValueError(f"uniform: high ({self.high}) must be >= low ({self.low})")
        return self

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.low, self.high)

    def upper(self) -> tuple[float, bool]:
        return self.high, True

    def sample_int(self, rng: random.Random, minimum: int = 1) -> int:
        return max(minimum, rng.randint(math.ceil(self.low), math.floor(self.high)))


class Normal(_Dist):
    """Normal, clipped to ``[min, max]``."""

    kind: Literal["normal"] = Field("normal", description="Discriminator.")
    mean: float = Field(..., ge=0, description="Mean.")
    std: float = Field(..., ge=0, description="Standard deviation.")
    min: float = Field(0.0, ge=0, description="Samples below are clipped to this value.")
    max: float | None = Field(None, description="Samples above are clipped to this value (none: no clip).")

    def sample(self, rng: random.Random) -> float:
        value = max(self.min, rng.gauss(self.mean, self.std))
        return value if self.max is None else min(self.max, value)

    def upper(self) -> tuple[float, bool]:
        if self.max is not None:
            return self.max, True
        return max(self.min, self.mean + self.std * NormalDist().inv_cdf(UNBOUNDED_QUANTILE)), False


class LogNormal(_Dist):
    """Log-normal given by its median and the sigma of log(value); long-tailed like real prompts."""

    kind: Literal["lognormal"] = Field("lognormal", description="Discriminator.")
    median: float = Field(..., gt=0, description="Median of the distribution.")
    sigma: float = Field(..., ge=0, description="Standard deviation of log(value).")
    min: float = Field(0.0, ge=0, description="Samples below are clipped to this value.")
    max: float | None = Field(None, description="Samples above are clipped to this value (none: no clip).")

    def sample(self, rng: random.Random) -> float:
        value = max(self.min, rng.lognormvariate(math.log(self.median), self.sigma))
        return value if self.max is None else min(self.max, value)

    def upper(self) -> tuple[float, bool]:
        if self.max is not None:
            return self.max, True
        z = NormalDist().inv_cdf(UNBOUNDED_QUANTILE)
        return max(self.min, self.median * math.exp(self.sigma * z)), False


class Exponential(_Dist):
    """Exponential with the given mean (memoryless think times)."""

    kind: Literal["exponential"] = Field("exponential", description="Discriminator.")
    mean: float = Field(..., gt=0, description="Mean value.")

    def sample(self, rng: random.Random) -> float:
        return rng.expovariate(1.0 / self.mean)

    def upper(self) -> tuple[float, bool]:
        return -self.mean * math.log(1.0 - UNBOUNDED_QUANTILE), False


class Choice(_Dist):
    """One of a list of values, optionally weighted (an empirical histogram)."""

    kind: Literal["choice"] = Field("choice", description="Discriminator.")
    values: list[float] = Field(..., min_length=1, description="The values to choose from.")
    weights: list[float] | None = Field(None, description="Relative weights, one per value (none: equal).")

    @model_validator(mode="after")
    def _weights_match(self) -> Choice:
        if self.weights is not None and len(self.weights) != len(self.values):
            raise ValueError(f"choice: {len(self.weights)} weights for {len(self.values)} values")
        return self

    def sample(self, rng: random.Random) -> float:
        if self.weights is None:
            return rng.choice(self.values)
        return rng.choices(self.values, weights=self.weights)[0]

    def upper(self) -> tuple[float, bool]:
        return max(self.values), True


def _number_is_constant(value: Any) -> Any:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return {"kind": "constant", "value": value}
    return value


Distribution = Annotated[
    Constant | Uniform | Normal | LogNormal | Exponential | Choice,
    Field(discriminator="kind"),
    BeforeValidator(_number_is_constant),
]
"""A distribution field: a bare number, or a mapping with ``kind`` and that kind's parameters."""
