"""The text matches the records: the figures and verdicts that README.md, docs/study.md ("The study as it ran") and
benchmarks/RESULTS.md quote about the committed miniatures are recomputed from their records (`results.json`,
`tasks-*.json` in benchmarks/miniature-wsd and benchmarks/miniature-4x128) and found in the text as printed, to
the digits it prints."""

import json
import math
import re
import statistics
import sys
from pathlib import Path

import numpy as np
import pytest

from scalevec.train.study.intervals import Interval, detectable_effect, holm, paired_interval

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
WSD, LADDER_4X128 = "miniature-wsd", "miniature-4x128"
WSD_SECTION, LADDER_SECTION = "The CPU miniature under the verdict rules", "The miniature's 4x128 models"
MARGIN = 0.01  # the quantization rows' non-inferiority margin, in nats
QUANTIZED = "Unified quantizes"  # the non-inferiority rows, whatever their wording
VARIANTS = ("none", "standard", "unified")
NUMBER = r"[+-]?\d+\.\d+"
# RESULTS.md's rows of the task tables -> benchmarks/miniature_tasks.py's
TASK_ROWS = {
    "acc (chance 0.25)": "acc",
    "acc_norm": "acc_norm",
    "bits per byte of the gold ending": "bpb",
    "held-out loss, report half": "report loss",
    **{f"{s}: {figure}": f"{s} {figure}" for s in ("int8", "int4") for figure in ("bpb increase", "loss increase")},
    "int4: acc change": "int4 acc change",
    "residual kurtosis, max over layers": "residual kurtosis",
    "linear-input kurtosis, max over maps (down_proj's)": "linear-input kurtosis",
}


def records(name: str) -> dict:
    return json.loads((ROOT / "benchmarks" / name / "results.json").read_text())


def section(path: Path, heading: str) -> str:
    """The text under the heading of `path` that starts with `heading`, to the next heading of its level or above;
    a minus sign (U+2212) read as '-'."""
    text = path.read_text().replace("\u2212", "-")
    heading = re.search(rf"^(#+) {re.escape(heading)}.*\n", text, re.M)
    end = re.search(rf"^#{{1,{len(heading.group(1))}}} ", text[heading.end() :], re.M)
    return text[heading.start() : heading.end() + end.start()] if end else text[heading.start() :]


def flat(text: str) -> str:
    """`text` with each run of whitespace one space: a quoted figure may break across lines."""
    return " ".join(text.split())


def wsd_text() -> str:
    return flat(section(RESULTS, WSD_SECTION))


def ladder_text() -> str:
    return flat(section(RESULTS, LADDER_SECTION))


def study_text() -> str:
    return flat(section(ROOT / "docs" / "study.md", "The study as it ran"))


def readme_text() -> str:
    return flat(section(ROOT / "README.md", "Figures"))


def table_rows(text: str, header: str) -> list[list[str]]:
    """The cells of each row of the markdown table in `text` whose header row is `| header |`."""
    body = re.search(rf"^\| {re.escape(header)} \|\n\|[-|]+\|\n((?:\|.*\n)+)", text, re.M).group(1)
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in body.splitlines()]


def matches(printed: str, value: float, slack: float = 1e-12) -> bool:
    """`printed` ("+0.0715", "0.07") is `value` rounded to the digits it shows (within `slack` more, where `value`
    is itself rounded)."""
    decimals = len(printed.partition(".")[2])
    return abs(float(printed) - value) <= 0.5 * 10**-decimals + slack


def summaries(results: dict) -> dict[tuple[str, str], dict]:
    return {(s["size"], s["variant"]): s for s in results["summary"]}


def quantization_differences(results: dict, scheme: str) -> dict[str, Interval]:
    """Per size, unified's loss increase with `scheme` minus standard's, each at its selected rate, seed by seed."""
    chosen, sizes = summaries(results), [size["name"] for size in results["grid"]["sizes"]]
    differences = {}
    for size in sizes:
        unified = chosen[size, "unified"]["quantization_increase"][scheme]
        standard = chosen[size, "standard"]["quantization_increase"][scheme]
        differences[size] = paired_interval([unified[seed] - standard[seed] for seed in sorted(unified)])
    return differences


def claim_key(name: str) -> str:
    """A claim's name, or for a quantization row its scheme: the rows' wording changed with the verdict rules
    ("as well as standard", "within 0.01 nats of standard"), records written before keep the old one."""
    return (
        scheme.group(1) if name.startswith(QUANTIZED) and (scheme := re.search(r"\((int\d) weights\)", name)) else name
    )


def holm_in_families(claims: list[dict]) -> dict[tuple[str, str], tuple[float, str]]:
    """(claim key, size) -> Holm's adjusted p-value and verdict within the row's family (the quantization rows, the
    non-inferiority family; every other tested row, the superiority family), from the records' p-values."""
    corrected = {}
    for quantization in (True, False):
        family = [
            c for c in claims if c["verdict"] != "not tested" and c["claim"].startswith(QUANTIZED) == quantization
        ]
        for claim, adjusted in zip(family, holm([c["interval"]["p_value"] for c in family]), strict=True):
            holds = claim["verdict"] != "unresolved" and adjusted < 0.05  # Holm never turns an unresolved row
            corrected[claim_key(claim["claim"]), claim["size"]] = adjusted, claim["verdict"] if holds else "unresolved"
    return corrected


def signed_range(values: list[float], decimals: int) -> str:
    return f"{min(values):+.{decimals}f} to {max(values):+.{decimals}f}"


def recorded(claim: dict) -> Interval:
    """A claim's interval as its record holds it."""
    return Interval(*(claim["interval"][key] for key in ("n", "mean", "low", "high", "p_value")))


def quoted_interval(interval: Interval, decimals: int) -> str:
    return f"{interval.mean:+.{decimals}f} [{interval.low:+.{decimals}f}, {interval.high:+.{decimals}f}]"


def test_every_row_of_the_verdict_table_is_its_claim_in_the_records():
    """RESULTS.md's verdict table of the miniature: per tested claim and size one row, whose mean Δ, interval and
    verdict are the records', and its Holm verdict (and p, where given) Holm's within its family over the records'
    p-values; the quantization rows show unified's increase minus standard's, the margin added back to the Δ."""
    all_claims = records(WSD)["claims"]
    claims = [claim for claim in all_claims if claim["verdict"] != "not tested"]
    corrected = holm_in_families(all_claims)
    rows, claim_cell = {}, ""
    for cells in table_rows(section(RESULTS, WSD_SECTION), "claim | size | mean Δ [95 %] | verdict | Holm"):
        claim_cell = cells[0] or claim_cell  # a blank claim cell continues the row above
        (key,) = {claim_key(c["claim"]) for c in claims if claim_key(claim_cell).startswith(claim_key(c["claim"]))}
        rows[key, cells[1]] = cells[2:]
    assert len(rows) == len(claims) == 21
    for claim in claims:
        delta, verdict, holm_cell = rows[claim_key(claim["claim"]), claim["size"]]
        adjusted, holm_verdict = corrected[claim_key(claim["claim"]), claim["size"]]
        shift = MARGIN if claim["claim"].startswith(QUANTIZED) else 0.0
        expected = [claim["interval"][key] + shift for key in ("mean", "low", "high")]
        printed = re.fullmatch(rf"({NUMBER}) \[({NUMBER}), ({NUMBER})\]", delta).groups()
        assert all(map(matches, printed, expected)), (claim["claim"], claim["size"], delta, expected)
        assert verdict.split(":")[0] == claim["verdict"], (claim["claim"], claim["size"])
        assert holm_cell.split(" (")[0] == holm_verdict, (claim["claim"], claim["size"], holm_cell)
        if p_value := re.search(r"\(p ([\d.]+)\)", holm_cell):
            assert matches(p_value.group(1), adjusted)


def test_the_quantization_rows_state_the_measured_differences_not_just_the_margin():
    """Unified's increase is "within 0.01 nats of standard's", never "no more than"; each text states the measured
    differences: the largest with int8, the range with int4, and 4x128's int4 difference with its interval."""
    wsd, ladder = records(WSD), records(LADDER_4X128)
    int8 = quantization_differences(wsd, "int8").values()
    int4 = quantization_differences(wsd, "int4").values()
    largest_int8 = f"at most {max(abs(d.mean) for d in int8):.4f} nats with int8"
    int4_range = signed_range([d.mean for d in int4], 4) + " with int4"
    (at_4x128,) = quantization_differences(ladder, "int4").values()
    assert at_4x128.low > 0  # unified's int4 increase is the larger at 4x128, resolved
    for name, text in (("README", readme_text()), ("study.md", study_text()), ("RESULTS", wsd_text())):
        assert "within 0.01 nats of standard" in text and "no more than" not in text, name
        assert largest_int8 in text and int4_range in text, (name, largest_int8, int4_range)
    for name, text in (("README", readme_text()), ("study.md", study_text()), ("RESULTS", ladder_text())):
        assert quoted_interval(at_4x128, 4) in text, (name, quoted_interval(at_4x128, 4))
    means = [statistics.fmean(s["quantization_increase"]["int4"].values()) for s in wsd["summary"]]
    assert f"the int4 increases themselves are at most {max(means):.4f} nats" in wsd_text()


def test_the_loss_claims_as_quoted():
    """The ranges of the loss rows that hold (removing the scales) and of the lowest-loss means below 0, with their
    counts of sizes, in README, study.md and RESULTS; at 4x128 each row's interval and seeds, and that they hold at
    one learning rate, not tuned."""
    claims = records(WSD)["claims"]
    hurts = [c["interval"]["mean"] for c in claims if c["claim"].startswith("Removing") and c["verdict"] == "holds"]
    lower = [c["interval"]["mean"] for c in claims if c["claim"].startswith("Unified has the lowest")]
    below = [mean for mean in lower if mean < 0]
    removing = f"({signed_range(hurts, 2)} nats at {len(hurts)} of {len(lower)} sizes"
    lowest = f"{max(below):+.2f} to {min(below):+.2f} nats at {len(below)} of {len(lower)} sizes"
    assert removing in readme_text() and lowest in readme_text(), (removing, lowest)
    assert f"*holds* at {len(hurts)} of {len(lower)} sizes ({signed_range(hurts, 2)}" in study_text()
    assert lowest in study_text(), lowest
    corrected = holm_in_families(claims)
    survivors = [(size, p) for (key, size), (p, v) in corrected.items() if key.startswith("Removing") and v == "holds"]
    ((size, adjusted),) = survivors
    phrase = f"after Holm within the superiority family only at {size}"
    for name, text in (("README", readme_text()), ("study.md", study_text())):
        assert phrase in text, (name, phrase)
    assert f"{phrase} (p {adjusted:.2g};" in wsd_text()

    loss_rows = [c for c in records(LADDER_4X128)["claims"] if c["verdict"] != "not tested"]
    loss_rows = [c for c in loss_rows if not c["claim"].startswith(QUANTIZED)]
    assert [(c["verdict"], c["holm_verdict"]) for c in loss_rows] == [("holds", "holds")] * 2
    assert all(flag.endswith("one learning rate only: not tuned") for c in loss_rows for flag in c["flags"])
    corrected = holm_in_families(records(LADDER_4X128)["claims"])
    for claim in loss_rows:
        interval, (adjusted, holm_verdict) = recorded(claim), corrected[claim["claim"], claim["size"]]
        seeds = ", ".join(f"{claim['differences'][seed]:+.3f}" for seed in sorted(claim["differences"]))
        assert holm_verdict == "holds"
        quoted = f"{quoted_interval(interval, 4)} (seeds {seeds}): **holds**, after Holm too (p {adjusted:.2g})"
        assert quoted in ladder_text(), quoted
    removing, lowest = (recorded(c) for c in loss_rows)
    assert f"costs {removing.mean:+.3f} nats [{removing.low:+.3f}, {removing.high:+.3f}]" in study_text()
    assert f"lowest by {-lowest.mean:.3f} [{-lowest.high:.3f}, {-lowest.low:.3f}]" in study_text()
    for name, text in (("README", readme_text()), ("study.md", study_text()), ("RESULTS", ladder_text())):
        assert re.search(r"one learning rate,( 3e-3,)? not tuned", text), name


def test_the_ladders_parameters_rates_and_noise_as_quoted():
    """Total N's span (embeddings included), each size's best rates, the seeds' spread, the unresolved rows'
    half-widths (an effect detected about half the time) and how far the loss falls over the ladder."""
    results = records(WSD)
    finals = [run for run in results["runs"] if run["budget"] is None]
    totals = {}
    for run in finals:
        totals.setdefault(run["variant"], []).append(run["total_parameters"])
    spans = {f"{max(t) / min(t):.2f}x" for t in totals.values()}
    assert len(spans) == 1
    (span,) = spans
    for name, text in (("RESULTS", wsd_text()), ("study.md", study_text())):
        assert f"total N span only {span}" in text and "1.3x" not in text, (name, span)
    every = [run["total_parameters"] for run in finals]
    assert f"{min(every) / 1000:.0f} k to {max(every) / 1000:.0f} k" in wsd_text()

    chosen, sizes = summaries(results), [size["name"] for size in results["grid"]["sizes"]]
    rates = "; ".join(
        f"{size} " + ", ".join(f"{chosen[size, v]['best_learning_rate']:.0e}".replace("e-0", "e-") for v in VARIANTS)
        for size in sizes
    )
    assert f"best rates (none, standard, unified): {rates}" in wsd_text()
    assert chosen["4x32", "standard"]["best_learning_rate"] == 0.003  # study.md says so in words
    assert "3e-3 for 4x32 standard and at 2x64" in study_text()

    stds = [s["report_loss_std"] for s in results["summary"]]
    assert f"seed standard deviations of {min(stds):.2f} to {max(stds):.2f} nats" in wsd_text()
    half_widths = [
        recorded(c).half_width
        for c in results["claims"]
        if c["verdict"] == "unresolved" and c["differences"]  # the scaling row has no per-seed differences
    ]
    assert f"half-widths of {min(half_widths):.2f} to {max(half_widths):.2f} nats" in wsd_text()
    assert "about 50 % power" in wsd_text()
    powered = [
        detectable_effect(recorded(c)) for c in results["claims"] if c["verdict"] == "unresolved" and c["differences"]
    ]
    assert f"80 % power only for effects of {min(powered):.2f} to {max(powered):.2f} nats" in wsd_text()
    falls = [chosen[sizes[0], v]["report_loss_mean"] - chosen[sizes[-1], v]["report_loss_mean"] for v in VARIANTS]
    assert f"falls by {min(falls):.1f} to {max(falls):.1f} nats" in wsd_text()


def test_the_budgets_separate_n_and_d_and_the_bootstrap_is_descriptive():
    """log N and log D correlate 0.75 over the ladder's (size, budget) points, so the N term did not drop for want
    of separation: at equal tokens the larger model was worse, in every variant. The β intervals and the scaling
    row come from a bootstrap over 3 seeds, which have C(5, 3) = 10 distinct resamples."""
    results = records(WSD)
    points = {(r["non_embedding_parameters"], r["tokens"]) for r in results["runs"]}
    n, d = np.log(np.array(sorted(points), dtype=float)).T
    correlation = float(np.corrcoef(n, d)[0, 1])
    assert 0.5 < correlation < 0.9
    for name, text in (("RESULTS", wsd_text()), ("study.md", study_text())):
        quoted = re.search(
            r"correlation of log N and log D over (?:the \d+ points of \(size, budget\)|its points) is "
            r"(\d\.\d\d)",
            text,
        )
        assert quoted and matches(quoted.group(1), correlation), name
    assert f"over the {len(points)} points of (size, budget)" in wsd_text()

    chosen = summaries(results)
    losses: dict[tuple[int, str, str], list[float]] = {}  # (tokens, size, variant) -> report losses over seeds
    for run in results["runs"]:
        if run["learning_rate"] == chosen[run["size"], run["variant"]]["best_learning_rate"]:
            losses.setdefault((run["tokens"], run["size"], run["variant"]), []).append(run["eval_report_loss"])
    sizes = [size["name"] for size in results["grid"]["sizes"]]
    shared = sorted({t for t, size, _ in losses if sum(1 for s in sizes if (t, s, "none") in losses) == 2})
    assert shared == [36864, 73728]
    for tokens in shared:
        small, large = [s for s in sizes if (tokens, s, "none") in losses]
        worse = [
            statistics.fmean(losses[tokens, large, v]) - statistics.fmean(losses[tokens, small, v]) for v in VARIANTS
        ]
        assert min(worse) > 0, (tokens, worse)
        assert (
            f"at {tokens:,} tokens {large} is above {small} by {min(worse):.2f} to {max(worse):.2f} nats" in wsd_text()
        )

    seeds = len(results["grid"]["seeds"])
    assert f"over {seeds} seeds, which have {math.comb(2 * seeds - 1, seeds)} distinct resamples" in wsd_text()
    for variant, fit in results["budget_fits"].items():
        beta, (low, high) = fit["estimates"]["beta"], fit["intervals"]["beta"]
        assert f"{variant} {beta:.3f} [{low:.3f}, {high:.3f}]" in wsd_text()


def test_the_4x128_quantization_costs_against_2x64():
    """What int8 and int4 cost at 4x128 (each strategy's mean increase), against 2x64, and unified's extra int4
    cost as a share of standard's and of its lead in loss, in RESULTS.md and docs/evaluation.md."""
    small, large = summaries(records(WSD)), summaries(records(LADDER_4X128))
    cost = {
        (size, v): statistics.fmean(chosen[size, v]["quantization_increase"]["int4"].values())
        for size, chosen in (("2x64", small), ("4x128", large))
        for v in VARIANTS
    }
    ratios = [cost["4x128", v] / cost["2x64", v] for v in VARIANTS]
    assert f"{min(ratios):.1f} to {max(ratios):.1f} times what it cost each strategy at 2x64" in ladder_text()
    extra = cost["4x128", "unified"] - cost["4x128", "standard"]
    assert f"That is {100 * extra / cost['4x128', 'standard']:.0f} % more than standard's int4 cost" in ladder_text()
    int8 = [statistics.fmean(large["4x128", v]["quantization_increase"]["int8"].values()) for v in VARIANTS]
    int4 = [cost["4x128", v] for v in VARIANTS]
    assert max(int8) <= 1e-4 and "int8 weights cost nothing measurable (≤ 1e-4 nats" in ladder_text()
    assert f"int4 costs {min(int4):.3f}–{max(int4):.3f} nats" in ladder_text()
    (lowest,) = [c for c in records(LADDER_4X128)["claims"] if c["claim"].startswith("Unified has the lowest")]
    assert abs(-lowest["interval"]["mean"] / extra - 60) < 1 and "a sixtieth of unified's lead" in ladder_text()
    evaluation = flat(section(ROOT / "docs" / "evaluation.md", "What an export loses to quantization"))
    at_2x64 = cost["2x64", "unified"] - cost["2x64", "standard"]
    quoted = (
        f"int8 costs under 1e-4 nats and int4 {min(int4):.3f} to {max(int4):.3f} nats; unified loses {extra:.4f} nats "
        f"more to int4 than standard, a sixtieth of its lead in loss, and at 2x64 {-at_2x64:.4f} less"
    )
    assert quoted in evaluation, quoted


@pytest.mark.parametrize("name, size", [(WSD, "2x64"), (LADDER_4X128, "4x128")])
def test_the_task_tables_are_the_task_records(name, size):
    """Each cell of RESULTS.md's task, loss and quantization table (mean, and against standard Δ with its interval)
    is benchmarks/miniature_tasks.py's table of the committed tasks-SIZE.json, to the digits RESULTS prints."""
    from miniature_tasks import table  # benchmarks/, on the path above

    generated = {}
    for line in table(json.loads((ROOT / "benchmarks" / name / f"tasks-{size}.json").read_text())).splitlines()[2:]:
        label, *cells = [cell.strip() for cell in line.strip("|").split("|")]
        generated[label] = cells
    text = section(RESULTS, WSD_SECTION if name == WSD else LADDER_SECTION)
    rows = table_rows(text, "figure | none | standard | unified")
    assert len(rows) == 11
    for label, *cells in rows:
        for printed, exact in zip(cells, generated[TASK_ROWS[label]], strict=True):
            numbers, values = re.findall(NUMBER, printed), [float(v) for v in re.findall(NUMBER, exact)]
            assert len(numbers) == len(values), (label, printed, exact)
            # the generated table prints 5 decimals: a value rounded once more
            assert all(matches(n, v, slack=5e-6) for n, v in zip(numbers, values)), (label, printed, exact)
