"""How far the scale vectors of a study's runs moved from their initial 1, by role and variant: what weight decay on
them could have changed. Reads the final model of every finished run under a `scalevec-ablate` folder.

    python benchmarks/study_scales.py runs/study [--size 4x128] [--learning-rate 0.003]

Per variant (mean over its seeds): for the input-role and the output-role scales, the mean of the effective vectors
(a magnitude-direction scale as g * u / rms(u)), their spread (std over all elements), the mean |γ - 1| and the
largest element; and the mean magnitude g of magnitude-direction scales.
"""

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

import torch
from transformers.utils import logging

from scalevec import ScaleVecForCausalLM
from scalevec.modeling_scalevec import ScaleVecScale


def scale_movement(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """Per role: mean, std, mean |γ - 1| and max over the elements of every effective scale vector of that role."""
    roles = {name: role for role, names in model.scale_vector_roles().items() for name in names}
    values: dict[str, list[torch.Tensor]] = defaultdict(list)
    magnitudes: list[float] = []
    for name, module in model.named_modules():
        if isinstance(module, ScaleVecScale) and module.scale_param is not None:
            role = next(roles[p] for p in roles if p.startswith(f"{name}."))
            with torch.no_grad():
                values[role].append(module.vector().detach().float().reshape(-1))
            if module.scale_param == "magdir":
                magnitudes.append(module.magnitude.detach().float().mean().item())
    movement = {}
    for role, parts in values.items():
        flat = torch.cat(parts)
        movement[role] = {
            "mean": flat.mean().item(),
            "std": flat.std().item(),
            "mean_abs_change": (flat - 1).abs().mean().item(),
            "max": flat.max().item(),
        }
    if magnitudes:
        movement["input"]["magnitude"] = statistics.mean(magnitudes)
    return movement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--size", default=None)
    parser.add_argument("--learning-rate", type=float, default=None)
    options = parser.parse_args()
    logging.disable_progress_bar()
    rows: dict[tuple, list[dict]] = defaultdict(list)
    for run in sorted(options.root.glob("*/*-lr*-seed*")):
        size, (variant, rate) = run.parent.name, run.name.rsplit("-seed", 1)[0].rsplit("-lr", 1)
        if not (run / "model.safetensors").exists() or (options.size and size != options.size):
            continue
        if options.learning_rate is not None and float(rate) != options.learning_rate:
            continue
        rows[size, variant, float(rate)].append(scale_movement(ScaleVecForCausalLM.from_pretrained(run)))
    print("| size | variant | lr | seeds | role | mean γ | std γ | mean abs(γ - 1) | max γ | magnitude g |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (size, variant, rate), runs in rows.items():
        for role in ("input", "output"):
            if role not in runs[0]:
                continue
            mean = {key: statistics.mean(run[role][key] for run in runs) for key in runs[0][role]}
            magnitude = f"{mean['magnitude']:.3f}" if "magnitude" in mean else "-"
            print(
                f"| {size} | {variant} | {rate:g} | {len(runs)} | {role} | {mean['mean']:.3f} | {mean['std']:.3f} "
                f"| {mean['mean_abs_change']:.3f} | {mean['max']:.3f} | {magnitude} |"
            )


if __name__ == "__main__":
    main()
