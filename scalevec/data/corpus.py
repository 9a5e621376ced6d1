"""The embedded default corpus and tokenizer: built offline from text that ships with CPython, cached on disk.

The corpus is `pydoc_data`'s help topics plus the docstrings of the standard library's modules, classes and
functions (read with `ast`, never imported), de-duplicated, in a fixed order. The tokenizer is a byte-level BPE
trained on it with `tokenizers`. Both are deterministic functions of the Python version, so the cache key is that
version and the vocabulary size.
"""

import ast
import functools
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from ..atomic import commit_folder, write_text_atomically

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
DEFAULT_VOCAB_SIZE = 4096
MIN_CORPUS_BYTES = 1_000_000
_SKIPPED_DIRECTORIES = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def cache_dir() -> Path:
    """`$SCALEVEC_CACHE`, else `$HF_HOME/scalevec`, else `~/.cache/scalevec`."""
    if "SCALEVEC_CACHE" in os.environ:
        return Path(os.environ["SCALEVEC_CACHE"])
    xdg_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(os.environ.get("HF_HOME") or xdg_cache / "huggingface") / "scalevec"


def _docstrings(path: Path) -> Iterator[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node)
            if docstring and len(docstring) > 40:
                yield docstring


def corpus_documents() -> list[str]:
    """The documents of the embedded corpus, de-duplicated, in a fixed order."""
    import pydoc_data.topics

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents = [pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics)]
    for path in sorted(stdlib.rglob("*.py")):
        if not _SKIPPED_DIRECTORIES.intersection(path.relative_to(stdlib).parts):
            documents.extend(_docstrings(path))
    seen: set[str] = set()
    unique = []
    for document in documents:
        key = hashlib.sha1(document.strip().encode()).hexdigest()
        if key not in seen:
            seen.add(key)
            unique.append(document.strip())
    return unique


def default_corpus_file() -> Path:
    """A JSON-lines file (`{"text": ...}` per document) holding the embedded corpus, written once and cached."""
    path = cache_dir() / f"corpus-py{sys.version_info[0]}.{sys.version_info[1]}.jsonl"
    if not path.exists():
        documents = corpus_documents()
        text = "".join(json.dumps({"text": d}) + "\n" for d in documents)
        if len(text.encode()) < MIN_CORPUS_BYTES:
            raise RuntimeError(f"the embedded corpus holds only {len(text.encode())} bytes; expected at least 1 MB")
        write_text_atomically(path, text)
    return path


@functools.cache
def corpus_name() -> str:
    """The embedded corpus as people are told of it, in the plan, the records and the cards: what it is and its size
    (which depend on the Python version)."""
    documents = [json.loads(line)["text"] for line in default_corpus_file().read_text().splitlines()]
    megabytes = sum(len(text.encode()) for text in documents) / 1e6
    return (
        f"CPython {sys.version_info[0]}.{sys.version_info[1]}'s pydoc help topics and standard-library docstrings "
        f"(the embedded corpus, {megabytes:.1f} MB of text)"
    )


def train_tokenizer(documents: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE with an end-of-text and a padding token, as a `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )


def default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """The embedded byte-level BPE tokenizer, trained on the embedded corpus once and cached."""
    path = cache_dir() / f"tokenizer-py{sys.version_info[0]}.{sys.version_info[1]}-v{vocab_size}"
    if not (path / "tokenizer.json").exists():
        documents = [json.loads(line)["text"] for line in default_corpus_file().read_text().splitlines()]
        tokenizer = train_tokenizer(documents, vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
        tokenizer.save_pretrained(staging)
        try:
            commit_folder(staging, path)
        except OSError:  # another process cached it first
            shutil.rmtree(staging, ignore_errors=True)
            if not (path / "tokenizer.json").exists():
                raise
    return PreTrainedTokenizerFast.from_pretrained(path)
