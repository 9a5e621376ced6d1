"""What users stack on a transformers causal LM, on ScaleVec side by side with the stock models: PEFT LoRA
(target modules, "all-linear", defaults, expert parameters), torchao and optimum-quanto int8 quantization, and
tensor-parallel plans."""

import copy
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from optimum import quanto
from peft import LoraConfig, PeftModel, get_peft_model
from torchao.quantization import Int8WeightOnlyConfig, quantize_
from transformers import AutoConfig, AutoModelForCausalLM, QuantoConfig, TorchAoConfig

from scalevec import ScaleVecForCausalLM
from scalevec.convert import export_checkpoint, fold_checkpoint
from scalevec.modeling_scalevec import ScaleVecLinear

from ._helpers import (
    STOCK_TINY,
    SUBPROCESS_ENV,
    logged_losses,
    logits,
    random_ids,
    randomize_scales,
    saved_scalevec,
    tiny_config,
    tiny_moe_config,
    train_argv,
)

pytestmark = pytest.mark.slow  # it starts processes or trains end to end

ROOT = Path(__file__).parents[1]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def scalevec_model(moe: bool) -> ScaleVecForCausalLM:
    """Unified, with scales moved away from 1 as after training."""
    torch.manual_seed(0)
    config = tiny_moe_config(scale_preset="unified") if moe else tiny_config(scale_preset="unified")
    model = ScaleVecForCausalLM(config).eval()
    randomize_scales(model)
    return model


def stock_model(model_type: str):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **STOCK_TINY[model_type])
    return AutoModelForCausalLM.from_config(config).eval()


# name -> (model factory, LoRA target modules, LoRA target parameters, stock export target)
MODELS = {
    "scalevec-dense": (lambda: scalevec_model(moe=False), ATTENTION + MLP, None, "llama"),
    "scalevec-moe": (lambda: scalevec_model(moe=True), ATTENTION, EXPERTS, "mixtral"),
    "llama": (lambda: stock_model("llama"), ATTENTION + MLP, None, None),
    "qwen3_moe": (lambda: stock_model("qwen3_moe"), ATTENTION, EXPERTS, None),
}


def adapted(name: str):
    make, modules, parameters, _ = MODELS[name]
    base = make()
    torch.manual_seed(1)  # init_lora_weights=False: lora_B is random, so every adapter acts from the start
    config = LoraConfig(r=4, target_modules=modules, target_parameters=parameters, init_lora_weights=False)
    return get_peft_model(copy.deepcopy(base), config), base


def lora_b_weights(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if ".lora_B." in n}


@pytest.mark.parametrize("name", list(MODELS))
def test_lora_every_adapter_acts_trains_and_only_lora_trains(name):
    model, base = adapted(name)
    ids = random_ids(base.config)
    lora_b = lora_b_weights(model)
    expected = len(MODELS[name][1]) + len(MODELS[name][2] or [])
    assert len(lora_b) == expected * base.config.num_hidden_layers
    assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)

    saved = {n: p.detach().clone() for n, p in lora_b.items()}
    with torch.no_grad():
        for p in lora_b.values():
            p.zero_()
    torch.testing.assert_close(logits(model, ids), logits(base, ids), atol=1e-6, rtol=0)
    for n, p in lora_b.items():  # each adapter alone moves the logits
        with torch.no_grad():
            p.copy_(saved[n])
        assert (logits(model, ids) - logits(base, ids)).abs().max() > 1e-4, n
        with torch.no_grad():
            p.zero_()
    with torch.no_grad():
        for n, p in lora_b.items():
            p.copy_(saved[n])

    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        if not losses:
            trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for _, p in trainable)
            assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.01


@pytest.mark.parametrize("name", list(MODELS))
def test_lora_save_load_merge_and_export(name, tmp_path):
    model, base = adapted(name)
    ids = random_ids(base.config)
    expected = logits(model, ids)
    base.save_pretrained(tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(logits(reloaded.eval(), ids), expected, atol=1e-6, rtol=0)

    merged = model.merge_and_unload()
    torch.testing.assert_close(logits(merged, ids), expected, atol=1e-5, rtol=0)
    target = MODELS[name][3]
    if target is None:
        return
    assert type(merged) is ScaleVecForCausalLM and not any("lora" in n for n, _ in merged.named_parameters())
    merged.save_pretrained(tmp_path / "merged")
    export_checkpoint(tmp_path / "merged", tmp_path / target, target)
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / target)
    assert stock.config.model_type == target
    torch.testing.assert_close(logits(stock.eval(), ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("moe", [False, True])
def test_lora_all_linear_and_default_targets_match_the_stock_model(moe):
    model, stock = scalevec_model(moe), stock_model("qwen3_moe" if moe else "llama")

    def targets(m, config):
        wrapped = get_peft_model(copy.deepcopy(m), config)
        names = (n[: -len(".lora_A")] for n, _ in wrapped.named_modules() if n.endswith(".lora_A"))
        return sorted({re.sub(r".*layers\.\d+\.", "", n) for n in names})

    # Every `nn.Linear` of a block. For Qwen3-MoE PEFT adds the experts and the router by name, to keep what
    # "all-linear" meant when transformers 4 had them as `nn.Linear`; ScaleVec has no such past: its experts
    # take `target_parameters` (as every v5 MoE) and its router is not adapted.
    v4_compat = {"mlp.experts", "mlp.experts.base_layer", "mlp.gate"}
    all_linear = LoraConfig(target_modules="all-linear")
    assert targets(model, all_linear) == [n for n in targets(stock, all_linear) if n not in v4_compat]
    expected = ["self_attn." + n for n in ATTENTION] + ([] if moe else ["mlp." + n for n in MLP])
    assert targets(model, all_linear) == sorted(expected)
    # no targets: Llama's default, q and v (PEFT has none for Qwen3-MoE)
    llama_default = targets(stock_model("llama"), LoraConfig())
    assert targets(model, LoraConfig()) == llama_default == ["self_attn.q_proj", "self_attn.v_proj"]


def test_lora_on_expert_parameters_of_a_shared_expert_model_merges_exactly():
    torch.manual_seed(0)
    base = ScaleVecForCausalLM(tiny_moe_config(shared_expert_intermediate_size=8)).eval()
    randomize_scales(base)
    config = LoraConfig(r=2, target_modules="all-linear", target_parameters=EXPERTS, init_lora_weights=False)
    model = get_peft_model(base, config)
    ids = random_ids(base.config)
    expected = logits(model, ids)
    assert any("shared_expert_gate" in n for n in lora_b_weights(model))
    torch.testing.assert_close(logits(model.merge_and_unload(), ids), expected, atol=1e-5, rtol=0)


class Doubled(torch.nn.Module):
    def forward(self, weight):
        return 2 * weight


def test_projections_are_linear_and_any_wrapper_is_honoured():
    model = scalevec_model(moe=True)
    ids = random_ids(model.config)
    fused = logits(model, ids)
    projections = [m for m in model.modules() if isinstance(m, ScaleVecLinear)]
    assert projections and all(type(m).forward is torch.nn.Linear.forward for m in projections)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.model.layers[0].mlp.gate.modules())

    calls = []  # a hook on every projection: each module is called, with its scales around it
    handles = [m.register_forward_hook(lambda module, args, out: calls.append(module)) for m in projections]
    torch.testing.assert_close(logits(model, ids), fused, atol=1e-5, rtol=0)
    assert len(calls) == len(projections)
    for handle in handles:
        handle.remove()

    # a parametrization swaps the class for a subclass and computes `weight`: the fused path reads it
    q_proj = model.model.layers[0].self_attn.q_proj
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.model.layers[0].self_attn.q_proj.weight.mul_(2)
    torch.nn.utils.parametrize.register_parametrization(q_proj, "weight", Doubled())
    assert type(q_proj) is not ScaleVecLinear
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=1e-6, rtol=0)


# --- quantization ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folded_and_llama(tmp_path_factory):
    """A trained-like unified checkpoint folded to the ScaleVec inference form, and its Llama export."""
    root = tmp_path_factory.mktemp("quantize")
    saved_scalevec(root / "trained", tiny_config(scale_preset="unified", hidden_size=64, intermediate_size=128))
    fold_checkpoint(root / "trained", root / "folded")
    export_checkpoint(root / "trained", root / "llama", "llama")
    return root


def int8_linears(model) -> list[str]:
    """Names of the linear layers whose weight is quantized (torchao tensor subclass or quanto QLinear)."""
    return sorted(
        name
        for name, module in model.named_modules()
        if isinstance(module, quanto.QLinear)
        or (isinstance(module, torch.nn.Linear) and type(module.weight) not in (torch.Tensor, torch.nn.Parameter))
    )


def quantized_pair(root, how: str):
    def load(folder):
        if how == "torchao-config":
            return AutoModelForCausalLM.from_pretrained(
                root / folder, quantization_config=TorchAoConfig(Int8WeightOnlyConfig())
            )
        if how == "quanto-config":
            return AutoModelForCausalLM.from_pretrained(root / folder, quantization_config=QuantoConfig("int8"))
        model = AutoModelForCausalLM.from_pretrained(root / folder)
        if how == "torchao":
            quantize_(model, Int8WeightOnlyConfig())
        else:
            quanto.quantize(model, weights=quanto.qint8)
            quanto.freeze(model)
        return model

    return load("folded").eval(), load("llama").eval()


@pytest.mark.parametrize("how", ["torchao", "quanto", "torchao-config", "quanto-config"])
def test_int8_quantizes_every_projection_of_the_folded_checkpoint_as_of_llama(folded_and_llama, how):
    root = folded_and_llama
    reference = AutoModelForCausalLM.from_pretrained(root / "folded").eval()
    folded, llama = quantized_pair(root, how)
    assert type(folded).__name__ == "ScaleVecForCausalLM" and type(llama).__name__ == "LlamaForCausalLM"
    layers = folded.config.num_hidden_layers
    quantized = int8_linears(folded)
    assert quantized == int8_linears(llama)
    assert sum(".layers." in n for n in quantized) == 7 * layers

    ids = random_ids(folded.config)
    full, out = logits(reference, ids), logits(folded, ids)
    assert 0 < (out - full).abs().max() < 0.05 * full.abs().max()  # int8 weights: close, and really quantized
    torch.testing.assert_close(out, logits(llama, ids), atol=1e-4, rtol=0)
    prompt = ids[:, :4]
    generated = folded.generate(prompt, max_new_tokens=5, do_sample=False)
    assert torch.equal(generated, llama.generate(prompt, max_new_tokens=5, do_sample=False))


def test_torchao_on_the_training_form_keeps_the_scales_and_quanto_is_refused(tmp_path):
    model = scalevec_model(moe=False)
    ids = random_ids(model.config)
    full = logits(model, ids)
    quantized = copy.deepcopy(model)
    quantize_(quantized, Int8WeightOnlyConfig())  # in place: each projection keeps its scales around it
    assert sum(".layers." in n for n in int8_linears(quantized)) == 7 * model.config.num_hidden_layers
    error = (logits(quantized, ids) - full).abs().max()
    assert 0 < error < 0.05 * full.abs().max()

    with pytest.raises(ValueError, match=r"q_proj.*drop its scale vectors.*scalevec-convert fold"):
        quanto.quantize(copy.deepcopy(model), weights=quanto.qint8)
    model.save_pretrained(tmp_path / "trained")
    with pytest.raises(ValueError, match="drop its scale vectors"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "trained", quantization_config=QuantoConfig("int8"))


# --- tensor-parallel plan -------------------------------------------------------------------------------------


@pytest.mark.parametrize("moe", [False, True])
def test_tensor_parallel_plan_names_linear_projections_as_the_stock_plans_do(moe):
    # a MoE model with one dense layer, so that every pattern of the plan has modules to match
    moe_fields = dict(qk_norm=True, shared_expert_intermediate_size=8, mlp_only_layers=[0])
    config = tiny_moe_config(**moe_fields) if moe else tiny_config(qk_norm=True)
    model = ScaleVecForCausalLM(config)
    stock = AutoConfig.for_model("qwen3_moe" if moe else "llama")
    assert set(stock.base_model_tp_plan.items()) <= set(config.base_model_tp_plan.items())
    modules = dict(model.model.named_modules())
    for pattern, style in config.base_model_tp_plan.items():
        regex = re.compile(pattern.replace(".", r"\.").replace("*", r"\d+") + "$")
        matched = [modules[n] for n in modules if regex.match(n)]
        if "shared_expert" in pattern and not moe:
            continue
        assert matched, pattern
        expected = torch.nn.Linear if style in ("colwise", "rowwise") else torch.nn.Module
        assert all(isinstance(m, expected) for m in matched), pattern
    assert config.base_model_pp_plan == stock.base_model_pp_plan


def test_tensor_and_expert_parallel_plans_in_two_processes_give_the_unsharded_logits(tmp_path):
    """benchmarks/tp_check.py: `tp_plan="auto"` in 2 gloo processes (DTensor-sharded projections, each scale cut
    as its projection's weight) against the whole model, standard and unified, dense and MoE, tied embeddings as a
    tied Llama (the head gathers its sharded output); and the MoE with its experts and their scales sharded by
    expert (`ep_size=2`)."""
    report = tmp_path / "report.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "tp_check.py"), "--nproc", "2", "--json", str(report)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **SUBPROCESS_ENV})
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    rows = json.loads(report.read_text())["cases"]
    cases = {"standard-qk-norm", "unified", "unified-tied", "llama-tied", "unified-moe", "unified-moe-expert-parallel"}
    assert set(rows) == cases
    for name, row in rows.items():
        assert row["q_proj_local_rows"] == 16, name  # 32 rows of q_proj, half on each rank: really sharded
        assert row["max_logit_diff"] < 1e-5, name
    assert rows["unified-moe"]["local_experts"] == 4  # tensor parallelism leaves the experts whole
    assert rows["unified-moe-expert-parallel"]["local_experts"] == 2  # expert parallelism: 2 of 4 on each rank


def test_scalevec_train_lora_continues_a_checkpoint_and_the_adapter_merges_and_exports(tmp_path):
    from scalevec.train.cli import main

    base, run = tmp_path / "base", tmp_path / "lora"
    assert main(train_argv(base, steps=2)) == 0
    flags = ("--init-from", str(base), "--lora-r", "4", "--lora-target-modules", "all-linear")
    assert main(train_argv(run, *flags, "--learning-rate", "1e-2", steps=4)) == 0
    assert (run / "adapter_model.safetensors").is_file() and not (run / "model.safetensors").exists()
    assert all(math.isfinite(loss) for loss in logged_losses(run))

    model = AutoModelForCausalLM.from_pretrained(base).eval()
    ids = random_ids(model.config)
    before = logits(model, ids)
    adapted = PeftModel.from_pretrained(model, run).eval()
    assert len(lora_b_weights(adapted)) == 7 * model.config.num_hidden_layers
    expected = logits(adapted, ids)
    assert (expected - before).abs().max() > 1e-4  # the adapter trained
    adapted.merge_and_unload().save_pretrained(tmp_path / "merged")
    export_checkpoint(tmp_path / "merged", tmp_path / "llama", "llama")
    llama = AutoModelForCausalLM.from_pretrained(tmp_path / "llama").eval()
    torch.testing.assert_close(logits(llama, ids), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--lora-r", "-2"), "--lora-r must be a positive rank"),
        (("--lora-config", "missing.json"), "--lora-config missing.json: no such file"),
    ],
)
def test_scalevec_train_lora_bad_flags_are_named(flags, message, tmp_path, capsys):
    from scalevec.train.cli import main

    assert main(train_argv(tmp_path / "run", *flags, steps=1)) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
