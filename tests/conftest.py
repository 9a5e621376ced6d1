import pytest
import torch

from .hub_server import HubServer

# Files whose tests start processes (torchrun, the CLIs or a fresh interpreter in a subprocess, preparation shards) or
# train whole grids end to end: marked `slow`, so that `pytest -m "not slow"` is a quick loop; plain `pytest` runs all.
SLOW_FILES = {
    "test_ablate.py",
    "test_convert_faults.py",
    "test_convert_layout.py",
    "test_convert_safety.py",
    "test_data_preparation.py",
    "test_data_training.py",
    "test_distributed.py",
    "test_ecosystem.py",
    "test_evaluation.py",
    "test_gpu_check.py",
    "test_hub_push.py",
    "test_hub_server.py",
    "test_main_job.py",
    "test_old_transformers.py",
    "test_study.py",
    "test_train_cli.py",
    "test_train_preemption.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


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
