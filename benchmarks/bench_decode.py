"""Decoding a training-form model: `generate` at the 0.12B preset, stock Llama vs ScaleVec standard vs unified (not
folded), unified with its folded weights cached for inference (the default) and refolded at every token (as before
the cache).

    python benchmarks/bench_decode.py [--repetitions 5] [--new-tokens 24]
"""

import argparse
import sys
from collections.abc import Callable
from contextlib import nullcontext
from unittest import mock

import torch
from _common import interleaved_medians, machine, today
from transformers import LlamaConfig, LlamaForCausalLM

import scalevec.modeling_scalevec as modeling
from scalevec import ScaleVecConfig, ScaleVecForCausalLM
from scalevec.train.presets import MODEL_SIZES

PRESET = dict(MODEL_SIZES["0.12b"], vocab_size=32000)
PROMPT = 16


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**PRESET)).eval()
    preset = "standard" if name == "standard" else "unified"
    return ScaleVecForCausalLM(ScaleVecConfig(**PRESET, scale_preset=preset)).eval()


def decode(model: torch.nn.Module, new_tokens: int, refold: bool = False) -> Callable[[], None]:
    prompt = torch.randint(0, PRESET["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(0))
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def run() -> None:
        # refold: every call takes the training path, which folds the scales into each weight on the fly
        with mock.patch.object(modeling, "_reuses_folded_weights", lambda: False) if refold else nullcontext():
            model.generate(prompt, **options)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    models = {name: build(name) for name in ("llama", "standard", "unified")}
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
