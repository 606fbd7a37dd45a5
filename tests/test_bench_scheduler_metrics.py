"""bench/scheduler_metrics.py: reading kube-scheduler's /metrics text, the histogram quantile
(as Prometheus' histogram_quantile) and the throughput between two levels of a polled counter."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import scheduler_metrics as sm

# The shape kube-scheduler v1.37 writes (component-base: HELP with the stability level, label
# names sorted); two profiles, so summing over label sets is exercised.
TEXT = """\
# HELP scheduler_schedule_attempts_total [STABLE] Number of attempts to schedule pods, by the result. 'unschedulable' means a pod could not be scheduled, while 'error' means an internal scheduler problem.
# TYPE scheduler_schedule_attempts_total counter
scheduler_schedule_attempts_total{profile="ack-co-scheduler",result="scheduled"} 100
scheduler_schedule_attempts_total{profile="ack-co-scheduler",result="unschedulable"} 3
scheduler_schedule_attempts_total{profile="default-scheduler",result="scheduled"} 2
# HELP scheduler_scheduling_attempt_duration_seconds [STABLE] Scheduling attempt latency in seconds (scheduling algorithm + binding)
# TYPE scheduler_scheduling_attempt_duration_seconds histogram
scheduler_scheduling_attempt_duration_seconds_bucket{profile="ack-co-scheduler",result="scheduled",le="0.001"} 0
scheduler_scheduling_attempt_duration_seconds_bucket{profile="ack-co-scheduler",result="scheduled",le="0.002"} 10
scheduler_scheduling_attempt_duration_seconds_bucket{profile="ack-co-scheduler",result="scheduled",le="0.004"} 60
scheduler_scheduling_attempt_duration_seconds_bucket{profile="ack-co-scheduler",result="scheduled",le="0.008"} 90
scheduler_scheduling_attempt_duration_seconds_bucket{profile="ack-co-scheduler",result="scheduled",le="0.016"} 100
scheduler_scheduling_attempt_duration_seconds_bucket{profile="ack-co-scheduler",result="scheduled",le="+Inf"} 100
scheduler_scheduling_attempt_duration_seconds_sum{profile="ack-co-scheduler",result="scheduled"} 0.45
scheduler_scheduling_attempt_duration_seconds_count{profile="ack-co-scheduler",result="scheduled"} 100
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.001"} 0
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.002"} 0
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.004"} 0
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.008"} 0
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="0.016"} 0
scheduler_scheduling_attempt_duration_seconds_bucket{profile="default-scheduler",result="scheduled",le="+Inf"} 2
scheduler_scheduling_attempt_duration_seconds_sum{profile="default-scheduler",result="scheduled"} 0.05
scheduler_scheduling_attempt_duration_seconds_count{profile="default-scheduler",result="scheduled"} 2
"""

OURS = {"profile": "ack-co-scheduler", "result": "scheduled"}
ATTEMPT = "scheduler_scheduling_attempt_duration_seconds"


def test_counters_by_label_subset() -> None:
    samples = sm.parse(TEXT)
    assert sm.value(samples, "scheduler_schedule_attempts_total", OURS) == 100
    assert sm.value(samples, "scheduler_schedule_attempts_total", {"result": "scheduled"}) == 102
    assert sm.value(samples, "scheduler_schedule_attempts_total") == 105
    assert sm.value(samples, "scheduler_schedule_attempts_total", {"result": "error"}) == 0


def test_counter_line_finds_the_exact_sample_by_string_search() -> None:
    name = "scheduler_schedule_attempts_total"
    assert sm.counter_line(TEXT, name, {"result": "scheduled", "profile": "ack-co-scheduler"}) == 100
    assert sm.counter_line(TEXT, name, {**OURS, "result": "unschedulable"}) == 3
    assert sm.counter_line(TEXT, name, {**OURS, "result": "error"}) is None
    assert sm.counter_line(TEXT, "scheduler_schedule_attempts", OURS) is None  # no prefix match
    first = TEXT.split("\n", 2)[2]  # the sample is the very first line
    assert sm.counter_line(first, name, OURS) == 100
    last = 'x{a="1"} 7'  # no newline after the value
    assert sm.counter_line(last, "x", {"a": "1"}) == 7


def test_histogram_quantiles_interpolate_inside_the_bucket_as_prometheus_does() -> None:
    h = sm.histogram(sm.parse(TEXT), ATTEMPT, OURS)
    assert h.count == 100 and h.sum == pytest.approx(0.45)
    assert h.mean == pytest.approx(0.0045)
    assert h.buckets[-1] == (math.inf, 100)
    # rank 50: bucket (0.002, 0.004] holds ranks 10..60 -> 0.002 + 0.002 * 40/50
    assert h.quantile(0.5) == pytest.approx(0.0036)
    # rank 99: bucket (0.008, 0.016] holds 90..100 -> 0.008 + 0.008 * 9/10
    assert h.quantile(0.99) == pytest.approx(0.0152)
    assert h.quantile(1.0) == pytest.approx(0.016)
    # rank 5 in the first non-empty bucket (0.001, 0.002]: 0.001 + 0.001 * 5/10
    assert h.quantile(0.05) == pytest.approx(0.0015)


def test_histogram_summed_over_label_sets_and_the_inf_bucket() -> None:
    samples = sm.parse(TEXT)
    both = sm.histogram(samples, ATTEMPT, {"result": "scheduled"})
    assert both.count == 102 and both.buckets[-1] == (math.inf, 102)
    # rank 0.99 * 102 = 100.98 > 100: it falls in +Inf, whose value is the highest finite bound
    assert both.quantile(0.99) == pytest.approx(0.016)
    other = sm.histogram(samples, ATTEMPT, {"profile": "default-scheduler"})
    assert other.quantile(0.5) == pytest.approx(0.016)
    none = sm.histogram(samples, ATTEMPT, {"profile": "nobody"})
    assert none.count == 0 and math.isnan(none.quantile(0.99)) and math.isnan(none.mean)
    with pytest.raises(ValueError):
        sm.quantile(1.5, both.buckets)


def test_throughput_between_interpolated_crossings() -> None:
    series = [(0.0, 0.0), (1.0, 50.0), (2.0, 150.0), (3.0, 250.0), (4.0, 300.0)]
    # 10 % = 30 pods: 0.6 s; 90 % = 270: 3.4 s; 240 pods in 2.8 s
    rate, t_lo, t_hi = sm.throughput(series, 300)
    assert (t_lo, t_hi) == (pytest.approx(0.6), pytest.approx(3.4))
    assert rate == pytest.approx(240 / 2.8)
    assert sm.crossing(series, 0) == 0.0
    assert sm.crossing([(5.0, 10.0)], 3) == 5.0  # already there at the first poll
    with pytest.raises(ValueError):
        sm.crossing(series, 301)
    with pytest.raises(ValueError):
        sm.throughput([(0.0, 0.0), (1.0, 300.0)], 300, lo=0.5, hi=0.5)


def test_histogram_minus_keeps_what_was_observed_between_two_scrapes() -> None:
    before = sm.histogram(sm.parse(TEXT), ATTEMPT, OURS)
    later = TEXT.replace('le="0.016"} 100', 'le="0.016"} 150').replace(
        'le="+Inf"} 100', 'le="+Inf"} 150').replace(
        '_sum{profile="ack-co-scheduler",result="scheduled"} 0.45',
        '_sum{profile="ack-co-scheduler",result="scheduled"} 1.05').replace(
        '_count{profile="ack-co-scheduler",result="scheduled"} 100',
        '_count{profile="ack-co-scheduler",result="scheduled"} 150')
    since = sm.histogram(sm.parse(later), ATTEMPT, OURS).minus(before)
    assert since.count == 50 and since.mean == pytest.approx(0.012)
    assert [c for _, c in since.buckets] == [0, 0, 0, 0, 50, 50]
    # all 50 in (0.008, 0.016]: the median is its middle
    assert since.quantile(0.5) == pytest.approx(0.012)
