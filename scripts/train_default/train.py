#!/usr/bin/env python3
"""Train tandem's default model pair: a small Gemma 4 code model and its MTP assistant drafter.

Writes ``models/default/``:

  target/      gemma4_text (Gemma4ForCausalLM) checkpoint, bf16, with tokenizer and chat template
  assistant/   gemma4_assistant (Gemma4AssistantForCausalLM) drafter with the centroid head, bf16,
               generation_config.json carrying num_assistant_tokens, and a copy of the tokenizer
  heldout_prompts.json   prompts cut from held-out files, as text and as token ids
  training_summary.json  everything the model card reports (losses, times, recall, acceptance)

Usage (from the repository root; Python 3.11, CPU only)::

    python3.11 -m venv .venv
    .venv/bin/pip install -r scripts/train_default/requirements.txt
    OMP_NUM_THREADS=1 .venv/bin/python scripts/train_default/train.py

It takes about 50 minutes on one core of a 2024 server CPU with AVX512-BF16 (tokenizer under a
minute, target about 25 minutes, drafter data and training about 17 minutes, checks a few
minutes); a CPU without native bf16 matmuls is several times slower. ``--phase`` reruns one part
(``tokenizer``, ``target``, ``assistant``, ``check``) from the files an earlier run left.

Data
----
The corpus is the Python standard library of the interpreter that runs the script (located with
``sysconfig.get_paths()["stdlib"]``; PSF License, which permits this use): every ``*.py`` file
except tests, ``site-packages``, generated tables (``encodings`` code pages, ``pydoc_data``) and
machine-specific files (``_sysconfigdata*``). Files are split by a hash of their relative path:
1 in 20 is held out (never trained on, by either model or the tokenizer). The training stream is
the remaining files, each as ``<bos> source <eos>``, plus chat-formatted examples made from
documented functions of the training files (user turn: the docstring's summary; model turn: the
function), so the chat template has something to mean.

Tokenizer
---------
BPE with byte fallback (Hugging Face ``tokenizers``), vocabulary 4096 = 64 clusters x 64 tokens.
Spaces are written as U+2581 as in Gemma's tokenizers; a splitting regex keeps identifiers,
numbers, punctuation runs and newline+indentation runs apart. Gemma 4's special tokens sit at
their Gemma 4 ids (``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2, ``<unk>`` 3, ``<mask>`` 4, tool tokens
46-52, ``<|think|>`` 98, ``<|channel>`` 100, ``<channel|>`` 101, ``<|turn>`` 105, ``<turn|>`` 106);
unused ids below 107 are ``<unusedN>``. The 256 byte tokens follow, then the learned pieces.

Target
------
Gemma 4 text architecture at small scale, built and trained with transformers' own
``Gemma4ForCausalLM``: hidden 384, 6 layers ``[S,S,S,F,S,F]`` (sliding window 128, proportional
RoPE with partial factor 0.25 on the full layers), 6 query heads of 64 (sliding) / 128 (full)
dims and one KV head, MLP 1536, the last 2 layers (S, F) reuse the K/V of layers 2 (S) and 3 (F),
per-layer embeddings of width 16, final-logit softcap 30, tied embeddings. (The per-layer
embeddings are not just for coverage: transformers 5.23.0 crashes in
``_maybe_slice_kv_shared_inputs`` when KV sharing is on and PLE is off.) Next-token cross-entropy,
AdamW, bf16 autocast with f32 master weights, sequences of 256 tokens; saved in bf16.

Assistant (drafter) and its training objective
----------------------------------------------
A ``gemma4_assistant`` with 4 query-only layers ``[S,S,S,F]`` of width 128 that read the target's
store-layer K/V, trained by self-distillation to predict the target's own greedy continuation
exactly the way tandem runs it (docs/drafter.md and docs/speculative.md):

* data: the frozen bf16 target continues 64-token training windows greedily for 192 tokens, so the
  contexts look like what the drafter sees while decoding; one target forward over each
  256-token sequence x gives its store-layer K/V, its post-norm hidden states h_t and its greedy
  labels y_t = argmax logits_t (the token the target emits after x_0..x_t);
* a drafting round for committed length N has query position p = N-1 and K/V of positions
  0..p-1 (the full layer sees all of them, sliding layers the last W+1);
  step 1 input is [e(x_p); h_{p-1}] with e the target's scaled embedding;
  step j > 1 input is [e(previous draft token); post_projection(previous step)], at the same
  position p and with the same K/V;
* every query position p >= 1 of a sequence is trained at once (masks per row), K = 4 chained
  steps unrolled with backpropagation through the chain; step j's target is y_{p+j-1} and its
  input token is x_{p+j-1}, the target's greedy token (teacher forcing on the target's own
  predictions); a step counts only while the chain is consistent, i.e. x_{t+1} = y_t for
  t = p..p+j-2, which holds throughout the generated part, since there a correct draft is the
  only case in which later drafts matter;
* loss per step = 1/2 cross-entropy with the hard label y + 1/2 cross-entropy with the target's
  full distribution (soft label), over the whole vocabulary; steps weighted 1, 0.8, 0.64, 0.51.

The centroid head is built afterwards: the rows of the drafter's output embedding (its tied
head) are clustered into 64 equal clusters of 64 tokens (balanced k-means), ``token_ordering``
lists the clusters' tokens, and the centroid matrix starts from the cluster means and is then
fitted (cross-entropy over clusters) to rank the cluster of the drafter's full-vocabulary argmax
first; the drafter's weights stay fixed. The candidate recall (how often that argmax is among
the top-k clusters' tokens) is reported.

Checks (the script fails if one does not hold): the saved directories load in transformers
(the assistant with the ``kv_sharing_modes`` patch of ``scripts/fixtures/make_fixtures.py``);
the batched training forward of the drafter equals transformers' own one-step drafter forward;
assisted greedy generation equals plain greedy; the tokenizer loads with ``AutoTokenizer`` and
round-trips held-out text. A simulation of tandem's greedy loop with k = 4 and 6 measures the
acceptance on held-out prompts.

Determinism: fixed seeds, one thread, deterministic algorithms; a rerun on the same machine and
library versions reproduces the files. Another CPU (other bf16 kernels) gives an equivalent but
not bit-identical model.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import re
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import torch
import torch.nn.functional as Fn
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "models" / "default"
WORK = REPO / "target" / "train_default"  # scratch (git-ignored): f32 checkpoints, caches

# The transformers 5.23.0 `kv_sharing_modes` fix lives in the fixture script (docs/model.md, "KV sharing").
sys.path.insert(0, str(REPO / "scripts" / "fixtures"))
from make_fixtures import patch_kv_sharing_modes  # noqa: E402

from transformers import (  # noqa: E402
    AutoTokenizer,
    DynamicCache,
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    PreTrainedTokenizerFast,
)

S, F = "sliding_attention", "full_attention"
SEED = 20260530

# ---------------------------------------------------------------------------------------
# sizes and hyperparameters
# ---------------------------------------------------------------------------------------

VOCAB = 4096
NUM_CENTROIDS = 64
CENTROID_TOP_K = 8
# The draft length the assistant's generation_config.json declares (tandem's and transformers' default k).
# 5: on the trained pair, `tandem bench --pair` gained 2.02-2.07x at k = 5 against 1.90-1.97x at k = 4 in
# six alternations on a 2-core Xeon VM with AMX (docs/speculative.md, "The shipped pair's draft length").
NUM_ASSISTANT_TOKENS = 5
# The draft lengths the acceptance simulation measures (the first also per prompt).
SIMULATED_DRAFT_LENGTHS = (4, 6)
HELDOUT_MODULUS = 20  # 1 file in 20 is held out

ROPE = {
    S: {"rope_type": "default", "rope_theta": 10000.0},
    F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
}
TARGET_TEXT = {
    "model_type": "gemma4_text",
    "vocab_size": VOCAB,
    "hidden_size": 384,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    # The last two unshared layers are sliding then full, so each reuse layer's source is
    # first_shared - 2 (S) / first_shared - 1 (F): the layout llama.cpp assumes for K/V sharing
    # (it does not read the source layer; [S,S,F,S,S,F] would be computed wrongly there).
    "layer_types": [S, S, S, F, S, F],
    "num_attention_heads": 6,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "global_head_dim": 128,
    "num_global_key_value_heads": None,
    "attention_k_eq_v": False,
    "sliding_window": 128,
    "num_kv_shared_layers": 2,
    "use_double_wide_mlp": False,
    "hidden_size_per_layer_input": 16,
    "vocab_size_per_layer_input": VOCAB,
    "enable_moe_block": False,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "attention_bias": False,
    "rope_parameters": ROPE,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}
# Drafter: per-type (Hkv, D) equal the target's store layers: S (1, 64), F (1, 128).
ASSISTANT_TEXT = {
    "model_type": "gemma4_text",
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": [S, S, S, F],
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "global_head_dim": 128,
    "num_global_key_value_heads": None,
    "attention_k_eq_v": False,
    "sliding_window": 128,
    "num_kv_shared_layers": 4,
    "use_double_wide_mlp": False,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
    "enable_moe_block": False,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "attention_bias": False,
    "rope_parameters": ROPE,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

TARGET_SEQ = 256
TARGET_BATCH = 8
TARGET_STEPS = 1400
TARGET_LR = 2e-3
TARGET_WARMUP = 100

GEN_PROMPT = 64
GEN_NEW = 192
GEN_SEQS = 2560
GEN_HELD_SEQS = 64
GEN_BATCH = 32
DRAFT_K = 4
DRAFT_STEP_WEIGHTS = [1.0, 0.8, 0.64, 0.512]
DRAFT_BATCH = 8
DRAFT_STEPS = 1200
DRAFT_LR = 2e-3
DRAFT_WARMUP = 30
CENTROID_FIT_STEPS = 300

# ---------------------------------------------------------------------------------------
# corpus
# ---------------------------------------------------------------------------------------

EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data", "turtledemo"}
# encodings/: code-page tables generated by gencodec.py (hex tables, not code people write).
GENERATED_CODEC = re.compile(r"^encodings/(cp\d+|mac_\w+|iso8859_\d+|koi8_\w|kz1048|ptcp154|hp_roman8|palmos|tis_620)\.py$")


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect_corpus(root: Path | None = None) -> list[tuple[str, str]]:
    """(relative path, source) for every corpus file, sorted by path."""
    root = root or stdlib_dir()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        parts = rel.split("/")
        if any(p in EXCLUDED_DIRS for p in parts[:-1]) or parts[0].startswith("config-"):
            continue
        if parts[-1].startswith("_sysconfigdata") or GENERATED_CODEC.match(rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        text = text.replace("\r\n", "\n")
        if text.strip():
            out.append((rel, text))
    return out


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % HELDOUT_MODULUS == 0


def split_files(files):
    train = [f for f in files if not is_heldout(f[0])]
    held = [f for f in files if is_heldout(f[0])]
    return train, held


def corpus_digest(files) -> str:
    h = hashlib.sha256()
    for rel, text in files:
        h.update(rel.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()


def documented_functions(text: str):
    """(node, summary, source lines) of functions with a docstring, in source order."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.split("\n")
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc:
            continue
        summary = " ".join(doc.strip().split("\n\n")[0].split())
        src = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))
        out.append((node, summary, src))
    out.sort(key=lambda t: t[0].lineno)
    return out


def chat_text(user: str, model: str) -> str:
    """One exchange in the shipped chat template's format (without the leading <bos>)."""
    return f"<|turn>user\n{user}<turn|>\n<|turn>model\n{model}<turn|>\n"


def chat_examples(train_files) -> list[str]:
    """Chat-formatted examples: docstring summary -> the documented function."""
    out = []
    for rel, text in train_files:
        for node, summary, src in documented_functions(text):
            if not (20 <= len(summary) <= 200) or len(src) > 1200 or node.name.startswith("_"):
                continue
            # Half of them (by a hash of the text), so that chat is about a tenth of the data.
            if int(hashlib.sha256(src.encode()).hexdigest()[:8], 16) % 2:
                continue
            out.append(chat_text(summary, src))
    return out


# ---------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------

GEMMA4_SPECIALS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    51: "<tool_response|>",
    52: '<|"|>',
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
}
NUM_RESERVED = 107  # ids 0..106: specials at their Gemma 4 ids, the rest <unusedN>
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
MIN_CHAR_COUNT = 5
SPACE = "\u2581"
# Pieces BPE may merge within: a newline run with the next line's indentation, an identifier or
# keyword with at most one leading space, a number, a punctuation run, a run of spaces.
SPLIT_PATTERN = r"\n[\n▁]*|▁?[\p{L}_][\p{L}\p{N}_]*|▁?\p{N}+|▁?[^\p{L}\p{N}_▁\n]+|▁+"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<|turn>' + role + '\n' + (message['content'] | trim) + '<turn|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn>model\n' }}{% endif %}"
)


def reserved_tokens() -> list[str]:
    out, unused = [], 0
    for i in range(NUM_RESERVED):
        if i in GEMMA4_SPECIALS:
            out.append(GEMMA4_SPECIALS[i])
        else:
            out.append(f"<unused{unused}>")
            unused += 1
    return out


def alphabet(texts: list[str]) -> list[str]:
    """Characters seen at least MIN_CHAR_COUNT times; rarer ones are spelled with byte tokens.
    (A threshold, not the trainer's top-N `limit_alphabet` alone: that breaks ties at the cut in
    hash-map order, which made the vocabulary differ between runs.)"""
    counts: dict[str, int] = {}
    for text in texts:
        for ch in text.replace(" ", SPACE):
            counts[ch] = counts.get(ch, 0) + 1
    return sorted(ch for ch, n in counts.items() if n >= MIN_CHAR_COUNT)


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Train the BPE, then lay the vocabulary out as [reserved, bytes, learned pieces]."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated")
    reserved = reserved_tokens()
    chars = alphabet(texts)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - len(BYTE_TOKENS),
        special_tokens=reserved,
        initial_alphabet=chars,
        limit_alphabet=len(chars),  # exactly the initial alphabet (it outranks every other char)
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    learned = sorted((i, t) for t, i in vocab.items() if i >= len(reserved))
    new_vocab = {t: i for i, t in enumerate(reserved)}
    for b in BYTE_TOKENS:
        new_vocab[b] = len(new_vocab)
    for _, t in learned:
        assert t not in new_vocab, t
        new_vocab[t] = len(new_vocab)
    assert len(new_vocab) == VOCAB, len(new_vocab)
    spec["model"]["vocab"] = new_vocab
    for added in spec["added_tokens"]:
        assert new_vocab[added["content"]] == added["id"], added
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 2)]
    )
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """Standard Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        padding_side="left",
        model_max_length=TARGET_TEXT["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))


def encode_docs(tok: Tokenizer, docs: list[str]) -> list[int]:
    """The token stream: each document as <bos> ids <eos>."""
    stream: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        stream.append(2)
        stream.extend(enc.ids)
        stream.append(1)
    return stream


# ---------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------


def set_determinism(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)


def json_dump(obj, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def adamw(model: torch.nn.Module, lr: float, weight_decay: float):
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def windows(stream: np.ndarray, starts: torch.Tensor, length: int) -> torch.Tensor:
    """Training sequences: <bos> followed by length-1 stream tokens from each start."""
    rows = [np.concatenate([[2], stream[s : s + length - 1]]) for s in starts.tolist()]
    return torch.tensor(np.stack(rows), dtype=torch.long)


def text_config_kwargs(text: dict) -> dict:
    return {k: v for k, v in text.items() if k not in ("model_type", "architectures", "dtype")}


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tensors = {k: v.detach().contiguous().clone() for k, v in sorted(tensors.items())}
    save_file(tensors, str(path), metadata={"format": "pt"})


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits / cap) * cap


# ---------------------------------------------------------------------------------------
# phase 1: corpus and tokenizer
# ---------------------------------------------------------------------------------------


def phase_tokenizer(out: Path, summary: dict) -> None:
    t0 = time.time()
    files = collect_corpus()
    train_files, held_files = split_files(files)
    chats = chat_examples(train_files)
    tok = train_tokenizer([text for _, text in train_files] + chats)
    for d in (out / "target", out / "assistant"):
        d.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tok, d)
    WORK.mkdir(parents=True, exist_ok=True)
    train_stream = encode_docs(tok, [text for _, text in train_files] + chats)
    held_stream = encode_docs(tok, [text for _, text in held_files])
    np.save(WORK / "train_stream.npy", np.array(train_stream, dtype=np.int32))
    np.save(WORK / "held_stream.npy", np.array(held_stream, dtype=np.int32))
    prompts = heldout_prompts(tok, held_files)
    json_dump(prompts, out / "heldout_prompts.json")
    summary["corpus"] = {
        "source": "CPython standard library (*.py), PSF License",
        "stdlib_dir": str(stdlib_dir()),
        "python": platform.python_version(),
        "files": len(files),
        "train_files": len(train_files),
        "heldout_files": len(held_files),
        "heldout_paths": [rel for rel, _ in held_files],
        "train_chars": sum(len(t) for _, t in train_files),
        "heldout_chars": sum(len(t) for _, t in held_files),
        "chat_examples": len(chats),
        "chat_chars": sum(len(c) for c in chats),
        "train_tokens": len(train_stream),
        "heldout_tokens": len(held_stream),
        "sha256": corpus_digest(files),
    }
    summary["tokenizer"] = {
        "vocab_size": tok.get_vocab_size(),
        "chars_per_token_heldout": round(sum(len(t) for _, t in held_files) / len(held_stream), 3),
        "seconds": round(time.time() - t0, 1),
    }
    print(f"[tokenizer] {summary['corpus']['train_tokens']} train / {len(held_stream)} held-out tokens, "
          f"{summary['tokenizer']['seconds']} s", flush=True)


def heldout_prompts(tok: Tokenizer, held_files) -> list[dict]:
    """Code prompts (a function's signature and one-line docstring, cut from held-out files) and
    chat prompts (the docstring summary of another held-out function), 16 + up to 4."""
    code, chat = [], []
    for rel, text in held_files:
        cands = []
        for node, summary, src in documented_functions(text):
            body = node.body
            doc_end = body[0].end_lineno - node.lineno + 1
            lines = src.split("\n")
            if (
                len(body) < 3
                or not (20 <= len(summary) <= 100)
                or body[0].lineno != node.lineno + 1
                or body[0].end_lineno != body[0].lineno
                or node.name.startswith("_")
            ):
                continue
            cands.append((hashlib.sha256(src.encode()).hexdigest(), node.name, "\n".join(lines[:doc_end]), summary))
        cands.sort()
        # Up to two code prompts per file, then one chat prompt from another function.
        for c in cands[:2]:
            code.append({"kind": "code", "file": rel, "function": c[1], "text": c[2]})
        for c in cands[2:3]:
            chat.append({"kind": "chat", "file": rel, "function": c[1], "user": c[3]})
    code, chat = code[:16], chat[:4]
    for p in code:
        p["ids"] = tok.encode(p["text"]).ids
    for p in chat:
        p["text"] = "<bos>" + f"<|turn>user\n{p['user']}<turn|>\n<|turn>model\n"
        p["ids"] = tok.encode(p["text"], add_special_tokens=False).ids
    return code + chat


# ---------------------------------------------------------------------------------------
# phase 2: target
# ---------------------------------------------------------------------------------------


def target_config_json() -> dict:
    return {
        "architectures": ["Gemma4ForCausalLM"],
        **TARGET_TEXT,
        "dtype": "bfloat16",
        "transformers_version": transformers.__version__,
    }


@torch.no_grad()
def heldout_loss(model, held: np.ndarray, seq: int, max_seqs: int) -> float:
    """Mean next-token loss over consecutive held-out windows (each <bos> + seq-1 tokens)."""
    model.eval()
    starts = torch.arange(0, len(held) - seq, seq - 1)[:max_seqs]
    total, count = 0.0, 0
    for chunk in starts.split(8):
        x = windows(held, chunk, seq)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x, use_cache=False).logits
        loss = Fn.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def phase_target(out: Path, summary: dict, steps: int) -> None:
    set_determinism(SEED + 1)
    train = np.load(WORK / "train_stream.npy")
    held = np.load(WORK / "held_stream.npy")
    config = Gemma4TextConfig(**text_config_kwargs(TARGET_TEXT))
    model = Gemma4ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[target] {n_params / 1e6:.2f} M parameters, modes {config.kv_sharing_modes}", flush=True)
    opt = adamw(model, TARGET_LR, 0.1)
    gen = torch.Generator().manual_seed(SEED + 2)
    t0 = time.time()
    log, ema = [], None
    for step in range(steps):
        lr = lr_at(step, steps, TARGET_LR, TARGET_WARMUP)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train) - TARGET_SEQ, (TARGET_BATCH,), generator=gen)
        x = windows(train, starts, TARGET_SEQ)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=x, use_cache=False).logits
        loss = Fn.cross_entropy(logits[:, :-1].float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if (step + 1) % 50 == 0 or step == 0:
            row = {"step": step + 1, "train_loss_ema": round(ema, 4), "lr": lr, "seconds": round(time.time() - t0, 1)}
            if (step + 1) % 250 == 0:
                row["heldout_loss"] = round(heldout_loss(model, held, TARGET_SEQ, 16), 4)
            log.append(row)
            print(f"[target] {row}", flush=True)
    train_s = time.time() - t0
    final_held = heldout_loss(model, held, TARGET_SEQ, 96)
    final_held_512 = heldout_loss(model, held, 2 * TARGET_SEQ, 48)
    torch.save(model.state_dict(), WORK / "target_f32.pt")

    tdir = out / "target"
    tdir.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_weights(state, tdir / "model.safetensors")
    json_dump(target_config_json(), tdir / "config.json")
    json_dump(
        {
            "bos_token_id": 2,
            "eos_token_id": [1, 106],
            "pad_token_id": 0,
            "do_sample": False,
            "transformers_version": transformers.__version__,
        },
        tdir / "generation_config.json",
    )
    # The bf16 checkpoint's held-out loss (what tandem runs).
    bf16 = Gemma4ForCausalLM.from_pretrained(tdir, dtype=torch.bfloat16, attn_implementation="sdpa")
    bf16_held = heldout_loss(bf16, held, TARGET_SEQ, 96)
    summary["target"] = {
        "parameters": n_params,
        "steps": steps,
        "batch": TARGET_BATCH,
        "seq": TARGET_SEQ,
        "tokens_seen": steps * TARGET_BATCH * (TARGET_SEQ - 1),
        "train_seconds": round(train_s, 1),
        "final_train_loss_ema": round(ema, 4),
        "heldout_loss_f32": round(final_held, 4),
        "heldout_loss_bf16": round(bf16_held, 4),
        "heldout_loss_f32_seq512": round(final_held_512, 4),
        "log": log,
    }
    print(f"[target] done in {train_s:.0f} s: train {ema:.3f}, held-out {final_held:.3f} (bf16 {bf16_held:.3f}, "
          f"512-token windows {final_held_512:.3f})", flush=True)


# ---------------------------------------------------------------------------------------
# phase 3: assistant (drafter)
# ---------------------------------------------------------------------------------------


def assistant_config_json(top_k: int) -> dict:
    return {
        "architectures": ["Gemma4AssistantForCausalLM"],
        "model_type": "gemma4_assistant",
        "backbone_hidden_size": TARGET_TEXT["hidden_size"],
        "use_ordered_embeddings": True,
        "num_centroids": NUM_CENTROIDS,
        "centroid_intermediate_top_k": top_k,
        "tie_word_embeddings": True,
        "text_config": {**ASSISTANT_TEXT, "dtype": "bfloat16"},
        "dtype": "bfloat16",
        "transformers_version": transformers.__version__,
    }


def new_assistant(top_k: int = CENTROID_TOP_K, dtype=torch.float32) -> Gemma4AssistantForCausalLM:
    config = Gemma4AssistantConfig(
        text_config=text_config_kwargs(ASSISTANT_TEXT),
        backbone_hidden_size=TARGET_TEXT["hidden_size"],
        use_ordered_embeddings=True,
        num_centroids=NUM_CENTROIDS,
        centroid_intermediate_top_k=top_k,
        tie_word_embeddings=True,
    )
    return Gemma4AssistantForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype)


def load_target(out: Path, dtype=torch.bfloat16) -> Gemma4ForCausalLM:
    target = Gemma4ForCausalLM.from_pretrained(out / "target", dtype=dtype, attn_implementation="sdpa").eval()
    for p in target.parameters():
        p.requires_grad_(False)
    return target


@torch.no_grad()
def greedy_continue(target, prompts: torch.Tensor, n_new: int) -> torch.Tensor:
    """Plain greedy decoding of a batch of equal-length prompts (no stop tokens)."""
    cache = DynamicCache(config=target.config)
    out = target(input_ids=prompts, past_key_values=cache, use_cache=True)
    tok = out.logits[:, -1].argmax(-1)
    seq = [prompts, tok[:, None]]
    for _ in range(n_new - 1):
        out = target(input_ids=tok[:, None], past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1)
        seq.append(tok[:, None])
    return torch.cat(seq, dim=1)


@torch.no_grad()
def target_pass(target, x: torch.Tensor):
    """What the drafter reads from one target forward over x: softcapped logits, post-norm hidden
    states, the store layers' K/V ([B, Hkv, T, D], post-norm, post-RoPE) and the scaled embeddings."""
    out = target(input_ids=x, use_cache=False, output_hidden_states=True, return_shared_kv_states=True)
    kv = {S: tuple(out.shared_kv_states[S]), F: tuple(out.shared_kv_states[F])}
    emb = target.model.embed_tokens(x)
    return out.logits, out.hidden_states[-1], kv, emb


def drafter_masks(T: int, W: int, batch: int):
    """Rows are query positions p = 1..T-1. Full layers see keys 0..p-1, sliding layers the last
    W+1 of them (p-1-W..p-1): docs/drafter.md, "Which target K/V it reads" and "Positions"."""
    p = torch.arange(1, T)[:, None]
    t = torch.arange(T)[None, :]
    full = t < p
    sliding = full & (t >= p - 1 - W)
    return {
        F: full[None, None].expand(batch, 1, T - 1, T),
        S: sliding[None, None].expand(batch, 1, T - 1, T),
    }


def drafter_chain(asst, emb, hidden, kv, k: int, step_tokens=None):
    """Batched drafting rounds at every query position p = 1..T-1 of the sequences, k chained
    steps, with transformers' own drafter layers. Step 1 reads [e(x_p); h_{p-1}]; step j reads
    [e(x_{p+j-1}); post_projection(step j-1)] (teacher forcing: x is the target's greedy text),
    unless `step_tokens[j]` ([B, T-1] token embeddings) overrides the input embedding.
    Returns the drafter's final-normed states ([B, T-1, Hd]) of every step."""
    inner = asst.model
    B, T, _ = emb.shape
    W = inner.config.sliding_window
    masks = drafter_masks(T, W, B)
    pos = torch.arange(1, T)[None].expand(B, T - 1)
    h = hidden[:, :-1]
    pe = {lt: inner.rotary_emb(h, pos, lt) for lt in (S, F)}
    states = []
    for j in range(k):
        if step_tokens is not None and j in step_tokens:
            e = step_tokens[j]
        else:
            e = emb[:, torch.arange(1 + j, T + j).clamp(max=T - 1)]
        z = asst.pre_projection(torch.cat([e, h], dim=-1))
        for i, layer in enumerate(inner.layers):
            lt = inner.config.layer_types[i]
            z = layer(z, None, shared_kv_states=kv, position_embeddings=pe[lt], attention_mask=masks[lt], position_ids=pos)
        hd = inner.norm(z)
        states.append(hd)
        h = asst.post_projection(hd)
    return states


def chain_validity(x: torch.Tensor, y: torch.Tensor, k: int) -> list[torch.Tensor]:
    """valid[j][b, p-1]: step j+1 at query p has a defined target (y_{p+j}) and a consistent chain
    (x_{t+1} = y_t for t = p..p+j-1)."""
    B, T = x.shape
    P = torch.arange(1, T)
    ok = x[:, 1:] == y[:, :-1]  # ok[:, t] = (x_{t+1} == y_t), t = 0..T-2
    chain = torch.ones(B, T - 1, dtype=torch.bool)
    out = []
    for j in range(k):
        out.append(chain & (P + j <= T - 1)[None])
        t = (P + j).clamp(max=T - 2)
        chain = chain & ok[:, t] & (P + j <= T - 2)[None]
    return out


def draft_losses(asst, states, tlogits, x):
    """Per-step loss (1/2 hard CE on the target's greedy token + 1/2 CE on its distribution) and
    per-step accuracy of the full-vocabulary head."""
    T = x.shape[1]
    y = tlogits.argmax(-1)
    valid = chain_validity(x, y, len(states))
    E = asst.model.embed_tokens.weight
    losses, accs, counts = [], [], []
    for j, hd in enumerate(states):
        idx = torch.arange(1 + j, T + j).clamp(max=T - 1)
        labels = y[:, idx]
        logits = (hd @ E.t()).float()
        logp = torch.log_softmax(logits, dim=-1)
        hard = -logp.gather(-1, labels[..., None])[..., 0]
        soft = -(torch.softmax(tlogits[:, idx].float(), dim=-1) * logp).sum(-1)
        m = valid[j].float()
        n = m.sum().clamp(min=1)
        losses.append(((0.5 * hard + 0.5 * soft) * m).sum() / n)
        accs.append((((logits.argmax(-1) == labels).float() * m).sum() / n).item())
        counts.append(int(m.sum().item()))
    return losses, accs, counts


def prompt_windows(stream: np.ndarray, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - GEN_PROMPT, (n,), generator=gen)
    return windows(stream, starts, GEN_PROMPT)


def generate_sequences(target, stream: np.ndarray, n: int, seed: int) -> torch.Tensor:
    prompts = prompt_windows(stream, n, seed)
    return torch.cat([greedy_continue(target, chunk, GEN_NEW) for chunk in prompts.split(GEN_BATCH)])


@torch.no_grad()
def eval_drafter(asst, target, seqs: torch.Tensor) -> dict:
    """Per-step accuracy of the full head on sequences (conditional acceptance, teacher-forced)."""
    asst.eval()
    tot_loss, tot_acc, tot_n = np.zeros(DRAFT_K), np.zeros(DRAFT_K), np.zeros(DRAFT_K)
    for chunk in seqs.split(8):
        tlogits, hidden, kv, emb = target_pass(target, chunk)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            states = drafter_chain(asst, emb, hidden, kv, DRAFT_K)
        losses, accs, counts = draft_losses(asst, [s.float() for s in states], tlogits, chunk)
        for j in range(DRAFT_K):
            tot_loss[j] += losses[j].item() * counts[j]
            tot_acc[j] += accs[j] * counts[j]
            tot_n[j] += counts[j]
    asst.train()
    return {
        "loss_per_step": [round(v, 4) for v in (tot_loss / tot_n).tolist()],
        "accuracy_per_step": [round(v, 4) for v in (tot_acc / tot_n).tolist()],
    }


def phase_assistant(out: Path, summary: dict, steps: int) -> None:
    set_determinism(SEED + 3)
    patch_kv_sharing_modes()
    train = np.load(WORK / "train_stream.npy")
    held = np.load(WORK / "held_stream.npy")
    target = load_target(out)

    t0 = time.time()
    seqs = generate_sequences(target, train, GEN_SEQS, SEED + 4)
    held_seqs = generate_sequences(target, held, GEN_HELD_SEQS, SEED + 5)
    gen_s = time.time() - t0
    print(f"[assistant] generated {len(seqs)} + {len(held_seqs)} sequences in {gen_s:.0f} s", flush=True)

    asst = new_assistant()
    asst.train()
    n_params = sum(p.numel() for p in asst.parameters())
    opt = adamw(asst, DRAFT_LR, 0.01)
    gen = torch.Generator().manual_seed(SEED + 6)
    order = torch.cat([torch.randperm(len(seqs), generator=gen) for _ in range(1 + steps * DRAFT_BATCH // len(seqs))])
    t1 = time.time()
    log, ema = [], None
    for step in range(steps):
        lr = lr_at(step, steps, DRAFT_LR, DRAFT_WARMUP)
        for g in opt.param_groups:
            g["lr"] = lr
        x = seqs[order[step * DRAFT_BATCH : (step + 1) * DRAFT_BATCH]]
        tlogits, hidden, kv, emb = target_pass(target, x)
        kv = {lt: (k.float(), v.float()) for lt, (k, v) in kv.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            states = drafter_chain(asst, emb.float(), hidden.float(), kv, DRAFT_K)
            losses, accs, _ = draft_losses(asst, states, tlogits, x)
        loss = sum(w * l for w, l in zip(DRAFT_STEP_WEIGHTS, losses)) / sum(DRAFT_STEP_WEIGHTS)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(asst.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if (step + 1) % 20 == 0 or step == 0:
            row = {
                "step": step + 1,
                "loss_ema": round(ema, 4),
                "step_losses": [round(l.item(), 3) for l in losses],
                "step_accuracy": [round(a, 3) for a in accs],
                "seconds": round(time.time() - t1, 1),
            }
            log.append(row)
            print(f"[assistant] {row}", flush=True)
    train_s = time.time() - t1
    held_eval = eval_drafter(asst, target, held_seqs)
    print(f"[assistant] trained in {train_s:.0f} s; held-out {held_eval}", flush=True)

    # Centroid head on the bf16 drafter (as shipped).
    t2 = time.time()
    asst16 = new_assistant(dtype=torch.bfloat16)
    asst16.load_state_dict({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in asst.state_dict().items()})
    asst16.eval()
    head_train = head_inputs(asst16, target, seqs[: len(seqs) // 4])
    head_held = head_inputs(asst16, target, held_seqs)
    ordering, centroids, cluster_of = build_centroid_head(asst16.model.embed_tokens.weight.float(), head_train)
    recall = {str(k): centroid_recall(centroids, cluster_of, head_held, k) for k in (4, 8, 16)}
    centroid_s = time.time() - t2
    print(f"[assistant] centroid head in {centroid_s:.0f} s, held-out candidate recall {recall}", flush=True)

    adir = out / "assistant"
    adir.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in asst16.state_dict().items() if k != "lm_head.weight"}
    state["masked_embedding.centroids.weight"] = centroids.to(torch.bfloat16)
    state["masked_embedding.token_ordering"] = ordering.to(torch.int64)
    save_weights(state, adir / "model.safetensors")
    json_dump(assistant_config_json(CENTROID_TOP_K), adir / "config.json")
    json_dump(
        {
            "bos_token_id": 2,
            "eos_token_id": [1, 106],
            "pad_token_id": 0,
            "num_assistant_tokens": NUM_ASSISTANT_TOKENS,
            "transformers_version": transformers.__version__,
        },
        adir / "generation_config.json",
    )
    summary["assistant"] = {
        "parameters": n_params,
        "generated_sequences": len(seqs),
        "generation_seconds": round(gen_s, 1),
        "steps": steps,
        "batch": DRAFT_BATCH,
        "chain_steps": DRAFT_K,
        "train_seconds": round(train_s, 1),
        "final_train_loss_ema": round(ema, 4),
        "heldout": held_eval,
        "centroid_seconds": round(centroid_s, 1),
        "candidate_recall_heldout": recall,
        "centroid_top_k": CENTROID_TOP_K,
        "log": log,
    }


@torch.no_grad()
def head_inputs(asst, target, seqs: torch.Tensor):
    """(final-normed drafter state, full-head argmax) of every valid drafting step."""
    hs, am = [], []
    E = asst.model.embed_tokens.weight
    for chunk in seqs.split(8):
        tlogits, hidden, kv, emb = target_pass(target, chunk)
        states = drafter_chain(asst, emb, hidden, kv, DRAFT_K)
        valid = chain_validity(chunk, tlogits.argmax(-1), DRAFT_K)
        for hd, m in zip(states, valid):
            hd = hd[m]
            hs.append(hd.float())
            am.append((hd @ E.t()).float().argmax(-1))
    return torch.cat(hs), torch.cat(am)


def balanced_assign(score: torch.Tensor, cap: int) -> torch.Tensor:
    """Greedy balanced assignment: best (row, cluster) pairs first, each cluster takes `cap` rows."""
    V, C = score.shape
    order = torch.argsort(score.reshape(-1), descending=True, stable=True).tolist()
    assign = [-1] * V
    count = [0] * C
    left = V
    for flat in order:
        v, c = divmod(flat, C)
        if assign[v] < 0 and count[c] < cap:
            assign[v] = c
            count[c] += 1
            left -= 1
            if left == 0:
                break
    return torch.tensor(assign)


def build_centroid_head(E: torch.Tensor, head_train):
    """Balanced k-means of the head's rows into NUM_CENTROIDS clusters of V/C tokens, then fit the
    centroid matrix so the cluster of the full head's argmax scores highest."""
    V, _ = E.shape
    cap = V // NUM_CENTROIDS
    gen = torch.Generator().manual_seed(SEED + 7)
    cent = E[torch.randperm(V, generator=gen)[:NUM_CENTROIDS]].clone()
    for _ in range(20):
        d2 = (E * E).sum(1, keepdim=True) - 2 * E @ cent.t() + (cent * cent).sum(1)[None]
        assign = balanced_assign(-d2, cap)
        cent = torch.stack([E[assign == c].mean(0) for c in range(NUM_CENTROIDS)])
    ordering = torch.cat([torch.nonzero(assign == c)[:, 0] for c in range(NUM_CENTROIDS)])
    assert sorted(ordering.tolist()) == list(range(V))
    cluster_of = assign
    hd, am = head_train
    labels = cluster_of[am]
    w = torch.nn.Parameter(cent.clone())
    opt = torch.optim.Adam([w], lr=3e-3)
    for _ in range(CENTROID_FIT_STEPS):
        loss = Fn.cross_entropy(hd @ w.t(), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return ordering, w.detach(), cluster_of


def centroid_recall(centroids, cluster_of, head, k: int) -> float:
    hd, am = head
    c = (hd.to(torch.bfloat16) @ centroids.to(torch.bfloat16).t()).float()
    top = torch.topk(c, k, dim=-1).indices
    return round((top == cluster_of[am][:, None]).any(-1).float().mean().item(), 4)


# ---------------------------------------------------------------------------------------
# phase 4: checks and acceptance
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def hf_draft_step(asst, target, token: int, h: torch.Tensor, kv, p: int):
    """One drafter call the way transformers' candidate generator makes it, with clean donor K/V
    (positions 0..p-1) and the query at position p."""
    e = target.model.embed_tokens(torch.tensor([[token]]))[0, 0]
    kv_p = {lt: (k[:, :, :p], v[:, :, :p]) for lt, (k, v) in kv.items()}
    out = asst(
        inputs_embeds=torch.cat([e, h]).view(1, 1, -1),
        attention_mask=torch.ones(1, p + 1, dtype=torch.long),
        position_ids=torch.tensor([[p]]),
        shared_kv_states=kv_p,
        use_cache=False,
    )
    return out.logits[0, 0], out.last_hidden_state[0, 0]


@torch.no_grad()
def simulate_rounds(asst, target, prompt: list[int], max_new: int, k: int, eos=(1, 106)):
    """tandem's greedy speculative loop (clean semantics) replayed over the target's plain greedy
    output: returns (accepted per round list, generated length)."""
    x = torch.tensor([prompt])
    seq = greedy_continue(target, x, max_new)[0].tolist()
    P = len(prompt)
    gen = seq[P:]
    for i, t in enumerate(gen):
        if t in eos:
            gen = gen[: i + 1]
            break
    seq = prompt + gen
    _, hidden, kv, _ = target_pass(target, torch.tensor([seq]))
    rounds = []
    N = P + 1
    while N < len(seq):
        k_eff = min(k, len(seq) - N - 1)
        if k_eff <= 0:
            N += 1
            continue
        p = N - 1
        tok, h = seq[p], hidden[0, p - 1]
        n, matching = 0, True
        for j in range(1, k_eff + 1):
            logits, h = hf_draft_step(asst, target, tok, h, kv, p)
            tok = int(logits.argmax())
            if matching and tok == seq[p + j]:
                n += 1
            else:
                break
        rounds.append(n)
        N += n + 1
    return rounds, len(gen)


def acceptance_stats(all_rounds: list[list[int]], k: int) -> dict:
    flat = [n for r in all_rounds for n in r]
    per_pos = [sum(1 for n in flat if n > i) / max(1, len(flat)) for i in range(k)]
    return {
        "rounds": len(flat),
        "mean_accepted_per_round": round(float(np.mean(flat)), 3),
        "acceptance_rate": round(float(np.mean(flat)) / k, 3),
        "accepted_at_position": [round(v, 3) for v in per_pos],
        "tokens_per_round": round(float(np.mean(flat)) + 1, 3),
    }


def phase_check(out: Path, summary: dict) -> None:
    set_determinism(SEED + 8)
    patch_kv_sharing_modes()
    t0 = time.time()
    checks: dict = {}
    prompts = json.loads((out / "heldout_prompts.json").read_text())
    held_files = [(rel, (stdlib_dir() / rel).read_text(encoding="utf-8")) for rel in summary["corpus"]["heldout_paths"]]

    # Tokenizer: standard HF files, round trip, chat template.
    for d in ("target", "assistant"):
        tok = AutoTokenizer.from_pretrained(out / d)
        assert tok.bos_token_id == 2 and tok.eos_token_id == 1 and tok.pad_token_id == 0, d
        assert len(tok) == VOCAB, len(tok)
    roundtrip = all(tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text for _, text in held_files)
    assert roundtrip
    checks["tokenizer_roundtrip_heldout_files"] = roundtrip
    chat = tok.apply_chat_template([{"role": "user", "content": "Return the sum of a and b."}], add_generation_prompt=True, tokenize=False)
    assert chat == "<bos><|turn>user\nReturn the sum of a and b.<turn|>\n<|turn>model\n", chat
    for p in prompts:
        if p["kind"] == "code":
            assert tok(p["text"])["input_ids"] == p["ids"]
        else:
            rendered = tok.apply_chat_template([{"role": "user", "content": p["user"]}], add_generation_prompt=True)
            ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
            assert list(ids) == p["ids"], (ids, p["ids"])
    checks["heldout_prompt_ids_match_autotokenizer"] = True

    # Target generates; assistant loads; batched training forward == transformers' drafter step.
    target = load_target(out)
    asst = Gemma4AssistantForCausalLM.from_pretrained(out / "assistant", dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    assert asst.generation_config.num_assistant_tokens == NUM_ASSISTANT_TOKENS
    sample = greedy_continue(target, torch.tensor([prompts[0]["ids"]]), 48)[0]
    checks["sample_completion"] = tok.decode(sample.tolist())

    x = greedy_continue(target, torch.tensor([prompts[1]["ids"]]), 200)
    tl, hidden, kv, emb = target_pass(target, x)
    states = drafter_chain(asst, emb, hidden, kv, 1)
    hd_batched = states[0][0]
    post_batched = asst.post_projection(hd_batched)
    worst, agree, probes = 0.0, 0, (1, 5, 60, 129, 130, 131, 200, x.shape[1] - 1)
    for p in probes:
        logits, post = hf_draft_step(asst, target, int(x[0, p]), hidden[0, p - 1], kv, p)
        worst = max(worst, (post.float() - post_batched[p - 1].float()).abs().max().item())
        full = (hd_batched[p - 1] @ asst.model.embed_tokens.weight.t()).float()
        agree += int(logits.argmax()) == int(full.argmax())
    checks["batched_vs_hf_drafter_post_projection_max_diff"] = worst
    checks["batched_full_head_vs_hf_centroid_head_same_draft"] = f"{agree}/{len(probes)}"
    assert worst < 0.1, worst

    # Assisted greedy == plain greedy (transformers' own loop, f32 to stay clear of bf16 near-ties).
    t32 = load_target(out, torch.float32)
    a32 = Gemma4AssistantForCausalLM.from_pretrained(out / "assistant", dtype=torch.float32, attn_implementation="sdpa").eval()
    same = []
    for p in prompts[:4]:
        ids = torch.tensor([p["ids"]])
        kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64, eos_token_id=None, pad_token_id=0)
        plain = t32.generate(input_ids=ids, **kw)
        assisted = t32.generate(input_ids=ids, assistant_model=a32, **kw)
        same.append(plain.tolist() == assisted.tolist())
    checks["hf_assisted_equals_plain_greedy"] = same
    assert all(same), same
    del t32, a32

    # Acceptance: tandem's greedy loop (clean semantics) on the held-out prompts.
    acc = {}
    for k in SIMULATED_DRAFT_LENGTHS:
        rounds, lengths = [], []
        for p in prompts:
            r, n = simulate_rounds(asst, target, p["ids"], 128, k)
            rounds.append(r)
            lengths.append(n)
        acc[f"k{k}"] = acceptance_stats(rounds, k)
        acc[f"k{k}"]["generated_tokens"] = sum(lengths)
        if k == SIMULATED_DRAFT_LENGTHS[0]:
            acc[f"k{k}"]["per_prompt_mean_accepted"] = [round(float(np.mean(r)), 2) if r else None for r in rounds]
        print(f"[check] acceptance k={k}: {acc[f'k{k}']}", flush=True)
    summary["acceptance_python_sim"] = acc
    checks["seconds"] = round(time.time() - t0, 1)
    summary["checks"] = checks
    print(f"[check] {checks}", flush=True)


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------


def sizes(out: Path) -> dict:
    return {
        str(p.relative_to(out)): p.stat().st_size
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != "training_summary.json"
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--phase", choices=["all", "tokenizer", "target", "assistant", "check"], default="all")
    ap.add_argument("--target-steps", type=int, default=TARGET_STEPS)
    ap.add_argument("--assistant-steps", type=int, default=DRAFT_STEPS)
    ap.add_argument("--smoke", action="store_true", help="tiny data sizes, to test the script quickly")
    args = ap.parse_args()
    if args.smoke:
        global GEN_SEQS, GEN_HELD_SEQS, GEN_NEW
        GEN_SEQS, GEN_HELD_SEQS, GEN_NEW = 32, 8, 64
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "training_summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() and args.phase != "all" else {}
    summary["versions"] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": __import__("tokenizers").__version__,
        "numpy": np.__version__,
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
    }
    t0 = time.time()
    phases = ["tokenizer", "target", "assistant", "check"] if args.phase == "all" else [args.phase]
    for ph in phases:
        if ph == "tokenizer":
            phase_tokenizer(out, summary)
        elif ph == "target":
            phase_target(out, summary, args.target_steps)
        elif ph == "assistant":
            phase_assistant(out, summary, args.assistant_steps)
        else:
            phase_check(out, summary)
        summary["sizes"] = sizes(out)
        summary.setdefault("phase_seconds", {})[ph] = round(time.time() - t0, 1)
        t0 = time.time()
        json_dump(summary, summary_path)
    print(f"[done] {json.dumps(summary.get('phase_seconds'))}", flush=True)


if __name__ == "__main__":
    main()
