"""Decoding a training-form model: `generate` at the 0.12B preset, stock Llama vs ScaleVec standard vs unified (not
folded), unified with its folded weights cached for inference (the default) and refolded at every token (as before
the cache). `--against REVISION` adds standard and unified as that git revision's model code computes them.

    python benchmarks/bench_decode.py [--repetitions 5] [--new-tokens 24] [--against REVISION]
"""

import argparse
import sys
from collections.abc import Callable
from contextlib import nullcontext
from unittest import mock

import torch
from _common import at_revision, interleaved_medians, machine, split_revision, today
from transformers import LlamaConfig, LlamaForCausalLM

from scalevec import ScaleVecConfig, ScaleVecForCausalLM, scaled_ops
from scalevec.train.presets import MODEL_SIZES

PRESET = dict(MODEL_SIZES["0.12b"], vocab_size=32000)
PROMPT = 16


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**PRESET)).eval()
    preset, revision = split_revision(name)
    model = ScaleVecForCausalLM(ScaleVecConfig(**PRESET, scale_preset=preset)).eval()
    return model if revision is None else at_revision(revision, model)


def decode(model: torch.nn.Module, new_tokens: int, refold: bool = False) -> Callable[[], None]:
    prompt = torch.randint(0, PRESET["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def run() -> None:
        # refold: every call takes the training path, which folds the scales into each weight on the fly
        with mock.patch.object(scaled_ops, "reuses_folded_weights", lambda: False) if refold else nullcontext():
            model.generate(prompt, **options)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--against", metavar="REVISION", help="also standard and unified at this git revision")
    args = parser.parse_args()
    names = [
        "llama",
        "standard",
        "unified",
        *(f"{name} @ {args.against}" for name in ("standard", "unified") if args.against),
    ]
    models = {name: build(name) for name in names}
    runs = {name: decode(model, args.new_tokens) for name, model in models.items()}
    # its own copy: refolding drops the cached weights, which the other unified run would then rebuild each time
    runs["unified (refold per token)"] = decode(build("unified"), args.new_tokens, refold=True)
    times = interleaved_medians(runs, args.repetitions, warmup=1)
    print(f"## Decoding ({today()}, {machine()})\n")
    print(f"0.12B preset, prompt {PROMPT}, {args.new_tokens} new tokens, greedy, fp32, median of {args.repetitions}\n")
    print("| model | generate s | / standard |\n|---|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.3f} | {seconds / times['standard']:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
