#!/usr/bin/env python3
"""Check tandem against transformers 5.23.0 on a Gemma 4 checkpoint and, optionally, its assistant.

The tests in ``tests/`` compare tandem with transformers on tiny checkpoints that
``scripts/fixtures`` builds. This script makes the same comparison on any checkpoint, e.g. the
published ones, wherever they can be downloaded:

    python3.11 -m venv .venv
    .venv/bin/pip install -r scripts/check_checkpoint/requirements.txt
    cargo build --release
    .venv/bin/python scripts/check_checkpoint/check.py \\
        --target google/gemma-4-E2B-it --assistant google/gemma-4-E2B-it-assistant

``--target`` / ``--assistant`` take a local model directory or a Hugging Face repo id (downloaded
with ``huggingface_hub``; gated repos need ``HF_TOKEN``). Checks, per prompt:

  prompt ids  with a tokenizer, tandem's ``--chat`` prompt ids equal transformers'
              ``apply_chat_template(add_generation_prompt=True)``;
  greedy      tandem's greedy continuation (``--ignore-eos``) is compared with transformers' (an eager
              greedy loop over ``model(...)`` with its KV cache, in the checkpoint's dtype, ties to the
              lowest id), up to the first step where they part;
  distance    how far each is from exact arithmetic: transformers also runs the same weights in
              float32 over the same tokens, and for every step up to and including the first
              difference, both tandem and transformers' own run in the checkpoint dtype are compared
              with it: the mean |Δ log-probability| over the ``--top`` tokens that run finds most
              likely (every value is known exactly), averaged over those steps. The check fails when tandem's distance exceeds ``--ratio``
              (1.5) times transformers' own (plus 1e-3 nats, the float32 noise floor; for a float32
              checkpoint that floor is the whole bound). So a departure is a failure only when tandem
              is clearly further from exact arithmetic than transformers' bf16 run is; at real widths
              bf16 rounding alone moves log-probabilities by tenths of a nat, and greedy paths part
              where neither bf16 run is "right" (a fixed top-2 margin cannot tell that apart);
  lossless    with ``--assistant``, tandem's speculative output for each ``--draft-tokens`` value
              equals tandem's plain output token for token (acceptance and speed are reported).

Without a tokenizer the prompts are random token ids. A JSON report goes to stdout, progress to
stderr; the exit status is 0 when every check passes and 1 otherwise.

transformers 5.23.0 mis-derives ``kv_sharing_modes`` in some configurations (docs/model.md, "KV sharing"); the fix
that ``scripts/fixtures/make_fixtures.py`` applies is applied here too.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer
import gc

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "fixtures"))
from make_fixtures import patch_kv_sharing_modes  # noqa: E402

PROMPTS = [
    "Why is the sky blue?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "List three prime numbers greater than 100 and explain how you checked them.",
    "What is the capital of Australia? Answer in one sentence.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TOWERS = ("vision_tower", "embed_vision", "audio_tower", "embed_audio")
# Distances below this (nats) are float32 noise, not a difference between implementations.
FLOOR = 1e-3
FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def resolve(name: str) -> Path:
    """A local directory as it is, or a hub repo id downloaded (weights, configs, tokenizer)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path.resolve()
    from huggingface_hub import snapshot_download

    log(f"downloading {name} ...")
    return Path(snapshot_download(repo_id=name, allow_patterns=FILES))


def model_class(config):
    kind = config.model_type
    names = {
        "gemma4": "Gemma4ForConditionalGeneration",
        "gemma4_unified": "Gemma4UnifiedForConditionalGeneration",
        "gemma4_text": "Gemma4ForCausalLM",
        "gemma4_unified_text": "Gemma4UnifiedForCausalLM",
    }
    if kind not in names:
        raise SystemExit(f"not a Gemma 4 target: model_type {kind!r}")
    return getattr(transformers, names[kind])


def checkpoint_dtype(config) -> str:
    text = getattr(config, "text_config", None) or config
    dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None) or "bfloat16"
    return str(dtype).replace("torch.", "")


@torch.no_grad()
def reference_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float], torch.Tensor]:
    """Greedy continuation without stopping, the top-2 logit margin at each step, and each step's
    log-probabilities ([n, V], float32)."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    tokens, margins, logprobs = [], [], []
    for step in range(n):
        logits = out.logits[0, -1].float()
        top = torch.topk(logits, 2)
        token = int(torch.argmax(logits))  # the first maximum: the lowest id among ties
        tokens.append(token)
        margins.append(float(top.values[0] - top.values[1]))
        logprobs.append(torch.log_softmax(logits, -1))
        if step + 1 < n:
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins, torch.stack(logprobs)


@torch.no_grad()
def float32_logprobs(model, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """Log-probabilities of the float32 model before each of `tokens` (one forward): [len(tokens), V]."""
    seq = ids + tokens[:-1] if tokens else ids
    logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, len(ids) - 1 :].float()
    return torch.log_softmax(logits, -1)


def step_distance(exact: torch.Tensor, other: list[tuple[int, float]] | torch.Tensor, top: int) -> float:
    """Mean |Δ log-probability| against the float32 row `exact` over the `top` tokens that the run being
    measured finds most likely. `other` is that run's full row, or its top tokens as (id, log-probability),
    most likely first (what tandem's --top-logprobs reports)."""
    if isinstance(other, torch.Tensor):
        values, ids = torch.topk(other, top)
        pairs = zip(ids.tolist(), values.tolist())
    else:
        pairs = other[:top]
    pairs = list(pairs)
    return float(sum(abs(lp - float(exact[i])) for i, lp in pairs) / len(pairs))


def tandem(binary: Path, args: list[str]) -> dict:
    proc = subprocess.run([str(binary), *args, "--json"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tandem {' '.join(args)} failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def sig(x: float) -> float:
    """Three significant digits, for the report."""
    return float(f"{x:.3g}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="model directory or hub repo id")
    parser.add_argument("--assistant", help="assistant directory or hub repo id")
    parser.add_argument("--tandem", type=Path, default=REPO / "target" / "release" / "tandem")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts to run")
    parser.add_argument("--draft-tokens", nargs="*", default=["1", "4", "auto"])
    parser.add_argument("--ratio", type=float, default=1.5,
                        help="fail when tandem's distance from float32 exceeds this times transformers' own")
    parser.add_argument("--top", type=int, default=10, help="log-probabilities compared per step (each run's most likely)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()

    if transformers.__version__ != "5.23.0":
        log(f"warning: the reference is transformers 5.23.0; this is {transformers.__version__}")
    if not args.tandem.is_file():
        raise SystemExit(f"{args.tandem} not found: run `cargo build --release` first")
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    patch_kv_sharing_modes()

    target_dir = resolve(args.target)
    assistant_dir = resolve(args.assistant) if args.assistant else None
    config = AutoConfig.from_pretrained(target_dir)
    dtype = checkpoint_dtype(config)

    def load(torch_dtype):
        log(f"loading {target_dir} in transformers ({str(torch_dtype).replace('torch.', '')}) ...")
        model, info = model_class(config).from_pretrained(
            target_dir, dtype=torch_dtype, attn_implementation="eager", output_loading_info=True
        )
        # transformers fills what it cannot find with random values: no reference at all. (Vision and audio
        # towers do not take part in a text-only comparison.)
        missing = sorted(k for k in info.get("missing_keys", ()) if not any(t in k for t in TOWERS))
        if missing:
            raise SystemExit(f"transformers finds no weights for {len(missing)} parameters (e.g. {missing[0]}) in {target_dir}")
        return model.eval()

    model = load(DTYPES[dtype])

    has_tokenizer = (target_dir / "tokenizer.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(target_dir) if has_tokenizer else None
    vocab = (getattr(config, "text_config", None) or config).vocab_size
    rng = random.Random(7)

    report = {"target": str(args.target), "assistant": args.assistant, "dtype": dtype, "ratio": args.ratio,
              "top": args.top, "prompts": []}
    pending = []  # (prompt number, entry, ids, compared tokens, transformers' log-probabilities, tandem's, first difference)
    ok = True
    for n, text in enumerate(PROMPTS[: args.prompts]):
        entry: dict = {}
        if tokenizer is not None:
            messages = [{"role": "user", "content": text}]
            ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
            ours = tandem(args.tandem, ["generate", "--model", str(target_dir), "--chat", text, "--max-new-tokens", "1"])
            entry["text"] = text
            entry["prompt_ids_match"] = ours["prompt_ids"] == ids
            ok &= entry["prompt_ids_match"]
        else:
            ids = [2] + [rng.randrange(3, vocab) for _ in range(11 + 3 * n)]
        entry["prompt_ids"] = ids
        log(f"prompt {n + 1}: {len(ids)} tokens")

        t0 = time.time()
        ref, margins, ref_lp = reference_greedy(model, ids, args.max_new_tokens)
        entry["transformers_seconds"] = round(time.time() - t0, 2)
        common = ["generate", "--model", str(target_dir), "--prompt-ids", ",".join(map(str, ids)),
                  "--max-new-tokens", str(args.max_new_tokens), "--ignore-eos"]
        plain = tandem(args.tandem, common + ["--top-logprobs", str(args.top)])
        got = plain["tokens"]
        at = first_difference(got, ref)
        entry["greedy"] = {"tokens": got, "transformers": ref, "decode_tokens_per_s": plain["stats"]["decode_tokens_per_s"]}
        if at is None:
            entry["greedy"]["result"] = "identical"
        else:
            entry["greedy"]["result"] = f"identical up to step {at} (transformers' top-2 margin there {margins[at]:.4f})"
        log(f"  greedy: {entry['greedy']['result']}")
        # Steps 0..=at saw the same tokens in both engines; their log-probabilities are compared below.
        steps = len(ref) if at is None else min(at + 1, len(ref), len(got))
        ours = [[(int(t), float(lp)) for t, lp in step["top"]] for step in plain["logprobs"][:steps]]
        pending.append((n + 1, entry, ids, ref[:steps], ref_lp[:steps].clone(), ours, at))

        if assistant_dir is not None:
            entry["speculative"] = []
            for k in args.draft_tokens:
                spec = tandem(args.tandem, common + ["--assistant", str(assistant_dir), "--draft-tokens", k])
                same = spec["tokens"] == got
                ok &= same
                stats = spec["stats"]
                entry["speculative"].append({
                    "draft_tokens": k,
                    "identical_to_plain": same,
                    "mean_accepted_per_round": stats.get("mean_accepted_per_round"),
                    "acceptance_rate": stats.get("acceptance_rate"),
                    "speedup": stats["decode_tokens_per_s"] / max(plain["stats"]["decode_tokens_per_s"], 1e-9),
                })
                log(f"  draft tokens {k}: {'identical' if same else 'DIFFERENT'}, "
                    f"{stats.get('mean_accepted_per_round', 0):.2f} accepted per round")
        report["prompts"].append(entry)

    # Exact arithmetic: the same weights in float32 over the same tokens (loaded after the model-dtype run
    # is freed, so that both never sit in memory together).
    if dtype != "float32":
        del model
        gc.collect()
        model = load(torch.float32)
    for n, entry, ids, tokens, ref_lp, ours, at in pending:
        exact = float32_logprobs(model, ids, tokens)
        theirs = [step_distance(exact[i], ref_lp[i], args.top) for i in range(len(tokens))]
        mine = [step_distance(exact[i], ours[i], args.top) for i in range(len(tokens))]
        d_ref = sum(theirs) / max(len(theirs), 1)
        d_ours = sum(mine) / max(len(mine), 1)
        bound = args.ratio * d_ref + FLOOR
        passed = d_ours <= bound
        ok &= passed
        entry["distance"] = {
            "steps": len(tokens),
            "tandem_vs_float32": sig(d_ours),
            f"transformers_{dtype}_vs_float32": sig(d_ref),
            "bound": sig(bound),
            "passed": passed,
        }
        if at is not None and at < len(tokens):
            entry["distance"]["at_first_difference"] = {
                "tandem_vs_float32": sig(mine[at]),
                f"transformers_{dtype}_vs_float32": sig(theirs[at]),
            }
        verdict = "ok" if passed else "TOO FAR"
        log(f"prompt {n}: mean |Δ logprob| over {len(tokens)} steps: tandem {d_ours:.3g}, "
            f"transformers {dtype} {d_ref:.3g} (bound {bound:.3g}): {verdict}")

    report["passed"] = ok
    print(json.dumps(report, indent=1))
    log("PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
