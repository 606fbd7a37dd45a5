# One image for every sharegpu component:
#   sharegpu extender   the kube-scheduler extender (Deployment)
#   sharegpu agent      the node agent / device plugin (DaemonSet)
#   sharegpu webhook    the validating admission webhook (Deployment)
#   kubectl-inspect-cgpu
# Build: bash scripts/build-image.sh --tag REGISTRY/sharegpu:VERSION (docs/release.md).
#
# The base is pinned by digest (the multi-platform index of python:3.12.7-slim-bookworm, amd64
# and arm64); the release workflow checks that it resolves for both platforms. The tests build
# on a stand-in of the base: --build-arg BASE_IMAGE=<the stand-in's tag>.
ARG BASE_IMAGE=docker.io/library/python:3.12.7-slim-bookworm@sha256:032c52613401895aa3d418a4c563d2d05f993bc3ecc065c8f4e2280978acd249

FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md LICENSE constraints.txt ./
COPY src ./src
# sharegpu's wheel and every dependency's, at the versions of constraints.txt (PIP_CONSTRAINT
# also reaches the isolated build environment: setuptools and wheel pinned too)
RUN PIP_CONSTRAINT=/src/constraints.txt pip wheel --no-cache-dir --disable-pip-version-check \
        --wheel-dir /wheels .

FROM ${BASE_IMAGE}
ARG VERSION=unknown
ARG REVISION=unknown
LABEL org.opencontainers.image.title="sharegpu" \
      org.opencontainers.image.description="GPU sharing for Kubernetes: extender, node agent, webhook" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/sharegpu/sharegpu" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
COPY --from=build /wheels /wheels
# install from the built wheels only (no index), then take pip out of the image: nothing in it
# installs packages at run time
RUN pip install --no-cache-dir --disable-pip-version-check --no-index /wheels/*.whl \
 && rm -rf /wheels \
 && pip_dir=$(python -c 'import os, pip; print(os.path.dirname(pip.__file__))') \
 && rm -rf "$pip_dir" "$pip_dir"-*.dist-info /usr/local/bin/pip /usr/local/bin/pip3* \
 && ! python -c 'import pip' 2>/dev/null \
 && sharegpu --help >/dev/null \
 && kubectl-inspect-cgpu --help >/dev/null
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# Non-root by default; the agent's DaemonSet runs it as root for the kubelet's socket directory.
USER 65532:65532
ENTRYPOINT ["sharegpu"]
CMD ["--help"]
