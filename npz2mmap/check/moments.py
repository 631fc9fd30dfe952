"""Running count, min, max, mean and standard deviation of numbers that arrive in chunks.

Each chunk's count, mean and M2 (the sum of squared deviations from its own
mean) are merged into the running ones by Chan, Golub and LeVeque's update, so
a large common offset (millisecond timestamps near 1.7e12) never cancels as it
does in E[x^2] - mean^2. Integers of every width are summed exactly in Python
ints and their deviations taken from an integer near the mean without
overflow; floats are scaled by a power of two, so that neither 1e308 nor
denormals overflow or underflow. NaN and infinities are counted, not averaged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

INTEGER_KINDS = "biu"
FLOAT_KINDS = "f"
LOW_BITS = 32
LOW_MASK = (1 << LOW_BITS) - 1


class RunningStatistics(Protocol):
    """Statistics of every chunk added so far."""

    def add(self, values: NDArray[Any]) -> None: ...

    def result(self) -> dict[str, int | float]: ...


def running_statistics(dtype: np.dtype) -> RunningStatistics:
    """An accumulator for values of ``dtype``: bool, integers of any width, or floats."""
    if dtype.kind in INTEGER_KINDS:
        return IntegerStatistics()
    if dtype.kind in FLOAT_KINDS:
        return FloatStatistics(beyond_float64=dtype.itemsize > 8)
    raise TypeError(f"no statistics of dtype {dtype}")


class IntegerStatistics:
    """Count, exact min, max and mean, and the standard deviation of integers (bools count as 0 and 1)."""

    def __init__(self) -> None:
        self.count, self.total, self.m2 = 0, 0, 0.0
        self.low: int | None = None
        self.high: int | None = None

    def add(self, values: NDArray[Any]) -> None:
        """Merge in one chunk (a one-dimensional array)."""
        if not values.size:
            return
        high_part, low_part = _split(values)
        count, total = values.size, (int(high_part.sum()) << LOW_BITS) + int(low_part.sum())
        m2 = _integer_m2(high_part, low_part, Fraction(total, count))
        if self.count:
            delta = Fraction(total, count) - Fraction(self.total, self.count)
            m2 += float(delta * delta * self.count * count / (self.count + count))
        self.count, self.total, self.m2 = self.count + count, self.total + total, self.m2 + m2
        low, high = int(values.min()), int(values.max())
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)

    def result(self) -> dict[str, int | float]:
        """count, nan and inf (always 0), then min, max, mean and std if there are values."""
        out: dict[str, int | float] = {"count": self.count, "nan": 0, "inf": 0}
        if self.low is None or self.high is None:
            return out
        mean, std = float(Fraction(self.total, self.count)), math.sqrt(self.m2 / self.count)
        return {**out, "min": self.low, "max": self.high, "mean": mean, "std": std}


def _split(values: NDArray[Any]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """``values == high * 2**32 + low`` exactly, both int64 and low in [0, 2**32).

    Neither part of a chunk of up to 2**31 values can overflow int64 when summed,
    whether the values are int64 extremes or uint64 near 2**64.
    """
    if values.dtype.itemsize < 8 or values.dtype.kind == "b":
        values = values.astype(np.int64)
    return (values >> LOW_BITS).astype(np.int64, copy=False), (values & LOW_MASK).astype(np.int64, copy=False)


def _integer_m2(high_part: NDArray[np.int64], low_part: NDArray[np.int64], mean: Fraction) -> float:
    """The sum of squared deviations from ``mean`` of the values split into two parts.

    Deviations are taken from the integer nearest the mean, part by part in
    int64 (exact), and joined in float64 with one rounding.
    """
    reference = round(mean)
    deviations = (high_part - (reference >> LOW_BITS)).astype(np.float64)
    deviations *= float(1 << LOW_BITS)
    deviations += low_part - (reference & LOW_MASK)
    deviations -= float(mean - reference)
    return float(np.square(deviations, out=deviations).sum())


@dataclass(frozen=True)
class ScaledMoments:
    """Count, mean and M2 of some values, the mean scaled by 2**-exponent and M2 by 2**-(2 * exponent)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    exponent: int = 0

    def scaled_to(self, exponent: int) -> tuple[float, float]:
        """Mean and M2 at a scale ``exponent`` at least this one's (small parts may underflow to 0)."""
        shift = self.exponent - exponent
        return _ldexp(self.mean, shift), _ldexp(self.m2, 2 * shift)

    def merged(self, other: ScaledMoments) -> ScaledMoments:
        """Both sets of values as one (Chan, Golub and LeVeque's update)."""
        if not self.count or not other.count:
            return self if other.count == 0 else other
        exponent = max(self.exponent, other.exponent)
        (mean_a, m2_a), (mean_b, m2_b) = self.scaled_to(exponent), other.scaled_to(exponent)
        count = self.count + other.count
        delta = mean_b - mean_a
        mean = mean_a + delta * (other.count / count)
        m2 = m2_a + m2_b + delta * delta * (self.count * other.count / count)
        return ScaledMoments(count, mean, m2, exponent)


def scaled_moments(finite: NDArray[np.floating[Any]]) -> ScaledMoments:
    """The moments of finite floats, scaled so that the largest magnitude is in [0.5, 1).

    Computed in float64, or for longdouble in longdouble (whose extra digits
    float64 would round away: values 1 + k * eps would have no spread), by the
    corrected two-pass algorithm: the mean, then the deviations' sum corrects
    both figures.
    """
    wide = finite.astype(np.float64) if finite.dtype.itemsize < 8 else finite
    work = np.longdouble if finite.dtype.itemsize > 8 else np.float64
    peak = np.max(np.abs(wide))
    if peak == 0:
        return ScaledMoments(finite.size)
    exponent = int(np.frexp(peak)[1])
    with np.errstate(under="ignore"):  # what underflows is below 2**-1074 of the peak: nothing to the sums
        scaled = np.ldexp(wide, -exponent).astype(work, copy=False)
        mean = _number(scaled.mean())
        scaled -= mean
        correction = _number(scaled.sum())
        m2 = _number(np.square(scaled, out=scaled).sum()) - correction * correction / finite.size
    return ScaledMoments(finite.size, mean + correction / finite.size, max(m2, 0.0), exponent)


def _number(value: np.floating[Any]) -> Any:
    """A float64 figure as a Python float; a longdouble one kept, with its digits."""
    return float(value) if value.dtype.itemsize <= 8 else value


def _ldexp(value: Any, exponent: int) -> Any:
    """``value * 2**exponent``, in longdouble for a longdouble value."""
    return np.ldexp(value, exponent) if isinstance(value, np.floating) else math.ldexp(value, exponent)


class FloatStatistics:
    """Counts of values, NaN and infinities; min and max of all but NaN; mean and std of the finite values."""

    def __init__(self, beyond_float64: bool = False) -> None:
        self.count = self.nan = self.positive_inf = self.negative_inf = 0
        self.moments = ScaledMoments()
        # longdouble: figures stay np.longdouble, whose range and precision a Python float lacks
        self.beyond_float64 = beyond_float64
        self.low: Any = math.inf  # of the finite values
        self.high: Any = -math.inf

    def add(self, values: NDArray[Any]) -> None:
        """Merge in one chunk (a one-dimensional array)."""
        self.count += values.size
        is_finite = np.isfinite(values)
        num_finite = int(np.count_nonzero(is_finite))
        finite = values if num_finite == values.size else values[is_finite]
        if num_finite < values.size:
            positive = int(np.count_nonzero(values == np.inf))
            negative = int(np.count_nonzero(values == -np.inf))
            self.positive_inf += positive
            self.negative_inf += negative
            self.nan += values.size - num_finite - positive - negative
        if num_finite:
            self.moments = self.moments.merged(scaled_moments(finite))
            low, high = finite.min(), finite.max()
            if not self.beyond_float64:
                low, high = float(low), float(high)
            self.low, self.high = min(self.low, low), max(self.high, high)

    def result(self) -> dict[str, int | float]:
        """count, nan and inf; min and max unless all are NaN; mean and std if any are finite."""
        infinite = self.positive_inf + self.negative_inf
        out: dict[str, int | float] = {"count": self.count, "nan": self.nan, "inf": infinite}
        if self.count == self.nan:
            return out
        out["min"] = -math.inf if self.negative_inf else self.low  # inf if all others are inf
        out["max"] = math.inf if self.positive_inf else self.high
        m = self.moments
        if m.count:
            # rounding may not carry the figures past what the finite values bound them by; a
            # longdouble that overflows on the way (max - min near its limit) is bounded so too
            with np.errstate(over="ignore"):
                self._add_mean_and_std(out, m)
        return {key: _narrowed(value) for key, value in out.items()}

    def _add_mean_and_std(self, out: dict[str, Any], m: ScaledMoments) -> None:
        unscale = _unscaled_wide if self.beyond_float64 else _unscaled
        out["mean"] = min(max(unscale(m.mean, m.exponent), self.low), self.high)
        spread = (self.high - self.low) / 2  # Popoviciu: std <= (max - min) / 2
        spread = spread if math.isfinite(spread) else self.high / 2 - self.low / 2
        out["std"] = min(
            unscale(
                np.sqrt(m.m2 / m.count) if self.beyond_float64 else math.sqrt(m.m2 / m.count), m.exponent
            ),
            spread,
        )


def _unscaled(value: float, exponent: int) -> float:
    """``value * 2**exponent``, infinite (not an OverflowError) beyond float64's range."""
    try:
        return math.ldexp(value, exponent)
    except OverflowError:
        return math.copysign(math.inf, value)


def _unscaled_wide(value: Any, exponent: int) -> Any:
    """``value * 2**exponent`` as np.longdouble, for figures beyond float64's range or precision."""
    return np.ldexp(np.longdouble(value), exponent)


def _narrowed(value: Any) -> Any:
    """A np.longdouble figure as a Python float where that is exact, else kept (1e4000, 1e-4940)."""
    if isinstance(value, np.floating) and float(value) == value:
        return float(value)
    return value
