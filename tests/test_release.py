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
    assert project["license"] == {"text": "Apache-2.0"}


def test_one_version_and_a_changelog_section_for_it():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == version()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## \[{re.escape(version())}\]", changelog, flags=re.M)
    assert "## [Unreleased]" in changelog


def test_the_workflow_runs_on_version_tags_after_the_tests():
    wf = workflow()
    assert wf["on"] == {"push": {"tags": ["v*"]}}
    assert wf["jobs"]["release"]["needs"] == "test"
    assert "bash scripts/test.sh" in runs("test").splitlines()
    perms = wf["jobs"]["release"]["permissions"]
    assert perms["id-token"] == "write" and perms["packages"] == "write"
    assert wf["permissions"] == {"contents": "read"}


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
    assert 'helm push "dist/sharegpu-$version.tgz" "$CHART_REPO"' in text
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


def test_the_version_checks_of_the_workflow_read_this_repository():
    (step,) = [s for s in steps("test") if "the tag" in s.get("name", "")]
    env = {"GITHUB_REF_NAME": f"v{version()}", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(["bash", "-eo", "pipefail", "-c", step["run"]], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    env["GITHUB_REF_NAME"] = "v9.9.9"
    r = subprocess.run(["bash", "-eo", "pipefail", "-c", step["run"]], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0


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


def test_the_test_job_keeps_gos_caches_between_runs():
    (go,) = [s for s in workflow()["jobs"]["test"]["steps"]
             if str(s.get("uses", "")).startswith("actions/setup-go")]
    assert go["with"]["cache"] is True
    assert go["with"]["cache-dependency-path"] == "e2e/**/go.sum"
    assert sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("e2e/**/go.sum"))
