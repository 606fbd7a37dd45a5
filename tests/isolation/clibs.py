"""Builds the C stand-ins of the isolation tests with gcc: a fake CUDA driver (``libcuda.so.1``
from fakecuda.c) and a stand-in for HAMi-core's interposer (``libvgpu.so`` from
standin_vgpu.c). Used by this folder's conftest.py and by other tests that need a fake GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _cc() -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "gcc is needed to build the fake libcuda.so.1 and the stand-in libvgpu.so"
    return cc


def build_fake_cuda(dest_dir: str | Path) -> str:
    """Compiles fakecuda.c to ``dest_dir/libcuda.so.1``; returns ``dest_dir`` (the folder to put
    on ``LD_LIBRARY_PATH``)."""
    d = Path(dest_dir)
    d.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [_cc(), "-shared", "-fPIC", "-O1", "-Wall", "-o", str(d / "libcuda.so.1"),
         str(HERE / "fakecuda.c"), "-lm"],
        check=True,
    )
    return str(d)


def build_standin_vgpu(dest_dir: str | Path, cuda_dir: str | Path) -> str:
    """Compiles standin_vgpu.c to ``dest_dir/libvgpu.so`` (it dlopens ``libcuda.so.1``, found
    in ``cuda_dir`` through ``LD_LIBRARY_PATH`` at run time); returns the library's path."""
    assert (Path(cuda_dir) / "libcuda.so.1").is_file(), f"no libcuda.so.1 in {cuda_dir}"
    d = Path(dest_dir)
    d.mkdir(parents=True, exist_ok=True)
    out = d / "libvgpu.so"
    subprocess.run(
        [_cc(), "-shared", "-fPIC", "-O1", "-Wall", "-o", str(out),
         str(HERE / "standin_vgpu.c"), "-ldl", "-lpthread"],
        check=True,
    )
    return str(out)
