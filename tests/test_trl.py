"""TRL's `SFTTrainer` with its default settings fine-tunes ScaleVec as it fine-tunes Llama and Qwen3-MoE: a dense
ScaleVec is dense to it (no load-balancing loss), a MoE one adds and logs its load-balancing loss."""

import math

import pytest
import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from trl import SFTConfig, SFTTrainer

from scalevec import ScaleVecConfig, ScaleVecForCausalLM
from scalevec.data.corpus import train_tokenizer

from ._helpers import STOCK_TINY, TINY, TINY_MOE

TEXTS = [f"def f{i}(x):\n    return x * {i} + {i % 7}  # line {i}\n" for i in range(24)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(TEXTS, vocab_size=300)


def models(kind: str, vocab_size: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    if kind == "dense":
        return {
            "llama": LlamaForCausalLM(LlamaConfig(**TINY | {"vocab_size": vocab_size})),
            "scalevec": ScaleVecForCausalLM(ScaleVecConfig(**TINY | {"vocab_size": vocab_size})),
        }
    qwen3_moe = Qwen3MoeConfig(**STOCK_TINY["qwen3_moe"] | {"vocab_size": vocab_size})  # TRL turns the flag on
    return {
        "qwen3_moe": Qwen3MoeForCausalLM(qwen3_moe),
        "scalevec": ScaleVecForCausalLM(ScaleVecConfig(**TINY_MOE | {"vocab_size": vocab_size})),
    }


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sft_trainer_fine_tunes_scalevec_as_the_stock_model(kind, tokenizer, tmp_path):
    dataset = Dataset.from_dict({"text": TEXTS})
    runs = {}
    for name, model in models(kind, len(tokenizer)).items():
        # TRL's defaults (bf16 autocast, gradient checkpointing, ...), on the CPU
        args = SFTConfig(tmp_path / name, max_steps=3, logging_steps=1, report_to="none", use_cpu=True)
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer.train()
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        assert len(logged) == 3 and all(math.isfinite(entry["loss"]) for entry in logged), name
        assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters()), name  # it trained
        runs[name] = (trainer.aux_loss_enabled, all("aux_loss" in entry for entry in logged))
    stock, scalevec = runs.values()
    assert scalevec == stock == ((kind == "moe"),) * 2
