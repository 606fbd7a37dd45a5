"""The chart's hami-mps values: the agent told which back-end core_mem nodes get, HAMi-core
installed and the MPS control daemon run for it, and bad values refused naming the field."""

from __future__ import annotations

from test_chart import CHART, KUBE, args_of, init_container, one, render, run_helm, sidecar


def test_core_mem_on_hami_mps_installs_and_runs_both_parts():
    default = one(render(None), "DaemonSet", "agent")
    assert "--core-mem-isolation=hami" in args_of(default)  # opt-in: hami stays the default
    for ds in (one(render("core-mem-hami-mps.yaml"), "DaemonSet", "agent"),
               one(render(None, KUBE, "isolation=hami-mps"), "DaemonSet", "agent")):
        args = args_of(ds)
        assert init_container(ds, "hami-install") is not None  # HAMi-core from HAMi's image
        assert "--hami-installed=/usr/local/vgpu/sharegpu/installed" in args
        mps = sidecar(ds, "mps-control")  # the MPS control daemon
        assert mps is not None and mps["securityContext"]["runAsUser"] == 0
        assert "--mps-pipe-dir=/run/nvidia/mps" in args
    example = args_of(one(render("core-mem-hami-mps.yaml"), "DaemonSet", "agent"))
    assert "--isolation=auto" in example and "--core-mem-isolation=hami-mps" in example
    # mps alone installs no HAMi-core; hami alone runs no MPS daemon
    mps_only = one(render("mps.yaml"), "DaemonSet", "agent")
    assert "initContainers" not in mps_only["spec"]["template"]["spec"]
    hami_only = one(render(None, KUBE, "isolation=hami"), "DaemonSet", "agent")
    assert sidecar(hami_only, "mps-control") is None


def test_bad_hami_mps_values_are_refused_naming_the_field():
    r = run_helm("template", "x", str(CHART), "--set", "coreMemIsolation=mps")
    assert r.returncode != 0 and "coreMemIsolation" in r.stderr and "'hami-mps'" in r.stderr
    r = run_helm("template", "x", str(CHART), "--set", "isolation=hami+mps")
    assert r.returncode != 0 and "/isolation" in r.stderr and "'hami-mps'" in r.stderr
