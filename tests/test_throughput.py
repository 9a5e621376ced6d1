"""Throughput while pretraining (scalevec/train/throughput.py): the model-FLOPs formula against a measured count,
the peak FLOP/s table, and the callback that logs tokens/s, MFU and peak memory."""

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig, TrainerCallback, TrainerControl, TrainerState

from scalevec import ScaleVecForCausalLM
from scalevec.run_records import RUN_CLOCK, RunClock
from scalevec.train import ScaleVecTrainer, ScaleVecTrainingArguments, run_clock, throughput
from scalevec.train.run_clock import RunClockCallback
from scalevec.train.throughput import (
    ThroughputCallback,
    device_peak_flops,
    model_flops_per_token,
    peak_flops_by_name,
    training_peak_flops,
)

from ._helpers import TINY, TINY_MOE, tiny_config

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import bench_flops  # noqa: E402  (a script folder, not a package)

FLOP_CASES = [
    bench_flops.Case("dense", "dense", dict(TINY), seq_len=16),
    bench_flops.Case(
        "moe, every 2nd layer, shared expert",
        "moe",
        dict(TINY_MOE, qk_norm=True, decoder_sparse_step=2, shared_expert_intermediate_size=8),
        seq_len=16,
    ),
]


@pytest.mark.parametrize("model", bench_flops.MODELS)
@pytest.mark.parametrize("case", FLOP_CASES, ids=lambda case: case.name)
def test_formula_matches_counted_flops(case, model):
    row = bench_flops.measure(case, model)
    assert row.ratio == pytest.approx(1, abs=0.05), row


def test_formula_by_hand():
    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    attention = 64 * 64 * 2 + 64 * 32 * 2  # q, o; k, v (head_dim 16, 2 kv heads)
    mlp = 3 * 64 * 128
    parameters = 2 * (attention + mlp) + 64 * 100
    assert model_flops_per_token(config, seq_len=10) == 6 * parameters + 12 * 2 * 4 * 16 * 10


def test_moe_counts_only_active_experts():
    dense = tiny_config(intermediate_size=2 * 16)
    moe = tiny_config(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    router = TINY["num_hidden_layers"] * TINY["hidden_size"] * 8
    assert model_flops_per_token(moe, 16) - model_flops_per_token(dense, 16) == 6 * router


@pytest.mark.parametrize(
    ("name", "dtype", "tf32", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, False, 756e12),
        ("NVIDIA H100 NVL", torch.float16, False, 835e12),
        ("NVIDIA H200", torch.bfloat16, False, 989e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312e12),
        ("NVIDIA A100-SXM4-80GB", torch.float32, True, 156e12),
        ("NVIDIA A100-SXM4-80GB", torch.float32, False, 19.5e12),
        ("NVIDIA A10G", torch.bfloat16, False, 70e12),
        ("NVIDIA L40S", torch.bfloat16, False, 362e12),
        ("NVIDIA L4", torch.bfloat16, False, 121e12),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, False, 165.2e12),
        ("AMD Instinct MI300X", torch.bfloat16, False, 1307.4e12),
        ("NVIDIA GB200", torch.bfloat16, False, 2.5e15),
        ("NVIDIA B200", torch.bfloat16, False, 2.25e15),
        ("NVIDIA Tesla K80", torch.bfloat16, False, None),
    ],
)
def test_peak_flops_by_name(name, dtype, tf32, peak):
    assert peak_flops_by_name(name, dtype, tf32) == peak


def test_peak_flops_unknown_on_cpu_and_refused_for_other_dtypes():
    assert device_peak_flops("cpu") is None
    with pytest.raises(ValueError, match="float8"):
        peak_flops_by_name("NVIDIA H100", torch.float8_e4m3fn)


def test_one_peak_flops_rule_for_the_plan_the_logs_and_the_summary():
    args = SimpleNamespace(bf16=True, fp16=False, tf32=None, device=torch.device("cpu"), peak_flops=None)
    assert training_peak_flops(args) is None  # no known peak on CPU
    assert training_peak_flops(SimpleNamespace(**{**vars(args), "peak_flops": 3e12})) == 3e12  # --peak-flops wins
    assert training_peak_flops(SimpleNamespace(bf16=False, fp16=False, tf32=True, device="cpu")) is None  # stock args


def test_the_run_clock_keeps_training_and_wall_time_apart_from_evaluations(monkeypatch):
    """Steps end at 101 and 102, a log at 102.5 and an evaluation ending at 110; the last step ends at 111: 2.5 s of
    training before the evaluation and 1 after it, 11 s of wall time."""
    clock = iter([100.0, 101.0, 102.0, 102.5, 110.0, 111.0])
    monkeypatch.setattr(run_clock.time, "perf_counter", lambda: next(clock))
    args, state, control = SimpleNamespace(), TrainerState(), TrainerControl()
    callback = RunClockCallback()
    callback.on_train_begin(args, state, control)  # 100
    callback.on_step_end(args, state, control)  # 101
    callback.on_step_end(args, state, control)  # 102
    callback.on_log(args, state, control, logs={"loss": 1.0})  # 102.5
    callback.on_evaluate(args, state, control)  # 110: the window closes at 102.5, the latest step's end
    callback.on_step_end(args, state, control)  # 111
    callback.on_train_end(args, state, control)  # the training ends at the latest event, 111
    recorded = RunClock.recorded(vars(state))
    assert recorded == RunClock([0], wall_seconds=11.0, training_seconds=3.5)


@pytest.mark.slow
def test_the_run_clock_is_saved_under_its_callbacks_own_key(tmp_path):
    """Each checkpoint's trainer state holds the clock under the key the readers look it up by; the throughput
    callback saves nothing (a rename of either cannot lose the clock unnoticed)."""
    assert RunClockCallback.__name__ == RUN_CLOCK  # the Trainer saves a stateful callback under its class name
    model = ScaleVecForCausalLM(tiny_config())
    ids = torch.randint(0, TINY["vocab_size"], (8, 16))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = ScaleVecTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, save_steps=2, per_device_train_batch_size=2, report_to="none",
        disable_tqdm=True, use_cpu=True, logging_steps=1,
    )  # fmt: skip
    ScaleVecTrainer(model=model, args=args, train_dataset=data, seq_len=16).train()
    state = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert "ThroughputCallback" not in state["stateful_callbacks"]
    clock = RunClock.recorded(state)
    assert clock.segment_starts == [0] and 0 < clock.training_seconds <= clock.wall_seconds


def test_callback_figures_over_each_window(monkeypatch):
    """4096 tokens in 2 s on 4 processes, then 2048 in the 7 s after an evaluation (whose time is left out)."""
    clock = iter([100.0, 102.0, 103.0, 110.0])
    monkeypatch.setattr(throughput.time, "perf_counter", lambda: next(clock))
    config = tiny_config()
    args = SimpleNamespace(bf16=True, fp16=False, tf32=None, device=torch.device("cpu"), world_size=4)
    state, control = TrainerState(), TrainerControl()
    callback = ThroughputCallback(seq_len=32, peak_flops=1e12)
    callback.on_train_begin(args, state, control, model=ScaleVecForCausalLM(config))  # clock: 100
    state.num_input_tokens_seen, state.global_step = 4096, 2
    first = {"loss": 5.0}
    callback.on_log(args, state, control, logs=first)  # 102
    callback.on_evaluate(args, state, control)  # 103
    state.num_input_tokens_seen = 6144
    callback.on_log(args, state, control, logs={"eval_loss": 5.0})  # not a training log: nothing read
    second = {"loss": 4.0}
    callback.on_log(args, state, control, logs=second)  # 110: 7 s after the evaluation
    flops = model_flops_per_token(config, 32)
    assert first["tokens_per_second"] == 2048 and first["tokens_per_second_per_device"] == 512
    assert first["model_tflops_per_device"] == pytest.approx(512 * flops / 1e12, rel=1e-3)
    assert first["mfu_percent"] == pytest.approx(100 * 512 * flops / 1e12, rel=1e-3)
    assert second["tokens_per_second"] == pytest.approx(2048 / 7, rel=1e-3)
    assert second["peak_rss_gib"] > 0.05  # this process: torch alone takes more


class Recorder(TrainerCallback):
    """A logger placed after the callback: what every `--report-to` logger would receive."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


@pytest.mark.slow
def test_callback_in_a_trainer_run(tmp_path):
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(tiny_config())
    ids = torch.randint(0, TINY["vocab_size"], (16, 24))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    recorder = Recorder()
    args = ScaleVecTrainingArguments(
        output_dir=str(tmp_path), max_steps=4, logging_steps=2, per_device_train_batch_size=2, report_to="none",
        disable_tqdm=True, save_strategy="no", use_cpu=True,
    )  # fmt: skip
    trainer = ScaleVecTrainer(model=model, args=args, train_dataset=data, callbacks=[recorder], seq_len=24)
    trainer.train()
    training_logs = [logs for logs in recorder.logs if "loss" in logs]
    recorded = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(training_logs) == len(recorded) == 2
    for logs, entry in zip(training_logs, recorded):
        for key in ("tokens_per_second", "tokens_per_second_per_device", "model_tflops_per_device", "peak_rss_gib"):
            assert logs[key] > 0 and entry[key] == logs[key], key
        assert "mfu_percent" not in logs  # no peak known on CPU
        assert logs["tokens_per_second_per_device"] == logs["tokens_per_second"]  # one process
        tflops = logs["tokens_per_second"] * model_flops_per_token(model.config, 24) / 1e12
        assert math.isclose(logs["model_tflops_per_device"], tflops, rel_tol=1e-3)
