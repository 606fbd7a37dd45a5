"""Reading openb-format traces (Alibaba cluster-trace-gpu-v2023).

Nodes: ``sn,cpu_milli,memory_mib,gpu,model``. Pods:
``name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...]`` (extra columns are ignored).
In the simulator a GPU is 1000 memory units and ``gpu_milli`` is a pod's share of one card.
Every bad row is reported with the file, line, column and rule; nothing is half-read.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import ValidationError
from ..core.modes import Mode
from ..core.request import ContainerRequest, Kind, PodRequest
from ..core.state import NodeSpec

GPU_UNITS = 1000
NODE_FILE = "openb_node_list_gpu_node.csv"
NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")
POD_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")


@dataclass(frozen=True, slots=True)
class TracePod:
    name: str
    cpu_milli: int
    mem_mib: int
    num_gpu: int
    gpu_milli: int
    gpu_spec: str = ""

    @property
    def shape(self) -> tuple[int, int, int, str]:
        return (self.cpu_milli, self.gpu_milli, self.num_gpu, self.gpu_spec)

    @property
    def gpu_demand(self) -> int:
        """GPU demand in milli-GPU (``num_gpu × gpu_milli``)."""
        return self.num_gpu * self.gpu_milli

    def request(self, name: str | None = None) -> PodRequest:
        models = frozenset(self.gpu_spec.split("|")) if self.gpu_spec else None
        if self.num_gpu == 0:
            return PodRequest(
                "trace", name or self.name, Kind.NONE, (), cpu_milli=self.cpu_milli,
                mem_mib=self.mem_mib, models=None,
            )
        c = ContainerRequest(0, "main", gpu_mem=self.gpu_milli, gpus=self.num_gpu)
        return PodRequest(
            "trace", name or self.name, Kind.SHARED, (c,), cpu_milli=self.cpu_milli,
            mem_mib=self.mem_mib, models=models,
        )


def _rows(path: Path, required: Iterable[str]) -> list[tuple[int, dict[str, str]]]:
    if not path.is_file():
        raise ValidationError("trace file", str(path), "does not exist")
    try:
        with path.open(newline="", encoding="utf-8") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            missing = [c for c in required if c not in header]
            if missing:
                raise ValidationError(
                    f"{path.name}: header", ",".join(header)[:200],
                    f"needs columns {', '.join(missing)}"
                )
            return [(n + 2, row) for n, row in enumerate(reader)]
    except UnicodeDecodeError as e:
        raise ValidationError(path.name, f"byte {e.start}", "must be UTF-8 text") from None
    except csv.Error as e:  # a field over the csv module's limit, a NUL byte, ...
        raise ValidationError(path.name, str(path), f"is not a readable CSV file ({e})"
                              ) from None
    except OSError as e:
        raise ValidationError("trace file", str(path), f"cannot be read ({e.strerror or e})"
                              ) from None


# Bounds far above any real machine, so a typo or a hostile file cannot make the simulator
# allocate huge arrays or overflow numpy's int64.
MAXIMA = {"gpu": 64, "num_gpu": 64, "cpu_milli": 10**9, "memory_mib": 10**12,
          "gpu_milli": 1000}


def _int(path: Path, line: int, row: dict[str, str], col: str, minimum: int = 0) -> int:
    raw = (row.get(col) or "").strip()
    field = f"{path.name}:{line}: {col}"
    if not raw.isascii() or len(raw) > 20:
        raise ValidationError(field, raw[:20], "must be a whole number")
    try:
        v = int(raw)
    except ValueError:
        raise ValidationError(field, raw, "must be a whole number") from None
    if v < minimum:
        raise ValidationError(field, raw, f"must be at least {minimum}")
    top = MAXIMA.get(col)
    if top is not None and v > top:
        raise ValidationError(field, raw, f"must be at most {top}")
    return v


def read_nodes(path: Path) -> list[NodeSpec]:
    nodes = []
    seen: dict[str, int] = {}
    for line, row in _rows(path, NODE_COLUMNS):
        name = (row.get("sn") or "").strip()
        if name in seen:
            raise ValidationError(f"{path.name}:{line}: sn", name,
                                  f"names a node already listed on line {seen[name]}: node "
                                  "names must be unique")
        if name:
            seen[name] = line
        gpus = _int(path, line, row, "gpu")
        if gpus == 0:
            continue
        nodes.append(
            NodeSpec(
                name=row["sn"].strip() or f"node-{line}",
                gpu_mem=[GPU_UNITS] * gpus,
                mode=Mode.CGPU,
                model=(row.get("model") or "").strip(),
                cpu_milli=_int(path, line, row, "cpu_milli"),
                mem_mib=_int(path, line, row, "memory_mib"),
            )
        )
    if not nodes:
        raise ValidationError(path.name, str(path), "holds no GPU node")
    return nodes


def read_pods(path: Path) -> list[TracePod]:
    pods = []
    for line, row in _rows(path, POD_COLUMNS):
        num_gpu = _int(path, line, row, "num_gpu")
        milli = _int(path, line, row, "gpu_milli")
        if num_gpu and not 0 < milli <= GPU_UNITS:
            raise ValidationError(
                f"{path.name}:{line}: gpu_milli", milli, "must be between 1 and 1000 for a GPU pod"
            )
        if num_gpu > 1 and milli != GPU_UNITS:
            raise ValidationError(
                f"{path.name}:{line}: gpu_milli", milli, "must be 1000 when num_gpu > 1"
            )
        spec = (row.get("gpu_spec") or "").strip()
        if spec.lower() == "nan":
            spec = ""
        pods.append(
            TracePod(
                name=row["name"].strip() or f"pod-{line}",
                cpu_milli=_int(path, line, row, "cpu_milli"),
                mem_mib=_int(path, line, row, "memory_mib"),
                num_gpu=num_gpu,
                gpu_milli=milli if num_gpu else 0,
                gpu_spec=spec,
            )
        )
    if not pods:
        raise ValidationError(path.name, str(path), "holds no pod")
    return pods


def workload_path(trace_dir: Path, workload: str) -> Path:
    return trace_dir / f"openb_pod_list_{workload}.csv"


def list_workloads(trace_dir: Path) -> list[str]:
    prefix = "openb_pod_list_"
    return sorted(p.stem[len(prefix):] for p in trace_dir.glob(f"{prefix}*.csv"))
