"""Most tests run tiny tensors: one intra-op thread avoids OpenMP spin overhead (≈4× faster on a
busy 2-core machine). Restored after each test; a test that measures throughput sets its own."""

import os

import pytest
import torch

# The Triton kernels (kernelmix.ops, backend="triton") are verified on CPU under Triton's
# interpreter. Triton reads this variable when a kernel is defined (at import), so it is set here,
# before any test imports triton; on a machine with CUDA the kernels compile for the GPU instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
