"""Document masking (`scalevec-train --document-masking`): the collator gives packed blocks position ids that
restart after every end-of-text token, and the model then gives every document the logits it gets alone."""

import random

import pytest
import torch
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from scalevec import ScaleVecForCausalLM
from scalevec.data import DataArguments, PackedBlockCollator, build_training_data, default_tokenizer
from scalevec.train.cli import main

from ._helpers import (
    corpus_texts,
    log_history,
    logged_losses,
    logits,
    randomize_scales,
    tiny_config,
    tiny_moe_config,
    train_argv,
    write_dataset,
)

EOS = 0


def test_positions_restart_after_every_end_of_text_and_every_row():
    blocks = [[1, 2, 3, EOS], [4, EOS, 5, 6], [7, 8, 9, EOS]]
    batch = PackedBlockCollator(EOS, document_masking=True)([{"input_ids": block} for block in blocks])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 0, 1], [0, 1, 2, 3]]
    assert torch.equal(batch["labels"], batch["input_ids"]) and batch["input_ids"].dtype == torch.int64
    assert set(PackedBlockCollator(EOS)([{"input_ids": block} for block in blocks])) == {"input_ids", "labels"}


@pytest.mark.parametrize("seed", [0, 1])
def test_positions_count_from_each_document_start(seed):
    rng = random.Random(seed)
    stream = [token for _ in range(40) for token in [*(rng.randrange(1, 500) for _ in range(rng.randrange(30))), EOS]]
    blocks = [stream[i : i + 16] for i in range(0, len(stream) - 15, 16)]
    positions = PackedBlockCollator(EOS, document_masking=True)([{"input_ids": b} for b in blocks])["position_ids"]
    for block, row in zip(blocks, positions.tolist()):
        for i, position in enumerate(row):
            starts_document = i == 0 or block[i - 1] == EOS  # no random document holds token 0
            assert position == (0 if starts_document else row[i - 1] + 1), (block, row)


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


@pytest.fixture(scope="module")
def packed_blocks(tokenizer, tmp_path_factory) -> list[dict]:
    """The first blocks of documents much shorter than --seq-len (several to a block, some cut by its end), as
    the data pipeline hands them to the collator."""
    folder = tmp_path_factory.mktemp("documents")
    path = write_dataset(folder, "jsonl", [text[:40] for text in corpus_texts(40)])
    arguments = DataArguments(dataset=str(path), seq_len=32, eval_every=0, prepared_cache=str(folder / "cache"))
    train = build_training_data(arguments, tokenizer, seed=0, progress=False).train
    return [train[i] for i in range(4)]


def documents_in(position_ids: torch.Tensor) -> list[slice]:
    """The spans of one row in which positions count up from 0."""
    starts = (position_ids == 0).nonzero().flatten().tolist()
    return [slice(start, end) for start, end in zip(starts, [*starts[1:], len(position_ids)])]


def tiny_model(tokenizer, moe: bool, attention: str) -> ScaleVecForCausalLM:
    make_config = tiny_moe_config if moe else tiny_config
    torch.manual_seed(0)
    model = ScaleVecForCausalLM._from_config(make_config(vocab_size=len(tokenizer)), attn_implementation=attention)
    randomize_scales(model)
    return model.eval()


@pytest.mark.parametrize(
    "moe, attention, flatten",
    [(False, "sdpa", False), (False, "eager", False), (True, "sdpa", False), (False, "sdpa", True)],
    ids=["dense-sdpa", "dense-eager", "moe-sdpa", "dense-sdpa-flattened"],
)
def test_each_document_gets_the_logits_it_gets_alone(packed_blocks, tokenizer, moe, attention, flatten):
    model = tiny_model(tokenizer, moe, attention)
    batch = PackedBlockCollator(tokenizer.eos_token_id, document_masking=True, flatten=flatten)(packed_blocks)
    assert "attention_mask" not in batch
    # The Trainer runs with use_cache=False: with a cache, transformers ignores packed position ids.
    masked = logits(model, batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    masked = masked.reshape(len(packed_blocks), 32, -1)
    rows = PackedBlockCollator(tokenizer.eos_token_id, document_masking=True)(packed_blocks)
    ids, position_ids = rows["input_ids"], rows["position_ids"]
    spans = [(row, span) for row in range(len(ids)) for span in documents_in(position_ids[row])]
    assert len(spans) >= 2 * len(ids)  # several documents to a block
    for row, span in spans:
        alone = logits(model, ids[row : row + 1, span])[0]
        torch.testing.assert_close(masked[row, span], alone, rtol=0, atol=1e-5)
    # Plain packing lets attention cross documents: every document after a block's first one is changed.
    crossing = logits(model, PackedBlockCollator(tokenizer.eos_token_id)(packed_blocks)["input_ids"])
    for row, span in spans:
        assert torch.allclose(crossing[row, span], masked[row, span], atol=1e-5) == (span.start == 0)


def test_flattened_blocks_train_exactly_as_rows_and_split_into_documents_for_flash_attention(packed_blocks, tokenizer):
    model = tiny_model(tokenizer, moe=False, attention="sdpa")
    rows = PackedBlockCollator(tokenizer.eos_token_id, document_masking=True)(packed_blocks)
    flattened = PackedBlockCollator(tokenizer.eos_token_id, document_masking=True, flatten=True)(packed_blocks)
    assert flattened["input_ids"].shape == (1, 32 * len(packed_blocks))
    # the sequences that flash attention's varlen kernel is given: one per document of every block
    (starts, _), _ = prepare_fa_kwargs_from_position_ids(flattened["position_ids"])
    spans = [
        (32 * row + span.start, 32 * row + span.stop)
        for row in range(len(packed_blocks))
        for span in documents_in(rows["position_ids"][row])
    ]
    assert list(zip(starts[:-1].tolist(), starts[1:].tolist())) == spans
    with torch.no_grad():
        loss = model(**rows, use_cache=False).loss.item()
        assert model(**flattened, use_cache=False).loss.item() == pytest.approx(loss, abs=1e-6)


def test_scalevec_train_with_document_masking_trains_and_evaluates(tmp_path, monkeypatch):
    batches = []
    collate = PackedBlockCollator.__call__

    def recording(self, blocks):
        batches.append(collate(self, blocks))
        return batches[-1]

    monkeypatch.setattr(PackedBlockCollator, "__call__", recording)
    output = tmp_path / "masked"
    flags = ("--document-masking", "true", "--learning-rate", "3e-3", "--eval-strategy", "steps", "--eval-steps", "4")
    workers = ("--dataloader-num-workers", "0")  # collate in this process, where `recording` sees the batches
    assert main(train_argv(output, *flags, *workers, steps=8)) == 0
    assert all(set(batch) == {"input_ids", "position_ids", "labels"} for batch in batches)
    assert any((batch["position_ids"][:, 1:] == 0).any() for batch in batches)  # documents restart inside blocks
    losses = logged_losses(output)
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert [entry["step"] for entry in log_history(output) if "eval_loss" in entry][:1] == [4]


def test_document_masking_refuses_a_cache(tmp_path, capsys):
    assert main(train_argv(tmp_path / "cached", "--document-masking", "true", "--use-cache", "true")) == 1
    assert "--document-masking needs --use-cache false" in capsys.readouterr().err
