"""`ScaleVecTrainer`: the stock Trainer with role-aware weight decay, Muon, held-out LM metrics, a stop on a
non-finite loss, atomic checkpoints, and streamed data that resumes from its saved position."""

import inspect
import json
import os
import shutil
import time
import warnings
from dataclasses import replace
from pathlib import Path

import datasets
import torch
from transformers import Trainer
from transformers.integrations.deepspeed import deepspeed_init
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import (
    PREFIX_CHECKPOINT_DIR,
    get_last_checkpoint,
    has_length,
    sort_checkpoints,
    speed_metrics,
)
from transformers.utils import logging
from transformers.utils.output_capturing import maybe_install_capturing_hooks

from ..atomic import commit_folder, remove_folder, write_text_atomically, writes_into
from ..data.held_out import EVALUATION_HALVES, evaluation_halves
from ..data.sampler import ShuffledBlockSampler
from ..evaluation.held_out import BlockEvaluation, HeldOutSums, held_out_metrics, score_together, token_byte_lengths
from ..evaluation.task_scoring import TaskEvaluation, check_requests, model_length, task_scores
from ..evaluation.tasks import Task
from ..modeling_scalevec import ScaleVecModel
from .arguments import ScaleVecTrainingArguments
from .diagnostics import HideScaleStatsFromConsole, ScaleStatsCallback, activation_kurtosis, kurtosis_log
from .optim import DecayConfig, MuonAdamW, decay_toward_targets, describe_groups, parameter_groups
from .run_clock import RunClockCallback
from .throughput import ThroughputCallback

logger = logging.get_logger(__name__)
_ADAMW = {"adamw_torch", "adamw_torch_fused"}
# `checkpoint-N` is written as `.checkpoint-N.staging/checkpoint-N`: hidden from `checkpoint-*` globs until done.
STAGING_SUFFIX = ".staging"
# Each rank's position in a streamed dataset, saved in every checkpoint.
DATA_STATE = "data_state_rank{rank}.json"


class NonFiniteLossError(RuntimeError):
    """Training stopped on a non-finite loss or non-finite weights: `step` is the optimizer step that produced them
    and `learning_rate` its learning rate, so that a study can record the run as diverged."""

    def __init__(self, message: str, step: int | None = None, learning_rate: float | None = None):
        super().__init__(message)
        self.step, self.learning_rate = step, learning_rate


def _install_output_hooks(model: torch.nn.Module) -> None:
    """transformers installs the hooks that record router logits on a model's first call, under a lock that
    torch.compile cannot trace: graph breaks that split every compiled step after it too. Install them first."""
    for module in model.modules():
        if isinstance(module, ScaleVecModel):
            maybe_install_capturing_hooks(module)


def _half_losses(rows: list[HeldOutSums], prefix: str) -> dict[str, float]:
    """`<prefix>_select_loss` and `<prefix>_report_loss` from each set's (select, report) sums in turn; none where
    too few blocks were evaluated to fill both halves."""
    halves = [sum(rows[k::2], HeldOutSums()) for k in range(2)]
    if not all(half.tokens for half in halves):
        return {}
    return {f"{prefix}_{name}_loss": half.nll / half.tokens for name, half in zip(EVALUATION_HALVES, halves)}


class ScaleVecTrainer(Trainer):
    """A `Trainer` whose optimizer groups come from `model.scale_vector_roles()`: matrices and input-role scales
    decayed, output-role scales not. The stock Trainer exempts every parameter named "norm" from weight decay,
    which the paper shows is wrong for input-norm scales."""

    def __init__(self, *args, seq_len: int | None = None, tasks: list[Task] | None = None, **kwargs):
        """`seq_len`, the length of the training sequences, gives the model FLOPs (and MFU) that each training log
        reports beside tokens per second. Without `compute_metrics`, evaluation reads each held-out block once
        over all processes and reports loss, perplexity, bits per byte (from the tokenizer's `processing_class`)
        and tokens from sums (`evaluate`), and scores the multiple-choice `tasks` beside them (`eval_<task>_acc`,
        scalevec/evaluation/task_scoring.py); with it, the stock evaluation loop runs."""
        self.tasks = tasks or []
        self._staging_run_dir: Path | None = None  # set while a checkpoint is being written (`_save_checkpoint`)
        self._stream_loader = None  # the loader of a streamed training dataset (`get_train_dataloader`)
        self._resumed_from: Path | None = None  # the checkpoint `train` resumes from
        self._token_bytes: torch.Tensor | None = None  # bytes of text per token id, for bits per byte
        # `--resume-weights-only`: the checkpoint lacks optimizer or scheduler state, and both start afresh.
        self.fresh_optimizer_on_resume = False
        bound = inspect.signature(Trainer.__init__).bind(self, *args, **kwargs)
        training_args = bound.arguments.get("args")
        if training_args is not None and bound.arguments.get("eval_dataset") is None:
            # The pretraining default evaluates periodically; with nothing held out there is nothing to evaluate.
            bound.arguments["args"] = replace(training_args, eval_strategy="no")
        super().__init__(*bound.args[1:], **bound.kwargs)
        if self.tasks and self.processing_class is None:
            raise ValueError("scoring tasks needs the tokenizer: pass it as processing_class")
        check_requests(self.processing_class, self.tasks, model_length(self.model))  # before step 1, not at its end
        if self.args.torch_compile:
            _install_output_hooks(self.model)
        callbacks = self.callback_handler.callbacks
        # Before every logger (after the Trainer's flow control), so that each logger gets what these add.
        callbacks.insert(1, ThroughputCallback(seq_len, getattr(self.args, "peak_flops", None)))
        callbacks.insert(1, RunClockCallback())
        if getattr(self.args, "scale_stats", True):
            callbacks.insert(1, ScaleStatsCallback())
            callbacks.insert(len(callbacks) - 1, HideScaleStatsFromConsole())  # after them, before the printer

    def get_train_dataloader(self):
        """A streamed dataset is already this rank's share: it gets a `StatefulDataLoader` of its own (no
        accelerate dispatch from rank 0), whose position every checkpoint saves, and whose workers tokenise."""
        if not isinstance(self.train_dataset, datasets.IterableDataset):
            return super().get_train_dataloader()
        from torchdata.stateful_dataloader import StatefulDataLoader

        # torchdata's worker loop calls a deprecated torch function, which warns once per run: not the user's concern
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        workers = min(self.args.dataloader_num_workers, self.train_dataset.num_shards)  # a worker reads whole shards
        self._stream_loader = StatefulDataLoader(
            self.train_dataset,
            batch_size=self._train_batch_size,
            collate_fn=self.data_collator,
            num_workers=workers,
            pin_memory=self.args.dataloader_pin_memory,
            prefetch_factor=self.args.dataloader_prefetch_factor if workers else None,
            persistent_workers=self.args.dataloader_persistent_workers and workers > 0,
        )
        return self._stream_loader

    def _get_train_sampler(self, train_dataset=None):
        """A seeded permutation of the blocks computed on the fly (`ShuffledBlockSampler`), in place of the stock
        sampler's stored one."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if self.args.train_sampling_strategy != "random" or dataset is None or not has_length(dataset):
            return super()._get_train_sampler(train_dataset)
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return ShuffledBlockSampler(len(dataset), seed, self._train_batch_size * self.args.world_size)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
        self._resumed_from = Path(resume_from_checkpoint) if resume_from_checkpoint else None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_resumed_dataloader(self, dataloader, num_batches: int):
        """The stream continues from the position saved with the checkpoint, instead of reading (and
        tokenising) everything consumed before it again."""
        if dataloader is not self._stream_loader:
            return self._resumed_block_dataloader(dataloader, num_batches)
        saved = sorted(self._resumed_from.glob(DATA_STATE.format(rank="*")))
        if len(saved) != self.args.world_size:
            raise ValueError(
                f"{self._resumed_from} holds the stream positions of {len(saved)} processes; this run has "
                f"{self.args.world_size}. Resume a streamed run on as many processes as it was saved with"
            )
        state = self._resumed_from / DATA_STATE.format(rank=self.args.process_index)
        dataloader.load_state_dict(json.loads(state.read_text()))
        return dataloader

    def _resumed_block_dataloader(self, dataloader, num_batches: int):
        """The training order from the position after `num_batches` batches of each process, computed directly
        instead of drawing and dropping every index before it."""
        batches = getattr(dataloader, "batch_sampler", None)
        batches = getattr(batches, "batch_sampler", batches)  # accelerate's shard of the batches, over processes
        sampler = getattr(batches, "sampler", None)
        if not isinstance(sampler, ShuffledBlockSampler) or not sampler.whole_batches:
            return super().get_resumed_dataloader(dataloader, num_batches)
        resumed = sampler.resumed(num_batches * sampler.global_batch)
        return self._get_dataloader(
            self.train_dataset, "Training", self._train_batch_size, sampler_fn=lambda _: resumed, is_training=True
        )

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Loss, perplexity, bits per byte and evaluated tokens on the held-out blocks (each set of a dict named in
        the metrics, `eval_<name>_loss`, beside the combined `eval_loss`), each block read once over all
        processes and the sums all-reduced; the stock loop where the trainer was given `compute_metrics`. With
        `--eval-halves`, also the loss of each fixed half of the blocks (`evaluation_halves`), `eval_select_loss` and
        `eval_report_loss`: a study picks its learning rate on the one and reports differences on the other."""
        if self.compute_metrics is not None or self.preprocess_logits_for_metrics is not None:
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        sets = self._held_out_sets(eval_dataset)
        if sets is None:  # blocks without a length: the stock loop, which needs none
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        self._memory_tracker.start()
        start = time.time()
        model = self._evaluation_model()
        model.eval()
        if self._token_bytes is None and (lengths := token_byte_lengths(self.processing_class)) is not None:
            self._token_bytes = torch.from_numpy(lengths).to(self.args.device)
        evaluation = BlockEvaluation(
            self.args.process_index,
            self.args.world_size,
            self.args.eval_batch_size,
            self._get_collator_with_removed_columns(self.data_collator, description="evaluation"),
            self.args.device,
            self.compute_loss_context_manager,
        )
        parts = 2 if getattr(self.args, "eval_halves", False) else 1  # each set's blocks whole, or in two halves
        pieces = [part for whole in sets.values() for part in (evaluation_halves(whole) if parts == 2 else [whole])]
        rows, task_sums = score_together(
            model, pieces, evaluation, self._token_bytes, self.tasks, self._task_evaluation()
        )
        by_set = {name: sum(rows[parts * k : parts * (k + 1)], HeldOutSums()) for k, name in enumerate(sets)}
        metrics = held_out_metrics(by_set, metric_key_prefix, per_set=isinstance(next(iter(sets)), str))
        if parts == 2:
            metrics.update(_half_losses(rows, metric_key_prefix))
        metrics.update(task_scores([task.name for task in self.tasks], task_sums).metrics(metric_key_prefix))
        blocks, tokens = sum(len(blocks) for blocks in sets.values()), metrics[f"{metric_key_prefix}_tokens"]
        metrics.update(speed_metrics(metric_key_prefix, start, num_samples=blocks, num_tokens=tokens))
        kurtosis = {}
        if getattr(self.args, "scale_stats", True):  # after the clock: the evaluation's speed does not count it
            kurtosis = self._held_out_kurtosis(model, next(iter(sets.values())), evaluation)
        metrics.update(kurtosis)
        self.log(metrics)
        metrics.update(kurtosis)  # `log` hands `metrics` itself to the console's filter, which drops `scale/` keys
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        self._memory_tracker.stop_and_update_metrics(metrics)
        return metrics

    def _task_evaluation(self) -> TaskEvaluation:
        return TaskEvaluation(
            self.processing_class,
            self.args.process_index,
            self.args.world_size,
            self.args.eval_batch_size,
            self.args.device,
            self.compute_loss_context_manager,
        )

    @staticmethod
    def _held_out_kurtosis(model, blocks, evaluation: BlockEvaluation) -> dict[str, float]:
        """Activation kurtosis per layer (`scale/kurtosis/...`) on one held-out batch, the same on every process
        (sharded models need every process's forward): one forward more per evaluation, whatever the sets' size."""
        with evaluation.forward_context():
            return kurtosis_log(activation_kurtosis(model, [evaluation.first_batch(blocks)]))

    def _held_out_sets(self, eval_dataset) -> dict | None:
        """The sets to evaluate, by name (a single set under the name None), or None if one has no length."""
        if isinstance(eval_dataset, str):
            sets = {None: self.eval_dataset[eval_dataset]}
        else:
            chosen = self.eval_dataset if eval_dataset is None else eval_dataset
            if chosen is None:
                raise ValueError("Trainer: evaluation requires an eval_dataset.")
            sets = dict(chosen) if isinstance(chosen, dict) else {None: chosen}
        for name, blocks in sets.items():
            if isinstance(blocks, datasets.Dataset):
                sets[name] = self._remove_unused_columns(blocks, description="evaluation")
        return sets if all(has_length(blocks) for blocks in sets.values()) else None

    def _evaluation_model(self) -> torch.nn.Module:
        """The model to evaluate, prepared by accelerate as the stock evaluation loop prepares it before training."""
        if self.is_deepspeed_enabled and self.deepspeed is None:
            deepspeed_init(self, num_training_steps=0, inference=True)
        model = self._wrap_model(self.model, training=False)
        if len(self.accelerator._models) == 0 and model is self.model:
            prepare_whole = self.is_deepspeed_enabled or (self.is_fsdp_enabled and not self.args.torch_compile)
            model = (
                self.accelerator.prepare(model)
                if prepare_whole
                else self.accelerator.prepare_model(model, evaluation_mode=True)
            )
            if self.is_fsdp_enabled:
                self.model = model
            if model is not self.model:
                self.model_wrapped = model
        return model

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        decay = (
            self.args.decay
            if isinstance(self.args, ScaleVecTrainingArguments)
            else DecayConfig(self.args.weight_decay)
        )
        groups = parameter_groups(model, decay)
        optim = str(getattr(self.args.optim, "value", self.args.optim))
        kwargs = dict(
            lr=self.args.learning_rate, betas=(self.args.adam_beta1, self.args.adam_beta2), eps=self.args.adam_epsilon
        )
        if optim == "muon":
            # FSDP2 keeps each parameter a (sharded) matrix, which MuonAdamW gathers; FSDP1 and ZeRO flatten them.
            plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
            fsdp2 = self.is_fsdp_enabled and getattr(plugin, "fsdp_version", 1) == 2
            if (self.is_fsdp_enabled and not fsdp2) or self.is_deepspeed_enabled:
                raise ValueError(
                    "--optim muon orthogonalises whole matrices, which FSDP1 and DeepSpeed ZeRO shard as flat "
                    "buffers: use FSDP2 (fsdp_version: 2), plain data parallelism (torchrun), or AdamW with them"
                )
            self.optimizer = MuonAdamW(
                groups, momentum=self.args.muon_momentum, adjust_lr_fn=self.args.muon_adjust_lr, fused=True, **kwargs
            )
        elif optim in _ADAMW:
            for group in groups:
                group["muon"] = False
            # As transformers does: one fused kernel per tensor on CPUs too, 4-5x faster than the per-op loop.
            self.optimizer = torch.optim.AdamW(groups, fused=optim == "adamw_torch_fused" or None, **kwargs)
        else:  # any other optimizer transformers knows, fed with the role-aware groups
            if decay.scale_decay_target:
                raise ValueError(f"--scale-decay-target needs AdamW or Muon (decoupled weight decay), not {optim}")
            optimizer_cls, optimizer_kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
            self.optimizer = optimizer_cls(groups, **optimizer_kwargs)
        if decay.scale_decay_target:
            self.optimizer.register_step_post_hook(decay_toward_targets)
        if self.is_world_process_zero():
            print(describe_groups(self.optimizer.param_groups))
        return self.optimizer

    def compute_loss(self, model, inputs, *args, **kwargs):
        # A MoE model balances its experts unless both router loss coefficients are 0 (TRL's rule), asked of each
        # forward rather than set in the config, so that the checkpoints saved keep plain forwards (Qwen3-MoE's).
        config = self.model.config
        if getattr(config, "router_aux_loss_coef", 0) or getattr(config, "router_z_loss_coef", 0):
            inputs = {**inputs, "output_router_logits": True}
        return super().compute_loss(model, inputs, *args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"the training loss became {loss.item()} at step {self.state.global_step + 1}; training stopped "
                f"before the optimizer step, {self._last_checkpoint()}. Lower the learning rate or check the data.",
                self.state.global_step + 1,
                self._current_learning_rate(),
            )
        return loss

    def _save_checkpoint(self, model, trial):
        """Write `checkpoint-N` into a staging folder, flush it, then rename it into place: a `checkpoint-N` that
        exists is complete, whenever the process is killed. The stock method does the writing, into the folder
        that `_get_output_dir` names while `_staging_run_dir` is set."""
        self._refuse_non_finite_weights(model)
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging_run_dir = run_dir / f".{name}{STAGING_SUFFIX}"
        if self.args.should_save:
            shutil.rmtree(staging_run_dir, ignore_errors=True)  # left by a run killed while saving this step
        self.accelerator.wait_for_everyone()  # every process writes its own RNG state into the staging folder
        self._staging_run_dir = staging_run_dir
        try:
            with writes_into(staging_run_dir, named=run_dir / name):
                super()._save_checkpoint(model, trial)
                self._record_final_path(staging_run_dir / name, run_dir / name)
                if self._stream_loader is not None:
                    position = staging_run_dir / name / DATA_STATE.format(rank=self.args.process_index)
                    write_text_atomically(position, json.dumps(self._stream_loader.state_dict()))
        except BaseException:
            shutil.rmtree(staging_run_dir, ignore_errors=True)
            raise
        finally:
            self._staging_run_dir = None
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            with writes_into(run_dir, named=run_dir / name):
                self._publish_checkpoint(staging_run_dir / name, run_dir / name)
                os.rmdir(staging_run_dir)
            self._rotate_checkpoints(run_dir)
        if self.args.push_to_hub:
            super()._push_from_checkpoint(str(run_dir / name))

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        # The upload runs in the background: it must read the checkpoint where it stays, once it is there.
        if self._staging_run_dir is None:
            super()._push_from_checkpoint(checkpoint_folder)

    def _get_output_dir(self, trial) -> str:
        return str(self._staging_run_dir) if self._staging_run_dir is not None else super()._get_output_dir(trial)

    def _record_final_path(self, staged: Path, final: Path) -> None:
        # The stock method records the best checkpoint where it wrote it; record where it will be instead.
        if self.state.best_model_checkpoint == str(staged):
            self.state.best_model_checkpoint = str(final)
            if self.args.should_save:
                self.state.save_to_json(str(staged / TRAINER_STATE_NAME))

    @staticmethod
    def _publish_checkpoint(staged: Path, final: Path) -> None:
        if final.exists():  # the same step saved again, by a run resumed from an earlier checkpoint
            remove_folder(final)
        commit_folder(staged, final)

    def _rotate_checkpoints(self, run_dir: Path) -> None:
        """`save_total_limit` as the stock Trainer applies it (keep the newest and the best, delete the oldest),
        by step rather than by time, as `--resume` picks; each deleted folder is first renamed out of sight, so a
        kill while deleting leaves no half checkpoint."""
        limit = self.args.save_total_limit
        if not limit or limit <= 0:
            return
        checkpoints = [Path(path) for path in sort_checkpoints(str(run_dir))]
        best = self.state.best_model_checkpoint
        protected = {checkpoints[-1], *([Path(best)] if best else [])}
        surplus = len(checkpoints) - max(limit, len(protected & set(checkpoints)))
        for checkpoint in [path for path in checkpoints if path not in protected][: max(surplus, 0)]:
            remove_folder(checkpoint)

    def _refuse_non_finite_weights(self, model) -> None:
        # A finite loss does not make the update after it finite: never save overflowed weights as a checkpoint.
        parameters = [p.detach() for p in model.parameters()]
        if parameters and not torch.stack([torch.isfinite(p).all() for p in parameters]).all():
            raise NonFiniteLossError(
                f"the weights became non-finite in the update of step {self.state.global_step}; training stopped "
                f"without saving them, {self._last_checkpoint()}. Lower the learning rate or check the data.",
                self.state.global_step,
                self._current_learning_rate(),
            )

    def _current_learning_rate(self) -> float | None:
        return float(self.lr_scheduler.get_last_lr()[0]) if self.lr_scheduler is not None else None

    def _load_optimizer_and_scheduler(self, checkpoint):
        if not self.fresh_optimizer_on_resume:  # the stock method would load an optimizer without its scheduler
            super()._load_optimizer_and_scheduler(checkpoint)

    def _last_checkpoint(self) -> str:
        last = sorted(Path(self.args.output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
        return f"the last good checkpoint is {last[-1]}" if last else "no checkpoint was saved yet"
