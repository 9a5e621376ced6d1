"""Training step with document masking (`scalevec-train --document-masking`) against plain packing: the same
packed blocks of the embedded corpus, batched by the collator each mode uses, through the `tiny` / `tiny-moe`
presets (unified), in one run with interleaved repetitions and medians.

    python benchmarks/bench_document_masking.py [--repetitions 9] [--seq-lens 256 1024] [--batch 8]
"""

import argparse
import sys
from collections.abc import Callable

import torch
from _common import interleaved_medians, machine, today
from transformers.masking_utils import create_causal_mask

from scalevec import ScaleVecConfig, ScaleVecForCausalLM
from scalevec.data import DataArguments, PackedBlockCollator, build_training_data, default_tokenizer
from scalevec.train.presets import MODEL_SIZES

# (preset, attention implementation)
MODELS = (("tiny", "sdpa"), ("tiny", "eager"), ("tiny-moe", "sdpa"))


def build_model(preset: str, attention: str, vocab_size: int) -> ScaleVecForCausalLM:
    torch.manual_seed(0)
    config = ScaleVecConfig(**MODEL_SIZES[preset], vocab_size=vocab_size, use_cache=False)  # as in the Trainer
    return ScaleVecForCausalLM._from_config(config, attn_implementation=attention)


def packed_blocks(tokenizer, seq_len: int, count: int) -> list[dict]:
    """The first `count` training blocks of the embedded corpus."""
    arguments = DataArguments(seq_len=seq_len, eval_every=0, max_documents=2000, document_masking=True)
    train = build_training_data(arguments, tokenizer, seed=0, progress=False).train
    return [train[index] for index in range(count)]


def batch_for(blocks: list[dict], tokenizer, document_masking: bool) -> dict:
    return PackedBlockCollator(tokenizer.eos_token_id, document_masking)(blocks)


def training_step(model: ScaleVecForCausalLM, batch: dict) -> Callable[[], None]:
    """Forward + backward + fused AdamW (the Trainer's default) on one batch."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step() -> None:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def mask_step(model: ScaleVecForCausalLM, batch: dict) -> Callable[[], None]:
    """What the model's forward does once per step before its layers: build the attention mask (plain packing
    passes default positions; document masking, restarting positions; neither passes a mask)."""
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach()
    positions = batch.get("position_ids", torch.arange(embeds.shape[1])[None])
    mask = batch.get("attention_mask")

    def step() -> None:
        create_causal_mask(model.config, embeds, attention_mask=mask, cache=None, position_ids=positions)

    return step


def documents_per_block(blocks: list[dict], eos_token_id: int) -> float:
    positions = PackedBlockCollator(eos_token_id, document_masking=True)(blocks)["position_ids"]
    return (positions == 0).sum(dim=1).float().mean().item()


def table(seq_lens: list[int], batch: int, repetitions: int) -> list[str]:
    tokenizer = default_tokenizer()
    rows = [
        "| model | attention | batch × seq | documents / block | plain s | masked s | masked / plain "
        "| mask build ms, plain | mask build ms, masked |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seq_len in seq_lens:
        blocks = packed_blocks(tokenizer, seq_len, batch)
        documents = documents_per_block(blocks, tokenizer.eos_token_id)
        for preset, attention in MODELS:
            steps, masks = {}, {}
            for masked in (False, True):
                model = build_model(preset, attention, len(tokenizer))
                batch_of_mode = batch_for(blocks, tokenizer, masked)
                steps[masked] = training_step(model, batch_of_mode)
                masks[masked] = mask_step(model, batch_of_mode)
            times = interleaved_medians(steps, repetitions)
            mask_times = interleaved_medians(masks, repetitions)
            rows.append(
                f"| {preset} | {attention} | {batch} × {seq_len} | {documents:.2f} | "
                f"{times[False]:.3f} | {times[True]:.3f} | {times[True] / times[False]:.3f} | "
                f"{mask_times[False] * 1e3:.1f} | {mask_times[True] * 1e3:.1f} |"
            )
            print(rows[-1], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=9)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    print(f"## Document masking ({today()}, {machine()})\n", flush=True)
    rows = table(args.seq_lens, args.batch, args.repetitions)
    print(f"\nunified, fp32, fused AdamW, median of {args.repetitions} interleaved steps\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
