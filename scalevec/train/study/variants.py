"""The variants a study compares: a scale strategy and its scales' weight-decay rule, each with the variant it is
compared with seed by seed and the paper's prediction for that comparison."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    """A scale strategy (ModelArguments fields) and its scales' weight-decay rule, compared seed by seed with
    `reference`; `expected` is the paper's prediction for its eval loss against the reference."""

    model: dict
    reference: str | None = "standard"
    expected: str | None = "lower"  # "lower", "higher", or None where the paper predicts nothing
    exempt_input_scales: bool = False  # the stock Trainer's rule (no decay on anything named "norm")
    decay_output_scales: bool = False  # decayed as the matrices are (--weight-decay)
    decay_toward_one: bool = False  # the scales' decay pulls them toward 1 (the identity), not 0

    def training_overrides(self, weight_decay: float) -> dict:
        """The training arguments this variant sets, given the matrices' `--weight-decay`."""
        overrides = {"scale_decay_target": 1.0} if self.decay_toward_one else {}
        if self.exempt_input_scales:
            overrides["input_scale_weight_decay"] = 0.0
        if self.decay_output_scales:
            overrides["output_scale_weight_decay"] = weight_decay
        return overrides


_STANDARD = dict(scale_preset="standard")
_UNIFIED = dict(scale_preset="unified")
_UNIFIED_OUTPUT_NORMS = dict(scale_preset="unified", output_norm=True)  # Peri-LN: output-role scales exist
# The paper's strategies, each isolated on top of "standard" (shared norm scale, direct), then all together; then
# its weight-decay rule by role: input-role scales decayed (ours) vs exempt (the stock Trainer, which for
# "standard" gives exactly its parameter groups), output-role scales exempt (ours and the stock Trainer) vs decayed;
# and, beyond the paper, the input-role scales' decay pulling toward 1 instead of 0.
VARIANTS: dict[str, Variant] = {
    "none": Variant(dict(scale_preset="none"), expected="higher"),
    "standard": Variant(_STANDARD, reference=None, expected=None),
    "branch": Variant(dict(_STANDARD, norm_scale="branch")),
    "placement": Variant(dict(_STANDARD, linear_scale="both")),
    "magdir": Variant(dict(_STANDARD, scale_param="magdir")),
    "unified": Variant(_UNIFIED),
    "standard-input-exempt": Variant(_STANDARD, expected="higher", exempt_input_scales=True),
    "unified-input-exempt": Variant(_UNIFIED, reference="unified", expected="higher", exempt_input_scales=True),
    "unified-output-norm": Variant(_UNIFIED_OUTPUT_NORMS, reference="unified", expected=None),
    "unified-output-norm-decayed": Variant(
        _UNIFIED_OUTPUT_NORMS, reference="unified-output-norm", expected="higher", decay_output_scales=True
    ),
    # Not the paper's: decay toward the identity instead of toward 0 (does the direction of the pull matter?).
    "standard-decay-to-one": Variant(_STANDARD, expected=None, decay_toward_one=True),
    "unified-decay-to-one": Variant(_UNIFIED, reference="unified", expected=None, decay_toward_one=True),
}
VARIANT_GROUPS: dict[str, list[str]] = {
    "strategies": ["none", "standard", "branch", "placement", "magdir", "unified"],
    "weight-decay": [
        "standard",
        "standard-input-exempt",
        "unified",
        "unified-input-exempt",
        "unified-output-norm",
        "unified-output-norm-decayed",
    ],
    "decay-target": ["standard", "standard-decay-to-one", "unified", "unified-decay-to-one"],
    "all": list(VARIANTS),
}


def as_predicted(difference: float, expected: str | None) -> bool:
    """Whether a variant's eval loss minus its reference's has the sign the paper predicts."""
    return (expected == "lower" and difference < 0) or (expected == "higher" and difference > 0)


PREDICTIONS = {"lower": "Δ < 0", "higher": "Δ > 0"}
