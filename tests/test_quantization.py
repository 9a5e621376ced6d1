"""Weight-only quantization (`scalevec/evaluation/quantization.py`) on a trained tiny model and on every published
form, activation kurtosis per layer (`scalevec/train/diagnostics.py`) against constructed activations and in the
training loop's evaluation, and what a `scalevec-eval` results file puts on the card and into a pushed folder."""

import copy
import json
import math
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml
from huggingface_hub import ModelCard, parse_eval_result_entries
from transformers import AutoModelForCausalLM

from scalevec import ScaleVecForCausalLM
from scalevec.convert import export_checkpoint
from scalevec.convert.card import write_model_card
from scalevec.convert.cli import main as convert_main
from scalevec.evaluation.quantization import parse_schemes, quantization_deltas, quantize_weights
from scalevec.train.diagnostics import MomentSums, activation_kurtosis

from ._helpers import logits, random_ids, run_python, saved_stock, tiny_config, tiny_trainer
from .test_hub_push import push

pytestmark = pytest.mark.slow  # a trained model, and commands in a fresh interpreter

WIDE = dict(hidden_size=64, intermediate_size=128)  # int4's groups of 32 columns divide every width


def pattern_batch(vocab: int, rows: int, length: int, seed: int) -> torch.Tensor:
    """Token sequences a tiny model learns in a few dozen steps: each row counts up from a random start."""
    starts = torch.randint(0, vocab, (rows, 1), generator=torch.Generator().manual_seed(seed))
    return (starts + torch.arange(length)) % vocab


def held_out_loss(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        out = model(ids).logits
    return F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1)).item()


@pytest.fixture(scope="module")
def trained():
    """A unified ScaleVec model trained for 60 steps (weights far from their random start), and held-out rows."""
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(tiny_config(scale_preset="unified", **WIDE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(60):
        ids = pattern_batch(model.config.vocab_size, 16, 24, seed=step)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.eval(), pattern_batch(model.config.vocab_size, 32, 24, seed=10_000)


def test_int8_loses_less_than_int4_on_a_trained_model(trained):
    model, held_out = trained
    base = held_out_loss(model, held_out)
    assert base < 0.5 * math.log(model.config.vocab_size)  # it learned something
    loss = {
        scheme: held_out_loss(quantize_weights(copy.deepcopy(model), scheme), held_out)
        for scheme in parse_schemes("int8,int4")
    }
    int8, int4 = loss["int8"] - base, loss["int4"] - base
    assert abs(int8) < 0.01 and int4 > 0  # int8 is nearly free; int4 costs
    assert abs(int8) < int4


def test_every_form_quantizes_its_decoder_maps_and_folded_equals_llama(trained, tmp_path):
    model, held_out = trained
    model.save_pretrained(tmp_path / "trained")
    export_checkpoint(tmp_path / "trained", tmp_path / "llama", "llama")
    export_checkpoint(tmp_path / "trained", tmp_path / "folded", "scalevec")
    saved_stock(tmp_path / "qwen3", "qwen3", **WIDE)
    forms = {
        name: AutoModelForCausalLM.from_pretrained(tmp_path / name).eval() for name in ("llama", "folded", "qwen3")
    }
    forms["training form"] = copy.deepcopy(model)
    for name, form in forms.items():
        quantize_weights(form, "int4")
        quantized = [
            n for n, m in form.named_modules() if type(getattr(m, "weight", None)).__name__.startswith("Intx")
        ]
        assert len(quantized) == 7 * form.config.num_hidden_layers, name  # every projection, no embedding, no head
        assert all(".layers." in n for n in quantized), name
    ids = held_out[:2]
    torch.testing.assert_close(logits(forms["folded"], ids), logits(forms["llama"], ids), atol=1e-4, rtol=0)
    # the training form quantizes W, not W with its input scales folded in: another rounding, of the same function
    base, quantized = logits(model, ids), logits(forms["training form"], ids)
    assert 0 < (quantized - base).abs().max() < 0.1 * base.abs().max()


def test_unknown_scheme_missing_torchao_and_ragged_groups_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"Unknown quantization scheme 'fp4'; choose from int8, int4\."):
        parse_schemes("int8,fp4")
    ragged = ScaleVecForCausalLM(tiny_config(intermediate_size=52))  # down_proj: 52 columns, no group of 8 or more
    with pytest.raises(ValueError, match=r"int4 quantizes groups of 32 \(at least 8\) input columns; 52 has none"):
        quantize_weights(ragged, "int4")
    model = ScaleVecForCausalLM(tiny_config())
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # as if torchao were not installed
    with pytest.raises(ImportError, match=r"needs torchao.*pip install 'scalevec\[quantize\]'"):
        quantize_weights(model, "int8")


def test_int4_groups_are_32_columns_or_the_largest_power_of_two_that_divides_the_width():
    model = ScaleVecForCausalLM(tiny_config(intermediate_size=48))  # down_proj: 48 columns, groups of 16
    weight = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    quantize_weights(model, "int4")
    quantized = model.model.layers[0].mlp.down_proj.weight
    assert quantized.block_size[-1] == 16 and model.model.layers[0].mlp.up_proj.weight.block_size[-1] == 32
    # each group of 16 has its own scale: 16 int4 levels between its extremes, so the error is within half a step
    step = (weight.view(-1, 3, 16).abs().amax(-1, keepdim=True) / 7.5).expand(-1, -1, 16).reshape(weight.shape)
    assert ((quantized.dequantize() - weight).abs() <= 0.5 * step + 1e-6).all()


def test_quantization_deltas_are_differences_of_shared_figures():
    base = {
        "held_out": {"loss": 3.0, "tokens": 100},
        "tasks": {"a": {"acc": 0.5, "acc_norm": 0.375, "bpb": 1.5, "items": 8}},
    }
    quantized = {
        "int4": {
            "held_out": {"loss": 3.25, "tokens": 100},
            "tasks": {"a": {"acc": 0.375, "acc_norm": 0.5, "bpb": 1.75, "items": 8}},
        }
    }
    assert quantization_deltas(base, quantized) == {
        "int4": {"held_out": {"loss": 0.25}, "tasks": {"a": {"acc": -0.125, "acc_norm": 0.125, "bpb": 0.25}}}
    }


# --- activation kurtosis ---------------------------------------------------------------------------------------


def test_moment_sums_give_the_known_kurtosis_over_batches():
    # one value 1 among n - 1 zeros, a Bernoulli(p = 1/n) sample: excess kurtosis (1 - 6 p q) / (p q)
    n = 1000
    spike = torch.zeros(n)
    spike[123] = 1.0
    p = 1 / n
    sums = MomentSums()
    for part in spike.split(300):  # added in pieces, as batches are
        sums.add(part + 5.0)  # an offset changes nothing
    assert sums.excess_kurtosis() == pytest.approx((1 - 6 * p * (1 - p)) / (p * (1 - p)), rel=1e-9)
    two_point = MomentSums()
    two_point.add(torch.tensor([-2.0, 2.0] * 50))
    assert two_point.excess_kurtosis() == pytest.approx(-2.0, abs=1e-12)


def test_activation_kurtosis_hooks_each_layer_output_and_linear_input():
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(tiny_config(scale_preset="standard")).eval()
    ids = random_ids(model.config, batch=3, length=11)
    spike = torch.zeros(3, 11, model.config.hidden_size)
    spike[1, 4, 7] = 50.0  # layer 0 outputs one outlier among zeros
    model.model.layers[0].register_forward_hook(lambda module, args, output: spike)
    kurtosis = activation_kurtosis(model, [{"input_ids": ids}])
    p = 1 / spike.numel()
    assert kurtosis["residual"][0] == pytest.approx((1 - 6 * p * (1 - p)) / (p * (1 - p)), rel=1e-6)
    outputs = []
    model.model.layers[1].register_forward_hook(lambda module, args, output: outputs.append(output))
    model(ids)
    expected = MomentSums()
    expected.add(outputs[0])
    assert kurtosis["residual"][1] == pytest.approx(expected.excess_kurtosis(), rel=1e-9)
    # standard: q, k and v (gate and up) read one normed tensor, measured once under the first map
    assert set(kurtosis) == {
        "residual",
        "self_attn.q_proj.input",
        "self_attn.o_proj.input",
        "mlp.gate_proj.input",
        "mlp.down_proj.input",
    }
    assert all(set(layers) == {0, 1} for layers in kurtosis.values())


def test_training_evaluation_logs_kurtosis_per_layer_beside_the_loss(tmp_path):
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(tiny_config())
    rows = [{"input_ids": ids, "labels": ids} for ids in random_ids(model.config, batch=6, length=16)]
    trainer = tiny_trainer(model, tmp_path, per_device_eval_batch_size=4, use_cpu=True)
    metrics = trainer.evaluate(rows)
    kurtosis = activation_kurtosis(model, [{"input_ids": torch.stack([row["input_ids"] for row in rows[:4]])}])
    for site, layers in kurtosis.items():
        for layer, value in layers.items():
            assert metrics[f"scale/kurtosis/{site}/{layer}"] == pytest.approx(value, rel=1e-6)
    assert "eval_loss" in metrics
    assert trainer.state.log_history[-1]["scale/kurtosis/residual/1"] == metrics["scale/kurtosis/residual/1"]


# --- the card and the pushed folder ------------------------------------------------------------------------------


def results_file(tmp_path):
    tasks = {
        "hellaswag": {"acc": 0.3, "acc_norm": 0.35, "bpb": 1.2, "items": 200, "dataset": "Rowan/hellaswag"},
        "my_task": {"acc": 0.5, "acc_norm": 0.5, "bpb": 0.9, "items": 40},
    }
    held_out = {"loss": 3.1, "perplexity": math.exp(3.1), "bits_per_byte": 1.1, "tokens": 25245}
    int8 = {
        "tasks": {"hellaswag": {**tasks["hellaswag"], "acc": 0.295}, "my_task": tasks["my_task"]},
        "held_out": {**held_out, "loss": 3.102},
    }
    int4 = {
        "tasks": {"hellaswag": {**tasks["hellaswag"], "acc": 0.25}, "my_task": {**tasks["my_task"], "acc": 0.45}},
        "held_out": {**held_out, "loss": 3.3},
    }
    results = {
        "model": "m",
        "date": "2026-12-06",
        "tasks": tasks,
        "held_out": held_out,
        "quantized": {"int8": int8, "int4": int4},
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    return tmp_path / "results.json"


def test_export_card_gives_tasks_and_quantization_and_eval_results_files(tmp_path):
    model = ScaleVecForCausalLM(tiny_config())
    model.save_pretrained(tmp_path / "trained")
    argv = ["export", str(tmp_path / "trained"), str(tmp_path / "llama"), "--to", "llama", "-q"]
    assert convert_main([*argv, "--eval-results", str(results_file(tmp_path)), "--model-name", "tiny"]) == 0
    card = ModelCard.load(tmp_path / "llama" / "README.md")
    assert "| `hellaswag` | `Rowan/hellaswag` | 200 items | 0.3000 | 0.3500 | 1.2000 |" in card.text
    assert "| `my_task` | task file | 40 items | 0.5000 | 0.5000 | 0.9000 |" in card.text
    assert "| weights | held-out loss | `hellaswag` acc | `my_task` acc |" in card.text
    assert "| as published | 3.1000 | 0.3000 | 0.5000 |" in card.text
    assert "| `int8` | 3.1020 (+0.0020) | 0.2950 (-0.0050) | 0.5000 (+0.0000) |" in card.text
    assert "| `int4` | 3.3000 (+0.2000) | 0.2500 (-0.0500) | 0.4500 (-0.0500) |" in card.text
    assert "over 25,245 predicted tokens" in card.text
    metrics = {(r.task_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    assert metrics[("hellaswag", "acc_norm")] == 0.35 and metrics[("my_task", "bpb")] == 0.9
    files = sorted(p.name for p in (tmp_path / "llama" / ".eval_results").iterdir())
    assert files == ["hellaswag.yaml"]  # a user's own task names no Hub dataset to file it under


def test_pushed_folder_carries_eval_results_files_beside_the_model_index(hub, tmp_path):
    saved_stock(tmp_path / "llama", "llama")
    from scalevec.convert.task_results import read_task_results

    results = read_task_results(results_file(tmp_path))
    write_model_card(
        tmp_path / "llama",
        export_target="llama",
        source_config=tiny_config(),
        repo_id="tester/tiny",
        task_results=results,
    )
    result = push(hub, tmp_path / "push_home", tmp_path / "llama", "tester/tiny", token=hub.token)
    assert result.returncode == 0, result.stderr
    repo = hub.repos["tester/tiny"]
    on_main = repo.commits[repo.branches["main"]]
    [entry] = parse_eval_result_entries(yaml.safe_load(on_main[".eval_results/hellaswag.yaml"].decode()))
    assert (entry.dataset_id, entry.task_id, entry.value, entry.date) == (
        "Rowan/hellaswag",
        "hellaswag",
        0.3,
        "2026-12-06",
    )
    assert entry.source_url == "https://huggingface.co/tester/tiny" and "200 items" in entry.notes
    card = ModelCard(on_main["README.md"].decode())
    assert any(r.task_name == "hellaswag" and r.metric_type == "acc" for r in card.data.eval_results)


def test_commands_start_without_torchao_import_noise():
    result = run_python("import scalevec.train.cli, scalevec.convert.cli")
    assert result.returncode == 0, result.stderr
    assert "Failed to load" not in result.stderr and "register_constant" not in result.stderr, result.stderr
