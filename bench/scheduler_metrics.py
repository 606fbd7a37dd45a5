"""Reading kube-scheduler's own /metrics for bench/scheduler_real.py (pure functions, no I/O).

- :func:`parse` / :func:`value`: the samples of a Prometheus text exposition and the sum of those
  of one name whose labels include the given ones;
- :func:`histogram` / :func:`quantile`: one histogram's cumulative buckets (summed over the
  label sets that match) and a quantile from them the way Prometheus' ``histogram_quantile``
  computes it (linear interpolation inside the bucket that holds the rank); ``minus``: what was
  observed between two scrapes;
- :func:`counter_line` : one counter's value found by a plain string search (cheap enough to poll
  a large exposition a few times a second);
- :func:`crossing` / :func:`throughput`: when a counter polled over time crossed a level
  (interpolated between the polls around it) and the rate between two such levels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

Labels = Mapping[str, str]


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Histogram:
    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), ascending, +Inf last
    sum: float
    count: float

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else math.nan

    def quantile(self, q: float) -> float:
        return quantile(q, self.buckets)

    def minus(self, earlier: Histogram) -> Histogram:
        """The observations made since ``earlier`` (a scrape of the same histogram before)."""
        before = dict(earlier.buckets)
        return Histogram([(le, c - before.get(le, 0.0)) for le, c in self.buckets],
                         self.sum - earlier.sum, self.count - earlier.count)


def parse(text: str) -> list[Sample]:
    """Every sample of a Prometheus text exposition (as kube-scheduler writes it)."""
    return [Sample(s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text) for s in family.samples]


def _matches(sample: Sample, name: str, labels: Labels | None) -> bool:
    return sample.name == name and all(sample.labels.get(k) == v
                                       for k, v in (labels or {}).items())


def value(samples: Sequence[Sample], name: str, labels: Labels | None = None) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (0 when none)."""
    return sum(s.value for s in samples if _matches(s, name, labels))


def histogram(samples: Sequence[Sample], name: str, labels: Labels | None = None) -> Histogram:
    """The histogram ``name`` (``name_bucket``/``_sum``/``_count``), its buckets added up over
    the label sets that include ``labels``."""
    by_le: dict[float, float] = {}
    for s in samples:
        if _matches(s, name + "_bucket", labels):
            le = float(s.labels["le"])  # "+Inf" parses as inf
            by_le[le] = by_le.get(le, 0.0) + s.value
    return Histogram(sorted(by_le.items()), value(samples, name + "_sum", labels),
                     value(samples, name + "_count", labels))


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """The ``q`` quantile (0..1) of cumulative ``buckets`` [(upper bound, count), ...], ascending
    with +Inf last, as Prometheus' ``histogram_quantile``: the rank ``q`` × total falls in one
    bucket, and the value is interpolated linearly between that bucket's lower and upper bound
    (the first bucket's lower bound is 0; a rank in the +Inf bucket gives the highest finite
    bound). NaN when there are no observations."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile {q} is not in [0, 1]")
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    if not math.isinf(buckets[-1][0]):
        raise ValueError("the last bucket must be +Inf")
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for i, (upper, count) in enumerate(buckets):
        if count >= rank and count > below:
            if math.isinf(upper):
                return buckets[i - 1][0] if i else math.nan
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return buckets[-2][0] if len(buckets) > 1 else math.nan


def counter_line(text: str, name: str, labels: Labels) -> float | None:
    """The value of the sample ``name{labels}`` found by string search (labels in the order the
    exposition writes them: sorted by name, as Go's client does), or None when absent."""
    head = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "} "
    at = text.find("\n" + head)
    if at < 0:
        if not text.startswith(head):
            return None
        at = -1
    start = at + 1 + len(head)
    end = text.find("\n", start)
    return float(text[start:end if end >= 0 else len(text)])


def crossing(series: Sequence[tuple[float, float]], level: float) -> float:
    """The time at which a non-decreasing counter polled as ``series`` [(time, value), ...]
    reached ``level``: interpolated linearly between the last poll below it and the first at or
    above it (the first poll's time if it already was there). ValueError if it never did."""
    for i, (t, v) in enumerate(series):
        if v >= level:
            if i == 0:
                return t
            t0, v0 = series[i - 1]
            return t0 + (t - t0) * (level - v0) / (v - v0)
    raise ValueError(f"the counter never reached {level} (last {series[-1] if series else None})")


def throughput(series: Sequence[tuple[float, float]], total: float, lo: float = 0.1,
               hi: float = 0.9) -> tuple[float, float, float]:
    """(rate, t_lo, t_hi): the counter's mean rate between the moments it reached ``lo`` and
    ``hi`` of ``total`` (leaving out the start, when the scheduler's queue fills, and the tail)."""
    t_lo, t_hi = crossing(series, lo * total), crossing(series, hi * total)
    if t_hi <= t_lo:
        raise ValueError(f"no time between {lo:.0%} and {hi:.0%} of {total}")
    return (hi - lo) * total / (t_hi - t_lo), t_lo, t_hi
