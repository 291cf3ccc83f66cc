import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run faster on one thread (no intra-op sync), and the machine may be shared."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
