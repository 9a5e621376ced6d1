"""What `scalevec-train --resume` continues from. A checkpoint is judged by its content, not by its name, since
folders written before checkpoints were atomic (or by other tools) may be partial: it is complete when its
`trainer_state.json` parses, its weights are readable, and its optimizer and scheduler states are there.

The newest complete checkpoint wins; newer incomplete ones are renamed `incomplete-checkpoint-N` (never deleted)
so that neither `--resume` nor `save_total_limit` looks at them again. A `checkpoint-N` that never was a checkpoint
(a file, or a folder of someone's own files) is not touched: `--resume` refuses the folder, naming it."""

import fnmatch
import json
import re
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from safetensors import SafetensorError, safe_open
from transformers import PretrainedConfig
from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME, TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_NAME

from .run_lock import LOCK_NAME
from .trainer import STAGING_SUFFIX

SET_ASIDE_PREFIX = "incomplete-"
WEIGHTS_ONLY_FLAG = "--resume-weights-only"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
# Config entries that describe no part of the model: transformers' bookkeeping, and `use_cache`, which training sets.
_NOT_THE_MODEL = {*PretrainedConfig().to_dict(), "use_cache"}
# What a checkpoint writer puts into `checkpoint-N` (the Trainer, accelerate's FSDP, DeepSpeed, PEFT): a folder
# holding files but none of these was never a checkpoint.
_CHECKPOINT_FILES = (
    TRAINER_STATE_NAME,
    TRAINING_ARGS_NAME,
    CONFIG_NAME,
    "model*.safetensors*",
    "pytorch_model*.bin*",
    "adapter_*",
    "optimizer*",
    "scheduler*",
    "rng_state*",
    "scaler.pt",
    "global_step*",
)
# What an interrupted run leaves besides complete checkpoints: a folder holding only these has nothing to resume.
_LEFTOVERS = (
    f".{PREFIX_CHECKPOINT_DIR}-*{STAGING_SUFFIX}",
    f".{PREFIX_CHECKPOINT_DIR}-*.deleting",
    f".result{STAGING_SUFFIX}",
)


@dataclass
class CheckpointContent:
    path: Path
    step: int = 0
    max_steps: int = 0
    broken: str | None = None  # why nothing can be resumed from it
    missing: list[str] = field(default_factory=list)  # optimizer / scheduler states it lacks

    @property
    def complete(self) -> bool:
        return self.broken is None and not self.missing

    def problem(self) -> str:
        return self.broken or f"{' and '.join(self.missing)} missing"


def checkpoint_content(folder: Path) -> CheckpointContent:
    content = CheckpointContent(folder)
    try:
        state = _read_state(folder / TRAINER_STATE_NAME)
        content.step, content.max_steps = int(state["global_step"]), int(state.get("max_steps") or 0)
        _check_weights(folder)
        content.missing = [name for name in (OPTIMIZER_NAME, SCHEDULER_NAME) if not _state_present(folder, name)]
    except _Unusable as reason:
        content.broken = str(reason)
    return content


class _Unusable(Exception):
    pass


def _read_state(file: Path) -> dict:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _Unusable(f"{file.name} missing") from None
    except (ValueError, UnicodeDecodeError):
        raise _Unusable(f"{file.name} unreadable (empty or cut short)") from None


def _check_weights(folder: Path) -> None:
    if (folder / SAFE_WEIGHTS_INDEX_NAME).is_file():
        index = _read_state(folder / SAFE_WEIGHTS_INDEX_NAME)
        files = sorted({folder / name for name in index.get("weight_map", {}).values()})
    elif (folder / SAFE_WEIGHTS_NAME).is_file():
        files = [folder / SAFE_WEIGHTS_NAME]
    elif (folder / WEIGHTS_NAME).is_file():
        _check_torch_file(folder / WEIGHTS_NAME)
        return
    else:
        raise _Unusable(f"no weights ({SAFE_WEIGHTS_NAME})")
    for file in files:
        try:
            with safe_open(file, framework="pt"):  # checks the header against the file's size
                pass
        except (SafetensorError, OSError):
            raise _Unusable(f"{file.name} unreadable (missing or cut short)") from None


def _state_present(folder: Path, name: str) -> bool:
    """A state file `torch.save` finished writing (`.pt`, or `.bin` from accelerate under FSDP); sharded states
    (FSDP's `optimizer_0/`, DeepSpeed's `global_step*/`) are taken on their names."""
    stem = name.removesuffix(".pt")
    for file in (folder / name, folder / f"{stem}.bin"):
        if file.is_file():
            _check_torch_file(file)
            return True
    return any(folder.glob(f"{stem}_*")) or (stem == "optimizer" and any(folder.glob("global_step*")))


def _check_torch_file(file: Path) -> None:
    # `torch.save` writes a zip archive whose directory comes last: a file cut short has none.
    if not zipfile.is_zipfile(file):
        raise _Unusable(f"{file.name} unreadable (empty or cut short)")


def checkpoints_newest_first(output_dir: Path) -> list[CheckpointContent]:
    """Every `checkpoint-N` in `output_dir`, inspected, newest first; one that no checkpoint writer made is refused
    (it is not ours to set aside, or for `save_total_limit` to delete)."""
    folders = [path for path in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if _CHECKPOINT.match(path.name)]
    folders.sort(key=lambda path: int(_CHECKPOINT.match(path.name).group(1)), reverse=True)
    for folder in folders:
        _refuse_if_foreign(folder)
    return [checkpoint_content(folder) for folder in folders]


def refuse_without_state(checkpoint: CheckpointContent) -> None:
    """Resuming without the optimizer or scheduler state would silently change the run: refuse unless asked."""
    raise ValueError(
        f"{checkpoint.path / checkpoint.missing[0]} is missing: resuming from {checkpoint.path.name} would restart "
        f"the optimizer and the learning-rate schedule, so the losses would differ from an uninterrupted run; "
        f"pass {WEIGHTS_ONLY_FLAG} to restart from its weights anyway"
    )


def check_explicit_checkpoint(folder: Path, weights_only: bool) -> CheckpointContent:
    """`--resume-from-checkpoint DIR`: that checkpoint, or a clear refusal."""
    checkpoint = checkpoint_content(folder)
    if checkpoint.broken:
        raise ValueError(f"--resume-from-checkpoint {folder}: cannot resume from it ({checkpoint.broken})")
    if checkpoint.missing and not weights_only:
        refuse_without_state(checkpoint)
    return checkpoint


def choose_checkpoint(output_dir: Path, weights_only: bool) -> CheckpointContent | None:
    """The newest checkpoint to resume from (None: nothing was saved yet, start from step 0), after setting newer
    incomplete ones aside. With `weights_only`, a checkpoint lacking optimizer or scheduler state qualifies."""
    checkpoints = checkpoints_newest_first(output_dir)
    usable = [c for c in checkpoints if c.complete or (weights_only and c.broken is None)]
    if not usable:
        without_state = [c for c in checkpoints if c.broken is None]
        if without_state:
            refuse_without_state(without_state[0])
        if _holds_only_leftovers(output_dir, checkpoints):
            _set_aside(checkpoints)
            return None
        raise ValueError(f"--resume: no checkpoint-* folder in {output_dir} holds a complete checkpoint")
    chosen = usable[0]
    _set_aside(checkpoints[: checkpoints.index(chosen)])  # the newer ones
    return chosen


def _refuse_if_foreign(path: Path) -> None:
    """A `checkpoint-N` that is a file, or a folder of files none of which a checkpoint holds, was never one (an
    empty folder may be what a writer killed at once left)."""
    if path.is_dir():
        files = sorted(child.name for child in path.iterdir())
        if not files or any(fnmatch.fnmatch(name, pattern) for name in files for pattern in _CHECKPOINT_FILES):
            return
        shown = ", ".join(files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
        content = f"it holds {shown}, and no trainer state, weights or optimizer state"
    else:
        content = "a file, not a folder"
    raise ValueError(
        f"--resume: {path} is not a checkpoint ({content}): move it out of {path.parent}, or choose another "
        "--output-dir"
    )


def _holds_only_leftovers(output_dir: Path, checkpoints: list[CheckpointContent]) -> bool:
    """True when `output_dir` holds only what an interrupted run leaves before its first complete save: then there
    is nothing to lose by starting over. A folder with anything else in it may be the wrong folder."""
    if not output_dir.exists():
        return True
    expected = {c.path for c in checkpoints} | {p for pattern in _LEFTOVERS for p in output_dir.glob(pattern)}
    expected |= set(output_dir.glob(f"{SET_ASIDE_PREFIX}{PREFIX_CHECKPOINT_DIR}-*")) | {output_dir / LOCK_NAME}
    return all(path in expected for path in output_dir.iterdir())


def _set_aside(checkpoints: list[CheckpointContent]) -> None:
    if not checkpoints:
        return
    moves = []
    for checkpoint in checkpoints:
        target = _free_name(checkpoint.path.with_name(SET_ASIDE_PREFIX + checkpoint.path.name))
        checkpoint.path.rename(target)
        moves.append(f"{checkpoint.path.name} ({checkpoint.problem()}) -> {target.name}")
    print(f"scalevec-train: warning: set aside incomplete checkpoints, kept: {'; '.join(moves)}", flush=True)


def _free_name(path: Path) -> Path:
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


def remove_leftovers(output_dir: Path) -> None:
    """Delete the staging and half-deleted folders of killed runs: hidden, and never a checkpoint."""
    for pattern in _LEFTOVERS:
        for folder in output_dir.glob(pattern):
            shutil.rmtree(folder, ignore_errors=True)


def resumed_model_config(built: PretrainedConfig, checkpoint: Path, given: dict[str, set[str]]) -> PretrainedConfig:
    """The model config to resume `checkpoint` with: `built` (from the flags) where it is the run's; else the run's
    own (its `config.json`) where every flag that sets a differing field was left at its default (`given` maps each
    flag given, as typed, to the fields it sets); else a `ValueError` naming the given flags that contradict the run.
    A checkpoint with no config of this model's type (a PEFT adapter's) leaves `built` as it is."""
    try:
        recorded = type(built).from_pretrained(checkpoint)
    except (OSError, ValueError):
        return built
    ours, theirs = built.to_dict(), recorded.to_dict()
    differing = [key for key in ours if key not in _NOT_THE_MODEL and ours[key] != theirs.get(key)]
    contradicting = {flag: [key for key in differing if key in fields] for flag, fields in given.items()}
    if named := [f"{flag} sets {_values(keys, ours, theirs)}" for flag, keys in contradicting.items() if keys]:
        raise ValueError(
            f"--resume: {'; '.join(named)}: {'it contradicts' if len(named) == 1 else 'they contradict'} the run's "
            f"model ({checkpoint / CONFIG_NAME}); leave {'it' if len(named) == 1 else 'them'} out to resume the run "
            "as it was, or choose another --output-dir"
        )
    if differing:
        restored = ", ".join(f"{key} {theirs.get(key)} (not {ours[key]})" for key in differing)
        print(f"scalevec-train: resuming the run's model as {checkpoint / CONFIG_NAME} records it: {restored}")
        return recorded
    return built


def _values(keys: list[str], ours: dict, theirs: dict) -> str:
    return ", ".join(f"{key} {ours[key]} (the run's {theirs.get(key)})" for key in keys)
