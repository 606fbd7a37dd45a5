"""The isolation-check tests: a package, so that its conftest.py is ``isolation.conftest`` and
does not hide the top-level ``conftest`` other tests import from. Other tests can use the fake
CUDA driver with ``from isolation.conftest import fake_cuda_dir, standin_vgpu`` (fixtures) or
``from isolation.clibs import build_fake_cuda, build_standin_vgpu``."""
