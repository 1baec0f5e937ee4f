"""Shared test set-up: `@pytest.mark.cuda` tests skip where no GPU is present; every test
runs torch on one intra-op thread."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny models on a shared 2-core machine: intra-op threads fighting other processes
    # make a step ~100x slower than one thread does.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
