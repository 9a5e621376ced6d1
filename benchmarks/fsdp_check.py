"""FSDP2 on CPU, checked against one process: N gloo processes train tiny unified dense and MoE models sharded per
decoder layer + root (`scalevec.train.distributed.apply_fsdp`), with AdamW and with Muon, on a fixed batch split
across the ranks; one process trains the same models unsharded on the whole batch. Prints the largest loss and
parameter differences, and the collectives of a Muon step: Newton–Schulz run on the DTensor shards (what plain
DTensor does) against `MuonAdamW`'s gather-once, orthogonalise-on-one-rank, scatter-back.

    python benchmarks/fsdp_check.py --nproc 2 [--steps 3] [--save-dir DIR] [--json results.json]

`--save-dir` keeps, per case, the sharded run's full state dict saved as an unsharded checkpoint (`sharded/`) and
the one-process model (`reference/`). Router losses are off: they depend on how the batch is split.
"""

import argparse
import json
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import TINY_DIMS
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from scalevec import ScaleVecConfig, ScaleVecForCausalLM
from scalevec.train.distributed import apply_fsdp, full_state_dict
from scalevec.train.optim import DecayConfig, MuonAdamW, newton_schulz, parameter_groups

TINY = dict(TINY_DIMS, scale_preset="unified")
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, output_router_logits=False)
CASES = [(model, optimizer) for model in ("dense", "moe") for optimizer in ("adamw", "muon")]
ROWS_PER_RANK, SEQ_LEN, LR = 2, 16, 1e-2


def tiny_model(kind: str) -> ScaleVecForCausalLM:
    torch.manual_seed(0)
    return ScaleVecForCausalLM(ScaleVecConfig(**TINY, **(MOE if kind == "moe" else {})))


def make_optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    groups = parameter_groups(model, DecayConfig(weight_decay=0.1))
    if name == "muon":
        return MuonAdamW(groups, lr=LR, betas=(0.9, 0.95))
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95))


def fixed_batch(world_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, TINY["vocab_size"], (ROWS_PER_RANK * world_size, SEQ_LEN), generator=generator)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def muon_collectives(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> dict:
    """Collectives of Newton–Schulz on every Muon gradient as DTensor shards (counted, not applied), then of a real
    step of the optimizer (which runs after these gradients' backward)."""
    loss = model(ids, labels=ids).loss
    loss.backward()
    muon = [p for group in optimizer.param_groups if group["muon"] for p in group["params"]]
    with CommDebugMode() as on_shards, torch.no_grad():
        for p in muon:
            newton_schulz(p.grad)
    with CommDebugMode() as gathered:
        optimizer.step()
    optimizer.zero_grad()
    return {
        "muon_matrices": len(muon),
        "dtensor_newton_schulz": on_shards.get_total_counts(),
        "gathered_step": gathered.get_total_counts(),
        "gathered_step_by_kind": {str(op): count for op, count in gathered.get_comm_counts().items()},
    }


def global_mean(value: torch.Tensor) -> float:
    value = value.clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def run_rank(rank: int, world_size: int, port: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    results = {}
    for kind, name in CASES:
        model = apply_fsdp(tiny_model(kind))
        assert all(isinstance(p, DTensor) for p in model.parameters())
        optimizer = make_optimizer(model, name)
        ids = fixed_batch(world_size).chunk(world_size)[rank]
        losses = [global_mean(train_step(model, optimizer, ids)) for _ in range(steps)]
        results[f"{kind}-{name}"] = {"losses": losses}
        state = full_state_dict(model)
        if rank == 0:
            torch.save(state, Path(out) / f"{kind}-{name}.pt")
        if name == "muon":
            results[f"{kind}-{name}"]["collectives"] = muon_collectives(model, optimizer, ids)
    if rank == 0:
        (Path(out) / "sharded.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def run_one_process(kind: str, name: str, world_size: int, steps: int) -> tuple[list[float], ScaleVecForCausalLM]:
    model = tiny_model(kind)
    optimizer = make_optimizer(model, name)
    ids = fixed_batch(world_size)
    return [train_step(model, optimizer, ids).item() for _ in range(steps)], model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compare(nproc: int, steps: int, save_dir: Path | None) -> dict:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(run_rank, args=(nproc, free_port(), steps, out), nprocs=nproc)
        sharded = json.loads((Path(out) / "sharded.json").read_text())
        report = {}
        for kind, name in CASES:
            case = f"{kind}-{name}"
            losses, reference = run_one_process(kind, name, nproc, steps)
            state = torch.load(Path(out) / f"{case}.pt")
            expected = reference.state_dict()
            assert state.keys() == expected.keys(), case
            report[case] = {
                **sharded[case],
                "reference_losses": losses,
                "max_loss_diff": max(abs(a - b) for a, b in zip(sharded[case]["losses"], losses)),
                "max_param_diff": max((state[k] - expected[k]).abs().max().item() for k in expected),
            }
            if save_dir is not None:
                reference.save_pretrained(save_dir / case / "reference")
                reference.load_state_dict(state)
                reference.save_pretrained(save_dir / case / "sharded")
    return report


def print_report(report: dict, nproc: int) -> None:
    print(f"FSDP2, {nproc} gloo processes vs one process:")
    print(f"{'case':<12} {'max |loss diff|':>16} {'max |param diff|':>17}  Muon-step collectives")
    for case, row in report.items():
        collectives = row.get("collectives")
        muon = ""
        if collectives:
            counts = collectives["muon_matrices"], collectives["dtensor_newton_schulz"], collectives["gathered_step"]
            muon = "{} matrices: Newton–Schulz on shards {}, gathered once {}".format(*counts)
        print(f"{case:<12} {row['max_loss_diff']:>16.2e} {row['max_param_diff']:>17.2e}  {muon}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--save-dir", type=Path)
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = compare(args.nproc, args.steps, args.save_dir)
    print_report(report, args.nproc)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    worst = max(max(row["max_loss_diff"], row["max_param_diff"]) for row in report.values())
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
