"""Tests marked `sandbox` grade or run candidate code through the kernel boundary (bubblewrap and
the verifier env). Where no sandbox can be made here they skip, saying exactly why; everywhere
else (CI included) they run. The grader itself never falls back: see tests/grader/test_sandbox.py."""
import functools

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one intra-op thread for a module's tests: the models are tiny, per-op overhead dominates,
    and on a busy 2-core box threads only contend (10x slower). Used as
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def sandbox_problem() -> str | None:
    from grader.isolation.sandbox import SandboxUnavailable, ensure_sandbox
    try:
        ensure_sandbox()
    except SandboxUnavailable as e:
        return str(e)
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("sandbox") and sandbox_problem():
            item.add_marker(pytest.mark.skip(reason=f"no sandbox here: {sandbox_problem()}"))
