"""The every-claim study's power plan (issue 50): how far paired differences between variants spread over seeds,
by size and run length, in committed study records, and the 95 % interval half-width and the effect detectable with
80 % power that N seeds would then give.

    python benchmarks/power_plan.py benchmarks/miniature-wsd/results.json benchmarks/miniature-4x128/results.json

For every (size, budget, learning rate) with at least 3 paired seeds, the paired differences unified − standard and
none − standard (report half of the held-out loss); their standard deviation is pooled over the learning rates and
both pairs (the spread does not depend on which pair: the pairs share standard's noise), weighted by degrees of
freedom. Expected half-width: t(0.975, n − 1) · s / √n; detectable effect with 80 % power (two-sided 5 %):
(t(0.975, n − 1) + t(0.8, n − 1)) · s / √n, the usual approximation to the noncentral t.
"""

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

from scipy import stats

PAIRS = (("unified", "standard"), ("none", "standard"))
SEED_COUNTS = (3, 5, 8)


def paired_spreads(runs: list[dict]) -> dict[tuple, tuple[float, int]]:
    """(size, steps) -> (pooled standard deviation of the paired differences, degrees of freedom)."""
    losses = defaultdict(dict)
    for run in runs:
        if run["status"] == "finished" and run.get("eval_report_loss") is not None:
            key = (run["size"], run["step"], run["learning_rate"], run["variant"])
            losses[key][run["seed"]] = run["eval_report_loss"]
    pooled = defaultdict(lambda: [0.0, 0])
    for (size, steps, rate, variant), by_seed in list(losses.items()):
        for first, second in PAIRS:
            if variant != first or (size, steps, rate, second) not in losses:
                continue
            other = losses[(size, steps, rate, second)]
            differences = [by_seed[s] - other[s] for s in by_seed if s in other]
            if len(differences) >= 3:
                mean = sum(differences) / len(differences)
                pooled[(size, steps)][0] += sum((d - mean) ** 2 for d in differences)
                pooled[(size, steps)][1] += len(differences) - 1
    return {key: (math.sqrt(squares / dof), dof) for key, (squares, dof) in pooled.items()}


def half_width(spread: float, seeds: int) -> float:
    return stats.t.ppf(0.975, seeds - 1) * spread / math.sqrt(seeds)


def detectable(spread: float, seeds: int) -> float:
    return (stats.t.ppf(0.975, seeds - 1) + stats.t.ppf(0.8, seeds - 1)) * spread / math.sqrt(seeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("records", nargs="+", type=Path, help="results.json files of finished studies")
    args = parser.parse_args()
    columns = " | ".join(f"{n} seeds: ±half / 80 % power" for n in SEED_COUNTS)
    print(f"| records | size | steps | s (paired Δ) | dof | {columns} |")
    print("|---" * (5 + len(SEED_COUNTS)) + "|")
    for path in args.records:
        runs = json.loads(path.read_text())["runs"]
        for (size, steps), (spread, dof) in sorted(paired_spreads(runs).items(), key=lambda item: item[0][1]):
            cells = " | ".join(f"{half_width(spread, n):.3f} / {detectable(spread, n):.3f}" for n in SEED_COUNTS)
            print(f"| {path.parent.name} | {size} | {steps} | {spread:.4f} | {dof} | {cells} |")


if __name__ == "__main__":
    main()
