"""The conversion pipeline: read a checkpoint unit by unit, fold it, place it into the output strategy, rename it
into the output format, and stream it into a staged folder that is verified and then renamed into place.

Everything that can be refused is refused before the staging folder exists: an unreadable source, tensors that do
not match the source's config, a target format that cannot express the model. Only NaN or Inf values, which take
reading every value to find, are refused as the tensors stream; the staging folder is removed then.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from transformers.utils.hub import convert_file_size_to_int

from ..configuration_scalevec import SCALE_FIELDS, SCALE_PRESETS, ScaleVecConfig
from .checkpoint import Checkpoint, TensorInfo, count_nonfinite
from .errors import CheckpointError, TargetError, VerificationError
from .fold import fold_unit
from .formats import FORMATS, Format, StockFormat, format_of, scalevec_view
from .heads import CAUSAL_LM, Head, head_of
from .layout import LM_HEAD
from .meta_model import meta_state
from .place import place_unit
from .side_files import copy_side_files, write_config, write_remote_code
from .staging import StagedFolder, check_destination
from .units import EMBED, group_by_unit
from .verify import Comparison, compare_checkpoints
from .writer import ShardedWriter

logger = logging.getLogger("scalevec.convert")

DEFAULT_MAX_SHARD_SIZE = "5GB"  # memory does not depend on it (see writer.py); 5 GB keeps files Hub-friendly
OUTPUT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Tensors = dict[str, torch.Tensor]


@dataclass
class ConversionResult:
    """What a conversion wrote. `verification` is None with `verify=False`."""

    destination: Path
    target: str
    config: ScaleVecConfig  # of the output
    source_config: ScaleVecConfig  # of the source, as a ScaleVec model (a stock source: its ScaleVec view)
    source_roles: dict[str, list[str]]  # the source's scale-vector names by role (`scale_vector_roles()`)
    dtype: torch.dtype
    files: list[str]
    num_tensors: int
    total_bytes: int
    verification: Comparison | None = None
    warnings: list[str] = field(default_factory=list)


# Called with the staging folder and the result once everything is written and verified, just before the commit:
# what it adds to the folder is committed with the rest (e.g. a model card).
BeforeCommit = Callable[[Path, ConversionResult], None]


@dataclass(frozen=True)
class CheckedSource:
    """A source checkpoint whose tensors were checked against its config: exactly the names and shapes it needs."""

    checkpoint: Checkpoint
    format: Format
    head: Head
    config: ScaleVecConfig  # as a ScaleVec model (a stock source: its ScaleVec view)
    roles: dict[str, list[str]]  # its scale-vector names by role (`scale_vector_roles()`)
    units: dict[str, list[str]]  # its tensor names on disk, by unit, in reading order


def open_source(path: str | Path) -> CheckedSource:
    """The checkpoint at `path`, refused (`CheckpointError`) unless its tensors are what its config describes."""
    checkpoint = Checkpoint(path)
    fmt = format_of(checkpoint.model_type)
    head = head_of(checkpoint.config, checkpoint.path / "config.json")
    config = scalevec_view(checkpoint, fmt)
    state, roles = meta_state(config, head)
    units = _on_disk(fmt, head, config, _by_unit(state, config))
    expected = {key: tuple(t.shape) for tensors in units.values() for key, t in tensors.items()}
    # Some writers store a tied LM head anyway.
    ignored = [LM_HEAD] if head is CAUSAL_LM and config.tie_word_embeddings else []
    checkpoint.check_tensors(expected, f"its config ({fmt.name})", ignored)
    return CheckedSource(
        checkpoint=checkpoint,
        format=fmt,
        head=head,
        config=config,
        roles=roles,
        units={unit: list(tensors) for unit, tensors in units.items()},
    )


@dataclass
class _Job:
    """Everything decided before anything is written."""

    source: CheckedSource
    output_config: ScaleVecConfig
    target: Format
    output_units: dict[str, Tensors]  # the output's meta tensors by unit, with ScaleVec names
    output_scales: set[str]  # the output's scale-vector names
    plan: list[tuple[str, tuple[int, ...]]]  # the output's tensors on disk (name, shape), in writing order


def _by_unit(state: Tensors, config: ScaleVecConfig) -> dict[str, Tensors]:
    return {
        unit: {key: state[key] for key in keys}
        for unit, keys in group_by_unit(state, config.num_hidden_layers).items()
    }


def _on_disk(fmt: Format, head: Head, config: ScaleVecConfig, units: dict[str, Tensors]) -> dict[str, Tensors]:
    return {unit: fmt.to_disk(unit, tensors, config, head) for unit, tensors in units.items()}


@dataclass(frozen=True)
class Strategy:
    """The scale-vector strategy of an imported model: a preset, and explicit fields that override it."""

    preset: str = "unified"
    norm_scale: str | None = None
    linear_scale: str | None = None
    scale_param: str | None = None


def folded_config(config: ScaleVecConfig) -> ScaleVecConfig:
    """The config of the folded (inference) form of `config`: the standard preset's layout, `folded=True`."""
    return _with_strategy(config, Strategy(preset="standard"), folded=True)


def _with_strategy(config: ScaleVecConfig, strategy: Strategy, folded: bool = False) -> ScaleVecConfig:
    fields = config.to_dict()
    for name in ("architectures", "auto_map", "dtype", "transformers_version"):
        fields.pop(name, None)
    # Every strategy field is replaced: a None one is filled from the new preset, not kept from `config`.
    overrides = {name: getattr(strategy, name) for name in SCALE_FIELDS}
    return ScaleVecConfig.from_dict({**fields, **overrides, "scale_preset": strategy.preset, "folded": folded})


def _prepare(source: str | Path, target: Format, output_config_of: Callable[[ScaleVecConfig], ScaleVecConfig]) -> _Job:
    opened = open_source(source)
    output_config = output_config_of(opened.config)
    _check_target(target, opened, output_config)
    output_state, output_roles = meta_state(output_config, opened.head)
    output_units = _by_unit(output_state, output_config)
    plan = [
        (key, tuple(t.shape))
        for tensors in _on_disk(target, opened.head, output_config, output_units).values()
        for key, t in tensors.items()
    ]
    return _Job(
        source=opened,
        output_config=output_config,
        target=target,
        output_units=output_units,
        output_scales=set(output_roles["input"] + output_roles["output"]),
        plan=plan,
    )


def _check_target(target: Format, source: CheckedSource, output_config: ScaleVecConfig) -> None:
    """Refuse (`TargetError`) a target format that cannot express the output model, head included."""
    head = source.head
    if target.architecture(head) is None:
        raise TargetError(
            f"cannot export a {head.name} model (*{head.suffix}) to {target.name}: transformers "
            f"{transformers.__version__} has no {head.name} head for {target.name}. "
            "`--to scalevec` (remote code) always works."
        )
    blockers = target.blockers(output_config)
    if blockers:
        raise TargetError(
            f"cannot export to {target.name}: the model has {'; and '.join(blockers)}. "
            "`--to scalevec` (remote code) always works."
        )


def _convert_unit(job: _Job, unit: str, source: Tensors) -> tuple[Tensors, dict[str, TensorInfo]]:
    """The output tensors of the unit whose source tensors are `source`, and where those that pass through
    unchanged lie in the source."""
    head = job.source.head
    tensors = job.source.format.from_disk(unit, source, job.source.config, head)
    folded = fold_unit(unit, tensors, job.source.config.hidden_size)
    placed = place_unit(unit, folded, job.output_units[unit], job.output_scales)
    output = job.target.to_disk(unit, placed, job.output_config, head)
    origin = {id(tensor): job.source.checkpoint.tensors[name] for name, tensor in source.items()}
    return output, {name: origin[id(tensor)] for name, tensor in output.items() if id(tensor) in origin}


def _check_finite(checkpoint: Checkpoint, tensors: Tensors, allow_nonfinite: bool) -> None:
    """Refuse (`CheckpointError`) tensors of `checkpoint` that hold NaN or Inf, naming the first and its count;
    with `allow_nonfinite`, only warn. The verification alone would miss a NaN in an embedding row or an expert
    that its random tokens never reach."""
    for name, tensor in tensors.items():
        count = count_nonfinite(tensor)
        if not count:
            continue
        found = f"tensor {name} in {checkpoint.tensors[name].file} holds {count:,} non-finite values (NaN or Inf)"
        if not allow_nonfinite:
            raise CheckpointError(f"{found}; pass --allow-nonfinite (allow_nonfinite=True) to convert it as it is")
        logger.warning("%s; converted as it is (--allow-nonfinite)", found)


@dataclass(frozen=True)
class OutputOptions:
    """How to write an output. `dtype`: of the written tensors (a torch dtype or its name; default: the source's);
    folding itself always runs in float32. `max_shard_size`: bytes or a size such as "500MB". `verify`: compare the
    logits of the output with the source's (see verify.py), against `atol` if given. `before_commit`: see
    `BeforeCommit`. `allow_nonfinite`: convert tensors that hold NaN or Inf (with a warning) instead of refusing
    them."""

    dtype: torch.dtype | str | None = None
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    overwrite: bool = False
    verify: bool = True
    atol: float | None = None
    before_commit: BeforeCommit | None = None
    allow_nonfinite: bool = False


def export_checkpoint(
    source: str | Path, destination: str | Path, target: str = "scalevec", options: OutputOptions = OutputOptions()
) -> ConversionResult:
    """Fold `source` (ScaleVec or a supported stock checkpoint) and write it as `target`: "scalevec" (folded, with
    remote code) or one of the stock formats that can express the model."""
    if target not in FORMATS:
        raise TargetError(f"unknown target {target!r}; choose one of {', '.join(FORMATS)}")
    return _run(_prepare(source, FORMATS[target], folded_config), destination, options)


def fold_checkpoint(
    source: str | Path, destination: str | Path, options: OutputOptions = OutputOptions()
) -> ConversionResult:
    """The folded ScaleVec checkpoint (inference form) with its remote code: `export_checkpoint(..., "scalevec")`."""
    return export_checkpoint(source, destination, "scalevec", options)


def import_checkpoint(
    source: str | Path,
    destination: str | Path,
    strategy: Strategy = Strategy(),
    options: OutputOptions = OutputOptions(),
) -> ConversionResult:
    """A stock (or ScaleVec) checkpoint as a ScaleVec model of `strategy`, computing the same function, for
    continued pretraining: norm weights become the scales the strategy has, every other scale starts at one."""

    def output_config(config: ScaleVecConfig) -> ScaleVecConfig:
        if strategy.preset not in SCALE_PRESETS:
            raise TargetError(f"unknown preset {strategy.preset!r}; choose one of {', '.join(SCALE_PRESETS)}")
        try:
            imported = _with_strategy(config, strategy)
        except ValueError as error:
            raise TargetError(f"invalid strategy: {error}") from error
        if imported.norm_scale == "none" and imported.tie_word_embeddings:
            raise TargetError(
                "norm_scale='none' leaves the final norm without a scale, and with tied embeddings its weight cannot "
                "move into the LM head; choose another norm_scale"
            )
        return imported

    return _run(_prepare(source, FORMATS["scalevec"], output_config), destination, options)


def _output_dtype(job: _Job, requested: torch.dtype | str | None) -> torch.dtype:
    if requested is None:
        (embeddings,) = job.source.units[EMBED]  # on disk, where a head may keep it under another prefix
        return job.source.checkpoint.tensors[embeddings].dtype
    if isinstance(requested, torch.dtype) and requested in OUTPUT_DTYPES.values():
        return requested
    if requested in OUTPUT_DTYPES:
        return OUTPUT_DTYPES[requested]
    raise TargetError(f"unsupported output dtype {requested!r}; choose one of {', '.join(OUTPUT_DTYPES)}")


def _shard_bytes(size: int | str) -> int:
    try:
        return convert_file_size_to_int(size)
    except ValueError as error:
        raise TargetError(f"invalid max shard size {size!r}: use bytes or a size like '500MB'") from error


def _run(job: _Job, destination: str | Path, options: OutputOptions) -> ConversionResult:
    destination = Path(destination)
    check_destination(destination.absolute(), options.overwrite)
    dtype, max_bytes = _output_dtype(job, options.dtype), _shard_bytes(options.max_shard_size)
    warnings = job.target.warnings(job.output_config)
    for warning in warnings:
        logger.warning(warning)
    source = job.source
    logger.info(
        "converting %s (%s) to %s in %s", source.checkpoint.path, source.format.name, job.target.name, destination
    )
    with StagedFolder(destination, options.overwrite) as staged:
        _write(job, staged.path, dtype, max_bytes, allow_nonfinite=options.allow_nonfinite)
        files, total_bytes = _listing(staged.path)
        result = ConversionResult(
            destination=destination,
            target=job.target.name,
            config=job.output_config,
            source_config=source.config,
            source_roles=source.roles,
            dtype=dtype,
            files=files,
            num_tensors=len(job.plan),
            total_bytes=total_bytes,
            warnings=warnings,
        )
        if options.verify:
            result.verification = _verify(source.checkpoint.path, staged.path, options.atol)
        if options.before_commit is not None:
            options.before_commit(staged.path, result)
            result.files, result.total_bytes = _listing(staged.path)  # with what the hook added
        staged.commit()
    return result


def _write(job: _Job, folder: Path, dtype: torch.dtype, max_shard_bytes: int, *, allow_nonfinite: bool) -> None:
    checkpoint = job.source.checkpoint
    with ShardedWriter(folder, job.plan, dtype, max_shard_bytes) as writer:
        for unit, names in job.source.units.items():
            source = checkpoint.read(names)
            _check_finite(checkpoint, source, allow_nonfinite)
            writer.write(*_convert_unit(job, unit, source))
        writer.close()
    write_config(folder, job.target, job.output_config, dtype, job.source.head)
    if not isinstance(job.target, StockFormat):
        write_remote_code(folder)
    copy_side_files(checkpoint.path, folder, job.output_config)


def _listing(folder: Path) -> tuple[list[str], int]:
    """The names of the files in `folder` and their total size in bytes."""
    files = sorted(folder.iterdir())
    return [p.name for p in files], sum(p.stat().st_size for p in files)


def _verify(source: Path, output: Path, atol: float | None) -> Comparison:
    # Not logged: the caller reports the comparison it gets back (`ConversionResult.verification`).
    comparison = compare_checkpoints(source, output, atol)
    if not comparison.passed:
        raise VerificationError(f"the output does not compute what its source does: {comparison.describe()}")
    return comparison
