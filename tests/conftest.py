"""Most tests run tiny tensors: one intra-op thread avoids OpenMP spin overhead (≈4× faster on a
busy 2-core machine). Restored after each test; a test that measures throughput sets its own."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
