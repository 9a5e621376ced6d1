"""`scalevec-train`: pretrain a ScaleVec model with the transformers Trainer.

scalevec-train --model-size tiny --scale-preset unified --max-steps 50 --output-dir runs/tiny
scalevec-train config.yaml [--flag value ...]      # a JSON/YAML file of the same options; flags override it
torchrun --nproc_per_node 2 -m scalevec.train.cli ...
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer, DataCollatorForLanguageModeling, HfArgumentParser
from transformers.trainer_utils import enable_full_determinism, get_last_checkpoint, set_seed

from ..atomic import write_text_atomically
from ..configuration_scalevec import SCALE_FIELDS, ScaleVecConfig
from ..modeling_scalevec import ScaleVecForCausalLM
from ..run_records import RUN_PICTURE
from .corpus import default_tokenizer
from .data import DataArguments, build_datasets
from .presets import MODEL_SIZES
from .trainer import NonFiniteLossError, ScaleVecTrainer, ScaleVecTrainingArguments


@dataclass
class ModelArguments:
    model_size: str = field(default="tiny", metadata={"help": f"One of {', '.join(MODEL_SIZES)}."})
    scale_preset: str | None = field(default=None, metadata={"help": "none, standard or unified (default)."})
    norm_scale: str | None = field(default=None, metadata={"help": "Override: none, shared or branch."})
    linear_scale: str | None = field(default=None, metadata={"help": "Override: none, in, out or both."})
    scale_param: str | None = field(default=None, metadata={"help": "Override: direct or magdir."})
    qk_norm: bool | None = field(default=None, metadata={"help": "Per-head QK-norm (default: the size preset's)."})
    output_norm: bool = field(default=False, metadata={"help": "Output norms on every branch."})
    config_overrides: str | None = field(default=None, metadata={"help": "JSON dict of ScaleVecConfig fields."})
    init_from: str | None = field(default=None, metadata={"help": "Continue from a ScaleVec checkpoint folder."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "eager, sdpa, flash_attention_2, ..."})
    resume: bool = field(default=False, metadata={"help": "Resume from the last checkpoint in --output-dir."})


@dataclass
class TrainResult:
    output_dir: Path
    metrics: dict
    plot: Path | None


def build_model_config(args: ModelArguments, tokenizer) -> ScaleVecConfig:
    if args.model_size not in MODEL_SIZES:
        raise ValueError(f"--model-size must be one of {', '.join(MODEL_SIZES)}; got {args.model_size!r}")
    fields = dict(
        MODEL_SIZES[args.model_size],
        vocab_size=len(tokenizer),
        scale_preset=args.scale_preset or "unified",
        output_norm=args.output_norm,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    for name in (*SCALE_FIELDS, "qk_norm"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    fields.update(json.loads(args.config_overrides or "{}"))
    return ScaleVecConfig(**fields)


def _check_output_dir(output_dir: Path, resuming: bool) -> None:
    if output_dir.is_dir() and any(output_dir.iterdir()) and not resuming:
        raise ValueError(
            f"--output-dir {output_dir} already holds files; pass --resume to continue that run, or choose another "
            "folder (nothing is overwritten)"
        )


def train(model_args: ModelArguments, data_args: DataArguments, training_args: ScaleVecTrainingArguments):
    """Build tokenizer, model and data, train, evaluate on the held-out split, save; returns a `TrainResult`."""
    _check_output_dir(Path(training_args.output_dir), model_args.resume or training_args.resume_from_checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(data_args.tokenizer) if data_args.tokenizer else default_tokenizer()
    # Seed before the model is built (the Trainer seeds only later): --seed must fix the initial weights too.
    seed = training_args.seed
    enable_full_determinism(seed) if training_args.full_determinism else set_seed(seed)
    if model_args.init_from:
        attention = model_args.attn_implementation
        model = ScaleVecForCausalLM.from_pretrained(model_args.init_from, attn_implementation=attention)
    else:
        config = build_model_config(model_args, tokenizer)
        model = ScaleVecForCausalLM._from_config(config, attn_implementation=model_args.attn_implementation)
    limit = model.config.max_position_embeddings
    if data_args.seq_len > limit:
        raise ValueError(f"--seq-len {data_args.seq_len} exceeds the model's max_position_embeddings ({limit})")
    with training_args.main_process_first(desc="dataset"):
        data = build_datasets(data_args, tokenizer, seed=training_args.seed)
    if data.eval is None and training_args.eval_strategy != "no":
        raise ValueError("evaluation was asked for but the held-out split is empty (--eval-every 0, or too few data)")
    trainer = ScaleVecTrainer(
        model=model,
        args=training_args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
        bytes_per_token=data.bytes_per_token,
    )
    resume = training_args.resume_from_checkpoint
    if model_args.resume:
        resume = get_last_checkpoint(training_args.output_dir)
        if resume is None:
            raise ValueError(f"--resume: no checkpoint-* folder in {training_args.output_dir}")
    outcome = trainer.train(resume_from_checkpoint=resume)
    metrics = dict(outcome.metrics)
    if data.eval is not None:
        metrics.update(trainer.evaluate())
    trainer.save_model()
    trainer.save_state()
    trainer.save_metrics("all", metrics)
    output_dir = Path(training_args.output_dir)
    if trainer.is_world_process_zero():
        write_text_atomically(output_dir / "training_args.json", training_args.to_json_string())
    plot = output_dir / RUN_PICTURE
    return TrainResult(output_dir, metrics, plot if plot.exists() else None)


TRAIN_ARGUMENTS = (ModelArguments, DataArguments, ScaleVecTrainingArguments)


def parse_arguments(argv: list[str], types: tuple[type, ...] = TRAIN_ARGUMENTS) -> tuple:
    """The dataclasses `types` from command-line flags, after an optional JSON/YAML file of the same options."""
    parser = HfArgumentParser(types)
    if argv and argv[0].endswith((".json", ".yaml", ".yml")):
        path = Path(argv[0])
        if not path.is_file():
            raise ValueError(f"config file {path} does not exist")
        if path.suffix == ".json":
            values = json.loads(path.read_text())
        else:
            import yaml

            values = yaml.safe_load(path.read_text())
        parser.set_defaults(**values)
        argv = argv[1:]
    return parser.parse_args_into_dataclasses(argv, look_for_args_file=False)


def main(argv: list[str] | None = None) -> int:
    try:
        result = train(*parse_arguments(sys.argv[1:] if argv is None else argv))
    except (ValueError, NonFiniteLossError) as error:
        print(f"scalevec-train: error: {error}", file=sys.stderr)
        return 1
    print(f"saved to {result.output_dir}" + (f"; plot {result.plot}" if result.plot else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
