"""Prepared data (scalevec/data/prepared.py, build.py, mixture.py): documents packed exactly into uint16/uint32
blocks on disk, the held-out split, preparation in parallel, the cache that a second start reuses without
tokenising, the refusal of a folder made with another tokenizer or sequence length, weighted mixtures, and a long
document in bounded memory."""

import json
import re

import numpy as np
import pytest

from scalevec import ScaleVecForCausalLM
from scalevec.data import (
    DataArguments,
    DataError,
    PreparedBlocks,
    PrepareOptions,
    WeightedMixture,
    build_training_data,
    default_tokenizer,
    find_source,
    prepare,
)
from scalevec.data.prepared import held_out_documents
from scalevec.data.tokenization import DocumentEncoder, text_pieces, token_dtype

from ._helpers import (
    corpus_texts,
    log_history,
    packed,
    run_python,
    tiny_config,
    tiny_trainer,
    train_argv,
    write_dataset,
    write_parts,
)


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


def blocks_of(folder, split: str = "train") -> list[list[int]]:
    data = PreparedBlocks(folder, split)
    return [data[i]["input_ids"].tolist() for i in range(len(data))]


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "folder"])
def test_prepared_blocks_are_the_packed_documents(kind, tokenizer, tmp_path):
    texts = corpus_texts(60)
    source = find_source(str(write_dataset(tmp_path / "data", kind, texts)))
    metadata = prepare([source], tokenizer, PrepareOptions(seq_len=16, eval_every=5), tmp_path / "prepared")
    train_texts = [t for i, t in enumerate(texts) if i % 5 != 4]
    eval_texts = [t for i, t in enumerate(texts) if i % 5 == 4]  # every 5th document held out, disjoint
    assert blocks_of(tmp_path / "prepared") == packed(tokenizer, train_texts, 16)
    assert blocks_of(tmp_path / "prepared", "eval") == packed(tokenizer, eval_texts, 16)
    assert metadata.dtype == "uint16" and (tmp_path / "prepared" / "train.bin").stat().st_size == (
        metadata.splits["train"].blocks * 16 * 2
    )
    eval_tokens = sum(len(ids) + 1 for ids in tokenizer(eval_texts, add_special_tokens=False)["input_ids"])
    assert metadata.splits["eval"].tokens + metadata.splits["eval"].dropped_tokens == eval_tokens
    assert metadata.splits["eval"].bytes == sum(len(t.encode()) for t in eval_texts)
    data = PreparedBlocks(tmp_path / "prepared")
    picked = data.__getitems__([3, 0, len(data) - 1])
    assert [block["input_ids"].tolist() for block in picked] == [
        blocks_of(tmp_path / "prepared")[i] for i in (3, 0, -1)
    ]
    with pytest.raises(IndexError):
        data[len(data)]


def test_empty_documents_are_skipped_and_a_dataset_of_nothing_else_refused(tokenizer, tmp_path):
    texts = ["first document", "", "second document", ""]
    source = find_source(str(write_dataset(tmp_path / "some", "jsonl", texts)))
    metadata = prepare([source], tokenizer, PrepareOptions(seq_len=2, eval_every=0), tmp_path / "some-prepared")
    assert blocks_of(tmp_path / "some-prepared") == packed(tokenizer, texts, 2)
    assert (metadata.splits["train"].documents, metadata.splits["train"].empty_documents) == (2, 2)
    empty = find_source(str(write_dataset(tmp_path / "none", "jsonl", ["", "", ""])))
    with pytest.raises(DataError, match="every document is empty"):
        prepare([empty], tokenizer, PrepareOptions(seq_len=2, eval_every=0), tmp_path / "none-prepared")
    assert not (tmp_path / "none-prepared").exists() and len(list(tmp_path.iterdir())) == 3  # no staging left


def test_copies_of_held_out_documents_never_train(tokenizer, tmp_path):
    texts = corpus_texts(20)
    held_out = texts[3]
    texts[10] = texts[15] = held_out  # copies elsewhere in the corpus
    source = find_source(str(write_dataset(tmp_path / "data", "jsonl", texts)))
    prepare([source], tokenizer, PrepareOptions(seq_len=8, eval_every=4, max_eval_documents=1), tmp_path / "p")
    assert list(held_out_documents(source.shards(), PrepareOptions(8, 4, 1))) == [held_out]
    train = [t for i, t in enumerate(texts) if t != held_out]
    assert blocks_of(tmp_path / "p") == packed(tokenizer, train, 8)
    assert blocks_of(tmp_path / "p", "eval") == packed(tokenizer, [held_out], 8)


def test_a_special_token_in_the_text_stays_text(tokenizer):
    encoder = DocumentEncoder(tokenizer, token_dtype(len(tokenizer)))
    (ids,) = encoder([f"before {tokenizer.eos_token} after"])
    assert tokenizer.eos_token_id not in ids.tolist()
    assert tokenizer.decode(ids) == f"before {tokenizer.eos_token} after"


def test_ids_over_65535_are_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"<eos>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    texts = ["w1 w69999 w65534", "w65535 w3"]
    source = find_source(str(write_dataset(tmp_path, "jsonl", texts)))
    metadata = prepare([source], tokenizer, PrepareOptions(seq_len=4, eval_every=0), tmp_path / "p")
    assert metadata.dtype == "uint32"
    assert blocks_of(tmp_path / "p") == packed(tokenizer, texts, 4) == [[3, 70001, 65536, 0]]


def test_long_documents_are_encoded_in_pieces_cut_at_line_breaks(tokenizer):
    line = "def scale(vector):\n    return vector * 2\n"
    text = line * 1000
    pieces = text_pieces(text, limit=1000)
    assert "".join(pieces) == text and all(len(piece) <= 1000 for piece in pieces) and len(pieces) > 40
    assert all(piece.endswith("\n") for piece in pieces)
    assert text_pieces("word " * 10, limit=12) == [
        "word word",
        " word word",
        " word word",
        " word word",
        " word word ",
    ]
    encoder = DocumentEncoder(tokenizer, np.dtype(np.uint16))
    (whole,) = encoder([text])
    assert tokenizer.decode(whole) == text


@pytest.mark.slow
def test_several_processes_prepare_the_same_bytes(tokenizer, tmp_path):
    source = find_source(str(write_dataset(tmp_path / "data", "jsonl", corpus_texts(3000))))
    options = PrepareOptions(seq_len=32, eval_every=10, max_eval_documents=50)
    prepare([source], tokenizer, options, tmp_path / "one", num_proc=1, progress=False)
    prepare([source], tokenizer, options, tmp_path / "two", num_proc=2, progress=False)
    for name in ("train.bin", "eval.bin"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    with pytest.raises(DataError, match="already exists"):
        prepare([source], tokenizer, options, tmp_path / "one")
    train = tmp_path / "two" / "train.bin"
    train.write_bytes(train.read_bytes()[:-10])  # a folder copied in part, say
    with pytest.raises(DataError, match=f"^{train}: [0-9,]+ bytes where its [0-9,]+ blocks take [0-9,]+$"):
        PreparedBlocks(tmp_path / "two")


def count_encodings(monkeypatch) -> list[int]:
    calls = []
    encode = DocumentEncoder.__call__

    def counting(self, texts):
        calls.append(len(texts))
        return encode(self, texts)

    monkeypatch.setattr(DocumentEncoder, "__call__", counting)
    return calls


def test_raw_data_is_prepared_once_and_reused(tokenizer, tmp_path, monkeypatch):
    path = write_dataset(tmp_path / "data", "jsonl", corpus_texts(200))
    args = DataArguments(dataset=str(path), seq_len=16, prepared_cache=str(tmp_path / "cache"), eval_every=10)
    calls = count_encodings(monkeypatch)
    first = build_training_data(args, tokenizer, seed=0, progress=False)
    assert sum(calls) == 200 and len(list((tmp_path / "cache").iterdir())) == 1
    calls.clear()
    second = build_training_data(args, tokenizer, seed=0, progress=False)
    assert calls == []  # no tokenisation on the second start
    assert [second.train[i]["input_ids"].tolist() for i in range(5)] == [
        first.train[i]["input_ids"].tolist() for i in range(5)
    ]
    assert any("(reused)" in note for note in second.notes)
    assert second.record["sources"][0]["blocks"] == len(first.train)
    assert len(second.eval) == second.record["eval"]["evaluated_blocks"] > 0
    path.write_text(path.read_text() + json.dumps({"text": "one more document"}) + "\n")
    build_training_data(args, tokenizer, seed=0, progress=False)  # the file changed: prepared again
    assert sum(calls) > 0 and len(list((tmp_path / "cache").iterdir())) == 2


def test_a_prepared_folder_made_otherwise_is_refused_naming_both(tokenizer, tmp_path):
    source = find_source(str(write_dataset(tmp_path / "data", "jsonl", corpus_texts(50))))
    prepare([source], tokenizer, PrepareOptions(seq_len=16, eval_every=0), tmp_path / "p", progress=False)
    same = build_training_data(DataArguments(dataset=str(tmp_path / "p")), tokenizer, seed=0)
    assert same.seq_len == 16 and len(same.train) == len(PreparedBlocks(tmp_path / "p"))
    with pytest.raises(DataError) as raised:
        build_training_data(DataArguments(dataset=str(tmp_path / "p"), seq_len=32), tokenizer, seed=0)
    assert "--seq-len 16; this run uses tokenizer" in str(raised.value) and "--seq-len 32" in str(raised.value)

    from scalevec.data.corpus import train_tokenizer

    other = train_tokenizer(corpus_texts(50), vocab_size=300)
    with pytest.raises(DataError) as raised:
        build_training_data(DataArguments(dataset=str(tmp_path / "p"), seq_len=16), other, seed=0)
    message = str(raised.value)
    assert message.startswith(f"--dataset {tmp_path / 'p'} was prepared with tokenizer the embedded byte-level BPE (")
    assert "this run uses tokenizer" in message and message.count("--seq-len 16") == 2


def test_mixture_places_thin_and_repeat_sources():
    small, large = list(range(10)), list(range(100, 1100))
    mixture = WeightedMixture([small, large], [0.5, 0.5])
    assert len(mixture) == 1010 and mixture.places == [505, 505]
    from_small = [mixture[i] for i in range(505)]
    assert sorted(set(from_small)) == small and all(from_small.count(b) in (50, 51) for b in small)  # repeated
    from_large = [mixture[i] for i in range(505, 1010)]
    assert len(set(from_large)) == 505 and from_large[:3] == [100, 101, 103]  # thinned evenly
    assert WeightedMixture([small, large], [1, 2]).places == [337, 673]
    with pytest.raises(IndexError):
        mixture[1010]


@pytest.mark.slow
def test_a_mixture_draws_by_its_weights_deterministically(tokenizer, tmp_path):
    alpha = write_dataset(tmp_path / "alpha", "jsonl", [f"alpha {i} " * 30 for i in range(300)])
    beta = write_dataset(tmp_path / "beta", "jsonl", [f"beta {i} " * 30 for i in range(100)])
    args = DataArguments(dataset=f"{alpha},{beta}", dataset_weights="0.7,0.3", seq_len=32, eval_every=0)
    args.prepared_cache = str(tmp_path / "cache")
    data = build_training_data(args, tokenizer, seed=0, progress=False)
    assert [source["share"] for source in data.record["sources"]] == pytest.approx([0.7, 0.3], abs=1e-3)
    blocks = [source["blocks"] for source in data.record["sources"]]
    assert data.train.places[1] > blocks[1] and data.train.places[0] < blocks[0]  # beta repeats, alpha is thinned
    alpha_ids = set(tokenizer("alpha", add_special_tokens=False)["input_ids"])

    def sources_drawn(seed: int) -> list[str]:
        model = ScaleVecForCausalLM(tiny_config())
        trainer = tiny_trainer(model, tmp_path / "run", per_device_train_batch_size=8, seed=seed)
        trainer.train_dataset, trainer.data_collator = data.train, lambda rows: rows
        batches = iter(trainer.get_train_dataloader())
        rows = [row for _ in range(100) for row in next(batches)]
        return ["alpha" if alpha_ids & set(row["input_ids"].tolist()) else "beta" for row in rows]

    drawn = sources_drawn(seed=0)
    assert drawn.count("alpha") / len(drawn) == pytest.approx(0.7, abs=0.04)  # 800 draws: ~3 standard deviations
    assert sources_drawn(seed=0) == drawn and sources_drawn(seed=1) != drawn


@pytest.mark.slow
def test_a_25_mb_line_is_prepared_in_bounded_memory(tmp_path):
    """One 25 MB document on one line (7 M tokens): the tokenizer sees it in pieces, 1 M characters at a time,
    so the preparing process grows by a few times the text's size (measured: 140 MB), where one whole encoding
    takes 3.2 GB more (measured)."""
    line = ("The scale vector preconditions the next linear map. " * 1000 + "\n") * 480  # 25 MB, one document
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": line}) + "\n")
    result = run_python(
        """
        import json, resource, sys
        from scalevec.data import PrepareOptions, default_tokenizer, find_source, prepare
        tokenizer = default_tokenizer()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        metadata = prepare([find_source(sys.argv[1])], tokenizer, PrepareOptions(1024, 0), sys.argv[2], progress=False)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"tokens": metadata.splits["train"].tokens, "growth_mb": (peak - before) / 1024}))
        """,
        str(tmp_path / "long.jsonl"),
        str(tmp_path / "prepared"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tokens"] > 7_000_000
    assert report["growth_mb"] < 250, report


@pytest.mark.slow
def test_scalevec_data_prepares_a_folder_that_training_uses_as_it_is(tmp_path, capsys, monkeypatch):
    from scalevec.data.cli import main as data_main
    from scalevec.train.cli import main as train_main

    path = write_dataset(tmp_path / "data", "jsonl", corpus_texts(400))
    folder = tmp_path / "prepared"
    argv = ["prepare", str(path), "--output", str(folder), "--seq-len", "32", "--eval-every", "10", "--quiet"]
    assert data_main(argv) == 0
    out = capsys.readouterr().out
    assert f"prepared {folder}" in out and "blocks of 32 tokens stored as uint16" in out
    assert data_main(["info", str(folder)]) == 0 and "'eval_every': 10" in capsys.readouterr().out
    assert data_main(argv) == 1
    assert capsys.readouterr().err == f"scalevec-data: error: {folder} already exists (nothing is overwritten)\n"

    calls = count_encodings(monkeypatch)
    argv = train_argv(tmp_path / "run", "--dataset", str(folder), "--eval-strategy", "steps", "--eval-steps", "2")
    argv = [flag for flag, previous in zip(argv, ["", *argv]) if "--seq-len" not in (flag, previous)]
    assert train_main(argv) == 0
    assert calls == []  # trained from the folder: nothing tokenised again, its --seq-len taken
    assert [entry["eval_loss"] for entry in log_history(tmp_path / "run") if "eval_loss" in entry]
    record = json.loads((tmp_path / "run" / "training_data.json").read_text())
    assert record["seq_len"] == 32 and record["sources"][0]["folder"] == str(folder)


@pytest.mark.slow
def test_training_on_one_part_of_a_sharded_preparation_says_so_and_points_to_combine(tmp_path, capsys):
    from scalevec.convert.card import _data_rows
    from scalevec.data.cli import main as data_main
    from scalevec.train.cli import main as train_main

    corpus = write_parts(tmp_path / "corpus", corpus_texts(400), [150, 130, 120])
    part = tmp_path / "parts" / "web-0"
    flags = ["--seq-len", "32", "--eval-every", "10", "--quiet"]
    assert data_main(["prepare", str(corpus), "--output", str(part), "--shard", "0/3", *flags]) == 0
    capsys.readouterr()
    argv = train_argv(tmp_path / "run", "--dataset", str(part), steps=2, max_documents=None)
    assert train_main(argv) == 0
    out = capsys.readouterr().out
    note = "part 0/3 of a preparation split with --shard (`scalevec-data combine` joins the parts)"
    assert (
        f"scalevec-train: warning: --dataset {part} is part 0/3 of a preparation split with --shard: this run "
        "trains on that part alone; join the parts first with `scalevec-data combine PART... --output FOLDER`"
    ) in out
    assert re.search(rf"data +{re.escape(str(part))}: .* blocks\); only {re.escape(note)}\n", out)  # the plan
    record = json.loads((tmp_path / "run" / "training_data.json").read_text())
    assert record["sources"][0]["shard"] == [0, 3]
    assert _data_rows(record, None)[0][0] == f"`{part}` ({note})"  # the card's data table
