"""Damaged and unusual sources: non-finite weights, configs that do not match the tensors, legacy and unsafe
`.bin` files, indexes that point outside the folder. Each is refused with one message that names the file, tensor
or field at fault, no traceback, nothing at the destination and the source untouched; what is sound converts."""

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from scalevec import ScaleVecForCausalLM
from scalevec.convert.cli import main
from scalevec.convert.verify import random_tokens

from ._helpers import logits, random_ids, saved_scalevec, tiny_config, tiny_moe_config


def snapshot(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def refused(argv: list[str], source: Path, capsys, *messages: str) -> None:
    """`scalevec-convert argv` exits with 1 and one error naming `messages`; `source` and its parent are as before."""
    before, neighbours = snapshot(source), sorted(p.name for p in source.parent.iterdir())
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("scalevec-convert: error:") == 1 and "Traceback" not in err, err
    for message in messages:
        assert message in err, err
    assert snapshot(source) == before
    assert sorted(p.name for p in source.parent.iterdir()) == neighbours  # no destination, no staging folder


def edit_weights(source: Path, edit) -> None:
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})


def set_values(name: str, value: float, count: int):
    def edit(tensors):
        tensors[name].view(-1)[:count] = value

    return edit


NONFINITE = [  # (config, tensor, value, count): one of each kind of tensor
    (tiny_config(scale_preset="standard"), "model.embed_tokens.weight", float("nan"), 1),
    (tiny_config(scale_preset="standard"), "model.layers.1.post_attention_layernorm.weight", float("inf"), 2),
    (tiny_config(), "model.layers.0.mlp.up_proj.in_scale.direction", float("nan"), 1),
    (tiny_moe_config(), "model.layers.1.mlp.experts.gate_up_proj", float("-inf"), 3),
]


@pytest.mark.parametrize("command", [["fold"], ["export", "--to", "llama"], ["import", "--preset", "unified"]])
@pytest.mark.parametrize("config, name, value, count", NONFINITE[:2])
def test_nonfinite_weights_are_refused_by_every_conversion(tmp_path, capsys, command, config, name, value, count):
    saved_scalevec(tmp_path / "src", config)
    edit_weights(tmp_path / "src", set_values(name, value, count))
    argv = [command[0], str(tmp_path / "src"), str(tmp_path / "out"), *command[1:]]
    refused(argv, tmp_path / "src", capsys, f"tensor {name}", f"holds {count} non-finite values", "--allow-nonfinite")


@pytest.mark.parametrize("config, name, value, count", NONFINITE[2:])
def test_nonfinite_scales_and_expert_stacks_are_refused(tmp_path, capsys, config, name, value, count):
    saved_scalevec(tmp_path / "src", config)
    edit_weights(tmp_path / "src", set_values(name, value, count))
    argv = ["fold", str(tmp_path / "src"), str(tmp_path / "out")]
    refused(argv, tmp_path / "src", capsys, f"tensor {name}", f"holds {count} non-finite values")


def test_allow_nonfinite_converts_a_nan_that_verification_cannot_see(tmp_path, caplog):
    config = tiny_config(scale_preset="standard")
    saved_scalevec(tmp_path / "src", config)
    row = min(set(range(config.vocab_size)) - set(random_tokens(config.vocab_size).flatten().tolist()))

    def poison(tensors):
        tensors["model.embed_tokens.weight"][row, 3] = float("nan")

    edit_weights(tmp_path / "src", poison)
    # The verification's tokens never read that row: only the streamed check stands between the NaN and the Hub.
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "llama"]) == 1
    assert not (tmp_path / "out").exists()
    argv = ["export", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "llama", "--allow-nonfinite"]
    assert main(argv) == 0
    assert "model.embed_tokens.weight" in caplog.text and "converted as it is" in caplog.text
    written = load_file(tmp_path / "out" / "model.safetensors")["model.embed_tokens.weight"]
    assert written.isnan().nonzero().tolist() == [[row, 3]]


def test_inspect_reports_nonfinite_tensors(tmp_path, capsys):
    name = "model.layers.1.mlp.experts.gate_up_proj"
    saved_scalevec(tmp_path / "src", tiny_moe_config())
    edit_weights(tmp_path / "src", set_values(name, float("nan"), 3))
    assert main(["inspect", str(tmp_path / "src"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["nonfinite"] == {name: 3}
    assert main(["inspect", str(tmp_path / "src")]) == 0
    assert f"non-finite values (NaN or Inf): 3 in {name}" in capsys.readouterr().out
    saved_scalevec(tmp_path / "clean", tiny_config())
    assert main(["inspect", str(tmp_path / "clean")]) == 0
    assert "non-finite values (NaN or Inf): none" in capsys.readouterr().out


def rewrite_config(source: Path, **fields) -> None:
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, **fields}))


@pytest.mark.parametrize("command", [["inspect"], ["export", "--to", "llama"]])
def test_a_config_whose_model_type_does_not_match_the_tensors_is_refused(tmp_path, capsys, command):
    saved_scalevec(tmp_path / "src", tiny_config())  # unified: branch scales that Llama has no place for
    rewrite_config(tmp_path / "src", model_type="llama")
    argv = [command[0], str(tmp_path / "src"), *([str(tmp_path / "out")] if command[0] != "inspect" else [])]
    refused([*argv, *command[1:]], tmp_path / "src", capsys, str(tmp_path / "src"), "that its config (llama)")


def test_inspect_refuses_shapes_its_config_contradicts(tmp_path, capsys):
    saved_scalevec(tmp_path / "src", tiny_config(scale_preset="standard"))
    rewrite_config(tmp_path / "src", intermediate_size=40)
    refused(
        ["inspect", str(tmp_path / "src")],
        tmp_path / "src",
        capsys,
        "tensor model.layers.0.mlp.gate_proj.weight",
        "has shape [48, 32]; its config (scalevec) needs [40, 32]",
    )


def save_bin(source: Path, state: dict, **torch_save_options) -> None:
    (source / "model.safetensors").unlink()
    torch.save(state, source / "pytorch_model.bin", **torch_save_options)


def test_a_legacy_format_bin_converts_and_inspects(tmp_path, capsys):
    model = saved_scalevec(tmp_path / "src", tiny_config())
    save_bin(tmp_path / "src", model.state_dict(), _use_new_zipfile_serialization=False)
    assert main(["fold", str(tmp_path / "src"), str(tmp_path / "out")]) == 0
    assert "within the bound" in capsys.readouterr().out
    folded = ScaleVecForCausalLM.from_pretrained(tmp_path / "out")
    ids = random_ids(model.config)
    torch.testing.assert_close(logits(folded, ids), logits(model, ids), atol=1e-4, rtol=0)
    assert main(["inspect", str(tmp_path / "src"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["nonfinite"] == {}


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_a_pickle_that_safe_loading_refuses_is_named_and_never_run(tmp_path, capsys, writer):
    model = saved_scalevec(tmp_path / "src", tiny_config())
    marker = tmp_path / "code-ran"
    state = {**model.state_dict(), "extra": _RunsCode(marker)}
    (tmp_path / "src" / "model.safetensors").unlink()
    with open(tmp_path / "src" / "pytorch_model.bin", "wb") as file:
        torch.save(state, file) if writer == "torch.save" else pickle.dump(state, file)
    message = "refuses: it is not a `torch.save` file of tensors alone"
    for command in (["inspect"], ["export", "--to", "llama"]):
        argv = [command[0], str(tmp_path / "src"), *([str(tmp_path / "out")] if command[0] != "inspect" else [])]
        refused([*argv, *command[1:]], tmp_path / "src", capsys, str(tmp_path / "src" / "pytorch_model.bin"), message)
    assert not marker.exists()


@pytest.mark.parametrize("outside", ["../{shard}", "/absolute/{shard}", "sub/../../{shard}"])
def test_an_index_that_points_outside_the_folder_is_refused(tmp_path, capsys, outside):
    torch.manual_seed(0)
    ScaleVecForCausalLM(tiny_config()).save_pretrained(tmp_path / "src", max_shard_size="20KB")
    index_file = tmp_path / "src" / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    escaping = outside.format(shard=shard)
    index["weight_map"] = {name: escaping if file == shard else file for name, file in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    argv = ["export", str(tmp_path / "src"), str(tmp_path / "out"), "--to", "llama"]
    refused(argv, tmp_path / "src", capsys, str(index_file), repr(escaping), "outside the checkpoint folder")


@pytest.mark.parametrize(
    "file, content, message",
    [
        ("config.json", "[1, 2]", "config.json holds a JSON list, not an object"),
        ("model.safetensors.index.json", '{"weight_map": {"lm_head.weight": 3}}', "must name a file"),
    ],
)
def test_json_of_the_wrong_shape_is_named(tmp_path, capsys, file, content, message):
    saved_scalevec(tmp_path / "src", tiny_config())
    (tmp_path / "src" / file).write_text(content)
    refused(["inspect", str(tmp_path / "src")], tmp_path / "src", capsys, str(tmp_path / "src" / file), message)


def test_a_checkpoint_that_rotation_removed_is_said_to_no_longer_exist(tmp_path, monkeypatch, capsys):
    """Named before the run's rotation removed it, and removed before or while the converter opens it."""
    from scalevec.convert import checkpoint

    run = tmp_path / "run"
    saved_scalevec(run / "checkpoint-4", tiny_config())
    gone = (
        f"scalevec-convert: error: {run / 'checkpoint-2'} no longer exists: the run in {run} holds checkpoint-4 now "
        "(a run keeps only its newest checkpoints, --save-total-limit, and removes the older ones as it saves)\n"
    )
    capsys.readouterr()
    assert main(["export", str(run / "checkpoint-2"), str(tmp_path / "out"), "--to", "llama"]) == 1
    assert capsys.readouterr().err == gone
    saved_scalevec(run / "checkpoint-2", tiny_config())
    capsys.readouterr()
    index = checkpoint._index_tensors

    def rotated_while_read(folder):  # the run saves checkpoint-6 and removes checkpoint-2 meanwhile
        shutil.rmtree(run / "checkpoint-2")
        return index(folder)

    monkeypatch.setattr(checkpoint, "_index_tensors", rotated_while_read)
    assert main(["export", str(run / "checkpoint-2"), str(tmp_path / "out"), "--to", "llama"]) == 1
    assert capsys.readouterr().err == gone
    assert main(["export", str(tmp_path / "nowhere"), str(tmp_path / "out"), "--to", "llama"]) == 1
    assert capsys.readouterr().err == f"scalevec-convert: error: {tmp_path / 'nowhere'}: no such folder\n"
    assert not (tmp_path / "out").exists()
