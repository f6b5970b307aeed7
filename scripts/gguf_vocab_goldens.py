#!/usr/bin/env python3
"""Record the tokenizer fixtures and goldens for `tests/gguf_tokenizer.rs`.

For each GGUF file given, this extracts the `tokenizer.*` metadata (llama.cpp's keys) into a compact JSON
file under `tests/fixtures/gguf_vocab/`, and records for a set of strings:
  - the ids from llama.cpp's `llama-tokenize` (with and without BOS, with and without special-token parsing),
  - the text of each token as llama-tokenize prints it (llama.cpp's piece, special tokens rendered),
  - the ids from Hugging Face transformers (`AutoTokenizer` on the checkpoint's `tokenizer.json`), with and
    without special tokens, when the checkpoint directory is given.

Run it with the python of the llama.cpp converter environment (it needs the `gguf` package; transformers
only for the HF goldens):

    ~/anchors/convenv/bin/python scripts/gguf_vocab_goldens.py \
        --llama-tokenize ~/anchors/build/bin/llama-tokenize \
        tiny=/tmp/gv/tiny.gguf:tests/fixtures/text-tiny \
        target=/tmp/gv/target.gguf:models/default/target \
        e2b10=$HOME/anchors/gguf/e2b10-bf16.gguf:$HOME/anchors/e2b10

The GGUF files for the two small vocabularies come from llama.cpp's converter:

    python convert_hf_to_gguf.py tests/fixtures/text-tiny --outtype f32 --vocab-only --outfile /tmp/gv/tiny.gguf

A vocabulary is written in compact form: runs of tokens that are a prefix plus consecutive numbers
(`▁tok1`, `▁tok2`, ...) become `{"run": [prefix, first_number, count]}`, a constant score list becomes
`{"fill": value, "len": n}`, and token types are run-length encoded as `[[type, count], ...]`.
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys

import gguf

STRINGS = [
    "",
    "Hello world",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "multiple    spaces     inside",
    " ",
    "    ",
    "line one\nline two",
    "\n",
    "\n\n",
    "\n\n\n\n\n",
    "a\n\n\nb",
    "ends with newline\n",
    "tabs\tand\t\ttabs",
    "carriage\r\nreturn",
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n",
    "def square(x):\n    return x ** 2  # four-space indent\n",
    "🚀 (rocket) 😶\u200d🌫️ ✅ 🦙🦙",
    "我想在apple工作1314151天～",
    "日本語のテキストと한국어",
    "Café naïve résumé Ångström façade",
    "нещо на Български",
    "កាន់តែពិសេសអាច",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u00ad soft \x7f del",
    "3 33 333 3333 3.14 1,000,000",
    "Hello , world . Is it ? yes ! I 'm here , he 's there",
    "<bos>",
    "<bos>Hello",
    "Hello<eos>",
    "<|turn>user\nWhat is 2+2?<turn|>\n<|turn>model\n",
    "<bos><|turn>user\nHi<turn|>\n",
    "x<|turn>y<turn|>z",
    "<pad><unk><mask>",
    "<|tool_response>{\"a\": 1}<tool_response|>",
    "<|channel>thought\nok<channel|>The answer",
    "<|\"|>quoted<|\"|>",
    "<|image|> <|audio|> <|think|>",
    "<unused0> <unused1>",
    "<turn <|turn <turn| |>",
    "</s> <s>",
    "A longer paragraph, with punctuation; quotes \"like this\" and 'this', parentheses (yes), and a URL: "
    "https://example.com/path?q=1&r=2.\nSecond line:\tTabbed.\n\nThird paragraph after a blank line.",
]


# Pieces random strings are made of: words, whitespace, special-token text and parts of it, characters
# that need byte fallback.
FUZZ_ALPHABET = [
    "a", "b", "e", "the", "Hello", "world", "ing", "tion", " ", " ", "  ", "\n", "\n\n", "\t", "\r", "▁",
    ".", ",", "?", "!", "'", '"', "(", ")", "{", "}", "#", "-", "_", "0", "1", "42", "3.14",
    "<", ">", "|", "<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool_response>", "<|channel>", "<|\"|>", "turn",
    "é", "ß", "ñ", "日本", "語", "한", "🦙", "🚀", "😶\u200d🌫️", "\u00ad", "\u200b", "\x7f", "ก", "ា",
]


def fuzz_strings(n, seed):
    rng = random.Random(seed)
    return ["".join(rng.choice(FUZZ_ALPHABET) for _ in range(rng.randint(1, 24))) for _ in range(n)]


def field_values(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def compact_tokens(tokens):
    out = []
    i = 0
    pat = re.compile(r"^(.*?)(\d+)$")
    while i < len(tokens):
        m = pat.match(tokens[i])
        if m:
            prefix, first = m.group(1), int(m.group(2))
            if str(first) == m.group(2):
                j = i + 1
                while j < len(tokens) and tokens[j] == f"{prefix}{first + (j - i)}":
                    j += 1
                if j - i >= 16:
                    out.append({"run": [prefix, first, j - i]})
                    i = j
                    continue
        out.append(tokens[i])
        i += 1
    return out


def compact_scores(scores):
    if scores and all(s == scores[0] for s in scores):
        return {"fill": scores[0], "len": len(scores)}
    return scores


def rle(values):
    out = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def run_tokenize(tool, gguf_path, text, bos, special, ids=True):
    args = [tool, "-m", gguf_path, "--stdin", "--no-escape", "--log-disable"]
    if ids:
        args.append("--ids")
    if not bos:
        args.append("--no-bos")
    if not special:
        args.append("--no-parse-special")
    out = subprocess.run(args, input=text.encode("utf-8"), capture_output=True, check=True).stdout
    return out


def llama_ids(tool, gguf_path, text, bos, special):
    out = run_tokenize(tool, gguf_path, text, bos, special).decode("utf-8").strip().splitlines()
    line = [ln for ln in out if ln.startswith("[")][-1]
    return json.loads(line)


def llama_pieces(tool, gguf_path, text, ids):
    """The piece of each id as llama-tokenize prints it (`%6d -> '<piece>'` lines), as bytes in hex."""
    out = run_tokenize(tool, gguf_path, text, True, True, ids=False)
    pieces = []
    pos = 0
    for k, tid in enumerate(ids):
        head = f"{tid:6d} -> '".encode()
        pos = out.index(head, pos) + len(head)
        if k + 1 < len(ids):
            nxt = f"'\n{ids[k + 1]:6d} -> '".encode()
            end = out.index(nxt, pos)
        else:
            end = out.rindex(b"'\n")
        pieces.append(out[pos:end].hex())
        pos = end
    return pieces


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--llama-tokenize", required=True)
    ap.add_argument("--out", default="tests/fixtures/gguf_vocab")
    ap.add_argument("--fuzz", type=int, default=0, help="random strings per vocabulary (llama.cpp ids only)")
    ap.add_argument("--fuzz-only", action="append", default=[], help="only for these names (default: all)")
    ap.add_argument("specs", nargs="+", help="name=file.gguf[:hf_dir]")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for spec in a.specs:
        name, rest = spec.split("=", 1)
        gguf_path, _, hf_dir = rest.partition(":")
        r = gguf.GGUFReader(gguf_path)
        g = lambda k: field_values(r, k)  # noqa: E731
        tokens = g("tokenizer.ggml.tokens")
        vocab = {
            "model": g("tokenizer.ggml.model"),
            "pre": g("tokenizer.ggml.pre"),
            "tokens": compact_tokens(tokens),
            "scores": compact_scores(g("tokenizer.ggml.scores")),
            "token_types": rle(g("tokenizer.ggml.token_type")),
            "merges": g("tokenizer.ggml.merges"),
            "bos": g("tokenizer.ggml.bos_token_id"),
            "eos": g("tokenizer.ggml.eos_token_id"),
            "unk": g("tokenizer.ggml.unknown_token_id"),
            "pad": g("tokenizer.ggml.padding_token_id"),
            "mask": g("tokenizer.ggml.mask_token_id"),
            "eot": g("tokenizer.ggml.eot_token_id"),
            "add_bos": g("tokenizer.ggml.add_bos_token"),
            "add_eos": g("tokenizer.ggml.add_eos_token"),
            "add_space_prefix": g("tokenizer.ggml.add_space_prefix"),
            "chat_template": g("tokenizer.chat_template"),
        }
        hf = None
        if hf_dir:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(hf_dir)
        cases = []
        for text in STRINGS:
            case = {"text": text, "llama": {}}
            for bos in (True, False):
                for special in (True, False):
                    key = ("bos" if bos else "nobos") + "_" + ("special" if special else "plain")
                    case["llama"][key] = llama_ids(a.llama_tokenize, gguf_path, text, bos, special)
            ids = case["llama"]["bos_special"]
            case["llama_pieces"] = llama_pieces(a.llama_tokenize, gguf_path, text, ids) if ids else []
            if hf is not None:
                case["hf"] = {
                    "bos": hf(text, add_special_tokens=True)["input_ids"],
                    "nobos": hf(text, add_special_tokens=False)["input_ids"],
                }
            cases.append(case)
        fuzz = []
        if a.fuzz and (not a.fuzz_only or name in a.fuzz_only):
            for text in fuzz_strings(a.fuzz, seed=len(name)):
                case = {"text": text, "llama": {}}
                for bos, special, key in ((True, True, "bos_special"), (False, False, "nobos_plain")):
                    case["llama"][key] = llama_ids(a.llama_tokenize, gguf_path, text, bos, special)
                fuzz.append(case)
        doc = {
            "name": name,
            "gguf": os.path.basename(gguf_path),
            # The checkpoint directory when it is in this repository (the tests may load it), else its name.
            "hf_dir": hf_dir if hf_dir and not os.path.isabs(hf_dir) else None,
            "hf_source": os.path.basename(os.path.normpath(hf_dir)) if hf_dir else None,
            "vocab": vocab,
            "cases": cases,
            "fuzz": fuzz,
        }
        path = os.path.join(a.out, f"{name}.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, ensure_ascii=False, separators=(",", ":"))
            fh.write("\n")
        print(f"{path}: {os.path.getsize(path)} bytes, {len(tokens)} tokens, {len(cases)} cases", file=sys.stderr)


if __name__ == "__main__":
    main()
