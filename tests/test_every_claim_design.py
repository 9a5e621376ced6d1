"""The every-claim study's groups (`benchmarks/ablation.sh`, issue 50) put every claim to the test: each paired
claim's variant and its reference at one size, every strategy beside unified at the largest size, unified and
standard at enough sizes for the scaling row, and the two claims of the MoE and Muon groups. A group that lacks a
reference leaves its claim "not tested" after hours of runs; this is checked before any run."""

import re
import shlex
from pathlib import Path

import pytest

from scalevec.train.study.arguments import AblationArguments
from scalevec.train.study.claims import PAIRED_CLAIMS
from scalevec.train.study.records import read_results
from scalevec.train.study.scaling import MIN_SIZES
from scalevec.train.study.summary import SELECTED, summarise
from scalevec.train.study.variants import VARIANT_GROUPS, VARIANTS

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ablation.sh"
DENSE = ("every-claim-headline", "every-claim-variants", "every-claim-ladder")  # one folder, one study


def group_calls(group: str) -> list[dict[str, str]]:
    """The flags of each scalevec-ablate call `ablation.sh` makes for the group (its case branch, continuation lines
    joined; one call a line)."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    (branch,) = re.findall(rf"^\s*{re.escape(group)}\) (every_claim .*?);;", text, flags=re.MULTILINE | re.DOTALL)
    calls = []
    for line in branch.strip().splitlines():
        words = shlex.split(line.strip(), comments=True)
        assert words[0] == "every_claim", line
        calls.append({flag: value for flag, value in zip(words, words[1:]) if flag.startswith("--")})
    return calls


def default_seeds() -> set[int]:
    """The seeds of `every_claim`'s defaults: every rate of a group trains them, unless the group names its own."""
    (defaults,) = re.findall(r"^every_claim=\((.*?)\)$", SCRIPT.read_text(), flags=re.MULTILINE | re.DOTALL)
    words = shlex.split(defaults)
    return {int(seed) for seed in words[words.index("--seeds") + 1].split(",")}


def pairs(groups) -> set[tuple[str, str]]:
    """Every (size, variant) the groups train."""
    found = set()
    for flags in (flags for group in groups for flags in group_calls(group)):
        variants = AblationArguments(variants=flags["--variants"]).variant_names()
        found |= {(size, variant) for size in flags["--sizes"].split(",") for variant in variants}
    return found


def test_each_paired_claim_has_both_sides_at_one_size():
    trained = pairs(DENSE)
    sizes = {size for size, _ in trained}
    for claim in PAIRED_CLAIMS:
        for name in claim.variants:
            reference = VARIANTS[name].reference
            assert any({(s, name), (s, reference)} <= trained for s in sizes), (claim.statement, name, reference)


def test_every_strategy_stands_beside_unified_at_the_largest_size_and_the_ladder_has_enough_sizes():
    trained = pairs(DENSE)
    (largest,) = {call["--sizes"] for call in group_calls("every-claim-headline")}
    assert {(largest, v) for v in VARIANT_GROUPS["strategies"]} <= trained
    ladder = {size for size, variant in trained if variant == "unified"}
    assert ladder == {size for size, variant in trained if variant == "standard"} and len(ladder) >= MIN_SIZES


@pytest.mark.parametrize("group", ["every-claim-moe", "every-claim-muon"])
def test_the_moe_and_muon_groups_test_both_claims_with_five_seeds_and_three_rates(group):
    (flags,) = group_calls(group)
    assert pairs([group]) == {(flags["--sizes"], v) for v in ("none", "standard", "unified")}
    assert flags["--output-dir"].endswith(group)  # a folder of its own: the preset or optimizer differs
    assert len(flags["--learning-rates"].split(",")) >= 3
    assert "--seeds" not in flags  # the groups keep every_claim's seeds
    assert default_seeds() == {0, 1, 2, 3, 4}


def test_the_headline_seeds_are_trained_at_the_best_rates_the_committed_records_choose():
    """`every-claim-headline-seeds` adds seeds at one rate per variant: that rate must be the one seeds 0-4 chose,
    inside the grid, or the added seeds count nowhere (while they train, their rows read incomplete)."""
    grid, records = read_results(SCRIPT.parent / "every-claim" / "results.json")
    calls = group_calls("every-claim-headline-seeds")
    (size,) = {call["--sizes"] for call in calls}
    first_seeds = default_seeds()
    first = [r for r in records if r.seed in first_seeds]
    chosen = {s.variant: s for s in summarise(first, grid) if s.size == size}
    trained = set()
    for call in calls:
        assert {int(seed) for seed in call["--seeds"].split(",")}.isdisjoint(first_seeds)
        for variant in call["--variants"].split(","):
            summary = chosen[variant]
            assert summary.status == SELECTED and summary.edge is None, (variant, summary.edge)
            assert float(call["--learning-rates"]) == summary.best_learning_rate, variant
            trained.add(variant)
    assert trained == {"none", "standard", "unified"}
