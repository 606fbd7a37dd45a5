# One image for every sharegpu component:
#   sharegpu extender   the kube-scheduler extender (Deployment)
#   sharegpu agent      the node agent / device plugin (DaemonSet)
#   sharegpu webhook    the validating admission webhook (Deployment)
#   kubectl-inspect-cgpu
# Build: docker build -t ghcr.io/sharegpu/sharegpu:0.1.0 .

FROM python:3.12-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir --upgrade pip \
 && pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.12-slim-bookworm
LABEL org.opencontainers.image.title="sharegpu" \
      org.opencontainers.image.description="GPU sharing for Kubernetes: extender, node agent, webhook" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl \
 && rm -rf /wheels \
 && sharegpu --help >/dev/null \
 && kubectl-inspect-cgpu --help >/dev/null
ENV PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# Non-root by default; the agent's DaemonSet runs it as root for the kubelet's socket directory.
USER 65532:65532
ENTRYPOINT ["sharegpu"]
CMD ["--help"]
