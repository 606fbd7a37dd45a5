"""``sharegpu whatif --free-gpus K``: the fewest evictions of pods a controller re-creates that
leave K more GPUs whole and free once the policy places the evicted pods again; never a bare
pod, never against a PodDisruptionBudget; printed, never run."""

from __future__ import annotations

import json

from sharegpu.cli import main as sharegpu
from sharegpu.core.placement.base import get_policy
from sharegpu.core.scheduler import Scheduler
from sharegpu.whatif.cluster import read
from sharegpu.whatif.repack import plan
from sharegpu_testing import kobjects
from test_whatif import _write, bound


def cluster_doc(bare: str = "") -> dict:
    """a: 2 × 16 GiB, p1 (8) on GPU 0, p3 (4) on GPU 1; b: 1 × 16 GiB, p2 (8)."""
    pods = [bound("p1", "a", 8, 0, created=1, owner=bare != "p1"),
            bound("p3", "a", 4, 1, created=2, owner=bare != "p3"),
            bound("p2", "b", 8, 0, created=3, owner=bare != "p2")]
    pods[0]["metadata"]["labels"]["app"] = "one"
    return {"kind": "List", "items": [kobjects.node("a", [16, 16]), kobjects.node("b", [16]),
                                      *pods]}


def pdb(allowed: int, app: str = "one") -> dict:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": {"name": f"pdb-{app}", "namespace": "default"},
            "spec": {"selector": {"matchLabels": {"app": app}}},
            "status": {"disruptionsAllowed": allowed}}


def _read(doc: dict):
    items = doc["items"]
    return read([o for o in items if o["kind"] == "Node"], [o for o in items if o["kind"] == "Pod"])


def whole_free(state) -> int:
    n = state.n
    return int((state.gpu_exists[:n] & (state.gpu_pods[:n] == 0)
                & (state.gpu_free[:n] == state.gpu_total[:n])).sum())


def check_applied(cluster, keys: list[str], policy: str, k: int) -> None:
    """The plan applied to a fresh state: evict, let the policy place each pod again."""
    state, _ = cluster.state()
    before = whole_free(state)
    pol = get_policy(policy)
    cluster.learned(pol).prepare(state)
    sched = Scheduler(state, pol, tie_break="order")
    pods = {p.key: p for p in cluster.pods}
    for key in keys:
        sched.release(key)
    for key in keys:
        assert sched.schedule(pods[key].request, cluster.among(pods[key].selector)) is not None
    assert whole_free(state) - before >= k


def test_the_plan_frees_the_gpus_it_promises_and_leaves_the_state_as_it_was():
    cluster = _read(cluster_doc())
    state, _ = cluster.state()
    before = state.fingerprint()
    p = plan(cluster, state, "bestfit", 1, [])
    assert state.fingerprint() == before
    assert p.exact and len(p.evict) == 1 and p.freed >= 1 and p.lower_bound == 1
    check_applied(cluster, [x.key for x in p.evict], "bestfit", 1)
    # two GPUs: the cluster holds 20 GiB on three 16 GiB GPUs, so one is the most
    p2 = plan(cluster, state, "bestfit", 2, [])
    assert p2.evict == [] and "no set of GPUs" in p2.note


def test_never_a_bare_pod_nor_against_a_budget():
    cluster = _read(cluster_doc())
    state, _ = cluster.state()
    free_p1 = plan(cluster, state, "bestfit", 1, [])
    assert [x.key for x in free_p1.evict] == ["default/p1"]
    blocked = plan(cluster, state, "bestfit", 1, [pdb(0)])
    assert "default/p1" not in [x.key for x in blocked.evict] and blocked.evict
    assert blocked.skipped == {"held by a pod whose PodDisruptionBudget allows no disruption": 1}
    check_applied(cluster, [x.key for x in blocked.evict], "bestfit", 1)
    assert [x.key for x in plan(cluster, state, "bestfit", 1, [pdb(1)]).evict] == ["default/p1"]
    bare = _read(cluster_doc(bare="p1"))
    s2, _ = bare.state()
    got = plan(bare, s2, "bestfit", 1, [])
    assert "default/p1" not in [x.key for x in got.evict]
    assert got.skipped == {"held by a bare or static pod": 1}
    unknown = plan(cluster, state, "bestfit", 1, None)  # budgets not known: nothing evicted
    assert unknown.evict == [] and "PodDisruptionBudgets unknown" in next(iter(unknown.skipped))


def test_cli_prints_the_evictions(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    doc = cluster_doc()
    doc["items"].append(pdb(0, app="none"))
    path = _write(tmp_path, doc)
    assert sharegpu(["whatif", str(path), "--policy", "bestfit", "--current-policy", "bestfit",
                     "--free-gpus", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["repack"]
    assert r["policy"] == "bestfit" and r["evictions"] == 1 and r["exact"]
    assert r["commands"] == [
        "kubectl create --raw /api/v1/namespaces/default/pods/p1/eviction -f - <<< "
        '\'{"apiVersion":"policy/v1","kind":"Eviction","metadata":{"name":"p1",'
        '"namespace":"default"}}\'']
    assert sharegpu(["whatif", str(path), "--policy", "bestfit", "--free-gpus", "1"]) == 0
    text = capsys.readouterr().out
    assert "Re-pack plan to free 1 GPU(s) under default: 1 eviction(s)" in text
    assert "/eviction -f - <<<" in text


def test_fit_a_pending_pod(capsys, tmp_path, monkeypatch):
    """A 12 GiB pod fits no GPU (8, 12 and 8 GiB free); evicting p3 (4 GiB on a's GPU 1)
    makes room (evicting p1 would too, moving more memory), and p3 goes elsewhere."""
    from sharegpu.core.nodeselector import NodeSelector
    from sharegpu.whatif.headroom import parse_shape
    from sharegpu.whatif.repack import fit

    cluster = _read(cluster_doc())
    state, _ = cluster.state()
    before = state.fingerprint()
    want = parse_shape("gpu-mem=13")
    p = fit(cluster, state, "bestfit", want, NodeSelector(), [])
    assert state.fingerprint() == before
    assert [x.key for x in p.evict] == ["default/p3"] and p.exact and p.lower_bound == 1
    assert "goes to a" in p.note and p.placed_again["default/p3"] in ("a", "b")
    assert fit(cluster, state, "bestfit", parse_shape("gpu-mem=8"), NodeSelector(), []
               ).note == "the pod fits now: nothing to evict"
    other = fit(cluster, state, "bestfit", want, NodeSelector(), [pdb(0, "none")])
    assert [x.key for x in other.evict] == ["default/p3"]  # a budget of other pods
    blocked = fit(cluster, state, "bestfit", want, NodeSelector(), None)
    assert blocked.evict == [] and "no plan" in blocked.note
    monkeypatch.setenv("COLUMNS", "200")
    path = _write(tmp_path, cluster_doc())
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(json.dumps(kobjects.pod("big", mem=13)))
    assert sharegpu(["whatif", str(path), "--policy", "bestfit", "--current-policy", "bestfit",
                     "--fit", str(manifest), "--assume-no-pdbs", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["repack"]
    assert r["fit"] == "default/big" and r["evict"][0]["pod"] == "default/p3"
