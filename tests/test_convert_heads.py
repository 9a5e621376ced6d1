"""Task heads through the converter: a ScaleVec sequence-classification, token-classification or question-answering
model folds into the same ScaleVec head, exports to the stock head of a target (which some keep under
`transformer.`, not `model.`), imports back, and is refused with a clear message where the target has no such head."""

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from scalevec.convert import (
    OutputOptions,
    Strategy,
    TargetError,
    export_checkpoint,
    fold_checkpoint,
    import_checkpoint,
    verify,
)
from scalevec.convert.cli import main
from scalevec.convert.heads import QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, Head

from ._helpers import random_ids, randomize_scales, tiny_config, tiny_moe_config

ATOL = 1e-4


def saved_head(path: Path, head: Head, config) -> torch.nn.Module:
    """A tiny ScaleVec `head` model with randomised scales and head weights, saved with `save_pretrained`."""
    torch.manual_seed(0)
    model = head.auto_class.from_config(config).eval()
    randomize_scales(model)
    model.save_pretrained(path)
    return model


def outputs(model: torch.nn.Module, head: Head, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        output = model(ids)
    return torch.stack([output[field] for field in head.outputs])


def loaded(path: Path, model_class: type) -> torch.nn.Module:
    """`model_class.from_pretrained(path)`, asserting that every tensor found its parameter and none is left over."""
    model, info = model_class.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


def architecture(path: Path) -> str:
    (name,) = json.loads((path / "config.json").read_text())["architectures"]
    return name


def tensor_names(path: Path) -> list[str]:
    with safe_open(path / "model.safetensors", framework="pt") as weights:
        return list(weights.keys())  # noqa: SIM118


HEADS = [SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, QUESTION_ANSWERING]
DENSE = dict(num_labels=3, pad_token_id=0)
DENSE_VOCAB = tiny_config().vocab_size


@pytest.mark.parametrize("head", HEADS, ids=lambda head: head.suffix)
def test_a_dense_head_folds_and_exports_to_llama_computing_the_same(tmp_path, head):
    source = saved_head(tmp_path / "src", head, tiny_config(**DENSE))
    ids = random_ids(source.config)
    expected = outputs(source, head, ids)
    fold_checkpoint(tmp_path / "src", tmp_path / "folded")
    export_checkpoint(tmp_path / "src", tmp_path / "llama", "llama")

    assert architecture(tmp_path / "folded") == f"ScaleVec{head.suffix}"
    folded = loaded(tmp_path / "folded", head.auto_class)
    torch.testing.assert_close(outputs(folded, head, ids), expected, atol=ATOL, rtol=0)
    assert architecture(tmp_path / "llama") == f"Llama{head.suffix}"
    stock = loaded(tmp_path / "llama", getattr(transformers, f"Llama{head.suffix}"))
    torch.testing.assert_close(outputs(stock, head, ids), expected, atol=ATOL, rtol=0)
    assert stock.config.id2label == source.config.id2label


def test_llama_question_answering_keeps_its_base_model_as_transformer(tmp_path):
    saved_head(tmp_path / "src", QUESTION_ANSWERING, tiny_config(**DENSE))
    export_checkpoint(tmp_path / "src", tmp_path / "llama", "llama")
    names = tensor_names(tmp_path / "llama")
    assert "transformer.embed_tokens.weight" in names and "qa_outputs.bias" in names
    assert not [name for name in names if name.startswith("model.")]


@pytest.mark.parametrize(
    "head, target", [(QUESTION_ANSWERING, "qwen3_moe"), (SEQUENCE_CLASSIFICATION, "mixtral")], ids=str
)
def test_a_moe_head_exports_to_its_stock_head(tmp_path, head, target):
    config = tiny_moe_config(**DENSE, qk_norm=target == "qwen3_moe")
    source = saved_head(tmp_path / "src", head, config)
    ids = random_ids(config)
    result = export_checkpoint(tmp_path / "src", tmp_path / "out", target)
    stock_class = getattr(transformers, head.stock_classes[target])
    assert architecture(tmp_path / "out") == stock_class.__name__
    torch.testing.assert_close(
        outputs(loaded(tmp_path / "out", stock_class), head, ids), outputs(source, head, ids), atol=ATOL, rtol=0
    )
    assert result.verification.passed


@pytest.mark.parametrize("head", HEADS, ids=lambda head: head.suffix)
def test_verification_streams_the_head_class(tmp_path, head):
    """Streamed, the source and its Llama export compute exactly what their head classes loaded whole do."""
    saved_head(tmp_path / "src", head, tiny_config(**DENSE))
    export_checkpoint(tmp_path / "src", tmp_path / "llama", "llama", OutputOptions(verify=False))
    tokens = verify.random_tokens(DENSE_VOCAB)
    for path, model_class in (tmp_path / "src", head.auto_class), (tmp_path / "llama", head.auto_class):
        whole = model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        expected = torch.cat(list(outputs(whole, head, tokens)), dim=-1)
        torch.testing.assert_close(verify.streamed_logits(path, tokens), expected, rtol=0, atol=0)


def test_a_stock_head_imports_into_scalevec(tmp_path):
    """Back from Llama's `transformer.`-prefixed question-answering head; with norm_scale='none' the final norm's
    weight moves into the columns of `qa_outputs`."""
    source = saved_head(tmp_path / "src", QUESTION_ANSWERING, tiny_config(**DENSE))
    export_checkpoint(tmp_path / "src", tmp_path / "llama", "llama")
    import_checkpoint(tmp_path / "llama", tmp_path / "imported", Strategy(norm_scale="none"))
    assert architecture(tmp_path / "imported") == "ScaleVecForQuestionAnswering"
    imported = loaded(tmp_path / "imported", QUESTION_ANSWERING.auto_class)
    assert imported.config.norm_scale == "none"
    ids = random_ids(source.config)
    torch.testing.assert_close(
        outputs(imported, QUESTION_ANSWERING, ids), outputs(source, QUESTION_ANSWERING, ids), atol=ATOL, rtol=0
    )


def test_a_sequence_head_without_a_pad_token_is_verified(tmp_path):
    """transformers' sequence head cannot pool a batch without a pad token; verification runs one row then."""
    saved_head(tmp_path / "src", SEQUENCE_CLASSIFICATION, tiny_config(num_labels=3))
    result = export_checkpoint(tmp_path / "src", tmp_path / "llama", "llama")
    assert result.verification.passed


def test_a_target_without_the_head_is_refused(tmp_path, monkeypatch):
    """As on a transformers release that has no question-answering head for Mixtral."""
    monkeypatch.delitem(QUESTION_ANSWERING.stock_classes, "mixtral")
    saved_head(tmp_path / "src", QUESTION_ANSWERING, tiny_moe_config(**DENSE))
    with pytest.raises(TargetError) as refused:
        export_checkpoint(tmp_path / "src", tmp_path / "out", "mixtral", OutputOptions(verify=False))
    message = str(refused.value)
    assert "question-answering" in message and "mixtral" in message and "`--to scalevec`" in message
    assert not (tmp_path / "out").exists()


def test_an_unknown_architecture_is_refused(tmp_path, capsys):
    saved_head(tmp_path / "src", SEQUENCE_CLASSIFICATION, tiny_config(**DENSE))
    config_file = tmp_path / "src" / "config.json"
    config_file.write_text(json.dumps(json.loads(config_file.read_text()) | {"architectures": ["ScaleVecModel"]}))
    assert main(["fold", str(tmp_path / "src"), str(tmp_path / "out"), "-q"]) == 1
    error = capsys.readouterr().err
    assert f"{config_file} names the architecture 'ScaleVecModel'" in error
    assert "*ForSequenceClassification" in error
    assert not (tmp_path / "out").exists()


def test_the_model_card_names_the_head(tmp_path):
    saved_head(tmp_path / "src", QUESTION_ANSWERING, tiny_config(**DENSE))
    assert main(["fold", str(tmp_path / "src"), str(tmp_path / "out"), "-q"]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    assert "pipeline_tag: question-answering" in card
    assert "AutoModelForQuestionAnswering.from_pretrained(" in card
    assert "decoder with a question-answering head" in card
