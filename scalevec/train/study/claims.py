"""The paper's claims, each tested by the runs of the grid that bear on it, with a verdict per size."""

from dataclasses import dataclass

from .records import RunRecord
from .scaling import exponents_per_seed
from .summary import Key, eval_losses, paired_differences
from .variants import PREDICTIONS, VARIANT_GROUPS, VARIANTS, as_predicted

HOLDS, FAILS, UNTESTED = "holds", "does not hold", "not tested by this grid"
RULE = (
    "Each variant is taken at its own best learning rate (lowest mean final eval loss over seeds) and compared with "
    "the other side seed by seed: within a seed both started from the same matrices and read the same batches, so "
    "Δ is the measurement. A claim **holds** at a size when Δ has the predicted sign in every seed in which both "
    "sides were run; it **does not hold** when any seed contradicts it; it is **not tested by this grid** when the "
    "grid lacks the runs (then the row names them)."
)


@dataclass(frozen=True)
class Claim:
    statement: str
    variants: tuple[str, ...]  # each compared with its reference, as VARIANTS predicts


PAIRED_CLAIMS = (
    Claim("Removing the scale vectors hurts", ("none",)),
    Claim(
        "Decaying input-role scales helps (exempting them hurts)", ("standard-input-exempt", "unified-input-exempt")
    ),
    Claim("Decaying output-role scales hurts", ("unified-output-norm-decayed",)),
    Claim("Branch-specific norm scales help", ("branch",)),
    Claim("Scales on the linear maps' inputs and outputs (placement) help", ("placement",)),
    Claim("The magnitude–direction parametrisation helps", ("magdir",)),
)
LOWEST = "Unified has the lowest terminal loss of the strategies"
SCALING = "Unified scales more favourably than standard"


@dataclass
class ClaimTest:
    claim: str
    size: str  # one size, every size (the scaling claim), or "-" where untested
    runs: str  # the runs compared, at their learning rates; what is missing where untested
    prediction: str
    differences: dict[int, float]  # seed -> Δ
    held: list[int]  # the seeds in which Δ has the predicted sign
    verdict: str


def claim_verdicts(best: dict[Key, list[RunRecord]], sizes: list[str]) -> list[ClaimTest]:
    """Every claim of the paper, tested at each size of `sizes` that holds its runs (`best`: the runs of each size and
    variant at its best learning rate)."""
    tests = []
    for claim in PAIRED_CLAIMS:
        for name in claim.variants:
            variant = VARIANTS[name]
            found = [_paired(claim, best, size, name) for size in sizes]
            found = [test for test in found if test]
            tests += found or [_untested(claim.statement, f"{name} and {variant.reference}", variant.expected)]
    found = [test for size in sizes if (test := _lowest(best, size))]
    tests += found or [_untested(LOWEST, "unified and another strategy", "lower")]
    tests.append(_scaling(best, sizes))
    return tests


def _paired(claim: Claim, best, size: str, name: str) -> ClaimTest | None:
    variant = VARIANTS[name]
    ours, theirs = best.get((size, name)), best.get((size, variant.reference))
    differences = paired_differences(ours, theirs) if ours and theirs else {}
    if not differences:
        return None
    runs = f"{_at(name, ours)} − {_at(variant.reference, theirs)}"
    return _test(claim.statement, size, runs, variant.expected, differences)


def _lowest(best, size: str) -> ClaimTest | None:
    others = [v for v in VARIANT_GROUPS["strategies"] if v != "unified" and (size, v) in best]
    if (size, "unified") not in best or not others:
        return None
    losses = {v: eval_losses(best[size, v]) for v in others}
    unified = eval_losses(best[size, "unified"])
    seeds = [seed for seed in unified if all(seed in losses[v] for v in others)]
    differences = {seed: unified[seed] - min(losses[v][seed] for v in others) for seed in seeds}
    if not differences:
        return None
    runs = f"{_at('unified', best[size, 'unified'])} − the lowest of " + ", ".join(
        _at(v, best[size, v]) for v in others
    )
    return _test(LOWEST, size, runs, "lower", differences)


def _scaling(best, sizes: list[str]) -> ClaimTest:
    unified, standard = exponents_per_seed(best, "unified"), exponents_per_seed(best, "standard")
    differences = {seed: alpha - standard[seed] for seed, alpha in unified.items() if seed in standard}
    if not differences:
        return _untested(SCALING, "unified and standard at 2 sizes or more", "higher", "Δα > 0")
    runs = (
        f"α of a power law A·N^-α through each seed's runs over sizes {', '.join(sizes)}, each at its best learning "
        "rate: unified − standard"
    )
    return _test(SCALING, "all", runs, "higher", differences, "Δα > 0")


def _at(variant: str, runs: list[RunRecord]) -> str:
    return f"{variant} (lr {runs[0].learning_rate:g})"


def _test(claim, size, runs, expected, differences, prediction=None) -> ClaimTest:
    held = [seed for seed, difference in differences.items() if as_predicted(difference, expected)]
    verdict = HOLDS if len(held) == len(differences) else FAILS
    return ClaimTest(claim, size, runs, prediction or PREDICTIONS[expected], differences, held, verdict)


def _untested(claim: str, needs: str, expected: str, prediction: str | None = None) -> ClaimTest:
    return ClaimTest(claim, "-", f"needs {needs}", prediction or PREDICTIONS[expected], {}, [], UNTESTED)


def claims_markdown(tests: list[ClaimTest], grid: str) -> str:
    rows = [
        "# The paper's claims, tested by this grid",
        "",
        f"Grid: {grid}.",
        "",
        RULE,
        "",
        "| claim | size | runs compared (learning rate) | prediction | Δ per seed | holds in seeds | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in tests:
        differences = ", ".join(f"{seed}: {d:+.4f}" for seed, d in t.differences.items()) or "-"
        held = f"{len(t.held)} of {len(t.differences)}" if t.differences else "-"
        held += f" ({', '.join(map(str, t.held))})" if t.held else ""
        rows.append(f"| {t.claim} | {t.size} | {t.runs} | {t.prediction} | {differences} | {held} | {t.verdict} |")
    return "\n".join(rows) + "\n"
