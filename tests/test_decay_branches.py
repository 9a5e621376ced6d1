"""`--decay-at`: one warmup-stable-decay run gives several token budgets. A branch's losses are those of a separate run
of its budget, it trains its cooldown only, a killed run resumes its branches, scalevec-ablate passes the flag to
every grid point, and values no schedule can honour are refused naming the flag."""

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scalevec.run_records import RunClock
from scalevec.train import ablate
from scalevec.train.arguments import ScaleVecTrainingArguments
from scalevec.train.branches import Budget, plan_budgets, resolve_decay_fraction
from scalevec.train.cli import main
from scalevec.train.study.budgets import read_budgets
from scalevec.train.trainer import NonFiniteLossError, ScaleVecTrainer

from ._helpers import log_history, logged_losses, train_argv

pytestmark = pytest.mark.slow  # training runs and their branches

STEPS, WARMUP, DECAY = 20, 2, 4  # the main run: decay ratio 4/20
TOKENS_PER_STEP = 4 * 32  # batch 4 x seq 32 (`train_argv`)


def wsd(decay: float = DECAY) -> list[str]:
    schedule = json.dumps({"num_decay_steps": decay})
    return [
        "--lr-scheduler-type",
        "warmup_stable_decay",
        "--warmup-steps",
        str(WARMUP),
        "--lr-scheduler-kwargs",
        schedule,
    ]


def argv(output: Path, *flags: str, steps: int = STEPS, decay: int = DECAY) -> list[str]:
    return train_argv(output, *wsd(decay), "--scale-preset", "standard", "--scale-stats", "false", *flags, steps=steps)


@pytest.fixture(scope="module")
def steps_taken():
    """Optimizer steps (one training step each: no accumulation) trained in each output folder, while in use."""
    counts: Counter = Counter()
    original = ScaleVecTrainer.training_step

    def counted(self, *args, **kwargs):
        counts[Path(self.args.output_dir).name] += 1
        return original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ScaleVecTrainer, "training_step", counted)
        yield counts


@pytest.fixture(scope="module")
def runs(tmp_path_factory, steps_taken) -> dict[str, Path]:
    """The run of 20 steps with --decay-at 0.5,1, and the separate runs of 10 steps (cooldown 2: the same ratio)
    and 20 steps (without --decay-at) that its budgets must reproduce."""
    root = tmp_path_factory.mktemp("budgets")
    folders = {"branched": root / "branched", "separate": root / "separate", "plain": root / "plain"}
    assert main(argv(folders["branched"], "--decay-at", "0.5,1")) == 0
    assert main(argv(folders["separate"], steps=10, decay=2)) == 0
    assert main(argv(folders["plain"])) == 0
    return folders


def eval_loss(folder: Path) -> float:
    return json.loads((folder / "all_results.json").read_text())["eval_loss"]


def assert_same_weights(folder: Path, reference: Path) -> None:
    expected, got = load_file(reference / "model.safetensors"), load_file(folder / "model.safetensors")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


def test_a_branch_is_a_separate_run_of_its_budget(runs):
    """fp32 on one CPU thread replays the same operations in the same order, so the branch's losses equal the
    separate run's to rounding (in practice bit for bit); 1e-6 leaves room for nothing else."""
    branch = runs["branched"] / "budget-0.5"
    assert [entry["step"] for entry in log_history(branch) if "loss" in entry] == list(range(1, 11))
    assert logged_losses(branch) == pytest.approx(logged_losses(runs["separate"]), abs=1e-6)
    assert eval_loss(branch) == pytest.approx(eval_loss(runs["separate"]), abs=1e-6)
    assert_same_weights(branch, runs["separate"])
    # The main run is the budget 1, as without --decay-at; and its cooldown did change the loss (the test can fail).
    assert logged_losses(runs["branched"]) == pytest.approx(logged_losses(runs["plain"]), abs=1e-6)
    assert eval_loss(runs["branched"]) == pytest.approx(eval_loss(runs["plain"]), abs=1e-6)
    assert abs(eval_loss(branch) - eval_loss(runs["branched"])) > 1e-3
    rates = [entry["learning_rate"] for entry in log_history(branch) if "loss" in entry]
    main_rates = [entry["learning_rate"] for entry in log_history(runs["branched"]) if "loss" in entry]
    assert rates[:8] == main_rates[:8] and rates[9] < main_rates[9]  # stable until its branch step, then its own


def test_branches_cost_their_cooldown_only(runs, steps_taken):
    assert steps_taken["branched"] == STEPS and steps_taken["budget-0.5"] == 2  # 10 steps, the last 2 its cooldown
    branch = runs["branched"] / "budget-0.5"
    summary = json.loads((branch / "run_summary.json").read_text())
    assert summary["segment_starts"] == [0, 8] and summary["tokens_seen"] == 10 * TOKENS_PER_STEP
    arguments = json.loads((branch / "training_args.json").read_text())
    assert (arguments["max_steps"], arguments["warmup_steps"], arguments["decay_at"]) == (10, WARMUP, None)
    assert arguments["lr_scheduler_kwargs"] == {"num_decay_steps": 2}
    # The branch point is a link to the main run's checkpoint, not a copy of it.
    linked, original = branch / "checkpoint-8" / "optimizer.pt", runs["branched"] / "checkpoint-8" / "optimizer.pt"
    assert linked.stat().st_ino == original.stat().st_ino


def test_read_budgets_gives_each_budget_its_tokens_and_eval_loss(runs):
    main_run, branch = runs["branched"], runs["branched"] / "budget-0.5"
    budgets = read_budgets(main_run)
    assert [(b.fraction, b.tokens) for b in budgets] == [(0.5, 10 * TOKENS_PER_STEP), (1.0, STEPS * TOKENS_PER_STEP)]
    assert [b.eval_loss for b in budgets] == [eval_loss(runs["branched"] / "budget-0.5"), eval_loss(runs["branched"])]
    perplexities = [json.loads((b / "all_results.json").read_text())["eval_perplexity"] for b in (branch, main_run)]
    assert [b.eval_loss for b in read_budgets(main_run, metric="eval_perplexity")] == perplexities


def copy_of(run: Path, destination: Path, keep: list[str]) -> Path:
    """`run` as a kill leaves it: only the paths `keep` (relative) of its folder."""
    for name in keep:
        shutil.copytree(run / name, destination / name)
    return destination


def test_a_run_killed_after_its_branch_point_resumes_the_main_run_and_the_branch(runs, steps_taken, tmp_path):
    """Killed after saving checkpoint-8 and before linking it: --resume links it, finishes the main run from step 8
    and the branch from there, as the uninterrupted run did."""
    killed = copy_of(runs["branched"], tmp_path / "branched", ["checkpoint-8"])
    steps_taken.clear()
    assert main(argv(killed, "--decay-at", "0.5,1", "--resume", "true")) == 0
    assert steps_taken == {"branched": STEPS - 8, "budget-0.5": 2}
    for budget in ("", "budget-0.5"):
        assert eval_loss(killed / budget) == pytest.approx(eval_loss(runs["branched"] / budget), abs=1e-6)
        assert_same_weights(killed / budget, runs["branched"] / budget)


def test_a_finished_run_with_an_unfinished_branch_resumes_the_branch(runs, steps_taken, tmp_path, capsys):
    killed = tmp_path / "branched"
    shutil.copytree(runs["branched"], killed, ignore=shutil.ignore_patterns("budget-*"))
    copy_of(runs["branched"], killed, ["budget-0.5/checkpoint-8"])
    steps_taken.clear()
    assert main(argv(killed, "--decay-at", "0.5,1", "--resume", "true")) == 0
    assert "already finished at step 20: nothing to train" in capsys.readouterr().out
    assert steps_taken == {"budget-0.5": 2}
    assert eval_loss(killed / "budget-0.5") == pytest.approx(eval_loss(runs["separate"]), abs=1e-6)
    steps_taken.clear()
    assert main(argv(killed, "--decay-at", "0.5,1", "--resume", "true")) == 0  # everything finished: nothing trains
    assert steps_taken == {}


def test_a_branch_point_outlives_the_rotation_of_the_main_runs_checkpoints(runs, tmp_path):
    """--save-total-limit 1 deletes the main run's checkpoint-8 once checkpoint-12 is saved: the branch's link to
    it stays, and the branch is still the separate run."""
    output = tmp_path / "rotated"
    flags = ["--decay-at", "0.5,1", "--save-strategy", "steps", "--save-steps", "6", "--save-total-limit", "1"]
    assert main(argv(output, *flags)) == 0
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-20"]
    assert eval_loss(output / "budget-0.5") == pytest.approx(eval_loss(runs["separate"]), abs=1e-6)
    assert eval_loss(output) == pytest.approx(eval_loss(runs["plain"]), abs=1e-6)


def test_a_branch_without_a_checkpoint_to_start_from_is_refused(runs, steps_taken, tmp_path, capsys):
    """A run that finished without --decay-at saved no checkpoint at step 8: asked for the budget 0.5 afterwards,
    it says so instead of training 10 steps from scratch."""
    finished = tmp_path / "plain"
    shutil.copytree(runs["plain"], finished)
    steps_taken.clear()
    assert main(argv(finished, "--decay-at", "0.5,1", "--resume", "true")) == 1
    assert capsys.readouterr().err == (
        f"scalevec-train: error: --decay-at 0.5: {finished / 'budget-0.5'} holds no checkpoint to branch from, nor "
        f"does {finished} hold checkpoint-8 (a run with --decay-at saves it at that step; one without it, or a "
        "--save-total-limit before it was linked, leaves none): train the budget of 10 steps as a run of its own\n"
    )
    assert steps_taken == {} and not (finished / "budget-0.5").exists()


def test_ablate_branches_every_grid_point_and_resumes_unfinished_branches(runs, steps_taken, tmp_path):
    root = tmp_path / "ablation"
    flags = [
        "--variants",
        "standard",
        "--decay-at",
        "0.5,1",
        *train_argv(root, *wsd(), "--scale-stats", "false", steps=STEPS),
    ]
    assert ablate.main(flags) == 0
    point = root / "tiny" / "standard-lr0.001-seed42"
    assert eval_loss(point / "budget-0.5") == pytest.approx(eval_loss(runs["separate"]), abs=1e-6)
    (point / "budget-0.5" / "trainer_state.json").unlink()  # killed before the branch's result was complete ...
    results = json.loads((root / "results.json").read_text())
    results["runs"] = [r for r in results["runs"] if r["budget"] is None]  # ... so before the report recorded it
    (root / "results.json").write_text(json.dumps(results))
    steps_taken.clear()
    assert ablate.main([*flags, "--resume", "true"]) == 0
    assert steps_taken == {"budget-0.5": 2}


def test_a_cooldown_that_diverges_is_its_budgets_result_and_its_run_stays_finished(tmp_path, monkeypatch, capsys):
    """The 0.25 budget's cooldown diverges: its branch records it, the run and the 0.5 budget after it finish, and a
    --resume call trains nothing again; a finished branch's record holds its cooldown's time, not the stable
    phase's it resumed."""
    original = ScaleVecTrainer.training_step

    def diverging(self, *args, **kwargs):
        if Path(self.args.output_dir).name == "budget-0.25":
            raise NonFiniteLossError("the training loss became nan at step 5", 5, 1e-4)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ScaleVecTrainer, "training_step", diverging)
    root = tmp_path / "ablation"
    flags = ["--variants", "standard", "--decay-at", "0.25,0.5,1"]
    flags += train_argv(root, *wsd(), "--scale-stats", "false", steps=STEPS)
    assert ablate.main(flags) == 0
    assert "tiny standard lr 0.001 seed 42 budget 0.25: the training loss became nan" in capsys.readouterr().out
    point = root / "tiny" / "standard-lr0.001-seed42"
    assert not (point / "diverged.json").exists()
    assert json.loads((point / "budget-0.25" / "diverged.json").read_text())["step"] == 5
    records = {r["budget"]: r for r in json.loads((root / "results.json").read_text())["runs"]}
    assert {budget: r["status"] for budget, r in records.items()} == {
        None: "finished",
        0.25: "diverged",
        0.5: "finished",
    }
    branch = point / "budget-0.5"
    whole = RunClock.recorded(json.loads((branch / "trainer_state.json").read_text()))
    assert whole.segment_starts == [0, 8]
    inherited = RunClock.recorded(json.loads((branch / "checkpoint-8" / "trainer_state.json").read_text()))
    assert records[0.5]["train_seconds"] == pytest.approx(whole.wall_seconds - inherited.wall_seconds)
    assert 0 < records[0.5]["train_seconds"] < whole.wall_seconds
    assert ablate.main([*flags, "--resume", "true"]) == 0
    assert "finished or diverged already: 1; to train now: 0" in capsys.readouterr().out


REFUSED = {
    "not a fraction": (
        ["--decay-at", "0.5,2"],
        "--decay-at must be comma-separated fractions of --max-steps in (0, 1]",
    ),
    "zero": (["--decay-at", "0,1"], "--decay-at must be comma-separated fractions"),
    "not a number": (["--decay-at", "half"], "--decay-at must be comma-separated fractions"),
    "cosine": (
        ["--decay-at", "0.5,1", "--lr-scheduler-type", "cosine"],
        "--decay-at branches cooldowns from the stable phase of --lr-scheduler-type warmup_stable_decay; got cosine",
    ),
    "no decay steps": (["--decay-at", "0.5,1", "--lr-scheduler-kwargs", "{}"], "--decay-at needs the main run's"),
    "inside the warmup": (
        ["--decay-at", "0.25,1", "--warmup-steps", "6"],
        "--decay-at 0.25: a budget of 5 of the 20 steps gets a cooldown of 1 steps (decay ratio 4/20), starting "
        "at step 4; it needs at least one step of cooldown, starting after the 6 warmup steps",
    ),
    "no cooldown": (["--decay-at", "0.1,1"], "a budget of 2 of the 20 steps gets a cooldown of 0 steps"),
    "no optimizer state": (
        ["--decay-at", "0.5,1", "--save-only-model", "true"],
        "--decay-at resumes each branch with the optimizer state: not with --save-only-model",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_bad_decay_at_values_are_refused_naming_the_flag(case, tmp_path, capsys):
    flags, message = REFUSED[case]
    output = tmp_path / "refused"
    assert main(argv(output, *flags)) == 1
    error = capsys.readouterr().err
    assert error.startswith("scalevec-train: error: ") and message in error, error
    assert not output.exists()  # refused before anything was written


def test_a_cooldown_given_as_a_fraction_is_the_same_share_of_every_run(tmp_path):
    """`num_decay_steps` 0.2 is 20 % of each run's steps, as --warmup-steps 0.05 is 5 %: a study's sizes under
    --tokens-per-parameter run for different numbers of steps, and each budget gets the same share as cooldown."""
    arguments = ScaleVecTrainingArguments(
        output_dir=str(tmp_path), max_steps=20, lr_scheduler_type="warmup_stable_decay", warmup_steps=2,
        lr_scheduler_kwargs={"num_decay_steps": 0.2}, decay_at="0.25,0.5,1", report_to="none",
    )  # fmt: skip
    assert plan_budgets(arguments, max_steps=40) == [Budget(0.25, 10, 2), Budget(0.5, 20, 4)]
    resolved = resolve_decay_fraction(arguments)
    assert resolved.lr_scheduler_kwargs == {"num_decay_steps": 4}
    assert plan_budgets(resolved) == [Budget(0.25, 5, 1), Budget(0.5, 10, 2)]
    assert [b.branch_step for b in plan_budgets(resolved)] == [4, 8]


def test_ablate_refuses_a_size_whose_branch_cannot_start_before_anything_trains(tmp_path, capsys):
    """At 0.5 tokens a parameter the size 1x16 runs 13 steps (2x32: 104): its 0.25 budget's cooldown would start
    inside the warmup."""
    root = tmp_path / "ablation"
    flags = ["--sizes", "1x16,2x32", "--tokens-per-parameter", "0.5", "--decay-at", "0.25,1"]
    flags += train_argv(root, *wsd(0.2), "--warmup-steps", "3", "--config-overrides", "{}", steps=-1)
    assert ablate.main(flags) == 1
    assert capsys.readouterr().err == (
        "scalevec-ablate: error: --decay-at 0.25: a budget of 3 of the 13 steps gets a cooldown of 1 steps (decay "
        "ratio 3/13), starting at step 2; it needs at least one step of cooldown, starting after the 3 warmup steps\n"
    )
    assert not root.exists()
