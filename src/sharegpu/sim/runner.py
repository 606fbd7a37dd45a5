"""Runs the (workload × policy × seed) matrix, in parallel processes, and aggregates it.

Progress is counted in pods decided, across every run, so that it moves within seconds even
when one run takes minutes: the workers add to one shared counter, which the parent reads.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import ValidationError
from ..core.state import ClusterState, NodeSpec
from . import generate
from .engine import RunResult, headline_length, run_one
from .trace import NODE_FILE, TracePod, list_workloads, read_nodes, read_pods, workload_path
from .workload import stream, target_workload


@dataclass(frozen=True)
class Source:
    """Where the cluster and the workloads come from: an openb folder, or the generator."""

    trace_dir: Path | None = None
    gen_seed: int = generate.DEFAULT_SEED

    def nodes(self) -> list[NodeSpec]:
        if self.trace_dir is None:
            return generate.nodes(self.gen_seed)
        return read_nodes(self.trace_dir / NODE_FILE)

    def pods(self, workload: str) -> list[TracePod]:
        if self.trace_dir is None:
            if workload != generate.WORKLOAD_NAME:
                raise ValidationError(
                    "--workload", workload,
                    f"without --trace the only workload is {generate.WORKLOAD_NAME!r}",
                )
            return generate.pods(self.gen_seed)
        path = workload_path(self.trace_dir, workload)
        if not path.is_file():
            there = ", ".join(list_workloads(self.trace_dir)) or "none"
            raise ValidationError(
                "--workload", workload,
                f"{self.trace_dir} has no {path.name}; its workloads: {there}")
        return read_pods(path)


_CACHE: dict[tuple[Source, str], tuple[list[NodeSpec], list[TracePod]]] = {}


def _load(source: Source, workload: str) -> tuple[list[NodeSpec], list[TracePod]]:
    key = (source, workload)
    if key not in _CACHE:
        _CACHE[key] = (source.nodes(), source.pods(workload))
    return _CACHE[key]


PodsDone = Callable[[int], None]
"""Called with the number of pods a run has decided since its last call."""

_SHARED: Any = None  # in a worker process: the parent's counter of pods decided


def _share(counter: Any) -> None:
    global _SHARED
    _SHARED = counter


def _add_to_shared(n: int) -> None:
    with _SHARED.get_lock():
        _SHARED.value += n


def _task(
    source: Source, workload: str, policy: str, seed: int, inflation: float,
    gpu_choice: str = "policy", on_pods: PodsDone | None = None, headline_only: bool = False,
) -> RunResult:
    nodes, pods = _load(source, workload)
    if on_pods is None and _SHARED is not None:
        on_pods = _add_to_shared
    reported = 0

    def progress(i: int) -> None:
        nonlocal reported
        if on_pods is not None and i > reported:
            on_pods(i - reported)
            reported = i

    r = run_one(nodes, pods, policy, seed, workload, target_workload(pods), inflation,
                on_progress=progress, gpu_choice=gpu_choice, headline_only=headline_only)
    progress(r.pods)
    return r


def stream_lengths(
    source: Source, workloads: Sequence[str], seeds: Sequence[int], inflation: float,
    headline_only: bool = False,
) -> dict[tuple[str, int], int]:
    """Pods in each (workload, seed)'s stream: what every policy's run of it decides (up to
    the headline's last pod with ``headline_only``, see :func:`.engine.headline_length`)."""
    out = {}
    for w in workloads:
        nodes, pods = _load(source, w)
        state = ClusterState(nodes)
        capacity = int(state.gpu_count[: state.n].sum())
        for s in seeds:
            seq = stream(pods, capacity, s, inflation)
            out[(w, s)] = headline_length(seq, capacity) if headline_only else len(seq)
    return out


@dataclass
class Summary:
    policy: str
    workload: str
    seeds: list[int]
    runs: list[RunResult]
    gpu_choice: str = "policy"

    @property
    def unallocated(self) -> tuple[float, float]:
        v = [r.unallocated_pct for r in self.runs]
        return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else 0.0)

    @property
    def frag(self) -> float:
        return statistics.fmean(r.frag_pct for r in self.runs)

    @property
    def pods_per_s(self) -> float:
        t = sum(r.decision_seconds for r in self.runs)
        return sum(r.pods for r in self.runs) / t if t > 0 else 0.0

    @property
    def curve(self) -> list[float | None]:
        out: list[float | None] = []
        for i in range(len(self.runs[0].curve)):
            vals = [r.curve[i] for r in self.runs if r.curve[i] is not None]
            out.append(round(statistics.fmean(vals), 3) if vals else None)  # type: ignore[arg-type]
        return out

    def to_json(self) -> dict[str, object]:
        mean, sd = self.unallocated
        return {
            "policy": self.policy,
            "workload": self.workload,
            "gpu_choice": self.gpu_choice,
            "seeds": self.seeds,
            "unallocated_pct": {"mean": round(mean, 3), "sd": round(sd, 3)},
            "per_seed_unallocated_pct": [r.unallocated_pct for r in self.runs],
            "frag_pct": round(self.frag, 3),
            "curve": [
                {"arrived_pct": x, "allocated_pct": y}
                for x, y in enumerate(self.curve) if y is not None
            ],
            "pods_per_s": round(self.pods_per_s, 1),
        }


def run_matrix(
    source: Source,
    workloads: Sequence[str],
    policies: Sequence[str],
    seeds: Sequence[int],
    *,
    inflation: float = 1.3,
    jobs: int | None = None,
    on_done: Callable[[RunResult], None] | None = None,
    gpu_choice: str = "policy",
    on_pods: Callable[[int], None] | None = None,
    poll_s: float = 0.25,
    headline_only: bool = False,
) -> list[Summary]:
    """``gpu_choice``: ``policy`` (the policy's own GPUs inside the node) or ``allocator``
    (kube-scheduler's DRA allocator's: the first that fit, in device order). ``on_done`` gets
    each finished run; ``on_pods`` the number of pods decided so far over all runs (every
    ``poll_s`` seconds with worker processes, every few hundred pods without).
    ``headline_only``: each run stops once the headline is known (its curve ends near 101 %);
    the headline and the fragmentation are those of the whole run."""
    for w in workloads:  # fail early, with a clear message, on a missing workload
        _load(source, w)
    # seed by seed, every policy of a seed together: the pace of the first runs is the pace
    # of the whole, so the time left estimated from it holds
    tasks = [(w, p, s) for w in workloads for s in seeds for p in policies]
    results: dict[tuple[str, str, int], RunResult] = {}
    jobs = jobs or min(len(tasks), os.cpu_count() or 1)
    if jobs <= 1:
        done = 0

        def count(n: int) -> None:
            nonlocal done
            done += n
            if on_pods:
                on_pods(done)

        for w, p, s in tasks:
            r = _task(source, w, p, s, inflation, gpu_choice, count, headline_only)
            results[(w, p, s)] = r
            if on_done:
                on_done(r)
    else:
        counter = multiprocessing.Value("q", 0)
        with ProcessPoolExecutor(max_workers=jobs, initializer=_share,
                                 initargs=(counter,)) as pool:
            futs: dict[Future[RunResult], tuple[str, str, int]] = {
                pool.submit(_task, source, w, p, s, inflation, gpu_choice, None,
                            headline_only): (w, p, s)
                for w, p, s in tasks}
            pending = set(futs)
            try:
                while pending:
                    finished, pending = wait(pending, timeout=poll_s,
                                             return_when=FIRST_COMPLETED)
                    if on_pods:
                        on_pods(int(counter.value))
                    for f in sorted(finished, key=lambda f: tasks.index(futs[f])):
                        r = f.result()
                        results[futs[f]] = r
                        if on_done:
                            on_done(r)
            except BaseException:  # a failed run or ^C: the runs not started yet never start
                for f in pending:
                    f.cancel()
                raise
    out = []
    for w in workloads:
        for p in policies:
            out.append(Summary(p, w, list(seeds), [results[(w, p, s)] for s in seeds],
                               gpu_choice))
    return out
