"""What a release is made of: the licence, the changelog, one version everywhere, the release
workflow (it builds the image with the tests' build script, pushes image and chart to the
registry the chart's values name, signs both), and helm for the tests from a pinned source."""

from __future__ import annotations

import re
import shlex
import subprocess
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
CHART = ROOT / "charts" / "sharegpu"


def workflow() -> dict:
    doc = yaml.safe_load(WORKFLOW.read_text())
    doc["on"] = doc.pop(True, doc.get("on"))  # YAML 1.1 reads the key `on` as true
    return doc


def steps(job: str) -> list[dict]:
    return workflow()["jobs"][job]["steps"]


def runs(job: str) -> str:
    return "\n".join(s.get("run", "") for s in steps(job))


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_license_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX" in text
    assert len(text) > 11000  # the whole text, not a pointer to it
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression (PEP 639)
    assert project["license-files"] == ["LICENSE"]


def test_one_version_and_a_changelog_section_for_a_release():
    """A release has its CHANGELOG section; main's pre-release has only [Unreleased]."""
    from packaging.version import Version

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"]
    assert Version(chart["version"]) == Version(version())
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    section = re.search(rf"^## \[{re.escape(chart['version'])}\]", changelog, flags=re.M)
    assert bool(section) != Version(version()).is_prerelease


def test_every_release_the_changelog_names_is_a_tag():
    """A section ``## [X]`` and a link to ``releases/tag/vX`` only for a tag of this history
    (the test job checks out every tag: fetch-depth 0)."""
    changelog = (ROOT / "CHANGELOG.md").read_text()
    named = set(re.findall(r"^## \[(\d[^\]]*)\]", changelog, flags=re.M))
    named |= set(re.findall(r"releases/tag/v([^\s)]+)", changelog))
    named |= set(re.findall(r"compare/v([^.\s]+\.[^.\s]+\.[^.\s]+?)\.\.\.", changelog))
    tags = subprocess.run(["git", "-C", str(ROOT), "tag", "--list", "v*"], capture_output=True,
                          text=True, check=True).stdout.split()
    assert {f"v{v}" for v in named} <= set(tags), (named, tags)


def test_the_workflow_tests_every_push_and_releases_only_tags_after_every_test():
    wf = workflow()
    assert wf["on"]["push"] == {"branches": ["main"], "tags": ["v*"]}
    assert "pull_request" in wf["on"]
    for job in ("release", "pypi"):
        assert wf["jobs"][job]["if"] == "github.ref_type == 'tag'"
    assert set(wf["jobs"]["release"]["needs"]) == {"versions", "test", "node", "dist"}
    assert wf["jobs"]["pypi"]["needs"] == "release"
    perms = wf["jobs"]["release"]["permissions"]
    assert perms["id-token"] == "write" and perms["packages"] == "write"
    assert wf["permissions"] == {"contents": "read"}


def root_tests() -> set[str]:
    """The test files that need root: a real node (tests/e2e/realnode.py), a check of the
    effective user, or the kubelet's device manager or DRA manager (the control plane binary's
    kubelet-devicemanager and kubelet-dra: a private mount namespace)."""
    out = set()
    for f in (ROOT / "tests" / "e2e").glob("test_*.py"):
        text = f.read_text()
        if re.search(r"^from \.(realnode|devicemanager_play) import|geteuid\(\) != 0"
                     r'|"kubelet-dra"', text, flags=re.M):
            out.add(f.relative_to(ROOT).as_posix())
    return out


def test_the_root_tests_run_in_the_node_job_and_every_other_in_the_test_job():
    listed = {p.relative_to(ROOT).as_posix() for pattern in workflow()["env"]["ROOT_TESTS"].split()
              for p in ROOT.glob(pattern)}
    assert listed == root_tests()
    assert "for f in $ROOT_TESTS; do ignore+=(\"--ignore=$f\"); done" in runs("test")
    assert "SHAREGPU_E2E=1 .venv/bin/python -m pytest $ROOT_TESTS" in runs("node")


def test_the_test_job_needs_no_root_and_the_node_job_asks_for_it_where_it_must():
    assert "sudo" not in runs("test") and "sudo" not in runs("dist")
    sudo = [ln.strip() for ln in runs("node").splitlines() if "sudo" in ln]
    assert sudo == ["sudo bash scripts/install-node-packages.sh",
                    'sudo env "PATH=$PATH" bash scripts/build-node-images.sh',
                    'sudo env "PATH=$PATH" SHAREGPU_E2E=1 .venv/bin/python -m pytest $ROOT_TESTS']


def test_the_workflow_runs_every_step_of_the_test_command():
    """What scripts/test.sh runs (as root on the CI machine), the two jobs run between them."""
    script = (ROOT / "scripts" / "test.sh").read_text()
    steps_ = set(re.findall(r"^bash (scripts/[\w-]+\.sh)$", script, flags=re.M))
    assert len(steps_) >= 6
    both = runs("test") + runs("node")
    for s in steps_:
        assert f"bash {s}" in both, s
    assert ".venv/bin/ruff check src tests bench testing" in runs("test")
    assert ".venv/bin/lint-imports" in runs("test")


# minutes of each build from nothing on the shared 2-core machine (docs/release.md)
COLD = {"scripts/install-tools.sh": 65, "scripts/build-controlplane.sh": 24,
        "scripts/build-node.sh": 17, "scripts/build-kube-router.sh": 20,
        "scripts/build-node-images.sh": 6}


def test_every_job_has_a_timeout_above_its_cold_build():
    """A job that builds its tools from nothing (no Go cache) still ends inside its limit, with
    time left for its tests."""
    for name, job in workflow()["jobs"].items():
        limit = job["timeout-minutes"]
        cold = sum(m for script, m in COLD.items() if script in runs(name))
        tests = 60 if "pytest" in runs(name) else 0
        assert limit >= cold + tests, (name, limit, cold, tests)


def test_the_image_is_built_by_the_shared_script_for_both_platforms_and_pushed():
    (line,) = [ln.strip() for ln in runs("release").splitlines() if "build-image.sh" in ln]
    args = shlex.split(line)
    assert args[:2] == ["bash", "scripts/build-image.sh"]
    opts = dict(zip(args[2::2], args[3::2], strict=False))
    assert opts["--builder"] == "docker"
    assert opts["--platform"] == "linux/amd64,linux/arm64"
    assert opts["--tag"] == "$IMAGE:$version" and args[-1] == "--push"


def test_image_and_chart_go_to_the_registry_the_chart_names():
    env = workflow()["env"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert env["IMAGE"] == values["image"]["repository"] == "ghcr.io/sharegpu/sharegpu"
    registry, org = env["IMAGE"].split("/")[:2]
    assert env["CHART_REPO"] == f"oci://{registry}/{org}/charts"
    text = runs("release")
    assert 'helm package charts/sharegpu' in text
    assert 'helm push "chart/sharegpu-$version.tgz" "$CHART_REPO"' in text
    login = [s for s in steps("release") if s.get("uses", "").startswith("docker/login-action")]
    assert login and login[0]["with"]["registry"] == registry


def test_both_are_signed_keyless_by_digest():
    text = runs("release")
    assert 'cosign sign --yes "$IMAGE@$IMAGE_DIGEST"' in text
    assert 'cosign sign --yes "${CHART_REPO#oci://}/sharegpu@$CHART_DIGEST"' in text
    assert "--key" not in text  # keyless: the workflow's OIDC identity
    assert any(s.get("uses", "").startswith("sigstore/cosign-installer") for s in steps("release"))


def test_every_run_block_is_valid_bash():
    for job in workflow()["jobs"]:
        for step in steps(job):
            if "run" in step:
                script = re.sub(r"\$\{\{[^}]*\}\}", "X", step["run"])
                r = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True)
                assert r.returncode == 0, (job, step.get("name"), r.stderr)


def version_step(cwd: Path, ref_type: str, ref: str) -> subprocess.CompletedProcess:
    (step,) = [s for s in steps("versions") if "one version" in s.get("name", "")]
    env = {"GITHUB_REF_NAME": ref, "REF_TYPE": ref_type, "PATH": "/usr/bin:/bin"}
    return subprocess.run(["bash", "-eo", "pipefail", "-c", step["run"]], cwd=cwd, env=env,
                          capture_output=True, text=True)


def test_the_version_checks_of_the_workflow_read_this_repository(tmp_path):
    from packaging.version import Version

    v = Version(version())
    assert version_step(ROOT, "branch", "main").returncode == (1 if not v.is_prerelease else 0)
    # main's pre-release is never released: no tag of it passes
    assert version_step(ROOT, "tag", f"v{v.base_version}").returncode != 0
    assert version_step(ROOT, "tag", "v9.9.9").returncode != 0
    # a release commit: every file says X.Y.Z and the CHANGELOG has its section
    for f in ("pyproject.toml", "CHANGELOG.md", "charts/sharegpu/Chart.yaml"):
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        text = (ROOT / f).read_text()
        text = text.replace(version(), v.base_version).replace(
            (ROOT / "charts/sharegpu/Chart.yaml").read_text().split("appVersion: ")[1].split()[0]
            .strip('"'), v.base_version)
        (tmp_path / f).write_text(text.replace("## [Unreleased]",
                                               f"## [Unreleased]\n\n## [{v.base_version}]"))
    r = version_step(tmp_path, "tag", f"v{v.base_version}")
    assert r.returncode == 0, r.stdout + r.stderr
    # on a branch, a released version only at its tag
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "release"], check=True)
    assert version_step(tmp_path, "branch", "main").returncode != 0
    subprocess.run([*git, "tag", f"v{v.base_version}"], check=True)
    r = version_step(tmp_path, "branch", "main")
    assert r.returncode == 0, r.stdout + r.stderr


def test_helm_for_the_tests_is_built_from_its_pinned_go_module():
    script = (ROOT / "scripts" / "install-tools.sh").read_text()
    assert "npm" not in script
    assert "helm.sh/helm/v4/cmd/helm" in script and "-mod=readonly" in script
    gomod = (ROOT / "e2e" / "tools" / "helm" / "go.mod").read_text()
    (pin,) = re.findall(r"^\s*helm\.sh/helm/v4 (v\d+\.\d+\.\d+)\b", gomod, flags=re.M)
    gosum = (ROOT / "e2e" / "tools" / "helm" / "go.sum").read_text()
    assert re.search(rf"^helm\.sh/helm/v4 {re.escape(pin)} h1:\S+=$", gosum, flags=re.M)
    assert re.search(rf"^helm\.sh/helm/v4 {re.escape(pin)}/go\.mod h1:\S+=$", gosum, flags=re.M)
    kube = (ROOT / "e2e" / "tools" / "kubectl" / "go.mod").read_text()
    assert re.search(r"^\s*k8s\.io/kubectl v0\.\d+\.\d+$", kube, flags=re.M)


def test_run_blocks_take_secrets_from_env_and_fail_on_a_failed_pipe():
    assert workflow()["defaults"] == {"run": {"shell": "bash"}}  # -eo pipefail
    for job in workflow()["jobs"]:
        for step in steps(job):
            assert "${{" not in step.get("run", ""), (job, step.get("name"))


def test_every_job_with_go_keeps_gos_caches_between_runs():
    jobs = workflow()["jobs"]
    gos = {name: s for name, job in jobs.items() for s in job["steps"]
           if str(s.get("uses", "")).startswith("actions/setup-go")}
    assert set(gos) == {"test", "node", "release"}
    for go in gos.values():
        assert go["with"]["cache"] is True
        assert go["with"]["cache-dependency-path"] == "e2e/**/go.sum"
    assert sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("e2e/**/go.sum"))


def test_the_wheel_and_sdist_are_built_checked_and_installed_fresh():
    text = runs("dist")
    assert "python -m build --outdir dist" in text
    assert "python -m twine check --strict dist/*" in text
    assert "python -m venv /tmp/fresh" in text
    assert "/tmp/fresh/bin/python -m pip install -q --disable-pip-version-check dist/*.whl" in text
    for cmd in ("sharegpu --version", "sharegpu policies", "kubectl-inspect-cgpu --version"):
        assert f"/tmp/fresh/bin/{cmd}" in text
    (upload,) = [s for s in steps("dist") if s.get("uses", "").startswith("actions/upload-artifact")]
    assert upload["with"]["name"] == "dist"


def test_pypi_gets_the_release_by_trusted_publishing():
    job = workflow()["jobs"]["pypi"]
    assert job["permissions"] == {"id-token": "write"}
    assert job["environment"]["name"] == "pypi"
    (publish,) = [s for s in job["steps"] if "uses" in s and "pypi-publish" in s["uses"]]
    assert publish["uses"].startswith("pypa/gh-action-pypi-publish@")
    assert "password" not in publish.get("with", {})  # no stored token: OIDC


def test_the_release_refuses_a_base_without_a_digest_and_records_an_sbom(tmp_path):
    (step,) = [s for s in steps("release") if "pinned by digest" in s.get("name", "")]
    script = step["run"].split("platforms=")[0]  # up to the registry look-up
    for i, (base, ok) in enumerate(((None, True),
                                    ("docker.io/library/python:3.12-slim-bookworm", False),
                                    ("docker.io/library/python:3.12-slim-bookworm@sha256:TODO",
                                     False))):
        d = ROOT if base is None else tmp_path / str(i)
        if base is not None:
            d.mkdir()
            (d / "Dockerfile").write_text(f"ARG BASE_IMAGE={base}\nFROM ${{BASE_IMAGE}}\n")
        r = subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=d,
                           capture_output=True, text=True)
        assert (r.returncode == 0) == ok, (base, r.stdout, r.stderr)
    text = runs("release")
    assert 'syft scan "registry:$IMAGE@$IMAGE_DIGEST"' in text
    assert 'cosign attest --yes --type spdxjson' in text
