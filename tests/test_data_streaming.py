"""Streamed data (scalevec/data/streaming.py): a source's files are shards, each window of documents is packed on
its own, ranks read disjoint shards whose union is one process's data, held-out documents never stream, a
`StatefulDataLoader` with workers resumes exactly, and mixtures stream by weight."""

from collections import Counter

import numpy as np
import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from scalevec.data import (
    DataArguments,
    DataError,
    PackedBlockCollator,
    build_training_data,
    default_tokenizer,
    find_source,
)
from scalevec.data import sources as sources_module
from scalevec.data.streaming import seeded_shards, streamed_blocks
from scalevec.data.tokenization import DocumentEncoder

from ._helpers import corpus_texts, packed, write_dataset, write_parts

SEQ_LEN, WINDOW = 16, 7


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


@pytest.fixture(scope="module")
def shards_folder(tmp_path_factory):
    """Four jsonl files of distinct documents (25, 30, 35, 40), a few empty."""
    texts = corpus_texts(130, seed=3)
    texts[5] = texts[77] = ""
    return write_parts(tmp_path_factory.mktemp("shards"), texts, [25, 30, 35, 40])


def file_windows(source, tokenizer) -> dict[str, list[list[int]]]:
    """Per file, the blocks its windows pack into (each window's tail dropped), in file order."""
    from scalevec.data.sources import read_documents

    blocks = {}
    for shard in source.shards():
        texts = [text for text in read_documents(shard) if text]
        windows = [texts[i : i + WINDOW] for i in range(0, len(texts), WINDOW)]
        blocks[str(shard)] = [block for window in windows for block in packed(tokenizer, window, SEQ_LEN)]
    return blocks


def stream_of(source, tokenizer, rank: int = 0, world_size: int = 1, seed: int = 0, endless: bool = False):
    stream = streamed_blocks(
        [source], [1.0], tokenizer, SEQ_LEN, seed, WINDOW, [frozenset()], rank, world_size, endless=endless
    )
    return (row["input_ids"].tolist() for row in stream)


def test_a_stream_packs_each_window_of_each_file_in_a_seeded_order(shards_folder, tokenizer):
    source = find_source(str(shards_folder))
    expected = file_windows(source, tokenizer)
    first = list(stream_of(source, tokenizer))
    assert sorted(first) == sorted(block for blocks in expected.values() for block in blocks)
    by_file = [expected[str(shard)] for shard in seeded_shards(source, seed=0)]
    assert first != [block for blocks in by_file for block in blocks]  # blocks reordered within windows
    start = 0
    for blocks in by_file:  # ... but files come whole, in the seeded order
        assert sorted(first[start : start + len(blocks)]) == sorted(blocks)
        start += len(blocks)
    endless = stream_of(source, tokenizer, endless=True)
    assert [next(endless) for _ in range(2 * len(first))] == first + first  # starts again, in the same order
    assert list(stream_of(source, tokenizer, seed=1)) != first


@pytest.fixture(scope="module")
def seventeen_files(tmp_path_factory):
    """17 jsonl files of 12 distinct documents each."""
    return write_parts(tmp_path_factory.mktemp("seventeen"), corpus_texts(17 * 12, seed=5), [12] * 17)


def tokenised_stream(source, tokenizer, monkeypatch, rank: int = 0, world_size: int = 1):
    """One pass of this rank's stream, the tokens its encoder produced, and the files it opened."""
    counts = {"tokens": 0, "files": set()}
    encode, read = DocumentEncoder.__call__, sources_module.read_documents

    def counting_encode(self, texts):
        ids = encode(self, texts)
        counts["tokens"] += sum(len(document) for document in ids)
        return ids

    def recording_read(shard):
        counts["files"].add(str(shard))
        return read(shard)

    monkeypatch.setattr(DocumentEncoder, "__call__", counting_encode)
    monkeypatch.setattr("scalevec.data.streaming.read_documents", recording_read)
    blocks = list(stream_of(source, tokenizer, rank, world_size))
    monkeypatch.undo()
    return blocks, counts["tokens"], counts["files"]


@pytest.mark.parametrize("files", [4, 3, 17], ids=["4 files on 2 ranks", "3 files on 2 ranks", "17 files on 2 ranks"])
def test_two_ranks_tokenise_disjoint_shares_whose_union_is_one_process(
    files, shards_folder, seventeen_files, tokenizer, monkeypatch
):
    whole = find_source(str(seventeen_files if files == 17 else shards_folder))
    source = type(whole)(whole.name, whole.text_column, files=whole.files[:files])
    one, one_tokens, _ = tokenised_stream(source, tokenizer, monkeypatch)
    ranks = [tokenised_stream(source, tokenizer, monkeypatch, rank, world_size=2) for rank in (0, 1)]
    (first, first_tokens, first_files), (second, second_tokens, second_files) = ranks
    assert first and second
    assert not Counter(map(tuple, first)) & Counter(map(tuple, second))  # disjoint
    assert sorted(first + second) == sorted(one)  # together: one process's data
    assert first_tokens + second_tokens == one_tokens  # ... tokenised once between them
    if files == 17:  # the goal of issue 38 (each rank's share of the tokenising, not every window on each rank)
        assert max(first_tokens, second_tokens) <= 0.55 * one_tokens
    if files == 4:  # each rank reads only its own files
        assert not first_files & second_files and len(first_files | second_files) == 4
    else:  # a file per rank while both get one, then every other window of the files left over
        assert len(first_files & second_files) == files % 2 and len(first_files | second_files) == files


def test_held_out_documents_never_stream(shards_folder, tokenizer, tmp_path, monkeypatch):
    packed_windows = []
    from scalevec.data.streaming import WindowPacker

    pack = WindowPacker.__call__

    def recording(self, batch):
        packed_windows.append(batch["texts"][0])
        return pack(self, batch)

    monkeypatch.setattr(WindowPacker, "__call__", recording)
    args = DataArguments(dataset=str(shards_folder), streaming=True, seq_len=SEQ_LEN, eval_every=4)
    args.max_eval_documents, args.stream_window, args.prepared_cache = 10, WINDOW, str(tmp_path / "cache")
    data = build_training_data(args, tokenizer, seed=0, progress=False)
    held_out = {text for i, text in enumerate(corpus_texts(130, seed=3)[:40]) if i % 4 == 3 and text}
    assert len(data.eval) > 0 and data.record["eval"]["name"] == "documents held out of the training data"
    stream = iter(data.train)
    for _ in range(700):  # about one pass
        next(stream)
    streamed = {text for window in packed_windows for text in window}
    assert len(streamed) > 100 and not streamed & held_out


@pytest.mark.slow
def test_a_stateful_loader_with_workers_resumes_exactly(shards_folder, tokenizer):
    source = find_source(str(shards_folder))
    stream = streamed_blocks([source], [1.0], tokenizer, SEQ_LEN, 0, WINDOW, [frozenset()])
    collate = PackedBlockCollator(tokenizer.eos_token_id)

    def loader():
        return StatefulDataLoader(stream, batch_size=3, num_workers=2, collate_fn=collate)

    batches = iter(first := loader())
    for _ in range(11):
        next(batches)
    state = first.state_dict()
    expected = [next(batches)["input_ids"] for _ in range(12)]
    resumed = loader()
    resumed.load_state_dict(state)
    again = iter(resumed)
    assert all(np.array_equal(next(again)["input_ids"], batch) for batch in expected)


def test_a_streamed_mixture_draws_by_its_weights(tmp_path, tokenizer):
    alpha = find_source(str(write_dataset(tmp_path / "alpha", "jsonl", [f"alpha {i} " * 12 for i in range(200)])))
    beta = find_source(str(write_dataset(tmp_path / "beta", "jsonl", [f"beta {i} " * 12 for i in range(200)])))
    stream = streamed_blocks([alpha, beta], [3, 1], tokenizer, SEQ_LEN, 0, WINDOW, [frozenset(), frozenset()])
    alpha_ids = set(tokenizer("alpha", add_special_tokens=False)["input_ids"])
    drawn = []
    for row in stream:
        drawn.append(bool(alpha_ids & set(row["input_ids"].tolist())))
        if len(drawn) == 1000:
            break
    assert sum(drawn) / len(drawn) == pytest.approx(0.75, abs=0.045)  # ~3 standard deviations


def test_streaming_refuses_what_it_cannot_do(shards_folder, tokenizer, tmp_path):
    from scalevec.data import PrepareOptions, prepare

    prepare([find_source(str(shards_folder))], tokenizer, PrepareOptions(SEQ_LEN, 0), tmp_path / "p", progress=False)
    with pytest.raises(DataError, match="is a prepared folder: train from it without --streaming"):
        build_training_data(DataArguments(dataset=str(tmp_path / "p"), streaming=True), tokenizer, seed=0)
    with pytest.raises(ValueError, match="--max-documents applies to prepared data"):
        DataArguments(dataset=str(shards_folder), streaming=True, max_documents=10)
    short = write_dataset(tmp_path / "short", "jsonl", ["hi", "yo"])
    args = DataArguments(dataset=str(short), streaming=True, seq_len=64, eval_every=0)
    with pytest.raises(DataError, match="no complete block of --seq-len 64 tokens"):
        build_training_data(args, tokenizer, seed=0)
