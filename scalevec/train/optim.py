"""Role-aware parameter groups and the optimizers built on them: AdamW, and Muon for hidden matrices with AdamW
for everything else, as one `torch.optim.Optimizer` so that transformers' schedulers drive both."""

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adam import adam

from ..modeling_scalevec import ScaleVecExperts, ScaleVecLinear


@dataclass(frozen=True)
class DecayConfig:
    weight_decay: float = 0.0
    input_scale_weight_decay: float | None = None  # default: weight_decay
    output_scale_weight_decay: float = 0.0
    embedding_weight_decay: float | None = None  # default: weight_decay
    scale_decay_target: float = 0.0  # what decay pulls the scale vectors toward: 0 (AdamW's), or 1 (the identity)


def _hidden_matrices(model: nn.Module) -> tuple[list[str], list[str]]:
    """Names of 2-D hidden matrices (the routers' and single-row gates' excepted) and of stacked expert tensors."""
    matrices, experts = [], []
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, ScaleVecLinear):  # the router is not one (as in Qwen3-MoE)
            if module.weight.shape[0] > 1:
                matrices.append(prefix + "weight")
        elif isinstance(module, ScaleVecExperts):
            experts.extend((prefix + "gate_up_proj", prefix + "down_proj"))
    return matrices, experts


def parameter_groups(model: nn.Module, decay: DecayConfig) -> list[dict]:
    """Groups by role, from `model.scale_vector_roles()` and module types, never from parameter names.

    Each group has `name`, `params`, `param_names`, `weight_decay` and `muon` (whether Muon may take it).
    """
    roles = model.scale_vector_roles()
    matrices, experts = _hidden_matrices(model)
    embedding_ids = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m}
    base = decay.weight_decay
    spec = [
        ("matrices", set(matrices), base, True),
        ("experts", set(experts), base, True),
        ("input_scales", set(roles["input"]), _default(decay.input_scale_weight_decay, base), False),
        ("output_scales", set(roles["output"]), decay.output_scale_weight_decay, False),
    ]
    groups = {
        name: {"name": name, "params": [], "param_names": [], "weight_decay": wd, "muon": muon}
        for name, _, wd, muon in spec
    }
    for name in ("input_scales", "output_scales"):
        groups[name]["decay_target"] = decay.scale_decay_target
    extra = {"embeddings": _default(decay.embedding_weight_decay, base), "other_matrices": base}
    for name, wd in extra.items():
        groups[name] = {"name": name, "params": [], "param_names": [], "weight_decay": wd, "muon": False}
    for param_name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        group = next((name for name, names, _, _ in spec if param_name in names), None)
        if group is None:
            if id(parameter) in embedding_ids:
                group = "embeddings"
            elif parameter.ndim >= 2:  # routers, single-row gates
                group = "other_matrices"
            else:
                raise ValueError(f"parameter {param_name!r} has no role: it is neither a matrix nor a scale vector")
        groups[group]["params"].append(parameter)
        groups[group]["param_names"].append(param_name)
    return [group for group in groups.values() if group["params"]]


def _default(value: float | None, fallback: float) -> float:
    return fallback if value is None else value


def describe_groups(groups: list[dict]) -> str:
    lines = ["optimizer groups (by role):"]
    for group in groups:
        count = sum(p.numel() for p in group["params"])
        optimizer = "muon" if group.get("muon") else "adamw"
        target = f" toward {group['decay_target']:g}" if group.get("decay_target") else ""
        lines.append(
            f"  {group['name']:<15} {len(group['params']):>4} tensors {count:>12,} params  "
            f"weight_decay={group['weight_decay']:g}{target}  ({optimizer})"
        )
    return "\n".join(lines)


@torch.no_grad()
def decay_toward_targets(optimizer: torch.optim.Optimizer, *_) -> None:
    """A step post-hook: AdamW's decoupled decay `p *= 1 - lr * wd` pulls toward 0; adding `lr * wd * target`
    after it makes it `p -= lr * wd * (p - target)`, the pull of a group with a `decay_target`."""
    for group in optimizer.param_groups:
        target, decay = group.get("decay_target", 0.0), group["lr"] * group["weight_decay"]
        params = [p for p in group["params"] if p.grad is not None]  # the decayed ones
        if target and decay and params:
            torch._foreach_add_(params, decay * target)


def newton_schulz(matrix: torch.Tensor, steps: int = 5, eps: float = 1e-7, dtype: torch.dtype | None = None):
    """Approximate orthogonalisation of the last two dims, as `torch.optim.Muon` (same coefficients and steps).

    `dtype` defaults to bf16 on GPUs (as torch) and fp32 on CPUs, whose bf16 matmuls are ~70x slower here."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = matrix.to(dtype or (torch.bfloat16 if matrix.is_cuda else torch.float32))
    transposed = matrix.shape[-2] > matrix.shape[-1]
    if transposed:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    multiply_add = torch.addmm if x.ndim == 2 else torch.baddbmm  # experts: one matrix per expert
    for _ in range(steps):
        gram = x @ x.mT
        x = multiply_add(x, multiply_add(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if transposed else x


def orthogonalise_on_one_rank(
    update: DTensor, owner: int, orthogonalise: Callable[[torch.Tensor], torch.Tensor]
) -> DTensor:
    """`orthogonalise` a sharded matrix (FSDP2's DTensor) whole: gathered once, orthogonalised on rank `owner` of
    its mesh, and scattered back as shards of the same placement. Two collectives per matrix, where DTensor itself
    would redistribute inside every Newton–Schulz matmul ("Muon is Scalable"; torchtitan)."""
    mesh = update.device_mesh
    full = update.full_tensor()
    if mesh.ndim != 1:  # e.g. HSDP's (replicate, shard): no single source rank to scatter from, so every rank works
        return distribute_tensor(orthogonalise(full).to(full.dtype), mesh, update.placements, src_data_rank=None)
    owner %= mesh.size()
    if mesh.get_local_rank() == owner:
        full = orthogonalise(full).to(full.dtype)
    return distribute_tensor(full, mesh, update.placements, src_data_rank=owner)


def muon_lr_ratio(shape: torch.Size, adjust_lr_fn: str | None) -> float:
    rows, cols = shape[-2:]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


class MuonAdamW(torch.optim.Optimizer):
    """Muon on groups marked `muon` (2-D matrices; 3-D expert stacks orthogonalised expert by expert), AdamW on the
    rest. Muon follows `torch.optim.Muon`: Nesterov momentum, Newton–Schulz (bf16 on GPUs), decoupled weight decay
    `p *= 1 - lr * wd`, learning rate scaled by the matrix shape (`adjust_lr_fn`).

    Under FSDP2 (DTensor parameters) momentum and weight decay stay on the shards; each matrix (an expert stack as
    one) is orthogonalised whole by one rank, the matrices dealt round-robin over the ranks
    (`orthogonalise_on_one_rank`)."""

    def __init__(
        self,
        groups,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        momentum=0.95,
        nesterov=True,
        ns_steps=5,
        adjust_lr_fn="match_rms_adamw",
        ns_dtype: torch.dtype | None = None,
        fused: bool | None = None,
    ):
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            weight_decay=0.0,
            muon=False,
        )
        super().__init__(groups, defaults)
        self.ns_dtype = ns_dtype  # None: bf16 on GPUs, fp32 on CPUs (see `newton_schulz`)
        self.fused = fused  # for the AdamW groups, as `torch.optim.AdamW(fused=...)`

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owners = itertools.count()  # the same sequence on every rank: each matrix has one owner everywhere
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["muon"]:
                self._muon_step(group, params, owners)
            else:
                self._adamw_step(group, params)
        return loss

    def _muon_step(self, group, params, owners: Iterator[int]):
        lr, momentum = group["lr"], group["momentum"]
        for p in params:
            state = self.state[p]
            buffer = state.setdefault("momentum_buffer", torch.zeros_like(p.grad))
            buffer.lerp_(p.grad, 1 - momentum)
            update = p.grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            update = self._orthogonalise(update, group["ns_steps"], owners).to(p.dtype)
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update, alpha=-lr * muon_lr_ratio(p.shape, group["adjust_lr_fn"]))

    def _orthogonalise(self, update: torch.Tensor, steps: int, owners: Iterator[int]) -> torch.Tensor:
        def orthogonalise(matrix: torch.Tensor) -> torch.Tensor:
            return newton_schulz(matrix, steps, dtype=self.ns_dtype)

        if isinstance(update, DTensor):
            return orthogonalise_on_one_rank(update, next(owners), orthogonalise)
        return orthogonalise(update)

    def _adamw_step(self, group, params):
        if not params:
            return
        for p in params:
            if not self.state[p]:
                step = torch.zeros((), device=p.device if self.fused else "cpu")  # where torch's AdamW keeps it
                self.state[p].update(step=step, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        states = [self.state[p] for p in params]
        adam(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            amsgrad=False,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
            decoupled_weight_decay=True,
            fused=self.fused,
        )
