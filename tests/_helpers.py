"""Shared test helpers: tiny configs and fresh Python processes that cannot import `scalevec`."""

import contextlib
import itertools
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from scalevec import ScaleVecConfig

TINY = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TINY_MOE = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def tiny_config(**overrides) -> ScaleVecConfig:
    return ScaleVecConfig(**{**TINY, **overrides})


def tiny_moe_config(**overrides) -> ScaleVecConfig:
    return ScaleVecConfig(**{**TINY_MOE, **overrides})


def random_ids(config, batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=generator)


def gradients(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every parameter's gradient of the language-modelling loss on `ids`."""
    model.zero_grad()
    model(ids, labels=ids).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def randomize_scales(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every scale parameter away from 1 so that tests see what the scales do."""
    generator = torch.Generator().manual_seed(seed)
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for names in model.scale_vector_roles().values():
            for name in names:
                parameter = parameters[name]
                parameter.copy_(1 + 0.3 * torch.randn(parameter.shape, generator=generator))


# Parent tests run on one torch thread (conftest.py); a child on the same thread count reduces in the same order,
# so logits compared across processes are bitwise equal.
SUBPROCESS_ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def run_without_scalevec(script: str, *args: str, env: dict | None = None, timeout: int = 300) -> str:
    """Run `script` in a fresh interpreter in which `import scalevec` fails, and return its stdout."""
    prelude = "import sys\nsys.modules['scalevec'] = None  # this process must not see the package\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **SUBPROCESS_ENV, **(env or {})},
        cwd=Path(__file__).parent,
    )
    if result.returncode:
        raise AssertionError(f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


STRATEGIES = list(itertools.product(("none", "shared", "branch"), ("none", "in", "out", "both"), ("direct", "magdir")))


def logits(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kwargs).logits


def matrices_of(model) -> dict[str, torch.Tensor]:
    """The state dict without scale vectors: what a model of another strategy can load."""
    roles = model.scale_vector_roles()
    scales = set(roles["input"] + roles["output"])
    return {k: v for k, v in model.state_dict().items() if k not in scales}


# --- conversion (scalevec/convert) -----------------------------------------------------------------------------

STOCK_TINY = {
    "llama": dict(TINY),
    "qwen3": dict(TINY, head_dim=8),
    "mixtral": dict(TINY, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16),
    "qwen3_moe": dict(TINY, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
}


def saved_scalevec(path: Path, config: ScaleVecConfig, seed: int = 0) -> "torch.nn.Module":
    """A tiny ScaleVec model with randomised scales, saved to `path` with `save_pretrained`."""
    from scalevec import ScaleVecForCausalLM

    torch.manual_seed(seed)
    model = ScaleVecForCausalLM(config).eval()
    randomize_scales(model, seed)
    model.save_pretrained(path)
    return model


def saved_stock(path: Path, model_type: str, seed: int = 0, **overrides) -> "torch.nn.Module":
    """A tiny stock transformers model (`STOCK_TINY`) with norm weights moved away from 1, saved to `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**STOCK_TINY[model_type], **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


def load_in_fresh_process(folders: list[Path], ids: torch.Tensor, workdir: Path) -> dict[str, dict]:
    """Load every folder in ONE fresh process in which `scalevec` cannot be imported: stock formats with no custom
    code, folders with an `auto_map` with `trust_remote_code=True`. Returns, per folder (as str): `class`,
    `module`, `problems` (missing / unexpected / mismatched keys), `parameters` (names) and `logits` for `ids`."""
    import json

    from safetensors.torch import load_file, save_file

    workdir.mkdir(parents=True, exist_ok=True)
    save_file({"ids": ids}, workdir / "ids.safetensors")
    (workdir / "folders.json").write_text(json.dumps([str(f) for f in folders]))
    run_without_scalevec(
        """
        import json, sys, torch
        from safetensors.torch import load_file, save_file
        from transformers import AutoModelForCausalLM
        workdir = sys.argv[1]
        ids = load_file(workdir + "/ids.safetensors")["ids"]
        info, logits = {}, {}
        for i, folder in enumerate(json.load(open(workdir + "/folders.json"))):
            remote = "auto_map" in json.load(open(folder + "/config.json"))
            model, loading = AutoModelForCausalLM.from_pretrained(
                folder, trust_remote_code=remote, output_loading_info=True, dtype=torch.float32
            )
            with torch.no_grad():
                logits[str(i)] = model.eval()(ids).logits
            problems = {k: sorted(map(str, v)) for k, v in loading.items() if v}
            info[folder] = dict(cls=type(model).__name__, module=type(model).__module__, problems=problems,
                                parameters=[n for n, _ in model.named_parameters()])
        save_file(logits, workdir + "/logits.safetensors")
        json.dump(info, open(workdir + "/info.json", "w"))
        """,
        str(workdir),
        env={"HF_HOME": str(workdir / "hf_home")},
    )
    info = json.loads((workdir / "info.json").read_text())
    logits = load_file(workdir / "logits.safetensors")
    return {
        str(folder): {
            "class": info[str(folder)]["cls"],
            "module": info[str(folder)]["module"],
            "problems": info[str(folder)]["problems"],
            "parameters": info[str(folder)]["parameters"],
            "logits": logits[str(i)],
        }
        for i, folder in enumerate(folders)
    }


# --- Hub publishing (scalevec/convert/push.py, card.py) ------------------------------------------------------


def run_python(script: str, *args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run `script` in a fresh interpreter (scalevec importable) and return the finished process, failed or not,
    with its stdout and stderr, for tests that check what a command prints when it fails."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **SUBPROCESS_ENV, **(env or {})},
        cwd=Path(__file__).parent,
    )


# --- pretraining (scalevec/train) ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(*args: str, nproc: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node nproc ARGS` on loopback (gloo on CPUs), finished, failed or not."""
    launch = "import sys\nfrom torch.distributed.run import main\nmain(sys.argv[1:])\n"
    rendezvous = ("--master_addr", "127.0.0.1", "--master_port", str(free_port()))
    return run_python(launch, "--nproc_per_node", str(nproc), *rendezvous, *args, timeout=timeout)


TINY_TRAIN_OVERRIDES = (
    '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
    '"num_key_value_heads": 2}'
)


def train_argv(output_dir: Path, *extra: str, steps: int = 6, max_documents: int | None = 300) -> list[str]:
    """`scalevec-train` flags for a run of a few seconds on the embedded corpus; `extra` flags override these."""
    documents = ("--max-documents", str(max_documents)) if max_documents else ()
    return [
        *("--model-size", "tiny", "--config-overrides", TINY_TRAIN_OVERRIDES, "--seq-len", "32", *documents),
        *("--max-eval-documents", "4", "--per-device-train-batch-size", "4"),
        *("--max-steps", str(steps), "--logging-steps", "1", "--save-strategy", "no", "--report-to", "none"),
        *("--disable-tqdm", "true", "--output-dir", str(output_dir), *extra),
    ]


def corpus_texts(count: int = 60, seed: int = 7) -> list[str]:
    """Distinct one-line documents of varying lengths (a text file holds one document per line)."""
    import random

    rng = random.Random(seed)
    words = ["scale", "vector", "norm", "matrix", "decay", "expert", "router", "token", "block", "shard"]
    return [f"document {i}: " + " ".join(rng.choice(words) for _ in range(rng.randrange(3, 40))) for i in range(count)]


def write_dataset(folder: Path, kind: str, texts: list[str], column: str = "text") -> Path:
    """`texts` as a txt, jsonl, json (one array), parquet or jsonl.gz file in `folder`, or as a folder of two
    jsonl files (read in sorted order); returns the path to pass as `--dataset`."""
    import gzip
    import json

    import datasets

    folder.mkdir(parents=True, exist_ok=True)
    records = [{column: text, "id": i} for i, text in enumerate(texts)]
    lines = "".join(json.dumps(record) + "\n" for record in records)
    if kind == "txt":
        path = folder / "docs.txt"
        path.write_text("".join(t + "\n" for t in texts))
    elif kind == "jsonl":
        path = folder / "docs.jsonl"
        path.write_text(lines)
    elif kind == "json":
        path = folder / "docs.json"
        path.write_text(json.dumps(records, indent=1))
    elif kind == "jsonl.gz":
        path = folder / "docs.jsonl.gz"
        path.write_bytes(gzip.compress(lines.encode()))
    elif kind == "parquet":
        path = folder / "docs.parquet"
        datasets.Dataset.from_list(records).to_parquet(str(path), batch_size=16)
    else:  # a folder of two jsonl files, read in sorted order
        half = len(texts) // 2
        write_dataset(folder / "b", "jsonl", texts[half:], column)
        write_dataset(folder / "a", "jsonl", texts[:half], column)
        return folder
    return path


def write_parts(folder: Path, texts: list[str], counts: list[int]) -> Path:
    """`texts` in consecutive jsonl files of `counts` documents each (`part-00`, `part-01`, ...), in `folder`."""
    start = 0
    for index, count in enumerate(counts):
        write_dataset(folder / f"part-{index:02d}", "jsonl", texts[start : start + count])
        start += count
    return folder


def packed(tokenizer, texts: list[str], seq_len: int) -> list[list[int]]:
    """The blocks that packing `texts` gives: the non-empty ones, each followed by EOS, cut into whole blocks."""
    ids = tokenizer([text for text in texts if text], add_special_tokens=False)["input_ids"]
    stream = [token for document in ids for token in [*document, tokenizer.eos_token_id]]
    return [stream[i : i + seq_len] for i in range(0, len(stream) - seq_len + 1, seq_len)]


def log_history(output_dir: Path) -> list[dict]:
    import json

    return json.loads((Path(output_dir) / "trainer_state.json").read_text())["log_history"]


def logged_losses(output_dir: Path) -> list[float]:
    """The training losses logged by a finished run, in step order."""
    return [entry["loss"] for entry in log_history(output_dir) if "loss" in entry]


def tiny_trainer(model, output_dir: Path, **arguments):
    """A `ScaleVecTrainer` around `model` (no data needed to build its optimizer and scheduler)."""
    from scalevec.train import ScaleVecTrainer, ScaleVecTrainingArguments

    arguments = {"report_to": "none", "disable_tqdm": True, **arguments}
    return ScaleVecTrainer(model=model, args=ScaleVecTrainingArguments(output_dir=str(output_dir), **arguments))


# --- durability (scalevec/atomic.py) --------------------------------------------------------------------------


def record_fsyncs(monkeypatch) -> list[str]:
    """Make `os.fsync` also record the path of what it flushes (Linux: /proc/self/fd); returns the growing list."""
    flushed: list[str] = []
    fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        flushed.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return flushed


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size: str):
    """A tmpfs of `size` (e.g. "2m") mounted at `mount_point` while the block runs; skips the test where mounting
    is not allowed (it needs root)."""
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)], capture_output=True
    )
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)
