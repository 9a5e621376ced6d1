"""Document masking (`scalevec-train --document-masking`): packed blocks carry position ids that restart at every
document, and the model then gives every document the logits it gets alone."""

import dataclasses

import pytest
import torch
from transformers import DataCollatorForLanguageModeling
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from scalevec import ScaleVecForCausalLM
from scalevec.train import DataArguments, build_datasets, default_tokenizer, pack
from scalevec.train.cli import main
from scalevec.train.data import DocumentMaskingCollator, pack_with_positions

from ._helpers import log_history, logged_losses, logits, randomize_scales, tiny_config, tiny_moe_config, train_argv
from .test_train_data import corpus_texts, random_documents, write_dataset

EOS = 0


def test_positions_restart_at_every_document_and_every_block():
    documents = [[1, 2, 3], [4], [5, 6, 7, 8, 9], []]
    packed = list(pack_with_positions(documents, 4, EOS))
    assert packed == [
        ([1, 2, 3, EOS], [0, 1, 2, 3]),
        ([4, EOS, 5, 6], [0, 1, 0, 1]),
        ([7, 8, 9, EOS], [0, 1, 2, 3]),  # the rest of a document begun in the block before
    ]
    assert [block for block, _ in packed] == list(pack(documents, 4, EOS))


@pytest.mark.parametrize("seed", [0, 1])
def test_positions_count_from_each_document_start(seed):
    documents = random_documents(40, seed, longest=30)
    for block, positions in pack_with_positions(documents, 16, EOS):
        for i, position in enumerate(positions):
            starts_document = i == 0 or block[i - 1] == EOS  # no random document holds token 0
            assert position == (0 if starts_document else positions[i - 1] + 1), (block, positions)


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> DataArguments:
    """--document-masking on documents much shorter than --seq-len: several to a block, some cut by its end."""
    texts = [text[:40] for text in corpus_texts(40)]
    path = write_dataset(tmp_path_factory.mktemp("documents"), "jsonl", texts)
    return DataArguments(dataset=str(path), seq_len=32, eval_every=0, document_masking=True)


@pytest.fixture(scope="module")
def packed_blocks(tokenizer, short_documents):
    """The first blocks of the data pipeline, as the collator receives them."""
    return build_datasets(short_documents, tokenizer, seed=0).train.select(range(4)).to_list()


def test_streamed_blocks_carry_the_same_positions(tokenizer, short_documents):
    in_memory = build_datasets(short_documents, tokenizer, seed=0).train.to_list()
    streaming = dataclasses.replace(short_documents, streaming=True, shuffle_buffer=1)  # a buffer of one keeps order
    streamed = [dict(row) for row in build_datasets(streaming, tokenizer, seed=0).train]
    assert streamed == in_memory and all(set(row) == {"input_ids", "position_ids"} for row in streamed)


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
    batch = DocumentMaskingCollator(flatten=flatten)(packed_blocks)
    assert "attention_mask" not in batch
    # The Trainer runs with use_cache=False: with a cache, transformers ignores packed position ids.
    masked = logits(model, batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    masked = masked.reshape(len(packed_blocks), 32, -1)
    ids = torch.tensor([block["input_ids"] for block in packed_blocks])
    position_ids = torch.tensor([block["position_ids"] for block in packed_blocks])
    spans = [(row, span) for row in range(len(ids)) for span in documents_in(position_ids[row])]
    assert len(spans) >= 2 * len(ids)  # several documents to a block
    for row, span in spans:
        alone = logits(model, ids[row : row + 1, span])[0]
        torch.testing.assert_close(masked[row, span], alone, rtol=0, atol=1e-5)
    # Plain packing lets attention cross documents: every document after a block's first one is changed.
    plain = DataCollatorForLanguageModeling(tokenizer, mlm=False)([{"input_ids": b} for b in ids.tolist()])
    crossing = logits(model, plain["input_ids"], attention_mask=plain["attention_mask"])
    for row, span in spans:
        assert torch.allclose(crossing[row, span], masked[row, span], atol=1e-5) == (span.start == 0)


def test_flattened_blocks_train_exactly_as_rows_and_split_into_documents_for_flash_attention(packed_blocks, tokenizer):
    model = tiny_model(tokenizer, moe=False, attention="sdpa")
    rows = DocumentMaskingCollator()(packed_blocks)
    flattened = DocumentMaskingCollator(flatten=True)(packed_blocks)
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
    collate = DocumentMaskingCollator.__call__

    def recording(self, blocks):
        batches.append(collate(self, blocks))
        return batches[-1]

    monkeypatch.setattr(DocumentMaskingCollator, "__call__", recording)
    output = tmp_path / "masked"
    flags = ("--document-masking", "true", "--learning-rate", "3e-3", "--eval-strategy", "steps", "--eval-steps", "4")
    assert main(train_argv(output, *flags, steps=8)) == 0
    assert all(set(batch) == {"input_ids", "position_ids", "labels"} for batch in batches)
    assert any((batch["position_ids"][:, 1:] == 0).any() for batch in batches)  # documents restart inside blocks
    losses = logged_losses(output)
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert [entry["step"] for entry in log_history(output) if "eval_loss" in entry][:1] == [4]


def test_document_masking_refuses_a_cache(tmp_path, capsys):
    assert main(train_argv(tmp_path / "cached", "--document-masking", "true", "--use-cache", "true")) == 1
    assert "--document-masking needs --use-cache false" in capsys.readouterr().err
