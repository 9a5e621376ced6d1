"""`scalevec-train`: pretrain a ScaleVec model with the transformers Trainer.

scalevec-train --model-size tiny --scale-preset unified --max-steps 50 --output-dir runs/tiny
scalevec-train config.yaml [--flag value ...]      # a JSON/YAML file of the same options; flags override it
scalevec-train ... --output-dir runs/tiny --resume  # after a kill: the same command, from the last complete checkpoint
torchrun --nproc_per_node 2 -m scalevec.train.cli ...
"""

import argparse
import difflib
import json
import os
import shutil
import sys
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path

from transformers import HfArgumentParser, TrainerState
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import enable_full_determinism, set_seed
from transformers.utils.generic import is_flash_attention_requested

from ..atomic import (
    exit_status,
    finish_tree,
    fsync_path,
    removed_if_left_empty,
    write_text_atomically,
    writes_into,
)
from ..configuration_scalevec import SCALE_FIELDS, ScaleVecConfig
from ..data import DataArguments, PackedBlockCollator, build_training_data, check_vocabulary, load_tokenizer
from ..evaluation.cli import check_model_source
from ..evaluation.tasks import Task, load_tasks, parse_task_list
from ..modeling_scalevec import ScaleVecForCausalLM
from ..run_records import RUN_PICTURE, RUN_SUMMARY, TRAINING_DATA, finished_step, logged_entries
from .arguments import ScaleVecTrainingArguments
from .branches import (
    Budget,
    add_branch_points,
    branch_runs,
    describe_budgets,
    plan_budgets,
    resolve_decay_fraction,
    restore_branch_points,
)
from .lora import LoraArguments, with_lora
from .presets import MODEL_SIZES, SIZE_RULE, size_fields
from .resume import (
    CheckpointContent,
    check_explicit_checkpoint,
    choose_checkpoint,
    remove_leftovers,
    resumed_model_config,
)
from .run_lock import LOCK_NAME, holding_output_dir
from .run_report import PaceCallback, describe_summary, summary, training_plan
from .trainer import STAGING_SUFFIX, NonFiniteLossError, ScaleVecTrainer


@dataclass
class ModelArguments:
    model_size: str = field(
        default="tiny", metadata={"help": f"One of {', '.join(MODEL_SIZES)}, or {SIZE_RULE} on top of tiny."}
    )
    scale_preset: str | None = field(default=None, metadata={"help": "none, standard or unified (default)."})
    norm_scale: str | None = field(default=None, metadata={"help": "Override: none, shared or branch."})
    linear_scale: str | None = field(default=None, metadata={"help": "Override: none, in, out or both."})
    scale_param: str | None = field(default=None, metadata={"help": "Override: direct or magdir."})
    qk_norm: bool | None = field(default=None, metadata={"help": "Per-head QK-norm (default: the size preset's)."})
    output_norm: bool = field(default=False, metadata={"help": "Output norms on every branch."})
    config_overrides: str | None = field(default=None, metadata={"help": "JSON dict of ScaleVecConfig fields."})
    init_from: str | None = field(default=None, metadata={"help": "Continue from a ScaleVec checkpoint folder."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "eager, sdpa, flash_attention_2, ..."})
    resume: bool = field(
        default=False,
        metadata={
            "help": "Continue from the newest complete checkpoint in --output-dir (incomplete ones are set aside); "
            "a finished run trains nothing. The model is the run's: model flags left at their defaults are taken "
            "from the checkpoint's config.json, one given that contradicts it is refused."
        },
    )
    resume_weights_only: bool = field(
        default=False,
        metadata={"help": "Allow resuming from a checkpoint without optimizer or scheduler state (both restart)."},
    )


@dataclass
class TrainResult:
    output_dir: Path
    metrics: dict
    plot: Path | None


def build_model_config(args: ModelArguments, tokenizer) -> ScaleVecConfig:
    try:
        size = size_fields(args.model_size)
    except ValueError as error:
        raise ValueError(f"--model-size: {error}") from None
    fields = dict(
        size,
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
    fields.update(config_overrides(args.config_overrides))
    return ScaleVecConfig(**fields)


def given_model_fields(args: ModelArguments) -> dict[str, set[str]]:
    """The config fields that each model flag given (not left at its default) sets, by the flag as typed; and
    those the tokenizer sets."""
    defaults, given = ModelArguments(), {}
    if args.model_size != defaults.model_size:
        given[f"--model-size {args.model_size}"] = set(size_fields(args.model_size))
    overridden = [name for name in SCALE_FIELDS if getattr(args, name) is not None]
    if args.scale_preset is not None:
        given[f"--scale-preset {args.scale_preset}"] = {"scale_preset", *SCALE_FIELDS} - set(overridden)
    for name in (*overridden, *(["qk_norm"] if args.qk_norm is not None else [])):
        given[f"--{name.replace('_', '-')} {getattr(args, name)}"] = {name}
    if args.output_norm:
        given["--output-norm"] = {"output_norm"}
    if args.config_overrides:
        given[f"--config-overrides {args.config_overrides}"] = set(config_overrides(args.config_overrides))
    given["the tokenizer"] = {"vocab_size", "eos_token_id", "bos_token_id", "pad_token_id"}
    return given


def config_overrides(text: str | None) -> dict:
    try:
        overrides = json.loads(text or "{}")
    except ValueError as error:
        raise ValueError(f"--config-overrides {text!r}: not JSON ({error})") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--config-overrides {text!r}: must be a JSON object of ScaleVecConfig fields")
    return overrides


def check_output_dir(output_dir: Path, resuming: bool) -> None:
    if output_dir.is_dir() and any(p.name != LOCK_NAME for p in output_dir.iterdir()) and not resuming:
        raise ValueError(
            f"--output-dir {output_dir} already holds files; pass --resume to continue that run, or choose another "
            "folder (nothing is overwritten)"
        )


def train(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: ScaleVecTrainingArguments,
    lora_args: LoraArguments | None = None,
):
    """Build tokenizer, model and data, train, evaluate on the held-out split, save; returns a `TrainResult`.
    With `lora_args`, an adapter trains and is what the run saves. A failure leaves no output folder that this call
    created and left empty. Another run on the same output folder is refused while this one lives. With
    --decay-at, each smaller budget then trains its cooldown in a folder of its own (`branches.py`)."""
    output_dir = Path(training_args.output_dir)
    training_args = resolve_decay_fraction(training_args)
    budgets = plan_budgets(training_args)  # refuses --decay-at values before anything is written
    with removed_if_left_empty(output_dir), holding_output_dir(output_dir, training_args.process_index == 0):
        if model_args.resume and training_args.process_index == 0:
            restore_branch_points(output_dir, budgets)
        result = _train(model_args, data_args, training_args, lora_args or LoraArguments(), budgets)
        for branch_args in branch_runs(training_args, budgets):
            train(replace(model_args, resume=True), data_args, branch_args, lora_args)
        return result


def _train(
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: ScaleVecTrainingArguments,
    lora_args: LoraArguments,
    budgets: list[Budget],
):
    output_dir = Path(training_args.output_dir)
    check_output_dir(output_dir, model_args.resume or training_args.resume_from_checkpoint)
    if model_args.resume and (step := finished_step(output_dir, training_args.max_steps)) is not None:
        print(f"scalevec-train: the run in {output_dir} already finished at step {step}: nothing to train")
        return TrainResult(output_dir, _recorded_metrics(output_dir), _picture(output_dir))
    with training_args.main_process_first(desc="checkpoints"):
        checkpoint = _resume_point(model_args, training_args)
    tokenizer = load_tokenizer(data_args)
    # Seed before the model is built (the Trainer seeds only later): --seed must fix the initial weights too.
    seed = training_args.seed
    enable_full_determinism(seed) if training_args.full_determinism else set_seed(seed)
    if model_args.init_from:
        attention = model_args.attn_implementation
        cache_only = check_model_source("--init-from", model_args.init_from)
        model = ScaleVecForCausalLM.from_pretrained(
            model_args.init_from, attn_implementation=attention, local_files_only=cache_only
        )
    else:
        config = build_model_config(model_args, tokenizer)
        if checkpoint is not None:  # the run's model, whatever flags the resuming command left out
            config = resumed_model_config(config, checkpoint.path, given_model_fields(model_args))
        model = ScaleVecForCausalLM._from_config(config, attn_implementation=model_args.attn_implementation)
    check_vocabulary(tokenizer, model.config.vocab_size)
    seq_len, limit = data_args.resolved_seq_len(), model.config.max_position_embeddings
    if seq_len > limit:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings ({limit})")
    if data_args.document_masking and training_args.use_cache:
        # With a cache, transformers builds a causal mask over the whole block and ignores restarting position ids.
        raise ValueError("--document-masking needs --use-cache false (the default for training)")
    if data_args.streaming and training_args.max_steps <= 0:
        raise ValueError("--streaming reads an endless stream: give the run's length with --max-steps")
    if lora_args.enabled:
        model = with_lora(model, lora_args)
    with training_args.main_process_first(desc="dataset"):
        rank, world_size = training_args.process_index, training_args.world_size
        data = build_training_data(data_args, tokenizer, seed, rank, world_size, progress=training_args.should_log)
        tasks = _tasks(data_args, data)
    if training_args.should_log:
        for note in data.notes:
            print(note, flush=True)
        for warning in data.warnings:
            print(f"scalevec-train: warning: {warning}", flush=True)
    flatten = is_flash_attention_requested(model.config)
    trainer = ScaleVecTrainer(
        model=model,
        args=training_args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        data_collator=PackedBlockCollator(tokenizer.eos_token_id, data_args.document_masking, flatten),
        processing_class=tokenizer,
        seq_len=data.seq_len,
        tasks=tasks,
    )
    add_branch_points(trainer, budgets)
    if training_args.should_log:
        print(training_plan(trainer.model, training_args, data, tasks, tokenizer), flush=True)
        if line := describe_budgets(budgets, training_args.max_steps):
            print(line, flush=True)
        trainer.add_callback(PaceCallback())
    metrics = _run(trainer, checkpoint)
    if data.eval is not None:
        metrics.update(_final_evaluation(trainer))
    figures = summary(trainer, metrics, data.seq_len)
    _save_result(trainer, metrics, {**data.record, **_task_sources(tasks)}, figures)
    if training_args.should_log:
        written = sorted(path.name for path in output_dir.iterdir() if not path.name.startswith("."))
        print(describe_summary(figures, written), flush=True)
    return TrainResult(output_dir, metrics, _picture(output_dir))


def _tasks(data_args: DataArguments, data) -> list[Task]:
    """`--eval-tasks`, scored at each evaluation of the held-out data."""
    if not data_args.eval_tasks:
        return []
    if data.eval is None:
        raise ValueError("--eval-tasks are scored at each evaluation of held-out data, and this run holds none out")
    return load_tasks(parse_task_list(data_args.eval_tasks), data_args.task_examples)


def _resume_point(model_args: ModelArguments, training_args: ScaleVecTrainingArguments) -> CheckpointContent | None:
    weights_only = model_args.resume_weights_only
    if training_args.resume_from_checkpoint:
        return check_explicit_checkpoint(Path(training_args.resume_from_checkpoint), weights_only)
    if not model_args.resume:
        return None
    output_dir = Path(training_args.output_dir)
    if output_dir.is_dir():
        remove_leftovers(output_dir)
    checkpoint = choose_checkpoint(output_dir, weights_only)
    if checkpoint is None:
        print(f"scalevec-train: no checkpoint in {output_dir} yet: training from step 0", flush=True)
    elif checkpoint.missing:
        print(
            f"scalevec-train: warning: {checkpoint.path.name} lacks {' and '.join(checkpoint.missing)}: resuming "
            "from its weights with a fresh optimizer and learning-rate schedule",
            flush=True,
        )
    return checkpoint


def _task_sources(tasks: list[Task]) -> dict:
    """What `training_data.json` records of `--eval-tasks`: each task's source and subset (`Task.provenance`), which
    the model card shows beside its scores."""
    return {"tasks": {task.name: task.provenance() for task in tasks}} if tasks else {}


def _run(trainer: ScaleVecTrainer, checkpoint: CheckpointContent | None) -> dict:
    """Train from `checkpoint` (or from scratch); the training metrics."""
    if checkpoint is None:
        return dict(trainer.train().metrics)
    last_step = trainer.args.max_steps if trainer.args.max_steps > 0 else checkpoint.max_steps
    if checkpoint.step < last_step:
        trainer.fresh_optimizer_on_resume = bool(checkpoint.missing)
        return dict(trainer.train(resume_from_checkpoint=str(checkpoint.path)).metrics)
    # Killed after saving its last step: `Trainer.train` would take a step more, so load the checkpoint instead.
    print(f"scalevec-train: {checkpoint.path} holds the last step: nothing to train, saving it as the result")
    trainer._load_from_checkpoint(str(checkpoint.path))
    trainer.state = TrainerState.load_from_json(str(checkpoint.path / TRAINER_STATE_NAME))
    return {}


def _final_evaluation(trainer: ScaleVecTrainer) -> dict:
    """The evaluation after the last step: the periodic one of that step where there was one, else a new one."""
    evaluations = logged_entries(trainer.state.log_history, "eval_loss")
    if evaluations and evaluations[-1]["step"] == trainer.state.global_step:
        return {key: value for key, value in evaluations[-1].items() if key.startswith("eval_")}
    return trainer.evaluate()


def _save_result(trainer: ScaleVecTrainer, metrics: dict, data_record: dict, figures: dict) -> None:
    """The final model, tokenizer and records (what the run trained on, its summary). The model's files are written
    into a staging folder and moved in once all are there, and `trainer_state.json` comes last: a readable one means
    that the run finished."""
    output_dir = Path(trainer.args.output_dir)
    staging = output_dir / f".result{STAGING_SUFFIX}"
    main_process = trainer.is_world_process_zero()
    with writes_into(output_dir, named=output_dir):
        try:
            trainer.save_model(str(staging))
            if main_process:
                _move_files(staging, output_dir)
        finally:
            if main_process:
                shutil.rmtree(staging, ignore_errors=True)
        trainer.save_metrics("all", metrics)
        if main_process:
            write_text_atomically(output_dir / "training_args.json", trainer.args.to_json_string())
            write_text_atomically(output_dir / TRAINING_DATA, json.dumps(data_record, indent=2) + "\n")
            write_text_atomically(output_dir / RUN_SUMMARY, json.dumps(figures, indent=2) + "\n")
        trainer.save_state()
        if main_process:
            fsync_path(output_dir / TRAINER_STATE_NAME)
            fsync_path(output_dir)


def _move_files(source: Path, destination: Path) -> None:
    finish_tree(source)
    for file in source.iterdir():
        os.replace(file, destination / file.name)


def _recorded_metrics(output_dir: Path) -> dict:
    records = output_dir / "all_results.json"
    return json.loads(records.read_text()) if records.is_file() else {}


def _picture(output_dir: Path) -> Path | None:
    plot = output_dir / RUN_PICTURE
    return plot if plot.exists() else None


TRAIN_ARGUMENTS = (ModelArguments, DataArguments, ScaleVecTrainingArguments, LoraArguments)


class _Parser(HfArgumentParser):
    def error(self, message: str):
        # argparse prints its whole usage (140 lines here) above the one line that matters, and exits
        raise ValueError(f"{message} (--help lists the options)")


def parse_arguments(argv: list[str], types: tuple[type, ...] = TRAIN_ARGUMENTS) -> tuple:
    """The dataclasses `types` from command-line flags, after an optional JSON/YAML file of the same options
    (each checked against the flags' names and types before anything is built). A mistake is a `ValueError`."""
    parser = _Parser(types)
    if argv and argv[0].endswith((".json", ".yaml", ".yml")):
        parser.set_defaults(**_options_file(Path(argv[0]), parser))
        argv = argv[1:]
    return parser.parse_args_into_dataclasses(_attached_values(argv, parser), look_for_args_file=False)


def _attached_values(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`--flag -0.5,1` as `--flag=-0.5,1` where `--flag` takes one value and `-0.5,1` is no flag: argparse takes
    any word starting with "-" for a flag, except a plain negative number, and would say "expected one argument"
    instead of what is wrong with the value."""
    takes_value = {
        option
        for action in parser._actions
        if isinstance(action, argparse._StoreAction) and action.nargs is None
        for option in action.option_strings
    }
    attached, words = [], iter(argv)
    for word in words:
        value = next(words, None) if word in takes_value else None
        if value is not None and value.startswith("-") and value.split("=")[0] not in parser._option_string_actions:
            attached.append(f"{word}={value}")
        else:
            attached += [word] if value is None else [word, value]
    return attached


def _options_file(path: Path, parser: HfArgumentParser) -> dict:
    if not path.is_file():
        raise ValueError(f"options file {path} does not exist")
    try:
        if path.suffix == ".json":
            values = json.loads(path.read_text(encoding="utf-8"))
        else:
            import yaml

            values = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception as error:  # json's ValueError, yaml's YAMLError, a UnicodeDecodeError
        raise ValueError(f"{path}: not valid {path.suffix[1:].upper()} ({str(error).splitlines()[0]})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of option names to values, got a {type(values).__name__}")
    actions: dict[str, argparse.Action] = {}
    for action in parser._actions:  # a boolean flag's `--no_*` twin comes second: keep the flag itself
        actions.setdefault(action.dest, action)
    del actions["help"]
    lists = _list_fields(parser)
    for key, value in values.items():
        if key not in actions:
            close = difflib.get_close_matches(str(key), list(actions), n=1)
            raise ValueError(f"{path}: unknown option {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        if isinstance(value, list) and key not in lists:
            raise ValueError(f"{path}: {key}: expected one value, got a list ({value!r})")
        values[key] = _typed_value(path, key, value, actions[key])
    return values


def _list_fields(parser: HfArgumentParser) -> set[str]:
    """The options whose field takes a list (`report_to: [tensorboard, wandb]`), whatever their flag's nargs."""
    hints = {name: hint for kind in parser.dataclass_types for name, hint in typing.get_type_hints(kind).items()}
    return {
        name for name, hint in hints.items() if list in {typing.get_origin(t) for t in (hint, *typing.get_args(hint))}
    }


def _typed_value(path: Path, key: str, value, action):
    """`value` converted as the flag `--key` would convert its text; refused with the file and key if it can't."""
    if value is None or isinstance(value, dict) or action.type is None:
        return value
    items = value if isinstance(value, list) else [value]  # lists as the flag's nargs or its field's type take them
    converted = []
    for item in items:
        try:
            converted.append(action.type(str(item)))
        except Exception as error:  # a converter may raise anything: argparse takes its types the same way
            raise ValueError(f"{path}: {key}: {item!r} is not a valid {_type_name(action.type)} ({error})") from None
        if action.choices and converted[-1] not in action.choices:
            raise ValueError(f"{path}: {key}: {item!r} is not one of {list(action.choices)}")
    return converted if isinstance(value, list) else converted[0]


def _type_name(convert) -> str:
    return getattr(convert, "__name__", "value").replace("string_to_bool", "boolean")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return exit_status("scalevec-train", lambda: train(*parse_arguments(argv)), (ValueError, NonFiniteLossError))


if __name__ == "__main__":
    sys.exit(main())
