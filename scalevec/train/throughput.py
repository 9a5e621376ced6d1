"""Throughput while pretraining: model FLOPs per token, the peak FLOP/s of known accelerators, and a callback that
logs tokens per second, model FLOPs utilisation (MFU) and peak memory at every logging step. The run's clock across
resumes is `run_clock.RunClockCallback`'s."""

import sys
import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig, TrainerCallback

from .diagnostics import extend_log

try:
    import resource
except ImportError:  # Windows: no peak RSS to report
    resource = None


def _head_dim(config: PreTrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def matmul_parameters_per_token(config: PreTrainedConfig) -> int:
    """Weights of the matrix products one token goes through: q, k, v, o; the MLP's gate, up, down, or in a MoE
    layer the router, the `num_experts_per_tok` experts it picks and any shared expert with its gate; the LM head.
    Not the embedding (a lookup), norms or scale vectors (elementwise). Reads a ScaleVec, Llama, Qwen3, Mixtral or
    Qwen3-MoE config."""
    hidden, head_dim = config.hidden_size, _head_dim(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    attention = 2 * hidden * head_dim * (config.num_attention_heads + kv_heads)
    mlps = sum(_mlp_parameters_per_token(config, layer) for layer in range(config.num_hidden_layers))
    return config.num_hidden_layers * attention + mlps + hidden * config.vocab_size


def _num_experts(config: PreTrainedConfig) -> int:
    return getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None) or 0


def _is_moe_layer(config: PreTrainedConfig, layer: int) -> bool:
    # Qwen3-MoE's rule, which ScaleVec follows; Mixtral has neither field and every layer is MoE.
    sparse_step = getattr(config, "decoder_sparse_step", None) or 1
    dense_layers = getattr(config, "mlp_only_layers", None) or []
    return _num_experts(config) > 0 and layer not in dense_layers and (layer + 1) % sparse_step == 0


def _mlp_parameters_per_token(config: PreTrainedConfig, layer: int) -> int:
    hidden = config.hidden_size
    if not _is_moe_layer(config, layer):
        return 3 * hidden * config.intermediate_size
    expert_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size  # Mixtral: the latter
    shared_width = getattr(config, "shared_expert_intermediate_size", None) or 0
    router = hidden * _num_experts(config)
    experts = config.num_experts_per_tok * 3 * hidden * expert_width
    shared = 3 * hidden * shared_width + hidden if shared_width else 0  # the shared expert and its (H -> 1) gate
    return router + experts + shared


def model_flops_per_token(config: PreTrainedConfig, seq_len: int) -> float:
    """Training FLOPs (forward and backward) per token of a `seq_len`-token sequence, the PaLM / nanoGPT /
    torchtitan convention:

        6 * matmul_parameters_per_token(config) + 12 * layers * heads * head_dim * seq_len

    The first term is 2 FLOPs per multiply-add of every weight a token meets (`matmul_parameters_per_token`: MoE
    layers count the router, the active experts and any shared expert; the LM head counts; the embedding, norms and
    scale vectors do not), times 3 for the backward's two products. The second is attention's score (q k^T) and value
    (p v) products over the whole `seq_len` x `seq_len` square, without causal halving (a causal flash kernel skips
    about half). Model FLOPs, not hardware FLOPs: recomputation (gradient checkpointing, the scores a flash kernel
    recomputes in backward, the folded weights that ScaleVec recomputes) and elementwise work are not counted.
    `benchmarks/bench_flops.py` checks it against what `torch.utils.flop_counter` counts with eager attention."""
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * _head_dim(config) * seq_len
    return float(6 * matmul_parameters_per_token(config) + attention)


@dataclass(frozen=True)
class PeakFlops:
    """Dense (no sparsity) peak FLOP/s from the vendor's datasheet: 16-bit tensor (bf16 = fp16), TF32 tensor and
    plain fp32."""

    bf16: float
    tf32: float
    fp32: float


# Most specific name first: "gb200" holds "b200", "a100" holds "a10", "l40s" holds "l40" and "l4".
PEAK_FLOPS: tuple[tuple[str, PeakFlops], ...] = (
    ("gb200", PeakFlops(2.5e15, 1.25e15, 80e12)),
    ("b200", PeakFlops(2.25e15, 1.125e15, 75e12)),
    ("h200 nvl", PeakFlops(836e12, 418e12, 60e12)),
    ("h200", PeakFlops(989e12, 494.5e12, 67e12)),  # SXM, and GH200's GPU
    ("h100 nvl", PeakFlops(835e12, 417.5e12, 60e12)),
    ("h100 pcie", PeakFlops(756e12, 378e12, 51e12)),
    ("h100", PeakFlops(989e12, 494.5e12, 67e12)),  # SXM ("NVIDIA H100 80GB HBM3")
    ("a100", PeakFlops(312e12, 156e12, 19.5e12)),
    ("a10g", PeakFlops(70e12, 35e12, 35e12)),  # AWS's A10 variant, with half the A10's tensor rate
    ("a10", PeakFlops(125e12, 62.5e12, 31.2e12)),
    ("l40s", PeakFlops(362e12, 183e12, 91.6e12)),
    ("l40", PeakFlops(181e12, 90.5e12, 90.5e12)),
    ("l4", PeakFlops(121e12, 60e12, 30.3e12)),
    ("rtx 4090", PeakFlops(165.2e12, 82.6e12, 82.6e12)),  # GeForce: bf16 with fp32 accumulation
    ("mi325x", PeakFlops(1307.4e12, 653.7e12, 163.4e12)),
    ("mi300x", PeakFlops(1307.4e12, 653.7e12, 163.4e12)),
)


def peak_flops_by_name(device_name: str, dtype: torch.dtype = torch.bfloat16, tf32: bool = False) -> float | None:
    """Peak FLOP/s of the accelerator named `device_name` (as `torch.cuda.get_device_name` spells it) for matmuls in
    `dtype`: bf16 and fp16 on tensor cores; float32 as TF32 if `tf32`, else plain fp32. None for an unknown name."""
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"no peak FLOP/s for {dtype}: bfloat16, float16 and float32 are known")
    name = device_name.lower()
    peak = next((peak for pattern, peak in PEAK_FLOPS if pattern in name), None)
    if peak is None:
        return None
    if dtype != torch.float32:
        return peak.bf16
    return peak.tf32 if tf32 else peak.fp32


def device_peak_flops(
    device: torch.device | str, dtype: torch.dtype = torch.bfloat16, tf32: bool = False
) -> float | None:
    """`peak_flops_by_name` of a CUDA (or ROCm) device; None on CPU and other devices, or for an unknown GPU."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_by_name(torch.cuda.get_device_name(device), dtype, tf32)


def training_peak_flops(args) -> float | None:
    """The peak FLOP/s of one device that a run's MFU is taken against: `--peak-flops`, else `device_peak_flops` for
    the training dtype (bf16 with `--bf16` or `--fp16`, else TF32 with `--tf32`, else fp32); None when unknown."""
    dtype = torch.bfloat16 if args.bf16 or args.fp16 else torch.float32
    return getattr(args, "peak_flops", None) or device_peak_flops(args.device, dtype, tf32=bool(args.tf32))


def peak_memory_gib(device: torch.device | str) -> dict[str, float]:
    """`{"peak_memory_gib": ...}`, the largest CUDA allocation so far, on a GPU; elsewhere `{"peak_rss_gib": ...}`,
    the process's peak resident set size (none on Windows)."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    if resource is None:
        return {}
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"peak_rss_gib": peak_rss / (2**30 if sys.platform == "darwin" else 2**20)}


def _rounded(value: float) -> float:
    return float(f"{value:.4g}")


def throughput_figures(
    args, seconds: float, tokens: int, flops_per_token: float | None, peak_flops: float | None
) -> dict[str, float]:
    """Throughput, model TFLOP/s and MFU of `tokens` trained in `seconds` on `args.world_size` devices, given the
    model FLOPs per token and the peak FLOP/s of a device (either None: no TFLOP/s or no MFU), and the peak memory
    so far; each to 4 significant digits."""
    figures = peak_memory_gib(args.device)
    if tokens > 0 and seconds > 0:  # else the tokens were not counted (`include_num_input_tokens_seen` off)
        per_device = tokens / seconds / args.world_size
        figures.update(tokens_per_second=tokens / seconds, tokens_per_second_per_device=per_device)
        if flops_per_token is not None:
            achieved = per_device * flops_per_token
            figures["model_tflops_per_device"] = achieved / 1e12
            if peak_flops:
                figures["mfu_percent"] = 100 * achieved / peak_flops
    return {key: _rounded(value) for key, value in figures.items()}


class ThroughputCallback(TrainerCallback):
    """Adds to every training log, from the tokens the Trainer counted (`num_input_tokens_seen`, all processes)
    and the wall time since the previous log (`throughput_figures`):

    - `tokens_per_second` (all processes) and `tokens_per_second_per_device`;
    - `model_tflops_per_device`: `model_flops_per_token(config, seq_len)` times tokens per second per device;
    - `mfu_percent`: that over the device's peak (`peak_flops`, else `training_peak_flops(args)`), where one is known;
    - `peak_memory_gib` (CUDA's largest allocation so far) or, on CPU, `peak_rss_gib` (the process's peak RSS).

    Time spent evaluating or saving is left out: the window restarts after each.

    Place it before the loggers (`trainer.callback_handler.callbacks.insert(1, callback)`, as ScaleVecTrainer does
    with its scale statistics) for every `--report-to` logger to get these; passed as `callbacks=[...]`, it comes
    after them, and only the console and `log_history` do."""

    def __init__(self, seq_len: int | None, peak_flops: float | None = None):
        self.seq_len = seq_len
        self.peak_flops = peak_flops
        self.flops_per_token: float | None = None
        self._since: tuple[float, int] = (0.0, 0)  # (clock, tokens seen) where the current window began

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self.seq_len:  # without a sequence length: tokens per second and memory only
            self.flops_per_token = model_flops_per_token(getattr(model, "module", model).config, self.seq_len)
        if self.peak_flops is None:
            self.peak_flops = training_peak_flops(args)
        self._restart(state)

    def _restart(self, state) -> None:
        self._since = (time.perf_counter(), state.num_input_tokens_seen)

    def on_evaluate(self, args, state, control, **kwargs):
        self._restart(state)

    def on_save(self, args, state, control, **kwargs):
        self._restart(state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs:
            return
        # The Trainer has read the loss (`.item()`) before logging: the device has finished the steps timed here.
        now = time.perf_counter()
        seconds, tokens = now - self._since[0], state.num_input_tokens_seen - self._since[1]
        extend_log(state, logs, throughput_figures(args, seconds, tokens, self.flops_per_token, self.peak_flops))
        self._since = (now, state.num_input_tokens_seen)
