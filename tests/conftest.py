import pytest
import torch

from .hub_server import HubServer

# Tests that start processes (torchrun, the CLIs or a fresh interpreter in a subprocess, preparation shards, a C++
# compiler) or train whole grids end to end are marked `slow`: `pytest -m "not slow"` is the quick loop, plain
# `pytest` runs everything. Whole files, where every test (or a fixture they share) does so:
SLOW_FILES = {
    "test_ablate.py",
    "test_compile.py",  # inductor's C++ compiler
    "test_convert_fold.py",  # every output loaded in one fresh process
    "test_convert_faults.py",
    "test_convert_layout.py",
    "test_convert_safety.py",
    "test_cpu_kernels.py",  # the kernels' C++ build
    "test_data_preparation.py",
    "test_data_training.py",
    "test_decay_branches.py",  # training runs and their branches
    "test_distributed.py",
    "test_ecosystem.py",
    "test_evaluation.py",
    "test_gpu_check.py",
    "test_hub_push.py",
    "test_hub_server.py",
    "test_main_job.py",
    "test_quantization.py",  # a trained model, and commands in a fresh interpreter
    "test_old_transformers.py",
    "test_study.py",
    "test_tasks.py",  # torchrun, lm-eval, training runs
    "test_train_cli.py",
    "test_train_preemption.py",
    "test_workflows.py",  # the documented command sequences, each command in a fresh process
}
# ... and single tests of the other files (by function name, every parameter).
SLOW_TESTS = {
    "test_study_records.py": {  # training runs; the L(N, D) bootstrap of a committed study
        "test_shards_on_separate_machines_make_one_study_that_resumes_from_its_records_alone",
        "test_a_committed_records_file_alone_re_reports_the_committed_text_byte_for_byte",
    },
    "test_study_quantization.py": {"test_each_run_records_its_quantized_losses_and_the_claim_gets_a_row"},
    "test_data_prepared.py": {"test_a_25_mb_line_is_prepared_in_bounded_memory"},
    "test_intree.py": {"test_task_heads_train_and_load_with_remote_code_where_scalevec_is_absent"},
    "test_modeling.py": {
        "test_remote_code_loads_where_scalevec_is_not_installed",
        "test_remote_code_without_trust_is_refused_when_package_missing",
    },
    "test_moe.py": {"test_save_reload_and_remote_code_give_equal_logits"},
    "test_train_data.py": {"test_embedded_corpus_and_tokenizer_offline"},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = item.path.name
        if name in SLOW_FILES or item.originalname in SLOW_TESTS.get(name, ()):
            item.add_marker(pytest.mark.slow)
    # The slow files first: pytest-xdist hands out files in this order, so the quick ones fill the end of the run
    # instead of one worker finishing a long file alone.
    items.sort(key=lambda item: item.path.name not in SLOW_FILES)


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
