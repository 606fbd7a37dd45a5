"""Fixtures of the isolation tests: the fake CUDA driver and the stand-in HAMi-core interposer,
built once per session (see clibs.py)."""

from __future__ import annotations

import pytest

from .clibs import build_fake_cuda, build_standin_vgpu


@pytest.fixture(scope="session")
def fake_cuda_dir(tmp_path_factory) -> str:
    """The folder holding the fake ``libcuda.so.1`` (put it on ``LD_LIBRARY_PATH``)."""
    return build_fake_cuda(tmp_path_factory.mktemp("fakecuda"))


@pytest.fixture(scope="session")
def standin_vgpu(tmp_path_factory, fake_cuda_dir) -> str:
    """The path of the stand-in ``libvgpu.so`` (pass it as ``--hami-library``)."""
    return build_standin_vgpu(tmp_path_factory.mktemp("standin-vgpu"), fake_cuda_dir)
