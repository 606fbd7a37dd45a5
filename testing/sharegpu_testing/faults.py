"""Fault injection for the fake API server: error rates, latency, dropped watches, history
compaction (410 on resume) and outages. Random draws come from one seeded generator, so a
test that makes the same requests in the same order sees the same faults."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from . import status as st
from .store import Store

READ_VERBS = frozenset({"get", "list", "watch"})
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
ALL_VERBS = READ_VERBS | WRITE_VERBS
_ALIASES = {"read": READ_VERBS, "reads": READ_VERBS, "write": WRITE_VERBS, "writes": WRITE_VERBS}


def _verbs(verbs: str | Iterable[str] | None) -> frozenset[str] | None:
    if verbs is None:
        return None
    items = [verbs] if isinstance(verbs, str) else list(verbs)
    out: set[str] = set()
    for v in items:
        if v in _ALIASES:
            out |= _ALIASES[v]
        elif v in ALL_VERBS:
            out.add(v)
        else:
            raise ValueError(f"unknown verb {v!r}: use one of {sorted(ALL_VERBS | set(_ALIASES))}")
    return frozenset(out)


def _resources(resources: str | Iterable[str] | None) -> frozenset[str] | None:
    if resources is None:
        return None
    return frozenset([resources] if isinstance(resources, str) else resources)


@dataclass
class FaultRule:
    """One injected behaviour for requests matching ``verbs`` x ``resources`` (None: all).

    A resource ``pods`` matches pods and its subresources (``pods/binding``, ``pods/status``);
    ``pods/binding`` matches that subresource only. ``times`` bounds how often it fires.
    """

    verbs: frozenset[str] | None
    resources: frozenset[str] | None
    rate: float = 1.0
    code: int | None = None  # error to answer with; None for a pure latency rule
    latency: float = 0.0
    after_commit: bool = False  # apply the write, then answer the error (a lost response)
    times: int | None = None
    fired: int = 0
    cut_watch: str | None = None  # "clean" or "abrupt": end a watch after an event it sent
    lands: bool = False  # the request completes after its latency even if its client left

    def matches(self, verb: str, resource: str) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        if self.verbs is not None and verb not in self.verbs:
            return False
        if self.resources is None:
            return True
        base = resource.split("/", 1)[0]
        base_short = base.split(".", 1)[0]
        return any(r in (resource, base, base_short) for r in self.resources)


@dataclass
class Injected:
    verb: str
    resource: str
    name: str
    code: int
    after_commit: bool


@dataclass
class Decision:
    latency: float = 0.0
    error: st.StatusError | None = None
    after_commit: bool = False
    lands: bool = False
    rules: list[FaultRule] = field(default_factory=list)


class Faults:
    """The fault controller of one fake API server (``server.faults``)."""

    def __init__(self, store: Store, seed: int = 0) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._rules: list[FaultRule] = []
        self._down_until: float | None = None
        self.injected: list[Injected] = []

    # ---------------------------------------------------------------- configuration

    def reseed(self, seed: int) -> None:
        with self._lock:
            self._rng = random.Random(seed)

    def fail(
        self,
        *,
        verbs: str | Iterable[str] | None = None,
        resources: str | Iterable[str] | None = None,
        rate: float = 1.0,
        code: int = 500,
        times: int | None = None,
        after_commit: bool = False,
    ) -> FaultRule:
        """Answer matching requests with the error the real server gives for ``code`` (409
        Conflict, 429 TooManyRequests, 500 InternalError, 503, 504 Timeout, ...) with
        probability ``rate``. ``after_commit`` performs the write first (the client sees an
        error for a write that happened). ``verbs`` takes API verbs or ``read``/``write``."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate={rate!r}: must be within [0, 1]")
        rule = FaultRule(_verbs(verbs), _resources(resources), rate, code, 0.0, after_commit, times)
        with self._lock:
            self._rules.append(rule)
        return rule

    def delay(
        self,
        seconds: float,
        *,
        verbs: str | Iterable[str] | None = None,
        resources: str | Iterable[str] | None = None,
        rate: float = 1.0,
        times: int | None = None,
        lands: bool = False,
    ) -> FaultRule:
        """Add ``seconds`` of latency before matching requests are handled. ``lands``: the
        request is carried out after the latency even when its client gave up meanwhile, as
        kube-apiserver's storage commits a write already under way (otherwise a client that
        goes away cancels it)."""
        if seconds < 0:
            raise ValueError(f"seconds={seconds!r}: must be >= 0")
        rule = FaultRule(_verbs(verbs), _resources(resources), rate, None, seconds, False, times,
                         lands=lands)
        with self._lock:
            self._rules.append(rule)
        return rule

    def flaky_watches(
        self,
        rate: float,
        *,
        resources: str | Iterable[str] | None = None,
        abrupt: bool = False,
        times: int | None = None,
    ) -> FaultRule:
        """After each event a watch sends, end that watch with probability ``rate`` (cleanly,
        as a server-side timeout does, or by cutting the connection when ``abrupt``)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate={rate!r}: must be within [0, 1]")
        rule = FaultRule(
            frozenset({"watch"}),
            _resources(resources),
            rate,
            None,
            0.0,
            False,
            times,
            cut_watch="abrupt" if abrupt else "clean",
        )
        with self._lock:
            self._rules.append(rule)
        return rule

    def cut_after_event(self, resource: str) -> str | None:
        """Whether a watch of ``resource`` ends after the event it just sent: None, "clean"
        or "abrupt". Called by the server once per event sent."""
        with self._lock:
            for rule in self._rules:
                if rule.cut_watch is None or not rule.matches("watch", resource):
                    continue
                if rule.rate < 1.0 and self._rng.random() >= rule.rate:
                    continue
                rule.fired += 1
                return rule.cut_watch
        return None

    def remove(self, rule: FaultRule) -> None:
        with self._lock:
            if rule in self._rules:
                self._rules.remove(rule)

    def clear(self) -> None:
        """Remove every rule and end an outage."""
        with self._lock:
            self._rules.clear()
            self._down_until = None

    def drop_watches(
        self, resources: str | Iterable[str] | None = None, *, abrupt: bool = False
    ) -> int:
        """Close the open watches now (all, or those of ``resources``). A clean close ends the
        chunked response, as when the server's watch timeout expires; ``abrupt`` cuts the TCP
        connection mid-stream. Returns how many were closed."""
        return self._store.close_watches(_resources(resources), abrupt=abrupt)

    def compact(self) -> int:
        """Forget the change history: resuming a watch (or an exact list, or a continue token)
        from any older resourceVersion now gets 410 Expired. Returns the current resourceVersion."""
        return self._store.compact()

    def unavailable(self, seconds: float | None = None, *, drop_watches: bool = True) -> None:
        """Answer every request with 503 ServiceUnavailable, for ``seconds`` or until
        :meth:`available`; open watches are cut as well unless ``drop_watches`` is False."""
        with self._lock:
            self._down_until = float("inf") if seconds is None else time.monotonic() + seconds
        if drop_watches:
            self._store.close_watches(abrupt=True)

    def available(self) -> None:
        with self._lock:
            self._down_until = None

    @property
    def is_down(self) -> bool:
        with self._lock:
            return self._down_until is not None and time.monotonic() < self._down_until

    # ---------------------------------------------------------------- decisions

    def decide(self, verb: str, resource: str, name: str = "", group: str = "") -> Decision:
        """What happens to one request; called once per API request by the server."""
        if self.is_down:
            return Decision(error=st.unavailable())
        d = Decision()
        with self._lock:
            for rule in self._rules:
                if rule.cut_watch is not None or not rule.matches(verb, resource):
                    continue
                if rule.rate < 1.0 and self._rng.random() >= rule.rate:
                    continue
                rule.fired += 1
                d.rules.append(rule)
                d.latency += rule.latency
                d.lands = d.lands or rule.lands
                if rule.code is not None and d.error is None:
                    plural = resource.split("/", 1)[0]
                    d.error = st.by_code(rule.code, plural, name, group)
                    d.after_commit = rule.after_commit and verb in WRITE_VERBS
                    self.injected.append(Injected(verb, resource, name, rule.code, d.after_commit))
        return d
