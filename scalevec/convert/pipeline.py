"""The conversion pipeline: read a checkpoint unit by unit, fold it, place it into the output strategy, rename it
into the output format, and stream it into a staged folder that is verified and then renamed into place.

Everything that can be refused is refused before the staging folder exists: an unreadable source, tensors that do
not match the source's config, a target format that cannot express the model.
"""

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.utils.hub import convert_file_size_to_int

from ..configuration_scalevec import SCALE_PRESETS, ScaleVecConfig
from ..modeling_scalevec import ScaleVecForCausalLM
from .checkpoint import Checkpoint, TensorInfo
from .errors import TargetError, VerificationError
from .fold import fold_unit
from .formats import FORMATS, Format, StockFormat, format_of, scalevec_view
from .layout import EMBEDDINGS, LM_HEAD
from .place import place_unit
from .side_files import copy_side_files, write_config, write_remote_code
from .staging import StagedFolder, check_destination
from .units import group_by_unit
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


@dataclass
class _Job:
    """Everything decided before anything is written."""

    checkpoint: Checkpoint
    source_format: Format
    source_config: ScaleVecConfig
    source_roles: dict[str, list[str]]
    output_config: ScaleVecConfig
    target: Format
    source_units: dict[str, list[str]]
    output_units: dict[str, Tensors]
    output_scales: set[str]
    plan: list[tuple[str, tuple[int, ...]]]


def meta_state(config: ScaleVecConfig) -> tuple[Tensors, dict[str, list[str]]]:
    """The state dict (as saved: no tied LM head) and the scale-vector names by role of a ScaleVec model of
    `config`, on the meta device: the layout of a checkpoint, with no memory spent on it."""
    state, roles = _meta_state(json.dumps(config.to_dict(), sort_keys=True))
    return dict(state), {role: list(names) for role, names in roles.items()}


@functools.lru_cache(maxsize=4)  # a conversion and its model card ask for the same layouts
def _meta_state(config_json: str) -> tuple[Tensors, dict[str, list[str]]]:
    with torch.device("meta"):
        model = ScaleVecForCausalLM(ScaleVecConfig.from_dict(json.loads(config_json)))  # built from a copy
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        del state[LM_HEAD]
    return state, model.scale_vector_roles()


def _by_unit(state: Tensors, config: ScaleVecConfig) -> dict[str, Tensors]:
    return {
        unit: {key: state[key] for key in keys}
        for unit, keys in group_by_unit(state, config.num_hidden_layers).items()
    }


def _on_disk(fmt: Format, config: ScaleVecConfig, units: dict[str, Tensors]) -> dict[str, Tensors]:
    return {unit: fmt.to_disk(unit, tensors, config) for unit, tensors in units.items()}


def folded_config(config: ScaleVecConfig) -> ScaleVecConfig:
    """The config of the folded (inference) form of `config`."""
    return _with_strategy(config, "standard", "shared", "none", "direct", folded=True)


def _with_strategy(config, preset, norm_scale=None, linear_scale=None, scale_param=None, folded=False):
    fields = config.to_dict()
    for name in ("architectures", "auto_map", "dtype", "transformers_version"):
        fields.pop(name, None)
    strategy = {"norm_scale": norm_scale, "linear_scale": linear_scale, "scale_param": scale_param}
    return ScaleVecConfig.from_dict({**fields, **strategy, "scale_preset": preset, "folded": folded})


def _prepare(source: str | Path, target: Format, output_config_of: Callable[[ScaleVecConfig], ScaleVecConfig]) -> _Job:
    checkpoint = Checkpoint(source)
    source_format = format_of(checkpoint.model_type)
    source_config = scalevec_view(checkpoint, source_format)
    output_config = output_config_of(source_config)
    blockers = target.blockers(output_config)
    if blockers:
        raise TargetError(
            f"cannot export to {target.name}: the model has {'; and '.join(blockers)}. "
            "`--to scalevec` (remote code) always works."
        )
    source_state, source_roles = meta_state(source_config)
    source_units = _on_disk(source_format, source_config, _by_unit(source_state, source_config))
    expected = {key: tuple(t.shape) for tensors in source_units.values() for key, t in tensors.items()}
    ignored = [LM_HEAD] if source_config.tie_word_embeddings else []  # some writers store a tied head anyway
    checkpoint.check_tensors(expected, f"its config ({source_format.name})", ignored)
    output_state, output_roles = meta_state(output_config)
    output_units = _by_unit(output_state, output_config)
    plan = [
        (key, tuple(t.shape))
        for tensors in _on_disk(target, output_config, output_units).values()
        for key, t in tensors.items()
    ]
    return _Job(
        checkpoint,
        source_format,
        source_config,
        source_roles,
        output_config,
        target,
        {unit: list(tensors) for unit, tensors in source_units.items()},
        output_units,
        set(output_roles["input"] + output_roles["output"]),
        plan,
    )


def _convert_unit(job: _Job, unit: str) -> tuple[Tensors, dict[str, TensorInfo]]:
    """The unit's output tensors, and where those that pass through unchanged lie in the source."""
    source = job.checkpoint.read(job.source_units[unit])
    tensors = job.source_format.from_disk(unit, source, job.source_config)
    folded = fold_unit(unit, tensors, job.source_config.hidden_size)
    placed = place_unit(unit, folded, job.output_units[unit], job.output_scales)
    output = job.target.to_disk(unit, placed, job.output_config)
    origin = {id(tensor): job.checkpoint.tensors[name] for name, tensor in source.items()}
    return output, {name: origin[id(tensor)] for name, tensor in output.items() if id(tensor) in origin}


@dataclass(frozen=True)
class OutputOptions:
    """How to write an output. `dtype`: of the written tensors (a torch dtype or its name; default: the source's);
    folding itself always runs in float32. `max_shard_size`: bytes or a size such as "500MB". `verify`: compare the
    logits of the output with the source's (see verify.py), against `atol` if given. `before_commit`: see
    `BeforeCommit`."""

    dtype: torch.dtype | str | None = None
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE
    overwrite: bool = False
    verify: bool = True
    atol: float | None = None
    before_commit: BeforeCommit | None = None


@dataclass(frozen=True)
class Strategy:
    """The scale-vector strategy of an imported model: a preset, and explicit fields that override it."""

    preset: str = "unified"
    norm_scale: str | None = None
    linear_scale: str | None = None
    scale_param: str | None = None


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
            imported = _with_strategy(
                config, strategy.preset, strategy.norm_scale, strategy.linear_scale, strategy.scale_param
            )
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
        return job.checkpoint.tensors[EMBEDDINGS].dtype
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
    logger.info(
        "converting %s (%s) to %s in %s", job.checkpoint.path, job.source_format.name, job.target.name, destination
    )
    with StagedFolder(destination, options.overwrite) as staged:
        _write(job, staged.path, dtype, max_bytes)
        written = sorted(staged.path.iterdir())
        result = ConversionResult(
            destination=destination,
            target=job.target.name,
            config=job.output_config,
            source_config=job.source_config,
            source_roles=job.source_roles,
            dtype=dtype,
            files=[p.name for p in written],
            num_tensors=len(job.plan),
            total_bytes=sum(p.stat().st_size for p in written),
            warnings=warnings,
        )
        if options.verify:
            result.verification = _verify(job.checkpoint.path, staged.path, options.atol)
        if options.before_commit is not None:
            options.before_commit(staged.path, result)
        staged.commit()
    return result


def _write(job: _Job, folder: Path, dtype: torch.dtype, max_shard_bytes: int) -> None:
    with ShardedWriter(folder, job.plan, dtype, max_shard_bytes) as writer:
        for unit in job.source_units:
            writer.write(*_convert_unit(job, unit))
        writer.close()
    write_config(folder, job.target, job.output_config, dtype)
    if not isinstance(job.target, StockFormat):
        write_remote_code(folder)
    copy_side_files(job.checkpoint.path, folder, job.output_config)


def _verify(source: Path, output: Path, atol: float | None) -> Comparison:
    comparison = compare_checkpoints(source, output, atol)
    logger.info("verification: %s", comparison.describe())
    if not comparison.passed:
        raise VerificationError(f"the output does not compute what its source does: {comparison.describe()}")
    return comparison
