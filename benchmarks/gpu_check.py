"""The first run on a rented GPU: does everything work, and how fast. One command, no network, nothing installed;
writes `report.json` (every figure, error and timing) and `report.md` (the tables) into OUTPUT_DIR, after each
section, so a run cut short still leaves its report.

    python benchmarks/gpu_check.py OUTPUT_DIR          # CUDA, bf16: about 7 minutes on one H100 / H200
    python benchmarks/gpu_check.py OUTPUT_DIR --cpu    # the same code paths at tiny sizes on CPU, under 2 minutes

- smoke: the quickstart pipeline on the device in bf16 (`scalevec.train.cli.train` for a few steps on the embedded
  corpus; fold and export with `scalevec.convert`; reload; the same greedy tokens as the training form), dense and
  MoE, with SDPA, `flash_attention_2` where importable, `--torch-compile`, and each MoE `experts_implementation`;
- throughput at the `0.12b` and `moe-0.6b` presets, sequence 2048: HF Llama / Qwen3-MoE of the same shape against
  ScaleVec standard and unified, eager and compiled (each decoder layer with inductor), interleaved, under bf16
  autocast with fused AdamW (what `scalevec-train --bf16 true` runs), at the largest micro-batch that fits:
  tokens/s, MFU, peak memory;
- decode: `generate` tokens/s of a training-form model and of its folded export.

Each section runs on its own: an exception is recorded and the next section runs; one that would not fit in what
is left of the time budget is skipped, and recorded as such. `--sections smoke throughput` runs only the sections
whose names start so. Exit status 1 if a check failed or a section raised.
"""

import argparse
import contextlib
import gc
import importlib.util
import json
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from _common import interleaved_medians, machine, move_scales_off_one, peak_memory_during, today, training_step
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, AutoTokenizer

from scalevec import ScaleVecConfig, ScaleVecForCausalLM
from scalevec.convert import export_checkpoint
from scalevec.convert.formats import FORMATS
from scalevec.quickstart import PROMPT
from scalevec.train.cli import parse_arguments, train
from scalevec.train.presets import MODEL_SIZES
from scalevec.train.throughput import device_peak_flops, model_flops_per_token

STOCK = {"dense": "llama", "moe": "qwen3_moe"}
FAMILY = {kind: (stock, "standard", "unified") for kind, stock in STOCK.items()}
EXPERTS_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
FP32_TOLERANCE = 1e-4  # max |logit difference| of a folded model in float32 (DESIGN.md)
# bf16: a folded model's logits may differ from the float32 ones by twice what the training form's own bf16
# logits do (bf16 rounding, not folding, sets the scale), plus this much for logits that bf16 happens to hit
BF16_SLACK = 0.02
BOTH_DTYPES = (torch.float32, torch.bfloat16)
SAME_TOKENS = 16  # greedy tokens that a folded model must generate as the training form does


@dataclass(frozen=True)
class Sizes:
    """Everything the check's size depends on: a GPU's, or tiny ones that run the same code on CPU."""

    device: str
    presets: dict[str, str]  # kind -> MODEL_SIZES key, for throughput and decode
    smoke_presets: dict[str, str]  # kind -> --model-size of the smoke runs
    smoke_steps: int
    smoke_seq_len: int
    smoke_batch: int
    seq_len: int
    vocab_size: int
    max_micro_batch: int
    repetitions: int
    warmup: int
    compile_backend: str
    decode_prompt: int
    decode_new_tokens: int
    budget_minutes: float
    estimates: dict[str, float]  # seconds a section takes, by name prefix: skipped if it would not fit


GPU = Sizes(
    device="cuda",
    presets={"dense": "0.12b", "moe": "moe-0.6b"},
    smoke_presets={"dense": "tiny", "moe": "tiny-moe"},
    smoke_steps=10,
    smoke_seq_len=256,
    smoke_batch=4,
    seq_len=2048,
    vocab_size=32768,
    max_micro_batch=64,
    repetitions=5,
    warmup=3,
    compile_backend="inductor",
    decode_prompt=32,
    decode_new_tokens=128,
    budget_minutes=7,
    estimates={"smoke": 20, "smoke compiled": 60, "throughput": 110, "decode": 30},
)
CPU = Sizes(
    device="cpu",
    presets={"dense": "tiny", "moe": "tiny-moe"},
    smoke_presets={"dense": "tiny", "moe": "tiny-moe"},
    smoke_steps=6,
    smoke_seq_len=32,
    smoke_batch=2,
    seq_len=64,
    vocab_size=512,
    max_micro_batch=2,
    repetitions=2,
    warmup=1,
    compile_backend="aot_eager",  # what dynamo traces, without inductor's minute of C++ compilation per graph
    decode_prompt=8,
    decode_new_tokens=8,
    budget_minutes=2,
    estimates={"smoke": 4, "smoke compiled": 10, "throughput": 10, "decode": 4},
)


def check(name: str, ok: bool, detail: str) -> dict:
    return {"name": name, "ok": bool(ok), "detail": detail}


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def exact_fp32_matmuls() -> None:
    """Plain float32 matmuls for the comparisons (`--torch-compile` turns TF32 on), with torch's newer API where it
    has it, as transformers does: torch refuses to read a TF32 setting made with both."""
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    else:
        torch.backends.cuda.matmul.allow_tf32 = False


# --- report ---------------------------------------------------------------------------------------------------


@dataclass
class Report:
    """Sections run one by one, each result (or error, or reason to skip) recorded and written at once.

    A section returns a dict of any of: `facts` (name -> value), `rows` (a table), `checks` and `goals` (rows of
    `check`), `errors` (what -> message); only checks and errors make it fail."""

    output_dir: Path
    budget_s: float
    environment: dict
    started: float = field(default_factory=time.perf_counter)
    sections: dict[str, dict] = field(default_factory=dict)

    def remaining_s(self) -> float:
        return self.budget_s - (time.perf_counter() - self.started)

    def run(self, name: str, section: Callable[[], dict], estimate_s: float) -> None:
        if estimate_s > self.remaining_s():
            reason = f"needs about {estimate_s:.0f} s; {max(self.remaining_s(), 0):.0f} s of the budget left"
            self._record(name, {"status": "skipped", "reason": reason})
            return
        start = time.perf_counter()
        try:
            result = section()
            failed = result.get("errors") or not all(c["ok"] for c in result.get("checks", []))
            result = {"status": "failed" if failed else "ok", **result}
        except (Exception, SystemExit) as error:  # SystemExit: an argument parser's
            result = {"status": "error", "reason": f"{type(error).__name__}: {error}", "traceback": _tail()}
        result["seconds"] = round(time.perf_counter() - start, 1)
        self._record(name, result)
        free()

    def _record(self, name: str, result: dict) -> None:
        self.sections[name] = result
        print(f"gpu_check: {name}: {result['status']} ({result.get('seconds', 0)} s)", flush=True)
        self.write()

    @property
    def ok(self) -> bool:
        return all(section["status"] in ("ok", "skipped") for section in self.sections.values())

    def write(self) -> None:
        document = {
            "date": today(),
            "machine": machine(),
            "environment": self.environment,
            "seconds": round(time.perf_counter() - self.started, 1),
            "budget_seconds": self.budget_s,
            "ok": self.ok,
            "sections": self.sections,
        }
        (self.output_dir / "report.json").write_text(json.dumps(document, indent=1, default=str))
        (self.output_dir / "report.md").write_text(markdown(document))


def _tail() -> str:
    return "".join(traceback.format_exc().splitlines(keepends=True)[-25:])


def environment(sizes: Sizes) -> dict:
    cuda = sizes.device == "cuda"
    peak = device_peak_flops(sizes.device)
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "peak bf16 TFLOP/s": peak / 1e12 if peak else None,
        "device memory GiB": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None,
        "flash_attn importable": importlib.util.find_spec("flash_attn") is not None,
        "torch grouped_mm": hasattr(torch.nn.functional, "grouped_mm"),
    }


# --- smoke: the quickstart pipeline ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SmokeCase:
    kind: str  # "dense" or "moe"
    attention: str = "sdpa"
    compiled: bool = False
    experts: str | None = None  # a MoE's experts_implementation
    pipeline: bool = False  # also evaluate, fold, export, reload and generate

    @property
    def name(self) -> str:
        parts = [self.kind, self.attention, "compiled" if self.compiled else None]
        parts.append(f"experts {self.experts}" if self.experts else None)
        return "smoke " + ", ".join(part for part in parts if part)

    @property
    def folder(self) -> str:
        return self.name.replace(", ", "-").replace(" ", "-")


def smoke_cases(sizes: Sizes, flash: bool) -> list[SmokeCase]:
    cases = [SmokeCase("dense", pipeline=True), SmokeCase("moe", experts="eager", pipeline=True)]
    cases += [SmokeCase("dense", compiled=True), SmokeCase("moe", compiled=True, experts="eager")]
    cases += [SmokeCase("moe", experts=name) for name in EXPERTS_IMPLEMENTATIONS[1:]]
    if flash and sizes.device == "cuda":
        cases.append(SmokeCase("dense", attention="flash_attention_2"))
    return cases


def train_flags(case: SmokeCase, sizes: Sizes, run_dir: Path) -> list[str]:
    flags = [
        "--model-size", sizes.smoke_presets[case.kind],
        "--max-steps", str(sizes.smoke_steps),
        "--bf16", "true",
        "--seq-len", str(sizes.smoke_seq_len),
        "--per-device-train-batch-size", str(sizes.smoke_batch),
        "--logging-steps", "1",
        "--save-strategy", "no",
        "--report-to", "none",
        "--disable-tqdm", "true",
        "--max-documents", "400",
        "--max-eval-documents", "5",
        "--attn-implementation", case.attention,
        "--output-dir", str(run_dir),
    ]  # fmt: skip
    if case.kind == "moe":
        flags += ["--qk-norm", "true"]  # as moe-0.6b, and exportable as Qwen3-MoE
    if not case.pipeline:  # the held-out evaluation and the picture once per kind are enough
        flags += ["--eval-every", "0", "--scale-stats", "false"]
    if case.experts:
        flags += ["--config-overrides", json.dumps({"experts_implementation": case.experts})]
    if case.compiled:
        flags += ["--torch-compile", "true", "--torch-compile-backend", sizes.compile_backend]
    if sizes.device == "cpu":
        flags += ["--use-cpu", "true"]  # the Trainer's bf16 on CPU
    return flags


def logged_losses(run_dir: Path) -> list[float]:
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def smoke(case: SmokeCase, sizes: Sizes, workdir: Path, log: Path) -> dict:
    """`scalevec-train` for a few bf16 steps (its output into `log`): finite losses that go down; for a pipeline
    case, the exports' agreement with the training form too."""
    run_dir = workdir / case.folder
    with log.open("a") as stream, contextlib.redirect_stdout(stream):
        print(f"\n===== {case.name}", flush=True)
        metrics = train(*parse_arguments(train_flags(case, sizes, run_dir))).metrics
    losses = logged_losses(run_dir)
    finite = len(losses) == sizes.smoke_steps and all(map(math.isfinite, losses))
    checks = [
        check("losses finite", finite, ", ".join(f"{loss:.3f}" for loss in losses)),
        check("loss went down", losses[-1] < losses[0], f"{losses[0]:.3f} -> {losses[-1]:.3f}"),
    ]
    if case.pipeline:
        checks += exports_agree(run_dir, case.kind, sizes, workdir / f"{case.folder}-exports")
    return {"facts": {key: metrics[key] for key in ("eval_loss",) if key in metrics}, "checks": checks}


def load(path: Path, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The `new_tokens` greedy tokens after `ids`, with a KV cache (a trained checkpoint's config turns it off)."""
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True)
    return model.generate(ids, **options)[:, ids.shape[1] :]


@dataclass
class Outputs:
    logits: torch.Tensor  # float32, for the prompt
    tokens: torch.Tensor  # the greedy continuation


def outputs(path: Path, ids: torch.Tensor, new_tokens: int) -> dict[torch.dtype, Outputs]:
    """What the checkpoint at `path` computes for `ids`, in float32 and in bfloat16, on `ids`' device."""
    model = load(path, torch.float32, ids.device)
    found = {}
    for dtype in BOTH_DTYPES:
        model.to(dtype)
        with torch.no_grad():
            logits = model(ids).logits.float()
        found[dtype] = Outputs(logits, greedy(model, ids, new_tokens))
    return found


def exports_agree(run_dir: Path, kind: str, sizes: Sizes, export_dir: Path) -> list[dict]:
    """Fold and export the run (stock format and ScaleVec), reload each on the device and compare it with the
    training form: float32 logits within FP32_TOLERANCE and the same greedy tokens; bf16 logits about as close to
    the float32 ones as the training form's own bf16 logits (BF16 tolerance)."""
    exact_fp32_matmuls()
    ids = AutoTokenizer.from_pretrained(run_dir)(PROMPT, return_tensors="pt").input_ids.to(sizes.device)
    training = outputs(run_dir, ids, SAME_TOKENS)
    reference = training[torch.float32].logits
    bf16_error = (training[torch.bfloat16].logits - reference).abs().max().item()
    checks = []
    for target in (STOCK[kind], "scalevec"):
        verified = export_checkpoint(run_dir, export_dir / target, target).verification
        folded = outputs(export_dir / target, ids, SAME_TOKENS)
        fp32, bf16 = ((folded[dtype].logits - reference).abs().max().item() for dtype in BOTH_DTYPES)
        same = {dtype: folded[dtype].tokens.equal(training[dtype].tokens) for dtype in folded}
        bf16_detail = f"max abs diff from float32 {bf16:.3f}; the training form's {bf16_error:.3f}"
        checks += [
            check(f"{target}: converter's verification", verified.passed, verified.describe()),
            check(f"{target}: float32 logits", fp32 <= FP32_TOLERANCE, f"max abs diff {fp32:.2e}"),
            check(f"{target}: float32 greedy tokens", same[torch.float32], f"bf16: same {same[torch.bfloat16]}"),
            check(f"{target}: bf16 logits", bf16 <= 2 * bf16_error + BF16_SLACK, bf16_detail),
        ]
    return checks


# --- throughput ----------------------------------------------------------------------------------------------


def family_config(kind: str, preset: str, sizes: Sizes) -> ScaleVecConfig:
    """The ScaleVec config at `kind`'s preset with the scale preset `preset` ("standard" or "unified")."""
    fields = dict(MODEL_SIZES[sizes.presets[kind]], vocab_size=sizes.vocab_size, scale_preset=preset)
    if kind == "moe":
        fields["qk_norm"] = True  # Qwen3-MoE's: the stock model has the same shape
    return ScaleVecConfig(**fields, use_cache=False)  # as the Trainer trains: no KV cache built in training


def build(kind: str, name: str, sizes: Sizes) -> torch.nn.Module:
    """ScaleVec `name` ("standard", "unified") or the stock model of the same shape, float32 on the device."""
    torch.manual_seed(0)
    config = family_config(kind, "unified" if name == "unified" else "standard", sizes)
    if name == STOCK[kind]:
        config = FORMATS[name].stock_config(config)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(sizes.device)
    # Each layer's forward compiled, as torchtitan compiles each block: one graph that every layer reuses. Not the
    # whole call: transformers' output-capturing hooks on the layers read a ContextVar, a graph break in each.
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, backend=sizes.compile_backend)
    return model


def eager(step: Callable[[], None]) -> Callable[[], None]:
    """`step` with every compiled layer run eagerly: eager and compiled share one model and its optimizer."""

    def run() -> None:
        with torch.compiler.set_stance("force_eager"):
            step()

    return run


Steps = dict[tuple[str, str], Callable[[], None]]  # (model, "eager" or "compiled") -> one training step


def steps_at(models: dict[str, torch.nn.Module], batch: int, sizes: Sizes) -> Steps:
    """An eager and a compiled training step of every model (bf16 autocast, fused AdamW), `batch` sequences."""
    steps = {}
    for name, model in models.items():
        step = training_step(model, sizes.vocab_size, batch, sizes.seq_len, autocast=torch.bfloat16)
        steps[name, "eager"], steps[name, "compiled"] = eager(step), step
    return steps


def drop_gradients(models: dict[str, torch.nn.Module]) -> None:
    """After an out-of-memory error mid-backward, which left some gradients allocated."""
    for model in models.values():
        model.zero_grad(set_to_none=True)
    free()


def fits(models: dict[str, torch.nn.Module], batch: int, sizes: Sizes) -> bool:
    """Whether an eager step of every model at `batch` fits, with all their optimizer states held (as measured)."""
    steps = steps_at(models, batch, sizes)
    try:
        for (_, mode), step in steps.items():
            if mode == "eager":
                step()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del steps
        drop_gradients(models)


def largest_micro_batch(models: dict[str, torch.nn.Module], sizes: Sizes) -> int:
    batch = 1
    while batch * 2 <= sizes.max_micro_batch and fits(models, batch * 2, sizes):
        batch *= 2
    return batch


def warmed_up(steps: Steps, warmup: int) -> tuple[Steps, dict[str, str]]:
    """The steps that run (each called `warmup` times: compiled ones compile), and the error of each that fails."""
    working, errors = {}, {}
    for key, step in steps.items():
        try:
            for _ in range(warmup):
                step()
            working[key] = step
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            errors[" ".join(key)] = f"{type(error).__name__}: {error}"[:3000]
    return working, errors


def measured(models: dict[str, torch.nn.Module], batch: int, sizes: Sizes) -> tuple[list[dict], dict[str, str]]:
    """A row per model and mode: step time (interleaved medians), tokens/s, MFU, memory; and what failed."""
    steps, errors = warmed_up(steps_at(models, batch, sizes), sizes.warmup)
    seconds = interleaved_medians(steps, sizes.repetitions, warmup=0)
    step_peaks = {key: peak_memory_during(step) for key, step in steps.items()}
    peak = device_peak_flops(sizes.device)
    rows = []
    for (name, mode), step_seconds in seconds.items():
        model = models[name]
        tokens_per_second = batch * sizes.seq_len / step_seconds
        achieved = tokens_per_second * model_flops_per_token(model.config, sizes.seq_len)
        resident = 3 * sum(p.numel() * p.element_size() for p in model.parameters())  # weights, AdamW's moments
        rows.append(
            {
                "model": name,
                "mode": mode,
                "micro-batch": batch,
                "step s": step_seconds,
                "tokens/s": tokens_per_second,
                "MFU %": 100 * achieved / peak if peak else None,
                "model TFLOP/s": achieved / 1e12,
                "step peak GiB": step_peaks[name, mode] / 2**30,
                "memory GiB": (resident + step_peaks[name, mode]) / 2**30,
            }
        )
    return rows, errors


def with_ratios(rows: list[dict], stock: str) -> list[dict]:
    """Each row with its step time over the stock model's and over ScaleVec standard's, in the same mode."""
    times = {(row["model"], row["mode"]): row["step s"] for row in rows}
    for row in rows:
        for reference in (stock, "standard"):
            base = times.get((reference, row["mode"]))
            row[f"time / {reference}"] = row["step s"] / base if base else None
    return rows


def goals(rows: list[dict], stock: str) -> list[dict]:
    """Issue 30's goals for the dense family (the 0.12b preset on a GPU), per mode: standard no slower than the
    stock model and with its memory; unified at most 2 % (compiled) or 5 % (eager) slower than standard; unified's
    MFU at least the stock model's. Reported, not checked: they are targets, not correctness."""
    row = {(row["model"], row["mode"]): row for row in rows}
    found = []
    for mode, limit in (("compiled", 1.02), ("eager", 1.05)):
        if not all((name, mode) in row for name in FAMILY["dense"]):
            continue
        base, standard, unified = (row[name, mode] for name in (stock, "standard", "unified"))
        versus_stock, versus_standard = standard[f"time / {stock}"], unified["time / standard"]
        memory = f"{standard['memory GiB']:.3f} vs {base['memory GiB']:.3f} GiB"
        mfu = f"{_cell(unified['MFU %'])} vs {_cell(base['MFU %'])} %" if base["MFU %"] else "no peak known"
        found += [
            check(f"{mode}: standard / {stock} time <= 1", versus_stock <= 1, f"{versus_stock:.3f}"),
            check(
                f"{mode}: standard memory <= {stock}'s", standard["memory GiB"] <= 1.001 * base["memory GiB"], memory
            ),
            check(f"{mode}: unified / standard time <= {limit}", versus_standard <= limit, f"{versus_standard:.3f}"),
            check(f"{mode}: unified MFU >= {stock}'s", unified["tokens/s"] >= base["tokens/s"], mfu),
        ]
    return found


def largest_measured(models: dict[str, torch.nn.Module], sizes: Sizes) -> tuple[list[dict], dict[str, str]]:
    """`measured` at the largest micro-batch whose eager steps fit, halved while the compiled ones do not."""
    batch = largest_micro_batch(models, sizes)
    while True:
        try:
            return measured(models, batch, sizes)
        except torch.OutOfMemoryError:
            if batch == 1:
                raise
        batch //= 2
        drop_gradients(models)


def throughput(kind: str, sizes: Sizes) -> dict:
    torch._dynamo.reset()
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    stock = STOCK[kind]
    models = {name: build(kind, name, sizes) for name in FAMILY[kind]}
    rows, errors = largest_measured(models, sizes)
    compiled = {
        "compiled graphs": counters["stats"]["unique_graphs"] - graphs,
        "graph breaks": sum(counters["graph_break"].values()) - breaks,
    }
    facts = {"preset": sizes.presets[kind], "seq_len": sizes.seq_len, "vocab": sizes.vocab_size, **compiled}
    if kind == "moe":
        facts[f"{stock} experts_implementation"] = models[stock].config._experts_implementation
    rows = with_ratios(rows, stock)
    return {"facts": facts, "rows": rows, "errors": errors, "goals": goals(rows, stock) if kind == "dense" else []}


# --- decode --------------------------------------------------------------------------------------------------


def decode(kind: str, sizes: Sizes, workdir: Path) -> dict:
    """Greedy `generate` tokens/s in bf16: a training-form unified model (scales away from 1) and its folded export
    in the stock format, which is the stock model's speed."""
    train_dir, folded_dir = workdir / f"decode-{kind}", workdir / f"decode-{kind}-{STOCK[kind]}"
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(family_config(kind, "unified", sizes))
    move_scales_off_one(model)
    model.save_pretrained(train_dir)
    del model
    export_checkpoint(train_dir, folded_dir, STOCK[kind])
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, sizes.vocab_size, (1, sizes.decode_prompt), generator=generator).to(sizes.device)
    paths = {"training form": train_dir, f"folded ({STOCK[kind]})": folded_dir}
    models = {name: load(path, torch.bfloat16, sizes.device) for name, path in paths.items()}
    runs = {
        name: (lambda model=model: greedy(model, prompt, sizes.decode_new_tokens)) for name, model in models.items()
    }
    seconds = interleaved_medians(runs, sizes.repetitions, warmup=1)
    tokens = [run()[0] for run in runs.values()]
    rows = [
        {"model": name, "new tokens": sizes.decode_new_tokens, "s": s, "tokens/s": sizes.decode_new_tokens / s}
        for name, s in seconds.items()
    ]
    facts = {"preset": sizes.presets[kind], "same greedy tokens": bool(tokens[0].equal(tokens[1]))}
    return {"facts": facts, "rows": rows}


# --- markdown -------------------------------------------------------------------------------------------------


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value).replace("|", "/").replace("\n", " ")


def table(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_cell(row.get(column)) for column in columns) + " |" for row in rows]


def markdown(document: dict) -> str:
    verdict = "everything passed" if document["ok"] else "SOMETHING FAILED"
    budget = f"{document['seconds']:.0f} s of a {document['budget_seconds']:.0f} s budget"
    lines = [f"# ScaleVec GPU check, {document['date']}", "", f"{document['machine']}: {verdict}, {budget}.", ""]
    lines += table([{"": key, "value": value} for key, value in document["environment"].items()])
    lines += [
        "",
        f"Folded models: float32 logits within {FP32_TOLERANCE} of the training form's and the same {SAME_TOKENS} "
        f"greedy tokens; bf16 logits within 2 x the training form's own bf16 error (from its float32 logits) "
        f"+ {BF16_SLACK}.",
        "Memory GiB: float32 weights and AdamW moments, plus the step's peak above them (activations, gradients).",
    ]
    for name, section in document["sections"].items():
        lines += ["", f"## {name}: {section['status']} ({section.get('seconds', 0)} s)", ""]
        if section.get("reason"):
            lines += [f"`{_cell(section['reason'])[:1000]}`", ""]
        if section.get("facts"):
            lines += [", ".join(f"{key}: {_cell(value)}" for key, value in section["facts"].items()), ""]
        for key, title in (("rows", None), ("checks", "Checks:"), ("goals", "Goals (targets, not checks):")):
            if section.get(key):
                lines += ([title, ""] if title else []) + table(section[key]) + [""]
        lines += [f"**{what}**: `{_cell(message)[:500]}`\n" for what, message in section.get("errors", {}).items()]
    return "\n".join(lines) + "\n"


# --- main -----------------------------------------------------------------------------------------------------


def plan(sizes: Sizes, workdir: Path, log: Path) -> list[tuple[str, Callable[[], dict], float]]:
    """(name, section, estimated seconds), most telling first: a short budget skips the last."""
    cases = {case.name: case for case in smoke_cases(sizes, importlib.util.find_spec("flash_attn") is not None)}
    first, rest = list(cases)[:2], list(cases)[2:]

    def smoke_section(name):
        estimate = sizes.estimates["smoke compiled" if cases[name].compiled else "smoke"]
        return name, lambda: smoke(cases[name], sizes, workdir, log), estimate

    return [
        *map(smoke_section, first),
        ("throughput dense", lambda: throughput("dense", sizes), sizes.estimates["throughput"]),
        *map(smoke_section, rest),
        ("throughput moe", lambda: throughput("moe", sizes), sizes.estimates["throughput"]),
        ("decode dense", lambda: decode("dense", sizes, workdir), sizes.estimates["decode"]),
        ("decode moe", lambda: decode("moe", sizes, workdir), sizes.estimates["decode"]),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output_dir", type=Path, help="where report.json and report.md go")
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on a machine without CUDA: the same code")
    parser.add_argument("--budget-minutes", type=float, help="default: 7 on a GPU, 2 with --cpu")
    parser.add_argument("--sections", nargs="+", default=[""], help="run only sections whose names start so")
    args = parser.parse_args(argv)
    if args.cpu:
        torch.set_num_threads(1)  # tiny models: a second thread only waits (3 minutes instead of 1.3 on 2 cores)
    elif not torch.cuda.is_available():
        parser.error("no CUDA device: use --cpu for the CPU check")
    sizes = CPU if args.cpu else GPU
    budget = 60 * (args.budget_minutes or sizes.budget_minutes)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    report = Report(args.output_dir, budget, environment(sizes))
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as workdir:
        for name, section, estimate in plan(sizes, Path(workdir), args.output_dir / "train.log"):
            if any(name.startswith(prefix) for prefix in args.sections):
                report.run(name, section, estimate)
    print((args.output_dir / "report.md").read_text())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
