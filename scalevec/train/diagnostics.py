"""Scale-vector diagnostics: per-site statistics logged during training, and the end-of-run picture."""

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..atomic import write_figure_atomically
from ..modeling_scalevec import ScaleVecScale
from ..run_records import RUN_PICTURE, logged_curve
from ..scale_sites import scale_site, vector_statistics


def scale_statistics(model: torch.nn.Module) -> dict[str, dict[int, dict[str, float]]]:
    """`{site: {layer: {mean, std, min, max, anisotropy[, magnitude]}}}` for every learnable scale vector; a site
    is the module path without its layer index (layer -1: outside the blocks, e.g. the final norm)."""
    stats: dict[str, dict[int, dict[str, float]]] = defaultdict(dict)
    for name, module in model.named_modules():
        if not isinstance(module, ScaleVecScale) or module.scale_param is None:
            continue
        site, layer = scale_site(name)
        with torch.no_grad():
            entry = vector_statistics(module.vector())
        entry["anisotropy"] = entry["std"] / abs(entry["mean"]) if entry["mean"] else float("inf")
        if module.scale_param == "magdir":
            entry["magnitude"] = module.magnitude.detach().float().mean().item()
        stats[site][layer] = entry
    return dict(stats)


def flat_log(stats: dict[str, dict[int, dict[str, float]]]) -> dict[str, float]:
    """One number per site and statistic (averaged over layers), under `scale/<site>/<statistic>`."""
    logs = {}
    for site, layers in stats.items():
        for key in next(iter(layers.values())):
            logs[f"scale/{site}/{key}"] = sum(entry[key] for entry in layers.values()) / len(layers)
    return logs


def extend_log(state, logs: dict, extra: dict[str, float]) -> None:
    """Add `extra` to the `logs` that the callbacks after this one get, and to the record of this step in
    `state.log_history` (which the Trainer wrote before calling the callbacks)."""
    logs.update(extra)
    if state.log_history and state.log_history[-1].get("step") == state.global_step:
        state.log_history[-1].update(extra)


@dataclass
class MomentSums:
    """Sums of the first four powers of `x - shift` over every element seen, in float64, so that batches add up
    and the kurtosis of all of them together comes out (the shift, the first batch's mean, keeps the sums exact)."""

    shift: float | None = None
    count: int = 0
    powers: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    def add(self, values: torch.Tensor, chunk: int = 1 << 22) -> None:
        flat = values.detach().reshape(-1)
        if self.shift is None:
            self.shift = flat.float().mean().item()
        sums = list(self.powers)
        for start in range(0, flat.numel(), chunk):  # bounded float64 memory, whatever the batch
            centred = flat[start : start + chunk].double() - self.shift
            for power in range(4):
                sums[power] += centred.pow(power + 1).sum().item()
        self.count += flat.numel()
        self.powers = tuple(sums)

    def excess_kurtosis(self) -> float:
        """E[(x - mean)^4] / Var(x)^2 - 3: 0 for a normal distribution, large where a few values dwarf the rest."""
        n = self.count
        mean, second, third, fourth = (total / n for total in self.powers)
        variance = second - mean**2
        central4 = fourth - 4 * mean * third + 6 * mean**2 * second - 3 * mean**4
        return central4 / variance**2 - 3 if variance > 0 else float("nan")


def activation_kurtosis(model: torch.nn.Module, batches: Iterable[dict]) -> dict[str, dict[int, float]]:
    """`{site: {layer: excess kurtosis}}` of the activations of each decoder layer over `batches` (model inputs):
    "residual", the residual stream a layer outputs, and "<path>.input" for the input of each linear map in it
    (`self_attn.q_proj.input`; maps that read the same tensor, as q, k and v do, are counted once, under the first).
    The kurtosis is excess kurtosis (Pearson's minus 3) over every element of the tensor, tokens and channels
    together, as Outlier-Safe Pre-Training reports it: outlier channels, the ones that hurt quantization, raise it."""
    sums: dict[str, dict[int, MomentSums]] = defaultdict(lambda: defaultdict(MomentSums))
    handles, seen = [], {}
    for index, layer in enumerate(_decoder_layers(model)):
        handles.append(layer.register_forward_hook(_residual_hook(sums["residual"][index])))
        for path, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):
                handles.append(module.register_forward_pre_hook(_input_hook(sums, f"{path}.input", index, seen)))
    try:
        with torch.no_grad():
            for inputs in batches:
                seen.clear()
                model(**inputs, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return {site: {layer: sums.excess_kurtosis() for layer, sums in layers.items()} for site, layers in sums.items()}


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    model = _unwrap(model)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    if not isinstance(getattr(decoder, "layers", None), torch.nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no list of decoder layers (`.layers`) to measure.")
    return decoder.layers


def _residual_hook(sums: MomentSums):
    def hook(module, args, output):
        sums.add(output[0] if isinstance(output, tuple) else output)

    return hook


def _input_hook(sums: dict, site: str, layer: int, seen: dict):
    def hook(module, args):
        if id(args[0]) not in seen:  # q, k and v (gate and up) read one tensor: measure it once
            seen[id(args[0])] = args[0]  # held until the next batch, so that its id is not reused meanwhile
            sums[site][layer].add(args[0])

    return hook


def kurtosis_log(kurtosis: dict[str, dict[int, float]]) -> dict[str, float]:
    """Each layer's kurtosis under `scale/kurtosis/<site>/<layer>`, beside the scale statistics (and, like them,
    kept out of the console's progress lines)."""
    return {
        f"scale/kurtosis/{site}/{layer}": value for site, layers in kurtosis.items() for layer, value in layers.items()
    }


class ScaleStatsCallback(TrainerCallback):
    """Adds per-site scale statistics to every training log (so every logger the Trainer reports to gets them)
    and, at the end of training and again after each evaluation that follows it, writes `scale_vectors.png` with
    the loss curves and the per-layer statistics."""

    def __init__(self):
        self.training_ended = False

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if model is None or logs is None or "loss" not in logs:
            return
        extend_log(state, logs, flat_log(scale_statistics(_unwrap(model))))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self.training_ended = True
        self._plot(args, state, model)

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        # The held-out evaluation of a finished run comes after `on_train_end`: draw again to show its loss.
        if self.training_ended:
            self._plot(args, state, model)

    @staticmethod
    def _plot(args, state, model) -> None:
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
    """Write the picture of a run (`run_figure`) to `path`."""
    return write_figure_atomically(run_figure(log_history, stats), path)


# One line style per part of the block (attention, MLP or MoE, the rest), a colour per site within it, so that no
# two sites look alike and lines lying on top of each other still show.
_STYLES = {"self_attn": ("-", "o"), "mlp": ("--", "s"), "other": (":", "^")}
READING = (
    "How to read it: every scale starts at 1 (mean 1, anisotropy 0). Means and anisotropy leaving that start are the "
    "scales learning to precondition the linear maps they feed, as the paper finds; expect smooth changes from layer "
    "to layer. Look twice at a site whose mean heads for 0 or keeps growing, or whose anisotropy far outgrows the "
    "others: its weight decay (by role) or the learning rate may be off."
)


def _site_styles(sites: list[str]) -> dict[str, dict]:
    import matplotlib

    colours = matplotlib.colormaps["tab10"].colors
    styles, counts = {}, {}
    for site in sites:
        part = site.split(".")[0] if site.split(".")[0] in _STYLES else "other"
        index = counts[part] = counts.get(part, -1) + 1
        linestyle, marker = _STYLES[part]
        styles[site] = {"color": colours[index % len(colours)], "linestyle": linestyle, "marker": marker}
    return styles


def run_figure(log_history: list[dict], stats: dict):
    """Loss curves (train, eval) and the mean and anisotropy of every scale site across layers, each scale panel
    with its own legend, and a caption on how to read them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (losses, means, anisotropy) = plt.subplots(1, 3, figsize=(17, 6))
    for key, label in (("loss", "train"), ("eval_loss", "eval")):
        points = logged_curve(log_history, key)
        if points:
            losses.plot(*zip(*points), marker="o" if label == "eval" else None, label=label)
    losses.set(title="loss", xlabel="step", ylabel="nats per token")
    if losses.lines:
        losses.legend()
    styles = _site_styles(sorted(stats))
    for site, layers in sorted(stats.items()):
        order = sorted(layers)
        for panel, key in ((means, "mean"), (anisotropy, "anisotropy")):
            panel.plot(order, [layers[i][key] for i in order], label=site, markersize=4, linewidth=1.2, **styles[site])
    means.set(title="scale mean per layer", xlabel="layer (-1: outside the blocks)")
    anisotropy.set(title="scale anisotropy (std / mean) per layer", xlabel="layer (-1: outside the blocks)")
    for panel in (means, anisotropy):
        panel.xaxis.set_major_locator(MaxNLocator(integer=True))
        if stats:
            panel.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    fig.text(0.01, 0.01, READING, fontsize=8.5, wrap=True, va="bottom")
    fig.subplots_adjust(left=0.05, right=0.99, top=0.94, bottom=0.38, wspace=0.22)
    return fig
