"""Packing, local datasets (txt / jsonl / parquet / folders), held-out split, the embedded corpus and tokenizer,
and the language-modelling metric."""

import json
import math
import random

import datasets
import pytest
import torch
from transformers import default_data_collator

from scalevec import ScaleVecForCausalLM
from scalevec.train import (
    DataArguments,
    ScaleVecTrainer,
    ScaleVecTrainingArguments,
    build_datasets,
    default_tokenizer,
    pack,
)
from scalevec.train.trainer import METRIC_PATH

from ._helpers import run_python, tiny_config

EOS = 0


def random_documents(count: int, seed: int, longest: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(rng.randrange(0, longest))] for _ in range(count)]


@pytest.mark.parametrize("seq_len", [2, 7, 32, 100])
@pytest.mark.parametrize("seed", [0, 1])
def test_pack_loses_and_duplicates_nothing(seq_len, seed):
    documents = random_documents(30, seed) + [[], list(range(1, 3 * seq_len + 2))]  # an empty and a long one
    stream = [t for doc in documents for t in [*doc, EOS]]
    blocks = list(pack(iter(documents), seq_len, EOS))  # a generator is enough: one pass
    assert all(len(block) == seq_len for block in blocks)
    assert len(blocks) == len(stream) // seq_len  # only the final partial block is dropped
    assert [t for block in blocks for t in block] == stream[: len(blocks) * seq_len]
    assert len(stream) - len(blocks) * seq_len < seq_len
    # one EOS after each document (none of them contains token 0), in place
    flat = [t for block in blocks for t in block]
    ends = [i for i, t in enumerate(flat) if t == EOS]
    expected_ends = [i for i, t in enumerate(stream) if t == EOS and i < len(flat)]
    assert ends == expected_ends and len(ends) >= len(documents) - 2


def test_pack_of_nothing_and_of_exact_multiples():
    assert list(pack([], 4, EOS)) == []
    assert list(pack([[1, 2, 3]], 4, EOS)) == [[1, 2, 3, EOS]]
    assert list(pack([[1, 2, 3], [4, 5]], 4, EOS)) == [[1, 2, 3, EOS]]  # the partial [4, 5, 6, EOS] dropped
    assert list(pack([[1, 2, 3], [4, 5, 6]], 8, EOS)) == [[1, 2, 3, EOS, 4, 5, 6, EOS]]


# --- local datasets ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


def corpus_texts(count: int = 60) -> list[str]:
    """Distinct one-line documents of varying lengths (the text builder reads one document per line)."""
    rng = random.Random(7)
    words = ["scale", "vector", "norm", "matrix", "decay", "expert", "router", "token", "block", "shard"]
    return [f"document {i}: " + " ".join(rng.choice(words) for _ in range(rng.randrange(3, 40))) for i in range(count)]


def write_dataset(folder, kind: str, texts: list[str], column: str = "text"):
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "txt":
        path = folder / "docs.txt"
        path.write_text("".join(t + "\n" for t in texts))
    elif kind == "jsonl":
        path = folder / "docs.jsonl"
        path.write_text("".join(json.dumps({column: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    elif kind == "parquet":
        path = folder / "docs.parquet"
        datasets.Dataset.from_dict({column: texts, "id": list(range(len(texts)))}).to_parquet(str(path))
    else:  # a folder of two jsonl files, read in sorted order
        half = len(texts) // 2
        write_dataset(folder / "b", "jsonl", texts[half:], column)
        write_dataset(folder / "a", "jsonl", texts[:half], column)
        return folder
    return path


def expected_blocks(tokenizer, texts: list[str], seq_len: int) -> list[list[int]]:
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return list(pack(ids, seq_len, tokenizer.eos_token_id))


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet", "folder"])
def test_build_datasets_from_local_files(kind, tokenizer, tmp_path):
    texts = corpus_texts()
    column = "text" if kind == "txt" else "body"
    path = write_dataset(tmp_path / kind, kind, texts, column)
    args = DataArguments(dataset=str(path), text_column=column, seq_len=16, eval_every=5)
    data = build_datasets(args, tokenizer, seed=0)
    train_texts = [t for i, t in enumerate(texts) if i % 5 != 4]
    eval_texts = [t for i, t in enumerate(texts) if i % 5 == 4]  # every 5th document held out, disjoint
    assert data.train["input_ids"] == expected_blocks(tokenizer, train_texts, 16)
    assert data.eval["input_ids"] == expected_blocks(tokenizer, eval_texts, 16)
    assert torch.tensor(data.train["input_ids"]).shape[1] == 16 and len(data.train) > 10
    eval_ids = tokenizer(eval_texts, add_special_tokens=False)["input_ids"]
    tokens = sum(len(ids) + 1 for ids in eval_ids)  # + EOS per document
    assert data.bytes_per_token == pytest.approx(sum(len(t.encode()) for t in eval_texts) / tokens)


def test_streaming_matches_in_memory_and_is_seeded(tokenizer, tmp_path):
    texts = corpus_texts(80)
    path = write_dataset(tmp_path, "jsonl", texts)

    def build(**overrides):
        args = DataArguments(dataset=str(path), seq_len=16, eval_every=4, max_documents=60, **overrides)
        return build_datasets(args, tokenizer, seed=0)

    in_memory = build()
    train_texts = [t for i, t in enumerate(texts[:60]) if i % 4 != 3]  # max_documents applies before the split
    assert in_memory.train["input_ids"] == expected_blocks(tokenizer, train_texts, 16)
    unshuffled = build(streaming=True, shuffle_buffer=1)  # a buffer of one keeps the order
    assert isinstance(unshuffled.train, datasets.IterableDataset)
    streamed = [row["input_ids"] for row in unshuffled.train]
    assert streamed == in_memory.train["input_ids"]
    assert unshuffled.eval["input_ids"] == in_memory.eval["input_ids"]
    assert unshuffled.bytes_per_token == pytest.approx(in_memory.bytes_per_token)

    def shuffled(seed):
        args = DataArguments(dataset=str(path), seq_len=16, eval_every=4, streaming=True, shuffle_buffer=50)
        return [row["input_ids"] for row in build_datasets(args, tokenizer, seed=seed).train]

    first, again, other = shuffled(0), shuffled(0), shuffled(1)
    assert first == again  # deterministic given the seed
    every_block = expected_blocks(tokenizer, [t for i, t in enumerate(texts) if i % 4 != 3], 16)
    assert first != other and sorted(first) == sorted(other) == sorted(every_block)  # reordered, same blocks
    assert first != every_block


def test_no_eval_split_and_whole_stream(tokenizer, tmp_path):
    texts = corpus_texts(30)
    path = write_dataset(tmp_path, "txt", texts)
    data = build_datasets(DataArguments(dataset=str(path), seq_len=8, eval_every=0), tokenizer, seed=0)
    assert data.eval is None and data.bytes_per_token is None
    assert data.train["input_ids"] == expected_blocks(tokenizer, texts, 8)


@pytest.mark.parametrize(
    "dataset, message",
    [
        ("missing.jsonl", "no such file or folder"),
        ("empty.jsonl", "the dataset is empty"),
        ("mixed", "one of the types"),
    ],
)
def test_bad_local_datasets(dataset, message, tokenizer, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    write_dataset(tmp_path / "mixed", "txt", ["a b c"])
    write_dataset(tmp_path / "mixed", "jsonl", ["a b c"])
    with pytest.raises(ValueError, match=message):
        build_datasets(DataArguments(dataset=str(tmp_path / dataset)), tokenizer, seed=0)


@pytest.mark.parametrize("streaming", [False, True], ids=["in-memory", "streaming"])
def test_documents_too_short_for_one_block_are_refused(streaming, tokenizer, tmp_path):
    path = write_dataset(tmp_path, "jsonl", ["hi", "yo"])
    arguments = DataArguments(dataset=str(path), seq_len=64, eval_every=0, streaming=streaming)
    with pytest.raises(ValueError, match="no complete block of --seq-len 64 tokens"):
        build_datasets(arguments, tokenizer, seed=0)


# --- the embedded corpus and tokenizer -----------------------------------------------------------------------


def test_embedded_corpus_and_tokenizer_offline():
    """In a fresh process with the Hub off: the default corpus file (built or cached) and its BPE tokenizer."""
    result = run_python(
        """
        import hashlib, json
        from scalevec.train.corpus import EOS_TOKEN, PAD_TOKEN, default_corpus_file, default_tokenizer
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


# --- the evaluation metric -----------------------------------------------------------------------------------


def test_metric_against_a_hand_computation():
    import evaluate

    metric = evaluate.load(str(METRIC_PATH), keep_in_memory=True)
    nll = [0.5, 1.25, 2.0, 3.0, 40.0, 0.75]
    keep = [1, 1, 1, 1, 0, 1]  # the 40 is padding
    result = metric.compute(predictions=nll, references=keep, bytes_per_token=3.5)
    loss = (0.5 + 1.25 + 2.0 + 3.0 + 0.75) / 5
    assert result["loss"] == pytest.approx(loss, rel=1e-12)
    assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-12)
    assert result["bits_per_byte"] == pytest.approx(loss / math.log(2) / 3.5, rel=1e-12)
    assert "bits_per_byte" not in metric.compute(predictions=nll, references=keep)
    with pytest.raises(ValueError, match="no counted tokens"):
        metric.compute(predictions=nll, references=[0] * 6)


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
    trainer = ScaleVecTrainer(model, args, eval_dataset=eval_set, data_collator=collate, bytes_per_token=2.5)
    metrics = trainer.evaluate()  # batches of 4 + 4 + 2 blocks
    with torch.no_grad():
        expected = model.eval()(blocks, labels=blocks).loss.item()  # mean over all 10 * 15 predicted tokens
    assert metrics["eval_loss"] == pytest.approx(expected, abs=1e-5)
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(expected), rel=1e-5)
    assert metrics["eval_bits_per_byte"] == pytest.approx(expected / math.log(2) / 2.5, rel=1e-5)
