"""Several token budgets from one run: `--decay-at 0.25,0.5,1` with the warmup-stable-decay schedule.

A WSD cooldown branched from the stable phase ends where a separate run of that budget ends (Hägele et al. 2024),
so one run through its stable phase gives every budget. With --max-steps T and `num_decay_steps` c, the decay ratio
is r = c / T and a budget of fraction f has B = round(f·T) steps, the last round(r·B) of them its cooldown. The main
run trains the whole budget T as without --decay-at; at the step where a smaller budget's cooldown starts
(B - round(r·B), inside the main run's stable phase), it saves a checkpoint and links it into the branch's folder,
`OUTPUT/budget-F`. After the main run each branch resumes from there with --max-steps B (the project's own --resume:
data position, optimizer, scheduler and RNG states) and trains its cooldown only. Up to its branch step a branch's
learning rate is the main run's; from there it is what a separate run of B steps with the same decay ratio and the
same warmup (in steps) would have had, so its losses are that run's.
"""

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SchedulerType

from ..atomic import commit_folder, writes_into
from ..run_records import BRANCH_PREFIX, finished_step
from .resume import checkpoint_content
from .study.records import DIVERGED_FILE
from .trainer import STAGING_SUFFIX

FLAG = "--decay-at"
_SCHEDULER = SchedulerType.WARMUP_STABLE_DECAY


@dataclass(frozen=True)
class Budget:
    """One budget branched from the main run: `fraction` of its --max-steps."""

    fraction: float
    max_steps: int  # round(fraction x the main run's steps)
    decay_steps: int  # its cooldown: round(decay ratio x max_steps)

    @property
    def branch_step(self) -> int:
        """The main run's step after which this budget's cooldown starts: the checkpoint it resumes from."""
        return self.max_steps - self.decay_steps

    def folder(self, output_dir: str | Path) -> Path:
        return Path(output_dir) / f"{BRANCH_PREFIX}{self.fraction:g}"


def decay_fractions(text: str | None) -> list[float]:
    """The fractions of `--decay-at`, sorted and without repeats; [] without the flag."""
    if text is None:
        return []
    try:
        fractions = sorted({float(item) for item in text.split(",") if item.strip()})
    except ValueError:
        fractions = []
    if not fractions or not all(0 < f <= 1 for f in fractions):  # `not <=` refuses NaN too
        raise ValueError(f"{FLAG} must be comma-separated fractions of --max-steps in (0, 1]; got {text!r}")
    return fractions


def plan_budgets(args: TrainingArguments, max_steps: int | None = None) -> list[Budget]:
    """The budgets to branch from a run of `args` (of `max_steps` steps where given, else --max-steps), smallest
    first: every fraction of --decay-at below 1 (the main run itself is the budget 1). [] without --decay-at. A
    `ValueError` naming the flag where the schedule cannot give them."""
    fractions = decay_fractions(getattr(args, "decay_at", None))
    if not fractions:
        return []
    steps = args.max_steps if max_steps is None else max_steps
    if SchedulerType(args.lr_scheduler_type) != _SCHEDULER:
        raise ValueError(
            f"{FLAG} branches cooldowns from the stable phase of --lr-scheduler-type {_SCHEDULER.value}; got "
            f"{SchedulerType(args.lr_scheduler_type).value}"
        )
    if steps <= 0:
        raise ValueError(f"{FLAG} takes fractions of the run's --max-steps: give --max-steps")
    if args.save_only_model:
        raise ValueError(f"{FLAG} resumes each branch with the optimizer state: not with --save-only-model")
    kwargs = args.lr_scheduler_kwargs or {}
    decay = _decay_steps(kwargs.get("num_decay_steps"), steps)
    if "num_stable_steps" in kwargs or not isinstance(decay, int) or not 0 < decay <= steps:
        raise ValueError(
            f"{FLAG} needs the main run's cooldown as --lr-scheduler-kwargs '{{\"num_decay_steps\": N}}' with "
            f"0 < N <= --max-steps, or a fraction of it (and no num_stable_steps): each budget's cooldown is the "
            "same fraction of it"
        )
    warmup = args.get_warmup_steps(steps)
    budgets = []
    for fraction in fractions[:-1] if fractions[-1] == 1 else fractions:
        total = round(fraction * steps)
        budget = Budget(fraction, total, round(decay / steps * total))
        if budget.decay_steps < 1 or budget.branch_step < warmup:
            raise ValueError(
                f"{FLAG} {fraction:g}: a budget of {total} of the {steps} steps gets a cooldown of "
                f"{budget.decay_steps} steps (decay ratio {decay}/{steps}), starting at step {budget.branch_step}; "
                f"it needs at least one step of cooldown, starting after the {warmup} warmup steps"
            )
        if budgets and budgets[-1].max_steps == total:
            raise ValueError(f"{FLAG}: {budgets[-1].fraction:g} and {fraction:g} are the same {total} steps")
        budgets.append(budget)
    return budgets


def resolve_decay_fraction(args: TrainingArguments) -> TrainingArguments:
    """`args` with a WSD `num_decay_steps` given as a fraction (< 1) of --max-steps turned into steps, as
    --warmup-steps takes one: the cooldown of runs whose length differs (a study's sizes under
    --tokens-per-parameter) is then the same share of each. transformers' schedule takes steps only. The budgets of
    --decay-at take the resolved ratio (round(x·T) / T), which their `training_args.json` records in steps."""
    kwargs = args.lr_scheduler_kwargs
    decay = kwargs.get("num_decay_steps") if isinstance(kwargs, dict) else None
    if SchedulerType(args.lr_scheduler_type) != _SCHEDULER or not isinstance(decay, float) or not 0 < decay < 1:
        return args
    if args.max_steps <= 0:
        raise ValueError(f"--lr-scheduler-kwargs num_decay_steps {decay:g} is a fraction of --max-steps: give it")
    return replace(args, lr_scheduler_kwargs={**kwargs, "num_decay_steps": _decay_steps(decay, args.max_steps)})


def _decay_steps(value, steps: int):
    """`num_decay_steps` in steps: a fraction (0 < value < 1) of `steps` rounded, else `value` as given."""
    return round(value * steps) if isinstance(value, float) and 0 < value < 1 else value


def unfinished_budgets(output_dir: str | Path, budgets: list[Budget]) -> list[Budget]:
    """The `budgets` (`plan_budgets`') of the run in `output_dir` whose branch has neither finished nor diverged (all
    of them before it ran). A cooldown that diverged is that budget's result, as `DIVERGED_FILE` in its folder
    records it (`scalevec-ablate`): its main run stays finished."""
    return [
        b
        for b in budgets
        if finished_step(b.folder(output_dir), b.max_steps) is None
        and not (b.folder(output_dir) / DIVERGED_FILE).is_file()
    ]


def branch_arguments(args: TrainingArguments, budget: Budget) -> TrainingArguments:
    """The arguments of `budget`'s run: its folder, steps and cooldown, the main run's warmup in steps (a fraction
    of the main run's steps would be another number of steps in a shorter run), and no branches of its own."""
    return replace(
        args,
        output_dir=str(budget.folder(args.output_dir)),
        run_name=f"{args.run_name}/{budget.folder('').name}" if args.run_name else None,
        max_steps=budget.max_steps,
        warmup_steps=args.get_warmup_steps(args.max_steps),
        lr_scheduler_kwargs={**args.lr_scheduler_kwargs, "num_decay_steps": budget.decay_steps},
        resume_from_checkpoint=None,
        decay_at=None,
    )


def branch_runs(args: TrainingArguments, budgets: list[Budget]) -> Iterator[TrainingArguments]:
    """After the main run of `args`: the arguments of each branch of `budgets` to train (with --resume, from its
    folder's newest checkpoint), each checked when its turn comes; finished branches are skipped."""
    for budget in unfinished_budgets(args.output_dir, budgets):
        folder = budget.folder(args.output_dir)
        if not any(folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*")):
            raise ValueError(
                f"{FLAG} {budget.fraction:g}: {folder} holds no checkpoint to branch from, nor does {args.output_dir} "
                f"hold {_name(budget)} (a run with {FLAG} saves it at that step; one without it, or a "
                f"--save-total-limit before it was linked, leaves none): train the budget of {budget.max_steps} "
                "steps as a run of its own"
            )
        yield branch_arguments(args, budget)


def restore_branch_points(output_dir: str | Path, budgets: list[Budget]) -> None:
    """Link the main run's branch-point checkpoints into the folders of branches (of `budgets`) that lack one: a run
    killed between saving such a checkpoint and linking it resumes after it, and would not save it again."""
    for budget in unfinished_budgets(output_dir, budgets):
        folder, checkpoint = budget.folder(output_dir), _checkpoint(output_dir, budget)
        if any(folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*")):
            continue
        if checkpoint.is_dir() and checkpoint_content(checkpoint).complete:
            link_checkpoint(checkpoint, folder)


class BranchPoints(TrainerCallback):
    """Saves a checkpoint at each branch's step (whatever --save-strategy says) and links it into the branch's
    folder once it is complete, before `save_total_limit` can delete it from the main run's."""

    def __init__(self, budgets: list[Budget]):
        self.budgets = budgets

    def on_step_end(self, args, state, control, **kwargs):
        if any(budget.branch_step == state.global_step for budget in self.budgets):
            control.should_save = True

    def on_save(self, args, state, control, **kwargs):
        if not args.should_save:  # the main process writes the links; every process's RNG state is in the files
            return
        for budget in self.budgets:
            if (
                budget.branch_step == state.global_step
                and not (budget.folder(args.output_dir) / _name(budget)).exists()
            ):
                link_checkpoint(_checkpoint(args.output_dir, budget), budget.folder(args.output_dir))


def add_branch_points(trainer, budgets: list[Budget]) -> None:
    """Give the main run's `trainer` the saves its branches of `budgets` start from (nothing without --decay-at)."""
    if budgets:
        trainer.add_callback(BranchPoints(budgets))


def link_checkpoint(checkpoint: Path, folder: Path) -> None:
    """`checkpoint` as `folder/<its name>`, its files hard links (a copy where the file system has none), placed
    atomically: staged as `.checkpoint-N.staging/checkpoint-N`, the name `--resume` clears away, then renamed."""
    staging = folder / f".{checkpoint.name}{STAGING_SUFFIX}"
    shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while linking
    with writes_into(folder, named=folder / checkpoint.name):
        shutil.copytree(checkpoint, staging / checkpoint.name, copy_function=_link_or_copy)
        commit_folder(staging / checkpoint.name, folder / checkpoint.name)
        os.rmdir(staging)


def _link_or_copy(source: str, destination: str) -> None:
    try:
        os.link(source, destination)
    except OSError:
        shutil.copy2(source, destination)


def _name(budget: Budget) -> str:
    return f"{PREFIX_CHECKPOINT_DIR}-{budget.branch_step}"


def _checkpoint(output_dir: str | Path, budget: Budget) -> Path:
    return Path(output_dir) / _name(budget)


def describe_budgets(budgets: list[Budget], max_steps: int) -> str | None:
    """One line for the plan of a run of `max_steps`: its `budgets` and what each branch costs."""
    if not budgets:
        return None
    parts = [f"{b.fraction:g} ({b.max_steps} steps, cooldown from step {b.branch_step})" for b in budgets]
    cooldown = sum(b.decay_steps for b in budgets)
    return (
        f"scalevec-train: budgets {', '.join(parts)} and 1 ({max_steps} steps): the branches cost "
        f"{cooldown} steps ({cooldown / max_steps:.0%} of the main run)"
    )
