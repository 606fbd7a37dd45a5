"""A run stopped once its headline is known (what ``sharegpu simulate`` does when it prints
only the table) gives the very headline, fragmentation and curve up to 100 % of the whole run."""

from __future__ import annotations

import pytest

from sharegpu.sim import generate
from sharegpu.sim.engine import HEADLINE_END_PCT, headline_length, run_one
from sharegpu.sim.runner import Source, run_matrix, stream_lengths
from sharegpu.sim.trace import TracePod
from sharegpu.sim.workload import target_workload


@pytest.mark.parametrize("policy", ["bestfit", "fgd"])
def test_a_run_stopped_at_the_headline_gives_the_whole_runs_figures(policy: str) -> None:
    nodes, pods = generate.nodes(), generate.pods()
    target = target_workload(pods)
    whole = run_one(nodes, pods, policy, 42, "generated", target)
    short = run_one(nodes, pods, policy, 42, "generated", target, headline_only=True)
    assert short.pods < whole.pods
    assert short.unallocated_pct == whole.unallocated_pct
    assert short.frag_pct == whole.frag_pct
    assert short.curve[:101] == whole.curve[:101]
    assert whole.curve[110] is not None and short.curve[110] is None


def test_headline_length_takes_the_pod_that_reaches_the_end_and_no_more() -> None:
    # one GPU of capacity (1000 milli): pods of 200 milli reach 100, 120, 140 % ...
    seq = [TracePod(f"p{i}", 1000, 1000, 1, 200) for i in range(8)]
    n = headline_length(seq, 1)
    arrived = [200 * (i + 1) / 10.0 for i in range(8)]  # % of capacity after each pod
    assert arrived[n - 1] >= HEADLINE_END_PCT > arrived[n - 2]
    assert headline_length(seq[:3], 1) == 3  # never reaches it: the whole stream
    # CPU-only pods (no demand) after the end are not taken
    assert headline_length([*seq[:n], TracePod("cpu", 1000, 1000, 0, 0)], 1) == n


def test_progress_counts_the_pods_a_stopped_run_decides() -> None:
    source = Source(None, generate.DEFAULT_SEED)
    lengths = stream_lengths(source, ["generated"], [42], 1.3, headline_only=True)
    (summary,) = run_matrix(source, ["generated"], ["random"], [42], jobs=1,
                            headline_only=True)
    assert summary.runs[0].pods == lengths[("generated", 42)]
    assert lengths[("generated", 42)] < stream_lengths(source, ["generated"], [42], 1.3)[
        ("generated", 42)]
