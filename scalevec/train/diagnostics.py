"""Scale-vector diagnostics: per-site statistics logged during training, and the end-of-run picture."""

import re
from collections import defaultdict
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..convert.card import RUN_PICTURE
from ..modeling_scalevec import ScaleVecScale

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def scale_statistics(model: torch.nn.Module) -> dict[str, dict[int, dict[str, float]]]:
    """`{site: {layer: {mean, std, min, max, anisotropy[, magnitude]}}}` for every learnable scale vector; a site
    is the module path without its layer index (layer -1: outside the blocks, e.g. the final norm)."""
    stats: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for name, module in model.named_modules():
        if not isinstance(module, ScaleVecScale) or module.scale_param is None:
            continue
        match = _LAYER.search(name)
        site = _LAYER.sub(".", name).strip(".").removeprefix("model.")
        with torch.no_grad():
            vector = module.vector().float()
        mean = vector.mean().item()
        std = vector.std().item() if vector.numel() > 1 else 0.0
        entry = {
            "mean": mean,
            "std": std,
            "min": vector.min().item(),
            "max": vector.max().item(),
            "anisotropy": std / abs(mean) if mean else float("inf"),
        }
        if module.scale_param == "magdir":
            entry["magnitude"] = module.magnitude.detach().float().mean().item()
        stats[site][int(match.group(1)) if match else -1] = entry
    return dict(stats)


def flat_log(stats: dict[str, dict[int, dict[str, float]]]) -> dict[str, float]:
    """One number per site and statistic (averaged over layers), under `scale/<site>/<statistic>`."""
    logs = {}
    for site, layers in stats.items():
        for key in next(iter(layers.values())):
            logs[f"scale/{site}/{key}"] = sum(entry[key] for entry in layers.values()) / len(layers)
    return logs


class ScaleStatsCallback(TrainerCallback):
    """Adds per-site scale statistics to every training log (so every logger the Trainer reports to gets them)
    and, at the end, writes `scale_vectors.png` with the loss curves and the per-layer statistics."""

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if model is None or logs is None or "loss" not in logs:
            return
        extra = flat_log(scale_statistics(_unwrap(model)))
        logs.update(extra)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if model is not None and state.is_world_process_zero:
            plot_run(state.log_history, scale_statistics(_unwrap(model)), Path(args.output_dir) / RUN_PICTURE)


class HideScaleStatsFromConsole(TrainerCallback):
    """Placed just before the Trainer's console printer, after every logger: keeps the progress lines readable."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key in [key for key in logs or {} if key.startswith("scale/")]:
            del logs[key]


def _unwrap(model):
    return getattr(model, "module", model)


def plot_run(log_history: list[dict], stats: dict, path: Path) -> Path:
    """Loss curves (train, eval) and the mean and anisotropy of every scale site across layers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (losses, means, anisotropy) = plt.subplots(1, 3, figsize=(16, 4.5))
    for key, label in (("loss", "train"), ("eval_loss", "eval")):
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry]
        if points:
            losses.plot(*zip(*points), marker="o" if label == "eval" else None, label=label)
    losses.set(title="loss", xlabel="step", ylabel="nats per token")
    if losses.lines:
        losses.legend()
    for site, layers in sorted(stats.items()):
        order = sorted(layers)
        means.plot(order, [layers[i]["mean"] for i in order], marker=".", label=site)
        anisotropy.plot(order, [layers[i]["anisotropy"] for i in order], marker=".", label=site)
    means.set(title="scale mean per layer", xlabel="layer (-1: outside blocks)")
    anisotropy.set(title="scale anisotropy (std / mean) per layer", xlabel="layer (-1: outside blocks)")
    if stats:
        anisotropy.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Write a matplotlib figure as PNG atomically (a reader never sees half a file) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp.png")
    fig.savefig(temporary, dpi=110)
    plt.close(fig)
    temporary.replace(path)
    return path
