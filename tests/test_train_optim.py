"""Role-aware optimizer groups, MuonAdamW against torch's Muon and AdamW, and learning-rate schedules, read back
from a real `ScaleVecTrainer`."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import Trainer, TrainingArguments

from scalevec import ScaleVecForCausalLM
from scalevec.modeling_scalevec import ScaleVecTopKRouter
from scalevec.train import MuonAdamW, parameter_groups
from scalevec.train.optim import DecayConfig, muon_lr_ratio, newton_schulz

from ._helpers import random_ids, tiny_config, tiny_moe_config, tiny_trainer

CONFIGS = {
    # standard: decayed input norms; QK-norms and output norms are output-role scales
    "standard": lambda: tiny_config(scale_preset="standard", qk_norm=True, output_norm=True),
    # unified, magnitude-direction: two parameters per scale vector, both input-role
    "unified-magdir": lambda: tiny_config(scale_preset="unified", scale_param="magdir", qk_norm=True),
    # MoE: stacked expert tensors and a router
    "moe": lambda: tiny_moe_config(scale_preset="standard", qk_norm=True),
}
WD, INPUT_WD, EMBEDDING_WD = 0.1, 0.03, 0.007


def model_for(name: str, seed: int = 0) -> ScaleVecForCausalLM:
    torch.manual_seed(seed)
    return ScaleVecForCausalLM(CONFIGS[name]())


def owner(model, name: str) -> torch.nn.Module:
    return model.get_submodule(name.rsplit(".", 1)[0])


def expected_decay(model, input_wd: float, embedding_wd: float) -> dict[str, float]:
    """The weight decay every parameter should get, worked out from the roles and the module tree."""
    roles = model.scale_vector_roles()
    embeddings = {"model.embed_tokens.weight", "lm_head.weight"}
    expected = {}
    for name, parameter in model.named_parameters():
        if name in roles["input"]:
            expected[name] = input_wd
        elif name in roles["output"]:
            expected[name] = 0.0
        elif name in embeddings:
            expected[name] = embedding_wd
        else:
            assert parameter.ndim >= 2, name  # everything else is a matrix (linear, expert stack, router)
            expected[name] = WD
    return expected


def decay_by_name(model, optimizer) -> dict[str, float]:
    """Weight decay per parameter name, read from the optimizer; fails if a parameter is in two groups."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen = {}
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            name = names[id(parameter)]
            assert name not in seen, f"{name} is in two groups"
            seen[name] = group["weight_decay"]
    return seen


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("explicit", [False, True], ids=["defaults", "explicit"])
def test_groups_by_role(name, explicit, tmp_path):
    model = model_for(name)
    roles = model.scale_vector_roles()
    assert roles["input"] and roles["output"]
    arguments = dict(input_scale_weight_decay=INPUT_WD, embedding_weight_decay=EMBEDDING_WD) if explicit else {}
    trainer = tiny_trainer(model, tmp_path, weight_decay=WD, **arguments)
    optimizer = trainer.create_optimizer()
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.defaults["fused"]  # the default `adamw_torch_fused`, on CPUs as on GPUs
    decays = decay_by_name(model, optimizer)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(decays) == sorted(trainable)  # every trainable parameter in exactly one group
    input_wd, embedding_wd = (INPUT_WD, EMBEDDING_WD) if explicit else (WD, WD)
    assert decays == expected_decay(model, input_wd, embedding_wd)
    if name == "unified-magdir":
        magnitudes = [n for n in roles["input"] if n.endswith(".magnitude")]
        directions = [n for n in roles["input"] if n.endswith(".direction")]
        assert magnitudes and len(magnitudes) == len(directions)
        assert all(decays[n] == input_wd for n in magnitudes + directions)
    if name == "moe":
        stacks = [n for n in decays if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        routers = [n for n in decays if isinstance(owner(model, n), ScaleVecTopKRouter)]
        assert len(stacks) == 4 and len(routers) == 2
        assert all(decays[n] == WD for n in stacks + routers)
    qk_norms = [n for n in roles["output"] if ".self_attn.q_norm." in n or ".self_attn.k_norm." in n]
    assert qk_norms and all(decays[n] == 0.0 for n in qk_norms)  # QK-norms: output role, not decayed


def test_stock_trainer_exempts_norms_ours_decays_them(tmp_path):
    model = model_for("standard")
    stock = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), weight_decay=WD, report_to="none"))
    stock_decays = decay_by_name(model, stock.create_optimizer())
    ours = decay_by_name(model, tiny_trainer(model, tmp_path, weight_decay=WD).create_optimizer())
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"):
        assert name in model.scale_vector_roles()["input"]
        assert stock_decays[name] == 0.0  # the stock Trainer skips every name with "norm"
        assert ours[name] == WD  # an input-norm scale folds into the next matrix: decayed like it
    assert stock_decays["model.layers.0.self_attn.q_proj.weight"] == ours["model.layers.0.self_attn.q_proj.weight"]


def test_frozen_parameters_are_left_out(tmp_path):
    model = model_for("standard")
    frozen = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"]
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    decays = decay_by_name(model, tiny_trainer(model, tmp_path, weight_decay=WD).create_optimizer())
    assert sorted(decays) == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert not set(frozen) & set(decays) and "lm_head.weight" in decays


@pytest.mark.parametrize("name", CONFIGS)
def test_muon_takes_exactly_the_hidden_matrices(name, tmp_path):
    model = model_for(name)
    optimizer = tiny_trainer(model, tmp_path, optim="muon", weight_decay=WD).create_optimizer()
    assert isinstance(optimizer, MuonAdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    adamw = {names[id(p)] for g in optimizer.param_groups if not g["muon"] for p in g["params"]}
    hidden = {
        n
        for n, p in model.named_parameters()
        if n.startswith("model.layers.") and p.ndim >= 2 and not isinstance(owner(model, n), ScaleVecTopKRouter)
    }
    assert muon == hidden
    assert not muon & adamw and muon | adamw == set(dict(model.named_parameters()))
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= adamw
    if name == "moe":
        assert any(n.endswith("experts.gate_up_proj") for n in muon)
        assert model.get_parameter("model.layers.0.mlp.experts.down_proj").ndim == 3
    assert decay_by_name(model, optimizer) == expected_decay(model, WD, WD)  # same decays as with AdamW


# --- MuonAdamW against torch.optim.Muon / torch.optim.AdamW ---------------------------------------------------


def quadratic_grads(parameters, seed: int) -> None:
    """Fill `.grad` of every parameter with the gradient of a fixed random quadratic loss."""
    generator = torch.Generator().manual_seed(seed)
    for p in parameters:
        target = torch.randn(p.shape, generator=generator)
        p.grad = (p.detach() - target) * torch.rand(p.shape, generator=generator)


def hand_newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """torch.optim.Muon's iteration (coefficients, spectral normalisation, transpose of tall matrices), in fp32."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.T if g.shape[0] > g.shape[1] else g
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.shape[0] > g.shape[1] else x


@pytest.mark.parametrize("sharding", ["is_fsdp_enabled", "is_deepspeed_enabled"])
def test_muon_is_refused_when_matrices_are_flattened(sharding, tmp_path):
    """FSDP1 / ZeRO cannot start on this CPU machine; the Trainer records them in these flags (from accelerate's
    state), which is what the guard reads. AdamW stays allowed."""
    model = ScaleVecForCausalLM(tiny_config())
    trainer = tiny_trainer(model, tmp_path, optim="muon")
    setattr(trainer, sharding, True)
    with pytest.raises(ValueError, match="--optim muon orthogonalises whole matrices, which FSDP1 and DeepSpeed"):
        trainer.create_optimizer()
    adamw = tiny_trainer(model, tmp_path, optim="adamw_torch")
    setattr(adamw, sharding, True)
    assert isinstance(adamw.create_optimizer(), torch.optim.AdamW)


def test_muon_is_allowed_with_fsdp2(tmp_path, monkeypatch):
    """accelerate's FSDP2 plugin (`fsdp_version: 2`) keeps matrices whole per rank shard (DTensors), which
    `MuonAdamW` gathers: tests/test_distributed.py runs it in two processes."""
    trainer = tiny_trainer(ScaleVecForCausalLM(tiny_config()), tmp_path, optim="muon")
    trainer.is_fsdp_enabled = True
    monkeypatch.setattr(trainer.accelerator, "state", SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=2)))
    assert isinstance(trainer.create_optimizer(), MuonAdamW)


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)])
def test_newton_schulz_fp32_matches_hand_iteration_and_orthogonalises(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours = newton_schulz(g, dtype=torch.float32)
    assert ours.dtype == torch.float32 and ours.shape == g.shape
    torch.testing.assert_close(ours, hand_newton_schulz(g), rtol=1e-5, atol=1e-5)
    singular = torch.linalg.svdvals(ours)  # the quintic maps every singular value near 1 (not exactly)
    assert singular.min() > 0.5 and singular.max() < 1.5
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 3  # the input was far from that


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_muon_matches_torch_muon_in_bf16(adjust):
    """torch.optim.Muon always runs Newton–Schulz in bf16 (no dtype option); with `ns_dtype=bf16` ours runs the same
    bf16 operations in the same order on the same shapes, so the results are bitwise equal."""
    generator = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(24, 16, generator=generator)), torch.nn.Parameter(torch.randn(8, 20))]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    lr, wd = 0.02, 0.1
    groups = [{"params": ours, "muon": True, "weight_decay": wd}]
    mine = MuonAdamW(groups, lr=lr, adjust_lr_fn=adjust, ns_dtype=torch.bfloat16)
    reference = torch.optim.Muon(theirs, lr=lr, weight_decay=wd, adjust_lr_fn=adjust)
    start = [p.detach().clone() for p in ours]
    for step in range(4):
        quadratic_grads(ours, step)
        quadratic_grads(theirs, step)
        mine.step()
        reference.step()
    for p, q, p0 in zip(ours, theirs, start):
        moved = (p - p0).abs().max().item()
        assert moved > 10 * lr * 0.2  # a real update happened
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_muon_fp32_step_by_hand():
    """One fp32 MuonAdamW step against the formula: Nesterov momentum, fp32 Newton–Schulz, decoupled decay, lr
    scaled by the shape."""
    generator = torch.Generator().manual_seed(3)
    p = torch.nn.Parameter(torch.randn(12, 20, generator=generator))
    p0 = p.detach().clone()
    lr, wd, momentum = 0.05, 0.1, 0.95
    opt = MuonAdamW(
        [{"params": [p], "muon": True, "weight_decay": wd}], lr=lr, momentum=momentum, ns_dtype=torch.float32
    )
    buffer, expected = torch.zeros_like(p0), p0.clone()
    for step in range(3):
        quadratic_grads([p], step)
        grad = p.grad.clone()
        opt.step()
        buffer = momentum * buffer + (1 - momentum) * grad
        update = hand_newton_schulz((1 - momentum) * grad + momentum * buffer)
        expected = expected * (1 - lr * wd) - lr * 0.2 * math.sqrt(20) * update
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-5)
    assert muon_lr_ratio(p.shape, "match_rms_adamw") == pytest.approx(0.2 * math.sqrt(20))
    assert muon_lr_ratio(p.shape, "original") == 1.0 and muon_lr_ratio((20, 5), "original") == 2.0


@pytest.mark.parametrize("fused", [None, True])
def test_adamw_groups_match_torch_adamw(fused):
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(tiny_config(scale_preset="standard", qk_norm=True))
    twin = copy.deepcopy(model)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    decay = DecayConfig(WD, INPUT_WD, 0.0, EMBEDDING_WD)
    groups = [g for g in parameter_groups(model, decay) if not g["muon"]]  # embeddings, scales
    twin_groups = [g for g in parameter_groups(twin, decay) if not g["muon"]]
    kwargs = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    mine = MuonAdamW(groups, fused=fused, **kwargs)
    reference = torch.optim.AdamW(
        [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in twin_groups], fused=fused, **kwargs
    )
    ids = random_ids(model.config, batch=2, length=12)
    for _ in range(3):
        for m, opt in ((model, mine), (twin, reference)):
            opt.zero_grad()
            m(ids, labels=ids).loss.backward()
            opt.step()
    trained = {name for name, g in ((n, p.grad) for n, p in model.named_parameters()) if g is not None}
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)  # the same `adam` functional: bitwise
        in_group = any(p is x for g in groups for x in g["params"])
        assert torch.equal(p, start[name]) != (in_group and name in trained), name  # only the AdamW groups moved


def test_expert_stack_update_equals_per_expert_updates():
    """A 3-D expert stack is orthogonalised expert by expert: same result as one 2-D Muon per expert (fp32; the
    batched and the single matmuls may round differently, hence 1e-6)."""
    generator = torch.Generator().manual_seed(5)
    stack = torch.nn.Parameter(torch.randn(4, 16, 10, generator=generator))
    experts = [torch.nn.Parameter(stack.detach()[e].clone()) for e in range(4)]
    kwargs = dict(lr=0.02, momentum=0.9)
    batched = MuonAdamW([{"params": [stack], "muon": True, "weight_decay": WD}], ns_dtype=torch.float32, **kwargs)
    single = MuonAdamW([{"params": experts, "muon": True, "weight_decay": WD}], ns_dtype=torch.float32, **kwargs)
    start = stack.detach().clone()
    for step in range(3):
        quadratic_grads([stack], step)
        for e, p in enumerate(experts):
            p.grad = stack.grad[e].clone()
        batched.step()
        single.step()
    torch.testing.assert_close(stack.detach(), torch.stack([p.detach() for p in experts]), rtol=1e-6, atol=1e-6)
    # each expert normalised by its own norm: scaling one expert's gradient does not change another's update
    assert (stack.detach() - start).abs().amax(dim=(1, 2)).min() > 0.01


# --- learning-rate schedules ----------------------------------------------------------------------------------


def schedule(tmp_path, steps: int, **arguments) -> list[float]:
    """The learning rate of every optimizer step (and one past the end) from the trainer's own scheduler."""
    trainer = tiny_trainer(ScaleVecForCausalLM(tiny_config()), tmp_path, max_steps=steps, **arguments)
    trainer.create_optimizer_and_scheduler(num_training_steps=steps)
    rates = []
    for _ in range(steps + 1):
        rates.append(trainer.lr_scheduler.get_last_lr()[0])
        trainer.optimizer.step()
        trainer.lr_scheduler.step()
    return rates


def test_warmup_stable_decay_shape(tmp_path):
    peak, warmup, decay, steps = 2e-3, 3, 4, 12
    rates = schedule(
        tmp_path, steps, learning_rate=peak, lr_scheduler_type="warmup_stable_decay", warmup_steps=warmup,
        lr_scheduler_kwargs={"num_decay_steps": decay},
    )  # fmt: skip
    stable = steps - warmup - decay
    for step, rate in enumerate(rates):
        if step < warmup:
            expected = peak * step / warmup
        elif step < warmup + stable:
            expected = peak
        else:  # cosine decay to 0 over `decay` steps
            expected = peak * 0.5 * (1 + math.cos(math.pi * (step - warmup - stable) / decay))
        assert rate == pytest.approx(expected, rel=1e-9, abs=1e-15), step
    assert rates[warmup : warmup + stable + 1] == [peak] * (stable + 1)
    assert rates[-1] == pytest.approx(0.0, abs=1e-12)


def test_cosine_with_min_lr_reaches_the_floor(tmp_path):
    peak, floor, steps = 1e-3, 1e-4, 10
    rates = schedule(
        tmp_path, steps, learning_rate=peak, lr_scheduler_type="cosine_with_min_lr", warmup_steps=0,
        lr_scheduler_kwargs={"min_lr": floor},
    )  # fmt: skip
    assert rates[0] == pytest.approx(peak)
    assert all(a > b for a, b in zip(rates, rates[1:]))
    assert min(rates) == pytest.approx(floor, rel=1e-9) and rates[-1] == pytest.approx(floor, rel=1e-9)
    assert rates[steps // 2] == pytest.approx(floor + (peak - floor) / 2, rel=1e-9)


def test_fractional_warmup_and_default_cosine(tmp_path):
    rates = schedule(tmp_path, 8, learning_rate=1e-3, warmup_steps=0.25)  # 0.25 of 8 steps: 2 warmup steps
    assert rates[:3] == pytest.approx([0.0, 5e-4, 1e-3])
    assert rates[-1] == pytest.approx(0.0, abs=1e-12) and rates[3] < 1e-3


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "muon"])
def test_scale_decay_toward_one_pulls_scales_to_the_identity(optim, tmp_path):
    model = model_for("standard")
    lr, wd = 0.1, 0.5
    trainer = tiny_trainer(
        model, tmp_path, optim=optim, learning_rate=lr, weight_decay=wd, output_scale_weight_decay=wd,
        scale_decay_target=1.0, lr_scheduler_type="constant", warmup_steps=0,
    )  # fmt: skip
    optimizer = trainer.create_optimizer()
    roles = model.scale_vector_roles()
    scales = set(roles["input"] + roles["output"])
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(1.5)
            parameter.grad = torch.zeros_like(parameter)  # no update: decay alone
    optimizer.step()
    for name, parameter in model.named_parameters():
        expected = 1.5 - lr * wd * (1.5 - 1.0) if name in scales else 1.5 * (1 - lr * wd)
        torch.testing.assert_close(parameter.detach(), torch.full_like(parameter, expected), msg=name)


def test_scale_decay_toward_one_needs_decoupled_decay(tmp_path):
    trainer = tiny_trainer(model_for("standard"), tmp_path, optim="adafactor", scale_decay_target=1.0)
    with pytest.raises(ValueError, match="--scale-decay-target needs AdamW or Muon"):
        trainer.create_optimizer()
