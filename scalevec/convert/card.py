"""The model card (`README.md`) of an exported checkpoint, rendered from `templates/model_card.md`.

Every number on the card comes from the config, the checkpoint's own files or the training run's records
(`trainer_state.json`, `eval_results.json` / `all_results.json`, `training_args.json`); what is not recorded is
left out, so a checkpoint without records gets a short, honest card rather than invented figures.
"""

import contextlib
import math
import shutil
from collections.abc import Sequence
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..atomic import write_text_atomically
from ..configuration_scalevec import MINIMUM_TRANSFORMERS, SCALE_FIELDS, SCALE_PRESETS, ScaleVecConfig
from ..run_records import (
    RUN_PICTURE,
    EvaluationRecord,
    RunRecords,
    TaskScore,
    TaskScores,
    duration_text,
    logged_entries,
    loss_coverage,
    part_note,
    read_json,
    read_run_records,
    segments_text,
    whole_run,
)
from .checkpoint import Checkpoint
from .errors import CheckpointError
from .heads import CAUSAL_LM, Head, head_of
from .meta_model import num_parameters, scale_parameters
from .pipeline import BeforeCommit, ConversionResult
from .task_results import evaluation_section, subset_text, task_model_index, write_eval_result_files

TEMPLATE = Path(__file__).parent / "templates" / "model_card.md"
TRAINING_ARGUMENTS = {  # training_args.json field -> card label
    "optim": "optimizer",
    "learning_rate": "peak learning rate",
    "weight_decay": "weight decay",
    "lr_scheduler_type": "schedule",
    "lr_scheduler_kwargs": "schedule arguments",
    "warmup_steps": "warmup",
    "warmup_ratio": "warmup ratio",  # transformers < 5 only
    "per_device_train_batch_size": "batch size per device",
    "gradient_accumulation_steps": "gradient accumulation steps",
    "seed": "seed",
}


def write_model_card(
    folder: str | Path,
    *,
    export_target: str,
    source_config: ScaleVecConfig,
    run_dir: str | Path | None = None,
    base_model: str | None = None,
    folding_summary: str | None = None,
    picture: str | Path | None = None,
    datasets: Sequence[str] = (),
    license: str = "apache-2.0",
    repo_id: str | None = None,
    model_name: str | None = None,
    task_results: dict | None = None,
) -> Path:
    """Write `folder/README.md` for a checkpoint exported as `export_target` ("scalevec" or a stock architecture
    such as "llama") from the ScaleVec model configured by `source_config` (as trained, before folding), and
    return its path. `run_dir` is the Trainer output folder whose records fill the training section; `base_model`
    the repo an import started from; `datasets` the Hub ids trained on; `repo_id` goes into the loading snippet and
    names the model unless `model_name` does (default: the model's kind and size, never a folder's name);
    `picture` is copied into `folder` and shown on the card; `task_results`, a `scalevec-eval` results file as
    `read_task_results` reads it, adds the downstream tasks and the quantization differences to the card and its
    `model-index`, and the Hub's `.eval_results/` files beside it."""
    folder = Path(folder)
    head = head_of(read_json(folder / "config.json") or {}, folder / "config.json")
    records = read_run_records(run_dir) if run_dir is not None else RunRecords()
    model_name = model_name or repo_id or _default_title(source_config, head)
    eval_results = _eval_results(records.eval_metrics, datasets) + task_model_index(task_results or {})
    card_data = ModelCardData(
        model_name=model_name if eval_results else None,  # the model-index needs it; otherwise it is noise
        library_name="transformers",
        pipeline_tag=head.pipeline_tag,
        license=license,
        tags=_tags(source_config, export_target, head),
        datasets=list(datasets) or None,
        base_model=base_model,
        eval_results=eval_results or None,
    )
    load_note, load_snippet = _loading(folder, export_target, head, repo_id or "path/to/this/checkpoint")
    card = ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE),
        model_name=model_name,
        summary=_summary(source_config, export_target, head, base_model),
        architecture=_architecture_rows(source_config, folder, export_target, head),
        training=_training_rows(records),
        data_note=_data_note(records.training_data),
        data_sources=_data_rows(records.training_data, (records.state or {}).get("num_input_tokens_seen")),
        training_sources=", ".join(f"`{source}`" for source in records.sources),
        picture=_place_picture(folder, Path(picture)) if picture is not None else None,
        load_note=load_note,
        load_snippet=load_snippet,
        folding_summary=folding_summary or "No record of the conversion came with this card.",
        **evaluation_section(task_results or {}),
    )
    write_eval_result_files(folder, task_results or {}, repo_id)
    readme = folder / "README.md"
    write_text_atomically(readme, str(card))
    return readme


def card_writer(
    source: str | Path, repo_id: str | None = None, model_name: str | None = None, task_results: dict | None = None
) -> BeforeCommit:
    """The `before_commit` hook of an export from `source` that writes the card into the staged output: the run's
    records and picture (`scale_vectors.png`, as `scalevec-train` writes it) are read from `source`, so an export
    straight from a training folder gets the full card and any other export the minimal one. The card is titled
    `model_name`, else `repo_id`, else by the model's kind and size; `task_results` (a `scalevec-eval` results file)
    adds the downstream tasks and quantization differences."""
    source = Path(source)

    def write(folder: Path, result: ConversionResult) -> None:
        picture = source / RUN_PICTURE
        write_model_card(
            folder,
            export_target=result.target,
            source_config=result.source_config,
            run_dir=source,
            folding_summary=folding_summary(result),
            picture=picture if picture.is_file() else None,
            repo_id=repo_id,
            model_name=model_name,
            task_results=task_results,
        )

    return write


def folding_summary(result: ConversionResult) -> str:
    """What the conversion did, in a paragraph, from the source's strategy and the verification."""
    folded, kept = len(result.source_roles["input"]), len(result.source_roles["output"])
    dtype = str(result.dtype).removeprefix("torch.")
    text = (
        f"The source ({_strategy_name(result.source_config)} strategy) has {folded} input-role scale-vector tensors "
        f"and {kept} output-role ones. Folding multiplied every input-role scale exactly into the weights of the "
        "linear map it feeds or leaves (in float32), so they cost nothing at inference"
    )
    text += (
        "; output-role scales (output norms, QK-norms) are norm weights of the folded model."
        if kept
        else "; the model has no output-role scale."
    )
    text += f" The weights were written as `{result.target}` in {dtype}."
    if result.verification is not None:
        text += f" Verification against the source on fixed random tokens (float32): {result.verification.describe()}."
    return text


def _default_title(config: ScaleVecConfig, head: Head) -> str:
    """`ScaleVec unified dense language model, 1.8 M parameters`: what a card says when nobody named the model."""
    kind = f"mixture-of-experts ({config.num_experts} experts)" if config.num_experts else "dense"
    model = "language model" if head is CAUSAL_LM else f"model with a {head.name} head"
    total = num_parameters(config, head)
    size = f"{total / 1e9:.2f} B" if total >= 1e9 else f"{total / 1e6:.1f} M"
    return f"ScaleVec {_strategy_name(config)} {kind} {model}, {size} parameters"


def _strategy_name(config: ScaleVecConfig) -> str:
    """The preset whose three fields the config has, or "custom" when explicit fields override the preset."""
    fields = {name: getattr(config, name) for name in SCALE_FIELDS}
    return next((name for name, preset in SCALE_PRESETS.items() if preset == fields), "custom")


def _tags(config: ScaleVecConfig, export_target: str, head: Head) -> list[str]:
    tags = ["scalevec", f"scalevec-{_strategy_name(config)}", head.pipeline_tag]
    if export_target != "scalevec":
        tags.append(export_target)  # a stock architecture: the Hub and other engines know it by this name
    if config.num_experts:
        tags.append("mixture-of-experts")
    return tags


def _summary(config: ScaleVecConfig, export_target: str, head: Head, base_model: str | None) -> str:
    kind = "mixture-of-experts" if config.num_experts else "dense"
    published = (
        "a ScaleVec checkpoint that loads with `trust_remote_code=True`"
        if export_target == "scalevec"
        else f"a standard `{export_target}` checkpoint that loads with no custom code"
    )
    origin = f", imported from [{base_model}](https://huggingface.co/{base_model})" if base_model else ""
    strategy = f"the **{_strategy_name(config)}** scale-vector strategy"
    model = "decoder language model" if head is CAUSAL_LM else f"decoder with a {head.name} head"
    return f"A {kind} {model} with {strategy}{origin}, published as {published}."


def _architecture_rows(config: ScaleVecConfig, folder: Path, export_target: str, head: Head) -> list[tuple[str, str]]:
    rows = [
        ("published format", _published_format(folder, export_target)),
        ("scale strategy", f"{_strategy_name(config)} (`scale_preset={config.scale_preset}`)"),
        (
            " / ".join(f"`{name}`" for name in SCALE_FIELDS),
            " / ".join(str(getattr(config, name)) for name in SCALE_FIELDS),
        ),
        ("`output_norm` / `qk_norm`", f"{config.output_norm} / {config.qk_norm}"),
        ("layers", str(config.num_hidden_layers)),
        ("hidden size", str(config.hidden_size)),
        (
            "attention heads / key-value heads / head size",
            f"{config.num_attention_heads} / {config.num_key_value_heads} / {config.head_dim}",
        ),
        ("dense MLP intermediate size", str(config.intermediate_size)),
        ("vocabulary", str(config.vocab_size)),
        ("context length", str(config.max_position_embeddings)),
        ("tied embeddings", str(config.tie_word_embeddings)),
    ]
    return rows + _moe_rows(config) + _parameter_rows(config, folder, head)


def _moe_rows(config: ScaleVecConfig) -> list[tuple[str, str]]:
    if not config.num_experts:
        return []
    moe_layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
    routing = f"top-{config.num_experts_per_tok}, top-k renormalised: {config.norm_topk_prob}"
    return [
        ("experts", f"{config.num_experts}, {routing}"),
        ("expert intermediate size", str(config.moe_intermediate_size)),
        ("shared expert intermediate size", str(config.shared_expert_intermediate_size or "none")),
        ("MoE layers", "all" if len(moe_layers) == config.num_hidden_layers else ", ".join(map(str, moe_layers))),
    ]


def _parameter_rows(config: ScaleVecConfig, folder: Path, head: Head) -> list[tuple[str, str]]:
    total, scales = num_parameters(config, head), sum(scale_parameters(config).values())
    rows = [
        (
            "parameters of the ScaleVec model",
            f"{total:,}, {scales:,} of them in scale vectors ({100 * scales / total:.3f} %)",
        )
    ]
    with contextlib.suppress(CheckpointError):  # a folder without readable weights: the card does not guess
        rows.append(("parameters stored in this checkpoint", f"{Checkpoint(folder).num_values:,}"))
    return rows


def _published_format(folder: Path, export_target: str) -> str:
    if export_target != "scalevec":
        return f"`{export_target}` (stock transformers class)"
    folded = (read_json(folder / "config.json") or {}).get("folded")
    return "ScaleVec (remote code), " + ("folded: inference form" if folded else "scales not folded: training form")


def _training_rows(records: RunRecords) -> list[tuple[str, str]]:
    state = records.state or {}
    run = whole_run(state)  # however often the run was resumed
    rows = []
    if "global_step" in state:
        rows.append(("optimizer steps", f"{run.steps:,}"))
    if run.tokens:
        rows.append(("tokens seen", f"{run.tokens:,}"))
    if losses := logged_entries(records.log_history, "loss"):
        rows.append(("final training loss", f"{losses[-1]['loss']:.4f} (logged at step {losses[-1].get('step')})"))
    if run.mean_loss is not None:
        covered = loss_coverage(run.mean_loss_steps, run.steps)
        rows.append(("mean training loss", f"{run.mean_loss:.4f} (over {covered})"))
    if (clock := run.clock) is not None:
        where = records.summary or {}
        hardware = f" on {where['hardware']} ({where['precision']})" if "hardware" in where else ""
        rows.append(
            ("training wall time", duration_text(clock.wall_seconds) + segments_text(clock.segment_starts) + hardware)
        )
        if run.tokens_per_second:
            speed = f"{run.tokens_per_second:,.0f} tokens/s over {duration_text(clock.training_seconds)} of training"
            rows.append(("throughput", speed + _mfu(where)))
    for key, value in records.eval_metrics.items():
        if not TaskScores.is_metric(key):
            rows.append((key.replace("_", " "), _eval_value(key, value)))
    rows += _task_rows(records.eval_metrics, (records.training_data or {}).get("tasks") or {})
    for key, label in TRAINING_ARGUMENTS.items():
        value = (records.training_args or {}).get(key)
        if value not in (None, "", {}):
            rows.append((label, _warmup(value, state.get("max_steps")) if key == "warmup_steps" else f"`{value}`"))
    return rows


def _task_rows(metrics: dict[str, float], sources: dict[str, dict]) -> list[tuple[str, str]]:
    """A row per multiple-choice task of the run's last evaluation, with the items it scored of which source split
    (`sources`: `training_data.json`'s record of each task, where the run wrote one), and their mean."""
    scores = TaskScores.from_metrics(metrics)
    return [
        (
            f"mean of the {len(scores.tasks)} tasks"
            if score.items is None
            else f"{name} ({subset_text({**sources.get(name, {}), 'items': score.items})})",
            _task_figures(score),
        )
        for name, score in scores.rows()
    ]


def _task_figures(score: TaskScore) -> str:
    return (
        f"accuracy {score.acc:.4f}, length-normalised accuracy {score.acc_norm:.4f}, {score.bpb:.4f} bits per byte of "
        "the answer"
    )


def _eval_value(key: str, value: float) -> str:
    """A recorded eval metric: a count of tokens as a whole number, saying which tokens; a figure to 4 decimals."""
    if _is_count(key):
        return f"{round(value):,} predicted (every token of the blocks read but each block's first)"
    return f"{value:.4f}"


def _is_count(key: str) -> bool:
    return key.endswith("_tokens")


def _mfu(summary: dict) -> str:
    return f", model FLOPs utilisation {summary['mfu_percent']:.1f} %" if "mfu_percent" in summary else ""


def _data_note(data: dict | None) -> str | None:
    if not data:
        return None
    how = "streamed from its shards" if data.get("streaming") else "tokenised and packed once"
    masking = ", attention kept within each document" if data.get("document_masking") else ""
    note = f"Documents {how} into blocks of {data['seq_len']} tokens, tokenizer {data['tokenizer']}{masking}."
    if held_out := EvaluationRecord.read(data):
        note += f" Evaluation: {held_out.name}, {held_out.tokens:,} tokens ({held_out.blocks:,} blocks)"
        if 0 < held_out.evaluated_blocks < held_out.blocks:
            note += f", of which each evaluation read a fixed subset of {held_out.evaluated_tokens:,} tokens"
        note += "."
    return note


def _data_rows(data: dict | None, tokens_seen: int | None) -> list[tuple[str, str, str, str]]:
    """(source, documents, tokens, share of the training blocks) of each source a run trained on; with the tokens
    the run saw (`num_input_tokens_seen`), how many passes over each prepared source that share made."""
    rows = []
    for source in (data or {}).get("sources", []):
        if source.get("kind") == "streamed":
            size = (f"streamed, {source['shards']:,} shards", "")
            share = f"weight {source['weight']:g}"
        else:
            size = (f"{source['documents']:,}", f"{source['tokens']:,}")
            share = f"{100 * source['share']:.1f} %"
            if tokens_seen and source["tokens"]:
                share += f" ({source['share'] * tokens_seen / source['tokens']:.3g} passes over it)"
        part = f" ({part_note(source['shard'])})" if "shard" in source else ""
        rows.append((f"`{source['name']}`{part}", *size, share))
    return rows


def _warmup(steps: float, total_steps: int | None) -> str:
    """`warmup_steps` as transformers reads it: a number of steps, or below 1 a fraction of all steps."""
    if steps >= 1 or steps <= 0:
        return f"{int(steps):,} steps"
    if not total_steps:
        return f"{100 * steps:g} % of the optimizer steps"
    return f"{math.ceil(total_steps * steps):,} steps ({100 * steps:g} % of the {total_steps:,} optimizer steps)"


def _eval_results(metrics: dict[str, float], datasets: Sequence[str]) -> list[EvalResult]:
    """One model-index entry per recorded eval metric, on the run's held-out split."""
    return [
        EvalResult(
            task_type="text-generation",
            task_name="Causal language modeling",
            dataset_type=datasets[0] if datasets else "text",
            dataset_name=datasets[0] if datasets else "held-out split of the training data",
            dataset_split="held-out",
            metric_type=key.removeprefix("eval_"),
            metric_name=key.replace("_", " "),
            metric_value=round(value) if _is_count(key) else value,  # the records keep every figure as a float
        )
        for key, value in metrics.items()
        if not TaskScores.is_metric(key)
    ]


def _loading(folder: Path, export_target: str, head: Head, repo: str) -> tuple[str, str]:
    """(a sentence on what loading needs, the Python snippet)."""
    if export_target == "scalevec":
        model_class, extra = head.auto_class.__name__, ", trust_remote_code=True"
        note = (
            "The model code ships with the checkpoint (`configuration_scalevec.py`, `modeling_scalevec.py`, which "
            "import only `torch` and `transformers`), so ScaleVec need not be installed: `trust_remote_code=True` "
            f"runs that code. It needs transformers >= {'.'.join(map(str, MINIMUM_TRANSFORMERS))} (and says so "
            'on an older one); vLLM serves it with its Transformers backend (`model_impl="transformers"`).'
        )
    else:
        architectures = (read_json(folder / "config.json") or {}).get("architectures") or ["AutoModelForCausalLM"]
        model_class, extra = architectures[0], ""
        note = (
            f"A standard `{export_target}` checkpoint: the stock `transformers` class loads it, with no custom code."
        )
    has_tokenizer = any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))
    imports = sorted({model_class, "AutoTokenizer"} if has_tokenizer else {model_class})
    lines = [
        f"from transformers import {', '.join(imports)}",
        "",
        f'model = {model_class}.from_pretrained("{repo}"{extra})',
    ]
    if has_tokenizer:
        # AutoTokenizer reads config.json too, so without the flag it would stop and ask whether to run the code.
        lines.append(f'tokenizer = AutoTokenizer.from_pretrained("{repo}"{extra})')
    return note, "\n".join(lines)


def _place_picture(folder: Path, picture: Path) -> str:
    """Copy the picture into the folder (unless it is there already) and return its path relative to the card."""
    if not picture.is_file():
        raise FileNotFoundError(f"The picture for the model card, {picture}, does not exist.")
    if picture.resolve().is_relative_to(folder.resolve()):
        return picture.resolve().relative_to(folder.resolve()).as_posix()
    shutil.copyfile(picture, folder / picture.name)
    return picture.name
