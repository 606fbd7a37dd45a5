"""Golden tests: clusters built like the seeds' examples print the seeds' text exactly.

Seed texts are quoted below from /work/shared/spec/seeds: 000 (ACK scheduling labels; its
extraction collapsed runs of blanks, so it is compared whitespace-collapsed), 002 and 003 (which
keep the aligned columns; 002 is compared character for character).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import cgpu_cluster as cc
from sharegpu.inspect_cgpu import render
from sharegpu.inspect_cgpu.model import build

DATA = Path(__file__).parent / "data"

# seed 000, "binpack" (blanks collapsed by the extraction)
SEED000_BINPACK = """\
NAME IPADDRESS GPU0(Allocated/Total) GPU1(Allocated/Total) GPU2(Allocated/Total) GPU3(Allocated/Total) GPU Memory(GiB)
cn-shanghai.192.0.2.109 192.0.2.109 15/15 9/15 0/15 0/15 24/60
--------------------------------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
24/60 (40%)
"""
# seed 000, "spread"
SEED000_SPREAD = """\
NAME IPADDRESS GPU0(Allocated/Total) GPU1(Allocated/Total) GPU2(Allocated/Total) GPU3(Allocated/Total) GPU Memory(GiB)
cn-shanghai.192.0.2.109 192.0.2.109 4/15 4/15 0/15 4/15 12/60
--------------------------------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
12/60 (20%)
"""
# seed 002, aligned as printed there
SEED002 = """\
NAME                       IPADDRESS      GPU0(Allocated/Total)  GPU Memory(GiB)
cn-shanghai.192.168.6.104  192.168.6.104  0/15                   0/15
----------------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
0/15 (0%)
"""
# seed 003, after the sample job (blanks collapsed by the extraction)
SEED003 = """\
NAME IPADDRESS GPU0(Allocated/Total) GPU Memory(GiB)
cn-zhangjiakou.192.168.66.139 192.168.66.139 3/15 3/15
---------------------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
3/15 (20%)
"""

# The aligned form of the seed-000 samples (columns: widest cell + two spaces).
BINPACK = """\
NAME                     IPADDRESS    GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU2(Allocated/Total)  GPU3(Allocated/Total)  GPU Memory(GiB)
cn-shanghai.192.0.2.109  192.0.2.109  15/15                  9/15                   0/15                   0/15                   24/60
--------------------------------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
24/60 (40%)
"""
SPREAD = """\
NAME                     IPADDRESS    GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU2(Allocated/Total)  GPU3(Allocated/Total)  GPU Memory(GiB)
cn-shanghai.192.0.2.109  192.0.2.109  4/15                   4/15                   0/15                   4/15                   12/60
-------------------------------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
12/60 (20%)
"""
SEED003_ALIGNED = """\
NAME                           IPADDRESS       GPU0(Allocated/Total)  GPU Memory(GiB)
cn-zhangjiakou.192.168.66.139  192.168.66.139  3/15                   3/15
---------------------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
3/15 (20%)
"""
# SPEC §7's -d sample: 8 of 15 GiB allocated (53 %).
DETAILS = """\

NAME:       cn-shanghai.192.0.2.109
IPADDRESS:  192.0.2.109

NAME         NAMESPACE  GPU0(Allocated)
sample-a     default    5
sample-b     default    3
Allocated :  8 (53%)
Total :      15
---------------------------------------


Allocated/Total GPU Memory In Cluster:  8/15 (53%)
"""
CORE_MEM = """\
NAME        IPADDRESS  GPU0(Allocated/Total)  GPU1(Allocated/Total)  GPU2(Allocated/Total)  GPU3(Allocated/Total)  PENDING(Allocated)  GPU0(Core%)  GPU1(Core%)  GPU2(Core%)  GPU3(Core%)  GPU Memory(GiB)
gpu-core-1  10.0.0.11  4/15                   0/15                   0/15                   0/15                   2                   60/100       0/100        0/100        0/100        6/60
gpu-mem-1   10.0.0.12  6/15                   0/15                   0/0                    0/0                                        -            -            -            -            6/30
-----------------------------------------------------------------------------------------------------
Allocated/Total GPU Memory In Cluster:
12/90 (13%)
Allocated/Total GPU Core In Cluster:
90/400 (22%)
"""


def collapse(text: str) -> str:
    return "\n".join(" ".join(line.split()) for line in text.splitlines()) + "\n"


def view_of(doc: dict):
    items = doc["items"]
    nodes = [i for i in items if i["kind"] == "Node"]
    return build(nodes, [i for i in items if i["kind"] == "Pod"])


def test_binpack_matches_seed_000_character_for_character():
    out = render.summary(view_of(cc.binpack()))
    assert out == BINPACK
    assert collapse(out) == SEED000_BINPACK


def test_spread_matches_seed_000():
    out = render.summary(view_of(cc.spread()))
    assert out == SPREAD
    # Seed 000 prints the binpack sample's 86-dash line under the spread sample too, although
    # the spread row is one character shorter ("4/15" for "15/15"); under the rule that
    # reproduces seed 000's binpack line and seeds 002 and 003 it is 85. Every other line of the
    # seed is compared exactly.
    got, want = collapse(out).splitlines(), SEED000_SPREAD.splitlines()
    assert got[:2] == want[:2] and got[3:] == want[3:]
    assert re.fullmatch(r"-{85}", got[2]) and re.fullmatch(r"-{86}", want[2])


def test_seed_002_exactly():
    assert render.summary(view_of(cc.seed002())) == SEED002


def test_seed_003_after_the_sample_job():
    out = render.summary(view_of(cc.seed003()))
    assert out == SEED003_ALIGNED
    assert collapse(out) == SEED003


def test_details_sample():
    out = render.details(view_of(cc.details()))
    assert out == DETAILS
    assert "Allocated :  8 (53%)" in out and collapse(out).count("Total : 15") == 1


def test_core_mem_shows_compute_and_pending():
    assert render.summary(view_of(cc.core_mem())) == CORE_MEM


@pytest.mark.parametrize("key", sorted(cc.DUMPS))
def test_committed_dumps_are_current(key):
    """tests/data/*.json are what tests/cgpu_cluster.py builds (so the plugin tests below read
    the same clusters the golden tests check)."""
    assert json.loads((DATA / f"{key}.json").read_text()) == cc.DUMPS[key]()
