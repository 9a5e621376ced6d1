"""LoRA for continued pretraining and fine-tuning with `scalevec-train` (PEFT, optional)."""

import json
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn


@dataclass
class LoraArguments:
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains the whole model (no adapter)."})
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA alpha (default: twice the rank)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: str | None = field(
        default=None,
        metadata={"help": "Comma-separated projection names, or 'all-linear' (default: PEFT's, q_proj and v_proj)."},
    )
    lora_target_parameters: str | None = field(
        default=None,
        metadata={"help": "Comma-separated stacked expert tensors, e.g. experts.gate_up_proj,experts.down_proj."},
    )
    lora_config: str | None = field(
        default=None, metadata={"help": "A PEFT LoraConfig as JSON (a file, or the folder of a saved adapter)."}
    )

    @property
    def enabled(self) -> bool:
        return bool(self.lora_r or self.lora_config)


def _names(value: str | None) -> list[str] | str | None:
    if value is None or value == "all-linear":
        return value
    return [name.strip() for name in value.split(",") if name.strip()]


def lora_config(args: LoraArguments):
    from peft import LoraConfig

    if args.lora_config:
        path = Path(args.lora_config)
        path = path / "adapter_config.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"--lora-config {args.lora_config}: no such file or adapter folder")
        fields = json.loads(path.read_text())
        return LoraConfig(**{k: v for k, v in fields.items() if k in LoraConfig.__dataclass_fields__})
    if args.lora_r < 0:
        raise ValueError(f"--lora-r must be a positive rank (or 0 for no adapter); got {args.lora_r}")
    return LoraConfig(
        r=args.lora_r,
        lora_alpha=2 * args.lora_r if args.lora_alpha is None else args.lora_alpha,
        lora_dropout=args.lora_dropout,
        target_modules=_names(args.lora_target_modules),
        target_parameters=_names(args.lora_target_parameters),
        task_type="CAUSAL_LM",
    )


def with_lora(model: nn.Module, args: LoraArguments) -> nn.Module:
    """`model` wrapped by PEFT with the adapter `args` describe; only the adapter trains."""
    try:
        from peft import get_peft_model
    except ImportError as error:
        raise ImportError("LoRA needs PEFT: pip install 'scalevec[peft]'") from error
    return get_peft_model(model, lora_config(args))
