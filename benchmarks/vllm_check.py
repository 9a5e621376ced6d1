"""vLLM serving ScaleVec folders, checked against transformers. In this environment it saves tiny ScaleVec models
with scales moved away from 1 (dense with QK-norm, dense without, MoE) and a byte-level BPE tokenizer, and writes
each as its training form (`save_pretrained`), its folded remote-code folder (`fold_checkpoint`) and its stock
export (Qwen3, Llama, Mixtral). A second Python with vLLM then serves every folder in its own process (ScaleVec
folders through the Transformers backend, exports through vLLM's own implementations) and reports the greedy tokens,
their log-probabilities and the classes vLLM gave the model's modules; this process compares them with the greedy
`generate` of the training-form model in transformers.

    python benchmarks/vllm_check.py --vllm-python /path/to/vllm-venv/bin/python [--json report.json]

Heads are 32 wide, the smallest that vLLM's CPU attention takes.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _common import move_scales_off_one

DIMS = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
CASES = {  # name: (config fields, stock export)
    "dense-qk-norm": (dict(qk_norm=True), "qwen3"),
    "dense": ({}, "llama"),
    "moe": (dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "mixtral"),
}
PROMPTS = ["def main():", "Return the sum of", "hello world, hello"]
NEW_TOKENS = 8
SHOWN = re.compile(r"(embed_tokens|_proj|gate|experts|norm|lm_head)$")

SERVE = """
import json, re, sys, time
sys.modules["scalevec"] = None  # the folder's own code, not the package


def main():
    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    folder, impl, prompts, new_tokens, report = sys.argv[1:6]
    start = time.perf_counter()
    llm = LLM(model=folder, model_impl=impl, trust_remote_code=True, dtype="float32", max_model_len=64,
              max_num_seqs=4, enforce_eager=True, seed=0)
    loaded = time.perf_counter()
    params = SamplingParams(max_tokens=int(new_tokens), temperature=0, logprobs=1, ignore_eos=True)
    outputs = llm.generate(json.loads(prompts), params)
    done = time.perf_counter()
    modules = llm.apply_model(
        lambda model: {re.sub(r"\\.\\d+\\.", ".N.", n): type(m).__name__ for n, m in model.named_modules()}
    )[0]
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    result = dict(
        versions=f"vllm {vllm.__version__}, transformers {transformers.__version__}",
        prompt_ids=[list(o.prompt_token_ids) for o in outputs],
        tokens=tokens,
        logprobs=[[lp[t].logprob for t, lp in zip(ts, o.outputs[0].logprobs)] for ts, o in zip(tokens, outputs)],
        load_s=loaded - start,
        generate_s=done - loaded,
        modules=modules,
    )
    json.dump(result, open(report, "w"))


if __name__ == "__main__":
    main()
"""


def save_folders(root: Path) -> dict[str, dict]:
    """Every case's three folders; returns, per case, the training-form model's greedy tokens on `PROMPTS`."""
    from transformers import AutoTokenizer

    from scalevec import ScaleVecConfig, ScaleVecForCausalLM
    from scalevec.convert import export_checkpoint, fold_checkpoint
    from scalevec.data.corpus import train_tokenizer

    tokenizer = train_tokenizer(PROMPTS * 20 + ["def sum(a, b): return a + b"] * 20, DIMS["vocab_size"])
    references = {}
    for name, (fields, target) in CASES.items():
        torch.manual_seed(0)
        model = ScaleVecForCausalLM(ScaleVecConfig(**DIMS, **fields)).eval()
        move_scales_off_one(model)
        model.save_pretrained(root / f"{name}-trained")
        tokenizer.save_pretrained(root / f"{name}-trained")
        fold_checkpoint(root / f"{name}-trained", root / f"{name}-folded")
        export_checkpoint(root / f"{name}-trained", root / f"{name}-{target}", target)
        references[name] = greedy(model, AutoTokenizer.from_pretrained(root / f"{name}-trained"))
    return references


def greedy(model, tokenizer) -> dict:
    """transformers' greedy `generate` on every prompt: prompt ids, new tokens, their log-probabilities, and the
    smallest gap between the two best logits (how far greedy is from a tie)."""
    result = dict(prompt_ids=[], tokens=[], logprobs=[], margin=float("inf"))
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(
            ids, max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
        new = out.sequences[0, ids.shape[1] :]
        logits = torch.cat(out.logits).float()
        top2 = logits.topk(2).values
        result["prompt_ids"].append(ids[0].tolist())
        result["tokens"].append(new.tolist())
        result["logprobs"].append(logits.log_softmax(-1).gather(-1, new[:, None])[:, 0].tolist())
        result["margin"] = min(result["margin"], (top2[:, 0] - top2[:, 1]).min().item())
    return result


def serve(vllm_python: str, folder: Path, impl: str) -> dict:
    """Serve `folder` in a fresh vLLM process; its report, or the exception that stopped it."""
    report = folder / "vllm.json"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": "",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in this process, so that apply_model sees the model
    }
    command = [vllm_python, "-c", SERVE, str(folder), impl, json.dumps(PROMPTS), str(NEW_TOKENS), str(report)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env, cwd=folder)
    if result.returncode:
        errors = re.findall(r"^(?:\[rank\d+\]: )?(\w+(?:Error|Exception): .*)$", result.stderr, re.MULTILINE)
        return dict(error=errors[-1] if errors else result.stderr[-2000:])
    return json.loads(report.read_text())


def compare(served: dict, reference: dict) -> dict:
    diffs = [
        abs(a - b) for ours, theirs in zip(served["logprobs"], reference["logprobs"]) for a, b in zip(ours, theirs)
    ]
    return dict(
        prompt_ids_equal=served["prompt_ids"] == reference["prompt_ids"],
        tokens_equal=served["tokens"] == reference["tokens"],
        max_logprob_diff=max(diffs),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True, help="the Python of an environment with vLLM")
    parser.add_argument("--json", type=Path, help="also write the whole report here")
    args = parser.parse_args()
    report, failed = {}, False
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory)
        references = save_folders(root)
        for name, (_, target) in CASES.items():
            print(f"== {name}: transformers' greedy tokens {references[name]['tokens']}")
            print(f"   smallest gap between the two best logits: {references[name]['margin']:.2e}")
            for form, impl in (("folded", "transformers"), (target, "auto"), ("trained", "transformers")):
                served = serve(args.vllm_python, root / f"{name}-{form}", impl)
                report[f"{name}-{form}"] = served
                if "error" in served:
                    print(f"-- {form} (model_impl={impl}): refused: {served['error']}")
                    failed |= form != "trained" or "would drop its scale vectors" not in served["error"]
                    continue
                served["comparison"] = comparison = compare(served, references[name])
                failed |= not (comparison["tokens_equal"] and comparison["prompt_ids_equal"])
                print(
                    f"-- {form} (model_impl={impl}, {served['versions']}): {comparison}, "
                    f"load {served['load_s']:.1f} s, generate {served['generate_s']:.2f} s"
                )
                for module, cls in served["modules"].items():
                    if SHOWN.search(module):
                        print(f"   {module}: {cls}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
