"""Language-modelling metrics from per-token negative log-likelihoods: loss, perplexity and bits per byte.

An `evaluate` metric module shipped with ScaleVec and loaded by path (`evaluate.load(path)`), since
`evaluate.load("name")` needs the Hub.
"""

import math

import datasets
import evaluate

_DESCRIPTION = "Mean token loss (nats), perplexity exp(loss), and bits per byte loss * tokens / (bytes * ln 2)."
_KWARGS = """
Args:
    predictions: negative log-likelihood (nats) of each predicted token.
    references: 1 for a token that counts, 0 for padding / ignored positions.
    bytes_per_token: UTF-8 bytes of text per token of the evaluated corpus (for bits per byte); optional.
Returns:
    loss, perplexity, and bits_per_byte when bytes_per_token is given.
"""


class LMMetrics(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("float64"), "references": datasets.Value("int8")}
            ),
        )

    def _compute(self, predictions, references, bytes_per_token=None):
        counted = [nll for nll, keep in zip(predictions, references) if keep]
        if not counted:
            raise ValueError("no counted tokens: every reference is 0")
        loss = math.fsum(counted) / len(counted)
        result = {"loss": loss, "perplexity": math.exp(loss)}
        if bytes_per_token:
            result["bits_per_byte"] = loss / (math.log(2) * bytes_per_token)
        return result
