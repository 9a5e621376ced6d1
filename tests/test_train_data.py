"""The embedded corpus and tokenizer, and the language-modelling metric of held-out evaluation."""

import json
import math

import datasets
import pytest
import torch
from transformers import default_data_collator

from scalevec import ScaleVecForCausalLM
from scalevec.train import ScaleVecTrainer, ScaleVecTrainingArguments

from ._helpers import run_python, tiny_config

# --- the embedded corpus and tokenizer -----------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_corpus_and_tokenizer_offline():
    """In a fresh process with the Hub off: the default corpus file (built or cached) and its BPE tokenizer."""
    result = run_python(
        """
        import hashlib, json
        from scalevec.data.corpus import EOS_TOKEN, PAD_TOKEN, default_corpus_file, default_tokenizer
        path = default_corpus_file()
        lines = path.read_text(encoding="utf-8").splitlines()
        texts = [json.loads(line)["text"] for line in lines]
        tokenizer = default_tokenizer()
        ids = tokenizer(texts[0], add_special_tokens=False)["input_ids"]
        print(json.dumps(dict(
            bytes=path.stat().st_size, documents=len(texts),
            unique=len({hashlib.sha1(t.strip().encode()).hexdigest() for t in texts}),
            stripped=all(t == t.strip() and t for t in texts), eos=tokenizer.eos_token, pad=tokenizer.pad_token,
            eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, vocab=len(tokenizer),
            roundtrip=tokenizer.decode(ids) == texts[0], eos_in_text=tokenizer.eos_token_id in ids,
        )))
        """,
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["bytes"] >= 1_000_000 and info["documents"] > 500
    assert info["unique"] == info["documents"] and info["stripped"]  # de-duplicated
    assert (info["eos"], info["pad"]) == ("<|endoftext|>", "<|pad|>")
    assert info["eos_id"] is not None and info["pad_id"] is not None and info["eos_id"] != info["pad_id"]
    assert info["vocab"] == 4096 and info["roundtrip"] and not info["eos_in_text"]


# --- the evaluation ---------------------------------------------------------------------------------------------


def test_trainer_eval_loss_is_the_models_mean_loss(tmp_path):
    config = tiny_config()
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randint(1, config.vocab_size, (10, 16), generator=generator)
    eval_set = datasets.Dataset.from_dict({"input_ids": blocks.tolist()})

    def collate(rows):
        batch = default_data_collator(rows)
        return {**batch, "labels": batch["input_ids"].clone()}

    args = ScaleVecTrainingArguments(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to="none")
    trainer = ScaleVecTrainer(model, args, eval_dataset=eval_set, data_collator=collate)
    metrics = trainer.evaluate()  # batches of 4 + 4 + 2 blocks
    with torch.no_grad():
        expected = model.eval()(blocks, labels=blocks).loss.item()  # mean over all 10 * 15 predicted tokens
    assert metrics["eval_loss"] == pytest.approx(expected, abs=1e-5)
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert metrics["eval_tokens"] == 10 * 15 and "eval_bits_per_byte" not in metrics  # no tokenizer: no bytes
