"""What a person sees while pretraining (scalevec/train/run_report.py, throughput.py, diagnostics.py): the plan at the
start, tokens/s, MFU and memory in every training log, the end-of-run block and `run_summary.json` (equal to
`all_results.json`), a card titled by name rather than folder that names its data and hardware, and a picture in
which every line has its own style and every panel its own legend."""

import json
import re

import matplotlib
import pytest

from scalevec import ScaleVecForCausalLM
from scalevec.convert import OutputOptions, export_checkpoint
from scalevec.convert.card import card_writer
from scalevec.data.corpus import corpus_documents, corpus_name
from scalevec.run_records import TRAINING_DATA, EvaluationRecord
from scalevec.train.cli import main
from scalevec.train.diagnostics import READING, run_figure, scale_statistics
from scalevec.train.run_report import pace
from scalevec.train.throughput import model_flops_per_token

from ._helpers import log_history, randomize_scales, tiny_config, train_argv

PEAK = 2e11  # FLOP/s: a made-up peak, so that a CPU run reports an MFU


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run of 6 steps logging every 2, evaluated at the end, with the output it printed."""
    output = tmp_path_factory.mktemp("report") / "run"
    flags = ("--logging-steps", "2", "--peak-flops", str(PEAK), "--max-eval-documents", "40")
    capture = pytest.MonkeyPatch()
    lines = []
    capture.setattr("builtins.print", lambda *args, **kwargs: lines.append(" ".join(map(str, args))))
    try:
        assert main(train_argv(output, *flags, steps=6)) == 0
    finally:
        capture.undo()
    return output, "\n".join(lines)


def test_every_training_log_carries_throughput_mfu_and_memory(run):
    output, _ = run
    logs = [entry for entry in log_history(output) if "loss" in entry]
    assert [entry["step"] for entry in logs] == [2, 4, 6]
    config = ScaleVecForCausalLM.from_pretrained(output).config
    flops = model_flops_per_token(config, 32)
    for entry in logs:
        assert entry["tokens_per_second"] > 0 and entry["tokens_per_second_per_device"] == entry["tokens_per_second"]
        assert entry["peak_rss_gib"] > 0.1
        assert entry["mfu_percent"] == pytest.approx(100 * entry["tokens_per_second"] * flops / PEAK, rel=2e-3)


def test_the_plan_states_model_tokens_data_and_device(run):
    output, printed = run
    plan = printed[printed.index("== scalevec-train: the plan ==") :]
    model = ScaleVecForCausalLM.from_pretrained(output)
    total = sum(p.numel() for p in model.parameters())
    embeddings = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    n = total - embeddings - model.num_scale_parameters()  # the study's N: the same for every scale strategy
    assert f": {total:,} parameters, N = {n:,} non-embedding (no embedding, LM head or scale vector)," in plan
    assert "4 blocks × 32 tokens × 1 process × 1 accumulation step = 128 tokens per optimizer step" in plan
    assert f"6 steps = 768 tokens = {768 / total:.2f} tokens per parameter " in plan
    # Chinchilla's ratio counts all parameters; the study's grid counts non-embedding ones: the plan names both N.
    assert f"({768 / n:.2f} per non-embedding parameter N; Chinchilla's" in plan
    record = json.loads((output / "training_data.json").read_text())
    source = record["sources"][0]
    assert f"data         {corpus_name()}: {source['documents']:,} documents, {source['tokens']:,} tokens" in plan
    megabytes = sum(len(text.encode()) for text in corpus_documents()) / 1e6  # what it is, and its size
    assert re.fullmatch(
        r"CPython 3\.\d+'s pydoc help topics and standard-library docstrings \(the embedded corpus, "
        rf"{megabytes:.1f} MB of text\)",
        corpus_name(),
    )
    assert "checkpoints  none (--save-strategy no)" in plan
    assert f"MFU against {PEAK / 1e12:g} TFLOP/s per device" in plan and "device       1 × CPU (" in plan


def test_the_run_estimates_its_time_from_its_first_logged_steps(run):
    _, printed = run
    line = re.search(
        r"\npace +steps 3 to 4 took ([\d.]+) s: the 2 steps left take about ([\d.]+) s more at that pace", printed
    )
    assert line and float(line.group(2)) == pytest.approx(float(line.group(1)), abs=0.11)  # 2 steps timed, 2 left
    assert printed.index("== scalevec-train: the plan ==") < line.start() < printed.index("== scalevec-train: done")
    assert pace(90.0, 10, 40, 1000) == (
        "pace         steps 11 to 40 took 1.5 min: the 960 steps left take about 48.0 min more at that pace "
        "(evaluations and saves come on top)"
    )


def test_the_end_of_run_block_holds_what_all_results_holds(run):
    output, printed = run
    done = printed[printed.index("== scalevec-train: done ==") :]
    results = json.loads((output / "all_results.json").read_text())
    summary = json.loads((output / "run_summary.json").read_text())
    assert summary["eval"] == {key: value for key, value in results.items() if key.startswith("eval_")}
    eval_line = re.search(r"eval +loss (\d+\.\d+) nats per token, perplexity (\d+\.\d), (\d\.\d+) bits per byte", done)
    assert float(eval_line.group(1)) == round(results["eval_loss"], 4)
    assert float(eval_line.group(2)) == round(results["eval_perplexity"], 1)
    assert float(eval_line.group(3)) == round(results["eval_bits_per_byte"], 3)
    last = [entry for entry in log_history(output) if "loss" in entry][-1]
    assert summary["final_train_loss"] == last["loss"] and summary["final_train_loss_step"] == 6
    mean = sum(entry["loss"] * 2 for entry in log_history(output) if "loss" in entry) / 6  # each log: 2 steps
    assert summary["mean_train_loss"] == pytest.approx(mean, rel=1e-12) and summary["mean_train_loss_steps"] == 6
    assert summary["mean_train_loss"] == pytest.approx(results["train_loss"], rel=1e-6)  # the Trainer's, one segment
    assert (
        f"train loss   {last['loss']:.4f} at step 6 (the last logged; the mean over all 6 steps was {mean:.4f}" in done
    )
    assert summary["tokens_seen"] == 768 and "6 steps, 768 tokens in" in done
    mfu = 100 * summary["tokens_per_second"] * model_flops(output) / PEAK
    assert summary["mfu_percent"] == pytest.approx(mfu, rel=1e-3)
    assert "model.safetensors" in done and "run_summary.json" in done


def test_the_evaluation_record_is_read_in_one_place_and_written_back_unchanged(run):
    output, printed = run
    recorded = json.loads((output / TRAINING_DATA).read_text())
    evaluation = EvaluationRecord.read(recorded)
    assert evaluation.to_record() == recorded["eval"]
    assert list(evaluation.to_record()) == list(recorded["eval"])  # the same keys in the same order: the same file
    assert evaluation.evaluated_tokens == evaluation.evaluated_blocks * 32 and len(evaluation.sets) == 1
    assert EvaluationRecord.read({"eval": {"name": "x", "blocks": 0, "tokens": 9}}).sets == []  # nothing evaluated
    assert EvaluationRecord.read({"eval": {"name": "x", "what": 1}}) is None  # another version's: said nothing of
    # The plan and the end block say which of the three counts each is: held out, read, predicted.
    predicted = evaluation.evaluated_tokens - evaluation.evaluated_blocks
    assert f"each evaluation reads {evaluation.evaluated_tokens:,} tokens (" in printed
    assert f"and predicts {predicted:,} of them (all but each block's first)" in printed
    assert f"{predicted:,} tokens predicted" in printed[printed.index("== scalevec-train: done ==") :]


def model_flops(output) -> float:
    return model_flops_per_token(ScaleVecForCausalLM.from_pretrained(output).config, 32)


def test_a_card_is_titled_by_name_and_names_its_data_and_hardware(run, tmp_path):
    output, _ = run
    export_checkpoint(output, tmp_path / "llama", "llama", OutputOptions(before_commit=card_writer(output)))
    card = (tmp_path / "llama" / "README.md").read_text()
    title = re.search(r"\n# (.+)\n", card).group(1)
    assert title.startswith("ScaleVec unified dense language model, ") and title.endswith(" M parameters")
    assert "llama" not in title and "run" not in title
    assert f"| `{corpus_name()}` |" in card and "tokenizer the embedded byte-level BPE (4,096 tokens)" in card
    assert re.search(r"\| training wall time \| [\d.]+ s on 1 × CPU \(.+, \d+ threads\) \(fp32\) \|", card)
    assert "| throughput |" in card and "model FLOPs utilisation" in card
    # A count of tokens as a whole number, saying which ones; other figures to 4 decimals.
    predicted = json.loads((output / "all_results.json").read_text())["eval_tokens"]
    assert f"| eval tokens | {predicted:,} predicted (every token of the blocks read but each block's first) |" in card
    assert re.search(r"\| eval loss \| \d+\.\d{4} \|", card)
    assert "eval tokens per second" not in card  # the evaluation's speed is no figure of the model
    named = card_writer(output, repo_id="someone/tiny", model_name="Tiny ScaleVec")
    export_checkpoint(output, tmp_path / "named", "llama", OutputOptions(before_commit=named))
    assert "\n# Tiny ScaleVec\n" in (tmp_path / "named" / "README.md").read_text()


def test_the_picture_gives_every_site_its_own_style_and_every_panel_its_own_legend():
    model = ScaleVecForCausalLM(tiny_config(num_hidden_layers=3))
    randomize_scales(model)
    stats = scale_statistics(model)
    assert len(stats) > 10  # more sites than a colour cycle has colours
    figure = run_figure([{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}], stats)
    _, means, anisotropy = figure.axes
    for panel in (means, anisotropy):
        styles = [(line.get_color(), line.get_linestyle(), line.get_marker()) for line in panel.get_lines()]
        assert len(styles) == len(stats) == len(set(styles))
        legend = panel.get_legend()
        assert [text.get_text() for text in legend.get_texts()] == sorted(stats)
    assert any(text.get_text() == READING for text in figure.texts)
    matplotlib.pyplot.close(figure)
