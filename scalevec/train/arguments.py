"""`ScaleVecTrainingArguments`: the stock `TrainingArguments` with pretraining defaults, the role-aware weight decays
and Muon, each value checked against what a run can use."""

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from transformers import TrainingArguments

from .optim import DecayConfig


@dataclass
class ScaleVecTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus the role-aware weight decays and Muon (`--optim muon`), with pretraining defaults
    (learning rate, decay, beta2, cosine schedule with warmup, frequent logging) instead of fine-tuning ones."""

    learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate."})
    weight_decay: float = field(default=0.1, metadata={"help": "Weight decay of matrices (and, by default, scales)."})
    adam_beta2: float = field(default=0.95, metadata={"help": "AdamW beta2."})
    lr_scheduler_type: str = field(
        default="cosine", metadata={"help": "cosine, cosine_with_min_lr, warmup_stable_decay, linear, constant, ..."}
    )
    warmup_steps: float = field(default=0.05, metadata={"help": "Warmup steps, or a fraction (< 1) of all steps."})
    decay_at: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated fractions of --max-steps (e.g. 0.25,0.5,1): with --lr-scheduler-type "
            "warmup_stable_decay, each smaller budget branches its cooldown from the stable phase into "
            "OUTPUT/budget-F, costing its cooldown only (scalevec/train/branches.py)."
        },
    )
    logging_steps: float = field(default=10, metadata={"help": "Log every n steps (or a fraction of all steps)."})
    eval_strategy: str = field(
        default="steps",
        metadata={"help": "When to evaluate on the held-out data: 'steps' (every --eval-steps), 'epoch' or 'no'."},
    )
    eval_steps: float | None = field(
        default=1000,
        metadata={"help": "Evaluate every n steps (or a fraction of all steps); and always at the end of a run."},
    )
    optim: str = field(
        default="adamw_torch_fused",
        metadata={"help": "'muon' (Muon on hidden matrices, AdamW on the rest) or any transformers optimizer name."},
    )
    input_scale_weight_decay: float | None = field(
        default=None, metadata={"help": "Weight decay of input-role (foldable) scales. Default: --weight-decay."}
    )
    output_scale_weight_decay: float = field(
        default=0.0, metadata={"help": "Weight decay of output-role scales (output norms, QK-norms)."}
    )
    embedding_weight_decay: float | None = field(
        default=None, metadata={"help": "Weight decay of the embeddings and LM head. Default: --weight-decay."}
    )
    scale_decay_target: float = field(
        default=0.0,
        metadata={
            "help": "What weight decay pulls the scale vectors toward: 0 (AdamW's decay, default) or 1 (the identity, "
            "decaying γ - 1). With --optim adamw_torch, adamw_torch_fused or muon."
        },
    )
    muon_momentum: float = field(default=0.95, metadata={"help": "Muon momentum (with --optim muon)."})
    muon_adjust_lr: str = field(
        default="match_rms_adamw",
        metadata={"help": "Muon learning-rate scaling: 'match_rms_adamw' (same lr as AdamW) or 'original'."},
    )
    scale_stats: bool = field(
        default=True,
        metadata={
            "help": "Log per-site scale statistics and plot them; at each evaluation, activation kurtosis per layer."
        },
    )
    eval_halves: bool = field(
        default=False,
        metadata={
            "help": "Also log the loss of two fixed, disjoint halves of the held-out blocks (eval_select_loss, "
            "eval_report_loss), as scalevec-ablate does to choose learning rates on one and report on the other."
        },
    )
    peak_flops: float | None = field(
        default=None,
        metadata={"help": "Peak FLOP/s of one device, for MFU. Default: known GPUs by name (none on CPU)."},
    )
    include_num_input_tokens_seen: bool = field(default=True, metadata={"help": "Count the tokens seen."})
    dataloader_num_workers: int = field(
        default=2,
        metadata={
            "help": "Processes that read and collate batches ahead of the step, so that it never waits on the disk "
            "(transformers' default: 0, reading in the training process). A streamed run's order depends on it."
        },
    )
    dataloader_pin_memory: bool = field(
        default_factory=torch.cuda.is_available, metadata={"help": "Pin memory for data loaders (GPU only)."}
    )

    def __post_init__(self):
        _check_values(self)
        # Under torchrun on a machine without an accelerator, transformers sets up no DDP unless `use_cpu` is on:
        # each process would train alone, all writing the same folder. Use gloo on the CPUs instead.
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.accelerator.is_available():
            self.use_cpu = True
            # transformers gives --ddp-timeout to the process group on accelerators only: gloo would wait for its
            # own 30 minutes, whatever --ddp-timeout says (the time a rank waits for rank 0 to prepare data, say).
            if not torch.distributed.is_initialized():
                timeout = timedelta(seconds=self.ddp_timeout)
                torch.distributed.init_process_group(self.ddp_backend or "gloo", timeout=timeout)
        # `muon` is ours, not one of transformers' OptimizerNames: validate the rest as usual, then put it back.
        muon = self.optim == "muon"
        if muon:
            self.optim = "adamw_torch"
        super().__post_init__()
        if muon:
            self.optim = "muon"
        if self.muon_adjust_lr not in ("match_rms_adamw", "original"):
            raise ValueError(f"--muon-adjust-lr must be 'match_rms_adamw' or 'original'; got {self.muon_adjust_lr!r}")

    @property
    def decay(self) -> DecayConfig:
        return DecayConfig(
            self.weight_decay,
            self.input_scale_weight_decay,
            self.output_scale_weight_decay,
            self.embedding_weight_decay,
            self.scale_decay_target,
        )


_AT_LEAST_ONE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps")
_NOT_NEGATIVE = ("learning_rate", "weight_decay", "max_grad_norm", "dataloader_num_workers", "seed")
_NOT_NEGATIVE += ("input_scale_weight_decay", "output_scale_weight_decay", "embedding_weight_decay")
_POSITIVE = ("num_train_epochs", "logging_steps", "save_steps", "eval_steps", "adam_epsilon", "save_total_limit")
_POSITIVE += ("peak_flops",)
_FRACTIONS = ("adam_beta1", "adam_beta2", "muon_momentum")  # in [0, 1)


def _check_values(args: "ScaleVecTrainingArguments") -> None:
    """Refuse values no run can use, naming the flag (the stock arguments take, say, `--max-steps -5` and train
    for three epochs)."""

    def refuse(name: str, rule: str) -> None:
        raise ValueError(f"--{name.replace('_', '-')} must be {rule}; got {getattr(args, name)}")

    if args.max_steps == 0 or args.max_steps < -1:
        refuse("max_steps", "a positive number of steps, or -1 to train for --num-train-epochs")
    for name in _AT_LEAST_ONE:
        if getattr(args, name) < 1:
            refuse(name, "at least 1")
    for name in _NOT_NEGATIVE:
        if (getattr(args, name) or 0) < 0:
            refuse(name, "at least 0")
    for name in _POSITIVE:
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            refuse(name, "positive")
    for name in _FRACTIONS:
        if not 0 <= getattr(args, name) < 1:
            refuse(name, "at least 0 and below 1")
