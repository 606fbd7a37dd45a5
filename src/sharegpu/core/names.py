"""Every ACK-compatible name (labels, resources, annotations, env vars) lives here.

Names stay identical to Alibaba Cloud ACK's, so the seeds' commands and manifests work unchanged.
"""

from typing import Final

# --- node labels -----------------------------------------------------------------------------
LABEL_SCHEDULE: Final = "ack.node.gpu.schedule"
LABEL_PLACEMENT: Final = "ack.node.gpu.placement"
LABEL_DISABLE_ISOLATION: Final = "cgpu.disable.isolation"
LABEL_CARD_NAME: Final = "aliyun.accelerator/nvidia_name"
LABEL_CARD_MEM: Final = "aliyun.accelerator/nvidia_mem"
LABEL_CARD_COUNT: Final = "aliyun.accelerator/nvidia_count"

# --- extended resources ----------------------------------------------------------------------
RES_GPU_MEM: Final = "aliyun.com/gpu-mem"
RES_GPU_CORE: Final = "aliyun.com/gpu-core.percentage"
RES_GPU_COUNT: Final = "aliyun.com/gpu-count"
RES_NVIDIA_GPU: Final = "nvidia.com/gpu"
RES_TOPOLOGY_GPU: Final = "aliyun.com/gpu"

ALL_GPU_RESOURCES: Final = (
    RES_NVIDIA_GPU, RES_GPU_MEM, RES_GPU_CORE, RES_GPU_COUNT, RES_TOPOLOGY_GPU,
)

# --- pod labels ------------------------------------------------------------------------------
POD_LABEL_GPU_COUNT: Final = "aliyun.com/gpu-count"

# --- DRA mode: the mutating webhook's note on a pod it turned into ResourceClaims --------------
ANN_DRA_CLAIMS: Final = "sharegpu.io/dra-claims"  # {claim: template}

# --- pod annotations, first generation (open-source gpushare extender) ------------------------
ANN_MEM_IDX: Final = "ALIYUN_COM_GPU_MEM_IDX"
ANN_MEM_DEV: Final = "ALIYUN_COM_GPU_MEM_DEV"
ANN_MEM_POD: Final = "ALIYUN_COM_GPU_MEM_POD"
ANN_MEM_ASSIGNED: Final = "ALIYUN_COM_GPU_MEM_ASSIGNED"
ANN_MEM_ASSUME_TIME: Final = "ALIYUN_COM_GPU_MEM_ASSUME_TIME"

# --- pod annotations, second generation (per container) ---------------------------------------
ANN_ALLOCATION: Final = "scheduler.framework.gpushare.allocation"
ANN_CORE: Final = "gpushare.alibabacloud.com/core-percentage"
ANN_ASSIGNED: Final = "scheduler.framework.gpushare.assigned"
ANN_ASSUME_TIME: Final = "scheduler.framework.gpushare.assume-time"

# --- container environment -------------------------------------------------------------------
ENV_VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"
ENV_MEM_IDX: Final = "ALIYUN_COM_GPU_MEM_IDX"
ENV_MEM_POD: Final = "ALIYUN_COM_GPU_MEM_POD"
ENV_MEM_CONTAINER: Final = "ALIYUN_COM_GPU_MEM_CONTAINER"
ENV_MEM_DEV: Final = "ALIYUN_COM_GPU_MEM_DEV"
ENV_CGPU_DISABLE: Final = "CGPU_DISABLE"

# --- scheduling ------------------------------------------------------------------------------
CO_SCHEDULER_NAME: Final = "ack-co-scheduler"
MAX_PODS_PER_GPU: Final = 20
CORE_PER_GPU: Final = 100
CORE_STEP: Final = 5

# --- sharegpu's own node annotations (written by the node agent, read by the extender/CLI) ----
ANN_NODE_GPU_MEM: Final = "sharegpu.io/gpu-mem"  # GiB per GPU in index order, e.g. "15,15,32,32"
ANN_NODE_GPU_TOPOLOGY: Final = "sharegpu.io/gpu-topology"  # JSON matrix of nvidia-smi link kinds
ANN_NODE_LAST_MODE: Final = "sharegpu.io/last-mode"  # last explicit ack.node.gpu.schedule value
# "v1": the agent names the pod of each Allocate through the kubelet's pod-resources API, so
# look-alike pods may start together on the node (sharegpu.core.startingpods)
ANN_NODE_POD_RESOURCES: Final = "sharegpu.io/pod-resources"
# the node condition the agent keeps: is the node's isolation back-end usable (read by the
# extender's DRA diagnosis)
CONDITION_ISOLATION: Final = "GPUIsolationReady"
# the node condition the agent renews while it serves: are its device plugins (or its DRA
# plugin) registered with the kubelet and listed (sharegpu.core.agentserving)
CONDITION_AGENT_SERVING: Final = "GPUAgentServing"
