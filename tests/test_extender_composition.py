"""The extender's view is composed, not inherited: every class of the extender has at most one
base of the project's own, and the view holds its parts as attributes, built in its
constructor."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import sharegpu.extender as extender
from sharegpu.core.placement.learned import LearnedWorkload
from sharegpu.extender.answers import SchedulingAnswers
from sharegpu.extender.cache import ClusterCache
from sharegpu.extender.drastate import DraState
from sharegpu.extender.early_prioritize import EarlyPrioritize
from sharegpu.extender.gangs import GangScheduling
from sharegpu.extender.pickholds import PickHolds
from sharegpu.extender.view import ClusterView


def _classes() -> list[type]:
    out = []
    for info in pkgutil.iter_modules(extender.__path__):
        mod = importlib.import_module(f"sharegpu.extender.{info.name}")
        out += [c for _, c in inspect.getmembers(mod, inspect.isclass)
                if c.__module__ == mod.__name__]
    return out


def test_no_class_of_the_extender_has_more_than_one_base_of_the_project() -> None:
    classes = _classes()
    assert ClusterView in classes and len(classes) > 20
    for c in classes:
        own = [b for b in c.__bases__ if b.__module__.startswith("sharegpu.")]
        assert len(own) <= 1, (c.__qualname__, [b.__qualname__ for b in own])
    assert ClusterView.__bases__ == (object,)


def test_the_view_holds_each_part_once_and_shares_one_ledger() -> None:
    v = ClusterView("default")
    parts = {"ledger": ClusterCache, "learned": LearnedWorkload, "dra": DraState,
             "holds": PickHolds, "answers": SchedulingAnswers, "early": EarlyPrioritize,
             "gangs": GangScheduling}
    for name, cls in parts.items():
        assert type(getattr(v, name)) is cls, name
    for name in ("dra", "holds", "answers", "early", "gangs"):
        assert getattr(v, name).ledger is v.ledger, name
    assert v.ledger.gpus is v.dra and v.ledger.learned is v.learned
    # the parts' state is read and set through the view
    assert v.state is v.ledger.state and v.picks is v.holds.picks
    v.graded = True
    assert v.answers.graded is True
