import os

import pytest
import torch

# keep the suite deterministic and light on the 2-core CI machines: two threads in one process, one per
# process under pytest-xdist (`-n 2`: two workers share the two cores)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _kernels_only_where_marked(request, monkeypatch):
    """Tests marked ``kernels`` run with looplm's fast paths registered (building the CPU extension once if
    it is not built); every other test runs the plain-PyTorch reference — in this process
    (``dispatch.reference_only``) and in the processes it starts (``LOOPLM_CPU_KERNELS=0``) — so the model,
    rule and trainer tests never wait for a build."""
    from looplm import dispatch

    if request.node.get_closest_marker("kernels") is not None:
        from looplm import kernels

        kernels.load()
        yield
        return
    monkeypatch.setenv("LOOPLM_CPU_KERNELS", "0")
    with dispatch.reference_only():
        yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of small-tensor tests (token-by-token decoding, tiny models):
    as fast on an idle machine, far faster when the cores are shared. Restored afterwards.
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
