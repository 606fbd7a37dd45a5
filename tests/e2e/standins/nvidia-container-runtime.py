"""A stand-in for NVIDIA's container runtime (nvidia-container-runtime), for nodes without a GPU.

containerd's runc shim calls it as it would call runc (``BinaryName``); every call goes on to the
real runc unchanged, except ``create``: there, as NVIDIA's runtime does for a container whose
environment names GPUs (``NVIDIA_VISIBLE_DEVICES`` neither empty, ``void`` nor ``none``), it adds
the driver's files to the bundle's config.json, read-only bind mounts from the node's driver root:

    <driver>/lib/libnvidia-ml.so.1          -> /usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1
    <driver>/lib/libcuda.so.1               -> /usr/lib/x86_64-linux-gnu/libcuda.so.1
    <driver>/bin/nvidia-cuda-mps-control    -> /usr/bin/nvidia-cuda-mps-control

and ``FAKENVML_GPUS`` (the node's fake GPUs, read by the fake NVML). A driver sees every compute
process on the node; the fake NVML reads them from one node-wide list instead: when the driver root
has a ``fakenvml`` directory, it is mounted read-only at ``/run/fakenvml`` and
``FAKENVML_PROCS_FILE=/run/fakenvml/procs`` is set (the directory, not the file, so that a list
replaced whole is seen at once). No device node is added: the GPUs are fake. Usage (a per-node wrapper script execs it):

    python nvidia-container-runtime.py --runc PATH --driver-root DIR --gpus SPEC -- RUNC-ARGS...
"""

from __future__ import annotations

import json
import os
import sys

FILES = (
    ("lib/libnvidia-ml.so.1", "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"),
    ("lib/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"),
    ("bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-control"),
)
PROCS_DIR = ("fakenvml", "/run/fakenvml")  # the node's list of GPU processes (fakenvml.c)


def _bundle(args: list[str]) -> str | None:
    """The bundle directory of a ``create`` call (``--bundle DIR``/``-b DIR``, default cwd)."""
    if "create" not in args:
        return None
    rest = args[args.index("create") + 1:]
    for i, a in enumerate(rest):
        if a in ("--bundle", "-b") and i + 1 < len(rest):
            return rest[i + 1]
        if a.startswith("--bundle="):
            return a.split("=", 1)[1]
    return os.getcwd()


def inject(config: dict, driver_root: str, gpus: str) -> bool:
    """Add the driver's files, FAKENVML_GPUS and the process list (FAKENVML_PROCS_FILE) to an
    OCI config when its env names GPUs; return whether it did."""
    env = config.get("process", {}).get("env", [])
    visible = next((e.split("=", 1)[1] for e in env if e.startswith("NVIDIA_VISIBLE_DEVICES=")),
                   "")
    if visible.strip() in ("", "void", "none"):
        return False
    mounts = config.setdefault("mounts", [])
    have = {m.get("destination") for m in mounts}
    for rel, dest in FILES:
        src = os.path.join(driver_root, rel)
        if dest not in have and os.path.exists(src):
            mounts.append({"destination": dest, "type": "bind", "source": src,
                           "options": ["rbind", "ro", "nosuid", "nodev"]})
    added = [f"FAKENVML_GPUS={gpus}"]
    procs = os.path.join(driver_root, PROCS_DIR[0])
    if os.path.isdir(procs) and PROCS_DIR[1] not in have:
        mounts.append({"destination": PROCS_DIR[1], "type": "bind", "source": procs,
                       "options": ["rbind", "ro", "nosuid", "nodev"]})
        added.append(f"FAKENVML_PROCS_FILE={PROCS_DIR[1]}/procs")
    keys = tuple(a.split("=", 1)[0] + "=" for a in added)
    config["process"]["env"] = [e for e in env if not e.startswith(keys)] + added
    return True


def main(argv: list[str]) -> int:
    sep = argv.index("--")
    opts = dict(zip(argv[0:sep:2], argv[1:sep:2], strict=True))
    runc, driver_root, gpus = opts["--runc"], opts["--driver-root"], opts["--gpus"]
    args = argv[sep + 1:]
    bundle = _bundle(args)
    if bundle is not None:
        path = os.path.join(bundle, "config.json")
        with open(path) as f:
            config = json.load(f)
        if inject(config, driver_root, gpus):
            tmp = path + ".nvidia"
            with open(tmp, "w") as f:
                json.dump(config, f)
            os.replace(tmp, path)
    os.execv(runc, [runc, *args])
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
