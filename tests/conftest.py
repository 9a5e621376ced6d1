import pytest
import torch

from .hub_server import HubServer


@pytest.fixture
def hub():
    """A fresh Hub-protocol server on loopback (see `tests/hub_server.py`); `hub.env(tmp_path / "hf_home", token)`
    is the environment for a subprocess that uses it."""
    server = HubServer().start()
    yield server
    server.stop()


@pytest.fixture(autouse=True, scope="session")
def single_torch_thread():
    """Tiny models on a shared 2-core machine: with two threads each tiny op waits for a busy core (up to 100x
    slower). Subprocesses set OMP_NUM_THREADS themselves."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
