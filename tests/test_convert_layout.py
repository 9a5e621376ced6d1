"""Output layout: sharded sources and outputs, `.bin` sources, output dtypes, the files copied through, the
streaming writer against safetensors itself, streamed verification, and loading through a Hub cache snapshot by
repo id."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from scalevec import ScaleVecForCausalLM
from scalevec.convert import OutputOptions, export_checkpoint, fold_checkpoint, verify
from scalevec.convert.cli import main
from scalevec.convert.writer import ShardedWriter

from ._helpers import (
    logits,
    random_ids,
    randomize_scales,
    run_without_scalevec,
    saved_scalevec,
    tiny_config,
    tiny_moe_config,
)

pytestmark = pytest.mark.slow  # it starts processes or trains end to end


def test_a_sharded_source_converts_into_a_sharded_output(tmp_path, capsys):
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(tiny_moe_config(qk_norm=True)).eval()
    randomize_scales(model)
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    assert len(list((tmp_path / "src").glob("model-*.safetensors"))) >= 3
    arguments = [
        "export",
        str(tmp_path / "src"),
        str(tmp_path / "out"),
        "--to",
        "qwen3_moe",
        "--max-shard-size",
        "16KB",
    ]
    assert main(arguments) == 0
    assert "verification: max abs logit difference" in capsys.readouterr().out

    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    shards = sorted((tmp_path / "out").glob("model-*-of-*.safetensors"))
    assert len(shards) >= 4 and {p.name for p in shards} == set(index["weight_map"].values())
    total = 0
    for shard in shards:
        with safe_open(shard, "pt") as f:
            sizes = {name: f.get_tensor(name).nbytes for name in f.keys()}  # noqa: SIM118 (a safetensors handle)
            assert f.metadata() == {"format": "pt"}
        assert len(sizes) == 1 or sum(sizes.values()) <= 16_000, shard  # a larger tensor gets a file alone
        assert all(index["weight_map"][name] == shard.name for name in sizes)
        total += sum(sizes.values())
    assert index["metadata"]["total_size"] == total
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = random_ids(model.config)
    torch.testing.assert_close(logits(stock, ids), logits(model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kernel_copy", [True, False], ids=["sendfile", "refused"])
def test_unchanged_tensors_are_copied_byte_for_byte(tmp_path, monkeypatch, kernel_copy):
    """Tensors that folding leaves alone (here the embeddings and the LM head) are copied file to file in the
    kernel; where a file system refuses that, they are written the ordinary way, with the same result."""
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(tiny_config(tie_word_embeddings=False)).eval()
    randomize_scales(model)
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    copied = []

    def sendfile(output_fd, source_fd, offset, count):
        if not kernel_copy:
            raise OSError(22, "Invalid argument")
        sent = real_sendfile(output_fd, source_fd, offset, count)
        if os.readlink(f"/proc/self/fd/{output_fd}").endswith(".safetensors"):  # not shutil's copies of side files
            copied.append(sent)
        return sent

    real_sendfile = os.sendfile
    monkeypatch.setattr(os, "sendfile", sendfile)
    result = export_checkpoint(tmp_path / "src", tmp_path / "out", "llama", OutputOptions(max_shard_size="24KB"))
    assert result.verification.max_abs <= 1e-4
    unchanged = {"model.embed_tokens.weight", "lm_head.weight"}
    assert sum(copied) == (sum(model.state_dict()[name].nbytes for name in unchanged) if kernel_copy else 0)
    written = {}
    for shard in (tmp_path / "out").glob("*.safetensors"):
        written |= load_file(shard)
    source = model.state_dict()
    for name in unchanged:
        assert torch.equal(written[name], source[name]), name
    assert not torch.equal(
        written["model.layers.0.mlp.down_proj.weight"], source["model.layers.0.mlp.down_proj.weight"]
    )


def test_a_bin_source_is_read_with_weights_only(tmp_path):
    model = saved_scalevec(tmp_path / "src", tiny_config(qk_norm=True))
    (tmp_path / "src" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "src" / "pytorch_model.bin")
    result = export_checkpoint(tmp_path / "src", tmp_path / "out", "qwen3")
    assert result.verification.max_abs <= 1e-4 and "model.safetensors" in result.files


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_outputs_are_verified_against_a_dtype_bound(tmp_path, dtype):
    model = saved_scalevec(tmp_path / "src", tiny_moe_config())
    name = str(dtype).removeprefix("torch.")
    result = export_checkpoint(tmp_path / "src", tmp_path / "out", "mixtral", OutputOptions(dtype=name))
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {dtype}  # noqa: SIM118 (a safetensors handle)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == name
    comparison = result.verification
    assert comparison.weight_dtype == dtype and comparison.passed
    assert comparison.bound > 1e-4 and comparison.max_abs > 1e-7  # rounding shows, and the bound allows for it
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32)
    ids = random_ids(model.config)
    torch.testing.assert_close(logits(half, ids), logits(model, ids), atol=comparison.bound, rtol=0)


def test_tokenizer_and_generation_files_are_copied_and_training_files_are_not(tmp_path):
    saved_scalevec(tmp_path / "src", tiny_config())
    side_files = {
        "tokenizer.json": '{"version": "1.0"}',
        "tokenizer_config.json": '{"model_max_length": 64}',
        "special_tokens_map.json": "{}",
        "chat_template.jinja": "{{ messages }}",
        "generation_config.json": '{"max_new_tokens": 7, "do_sample": false}',
    }
    for name, content in side_files.items():
        (tmp_path / "src" / name).write_text(content)
    for name in ("trainer_state.json", "optimizer.pt", "README.md"):
        (tmp_path / "src" / name).write_text("not for the export")
    result = export_checkpoint(tmp_path / "src", tmp_path / "out", "llama")
    for name, content in side_files.items():
        assert (tmp_path / "out" / name).read_text() == content
    assert sorted(result.files) == sorted(["config.json", "model.safetensors", *side_files])


def test_the_streaming_writer_writes_what_safetensors_reads(tmp_path):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"t{i}": torch.randn(shape, generator=generator) for i, shape in enumerate([(3, 5), (7,), (2, 3, 4), (0, 4)])
    }
    plan = [(name, tuple(t.shape)) for name, t in tensors.items()]
    for dtype in (torch.float32, torch.bfloat16):
        folder = tmp_path / str(dtype)
        folder.mkdir()
        with ShardedWriter(folder, plan, dtype, max_shard_bytes=60) as writer:
            writer.write({"t1": tensors["t1"], "t0": tensors["t0"]})  # any order within a group
            writer.write({name: tensors[name] for name in ("t2", "t3")})
            writer.close()
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        read = {}
        for file in sorted(set(index["weight_map"].values())):
            read |= load_file(folder / file)
        assert sorted(read) == sorted(tensors)
        for name, tensor in tensors.items():
            assert read[name].dtype == dtype and torch.equal(read[name], tensor.to(dtype)), name
        save_file(tensors, folder / "reference.safetensors")  # the same layout rules as safetensors' own writer
        assert set(load_file(folder / "reference.safetensors")) == set(read)


def test_the_console_script_runs(tmp_path):
    saved_scalevec(tmp_path / "src", tiny_config())
    script = Path(sys.executable).with_name("scalevec-convert")
    result = subprocess.run(
        [str(script), "fold", str(tmp_path / "src"), str(tmp_path / "out"), "--no-verify", "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "verification: skipped" in result.stdout and (tmp_path / "out" / "modeling_scalevec.py").is_file()


def _as_hub_snapshot(folder: Path, cache: Path, repo_id: str) -> None:
    """Lay `folder` out as huggingface_hub's cache does: blobs, a snapshot of symlinks, and refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for i, file in enumerate(sorted(folder.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))


def test_the_scalevec_export_loads_by_repo_id_from_a_hub_cache_offline(tmp_path):
    model = saved_scalevec(tmp_path / "src", tiny_moe_config(qk_norm=True, output_norm=True))
    fold_checkpoint(tmp_path / "src", tmp_path / "out")
    _as_hub_snapshot(tmp_path / "out", tmp_path / "hub", "scalevec-org/tiny-moe")
    ids = random_ids(model.config)
    save_file({"ids": ids}, tmp_path / "ids.safetensors")
    run_without_scalevec(
        """
        import sys, torch
        from safetensors.torch import load_file, save_file
        from transformers import AutoModelForCausalLM
        ids = load_file(sys.argv[1])["ids"]
        model = AutoModelForCausalLM.from_pretrained("scalevec-org/tiny-moe", trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            save_file({"logits": model.eval()(ids).logits}, sys.argv[2])
        """,
        str(tmp_path / "ids.safetensors"),
        str(tmp_path / "logits.safetensors"),
        env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path / "hf_home"), "OMP_NUM_THREADS": "1"},
    )
    actual = load_file(tmp_path / "logits.safetensors")["logits"]
    torch.testing.assert_close(actual, logits(model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "target, moe, tied",
    [("scalevec", False, True), ("llama", False, False), ("qwen3_moe", True, True), ("mixtral", True, False)],
)
def test_verification_streams_one_unit_at_a_time_and_computes_what_the_whole_model_does(
    tmp_path, monkeypatch, target, moe, tied
):
    """Verification runs each checkpoint through its own class with one unit's weights in memory at a time; its
    logits are exactly those of the model loaded whole with `from_pretrained`, for the source and the export."""
    config = (tiny_moe_config if moe else tiny_config)(tie_word_embeddings=tied, qk_norm=target == "qwen3_moe")
    saved_scalevec(tmp_path / "src", config)
    export_checkpoint(tmp_path / "src", tmp_path / "out", target, OutputOptions(max_shard_size="20KB", verify=False))
    live, most_live = set(), []
    load, drop = verify._UnitLoader.load, verify._UnitLoader.drop

    def tracked_load(self, unit):
        live.add(unit)
        most_live.append(len(live))
        load(self, unit)

    def tracked_drop(self, unit):
        live.discard(unit)
        drop(self, unit)

    monkeypatch.setattr(verify._UnitLoader, "load", tracked_load)
    monkeypatch.setattr(verify._UnitLoader, "drop", tracked_drop)
    tokens = verify.random_tokens(config.vocab_size)
    for path in (tmp_path / "src", tmp_path / "out"):
        whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            expected = whole(tokens).logits
        most_live.clear()
        torch.testing.assert_close(verify.streamed_logits(path, tokens), expected, rtol=0, atol=0)
        assert len(most_live) == config.num_hidden_layers + 2 and max(most_live) == 1 and not live


def test_verification_uses_a_stored_head_beside_tied_embeddings_as_from_pretrained_does(tmp_path):
    """transformers unties a head that a tied checkpoint stores anyway (with a warning); verification runs the same."""
    model = saved_scalevec(tmp_path / "src", tiny_config(tie_word_embeddings=True))
    weights = tmp_path / "src" / "model.safetensors"
    state = load_file(weights)
    save_file({**state, "lm_head.weight": torch.randn_like(state["model.embed_tokens.weight"])}, weights)
    tokens = verify.random_tokens(model.config.vocab_size)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = whole.eval()(tokens).logits
    torch.testing.assert_close(verify.streamed_logits(tmp_path / "src", tokens), expected, rtol=0, atol=0)
