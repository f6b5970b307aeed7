#!/usr/bin/env python3
"""Make the GGUF test fixtures and llama.cpp reference outputs in tests/fixtures/gguf/.

For each HF fixture that llama.cpp's converter accepts, this converts it to GGUF with
convert_hf_to_gguf.py (and, for some targets, quantizes it with llama-quantize), runs llama.cpp on
the result (CPU, 1 thread, token ids fed directly, greedy) and writes:

  tests/fixtures/gguf/*.gguf              the small GGUF files (committed)
  tests/fixtures/gguf/llama_goldens.json  what llama.cpp computed / tokenized, per file

See tests/fixtures/gguf/README.md for the schema and the exact commands. Run from the repo root with
a Python that has llama.cpp's gguf-py requirements, torch, transformers and tokenizers (the
converter's venv), e.g.

  ~/anchors/convenv/bin/python scripts/gguf_goldens.py

Environment overrides: LLAMA_SRC (llama.cpp source tree), LLAMA_BUILD (its CMake build dir with
bin/ and the static libs), E2B_GGUF / E2B_TOKENIZER (large vocab used only for tokenization goldens).
"""
import argparse
import hashlib
import json
import os
import shutil
import string
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
HOME = Path.home()
LLAMA_SRC = Path(os.environ.get("LLAMA_SRC", HOME / "anchors/src/llama_cpp_python-0.3.36/vendor/llama.cpp"))
if not LLAMA_SRC.is_dir():
    LLAMA_SRC = HOME / "lsrc/llama_cpp_python-0.3.36/vendor/llama.cpp"
LLAMA_BUILD = Path(os.environ.get("LLAMA_BUILD", HOME / "anchors/build"))
E2B_GGUF = Path(os.environ.get("E2B_GGUF", HOME / "anchors/gguf/e2b10-bf16.gguf"))
E2B_TOKENIZER = Path(os.environ.get("E2B_TOKENIZER", HOME / "anchors/e2b10/tokenizer.json"))
OUT = ROOT / "tests/fixtures/gguf"
HELPERS = ROOT / "scripts/gguf_goldens"

sys.path.insert(0, str(LLAMA_SRC / "gguf-py"))
import gguf  # noqa: E402  (llama.cpp's own gguf-py, the one its converter uses)

QUANTS = ["Q8_0", "Q4_0", "Q4_K_M"]
# t6-long's o_proj rows (512 / 1024 columns) are the only tiny tensors wide enough for k-quant blocks (256);
# IQ4_XS has 256-blocks too (llama-quantize falls back for the 64-wide rows: the notes record to what)
QUANTS_T6 = ["Q4_K_M", "Q6_K", "IQ4_NL", "IQ4_XS"]
N_GREEDY = 12          # greedy steps recorded for the fixed / golden prompts
N_DRAFT = 4            # MTP draft length for the speculative runs

# name, source dir, converter outtypes, llama-quantize types (applied to the first outtype), commit?
TARGETS = [
    ("t1-f32", "tests/fixtures/t1-f32", ["f32", "f16"], QUANTS, True),
    ("t1-bf16", "tests/fixtures/t1-bf16", ["bf16"], [], True),
    ("t2-moe", "tests/fixtures/t2-moe", ["bf16"], [], True),
    ("t3-dense", "tests/fixtures/t3-dense", ["f16"], [], True),
    ("t4-unified", "tests/fixtures/t4-unified", ["bf16"], [], True),
    ("t5-e2b", "tests/fixtures/t5-e2b", ["f32"], QUANTS, True),
    ("t6-long", "tests/fixtures/t6-long", ["f32"], QUANTS_T6, True),
    ("text-tiny", "tests/fixtures/text-tiny", ["f32"], [], True),
    # the shipped default target: bf16 is ~30 MB, Q8_0 ~16 MB; goldens only, files not committed
    ("default-target", "models/default/target", ["bf16"], QUANTS, False),
]
# name, source dir, converter outtype, target name (its first outtype is the pair), commit?
DRAFTERS = [
    ("d1-centroid", "tests/fixtures/d1-centroid", "f32", "t1-f32", True),
    ("d2-tied", "tests/fixtures/d2-tied", "f32", "t1-f32", True),
    ("d3-bf16", "tests/fixtures/d3-bf16", "bf16", "t1-bf16", True),
    ("d4-trained", "tests/fixtures/d4-trained", "bf16", "t1-bf16", True),
    ("text-tiny-assistant", "tests/fixtures/text-tiny-assistant", "f32", "text-tiny", True),
    ("default-assistant", "models/default/assistant", "bf16", "default-target", True),
]

TOKENIZE_STRINGS = [
    "Hello world",
    "hello",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "multiple   spaces  between",
    "   ",
    " ",
    "line one\nline two",
    "\n\n",
    "tab\tseparated\tvalues",
    "mixed \t\n whitespace",
    "emoji 😀 🎉👍🏽",
    "CJK 你好世界 日本語",
    "accented café naïve Ångström façade",
    "control \x01\x02\x7f bytes",
    "numbers 12345 3.14",
    "<bos>hello",
    "<bos><bos>",
    "<|turn>user\nhi<turn|>\n<|turn>model\n",
    "<eos> <pad> <unk> <mask>",
    "<unused0>",
    "not<|turn>special",
    "",
]


# ----------------------------------------------------------------------------------------- utils

def run(cmd, env=None, check=True, timeout=600):
    cmd = [str(c) for c in cmd]
    p = subprocess.run(cmd, capture_output=True, text=True, encoding="utf-8", errors="replace", env=env, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def compact_json(obj, indent=0):
    """JSON with dicts indented and lists of scalars on one line (keeps the file diffable)."""
    pad = " " * indent
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f'{pad} {json.dumps(k, ensure_ascii=False)}: {compact_json(v, indent + 1)}' for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(x, (dict, list)) for x in obj):
        if all(isinstance(x, list) and not any(isinstance(y, (dict, list)) for y in x) for x in obj):
            return "[\n" + ",\n".join(pad + " " + compact_json(x) for x in obj) + "\n" + pad + "]"
        return "[\n" + ",\n".join(pad + " " + compact_json(x, indent + 1) for x in obj) + "\n" + pad + "]"
    if isinstance(obj, list):
        return "[" + ", ".join(compact_json(x) for x in obj) + "]"
    if isinstance(obj, float):
        assert np.isfinite(obj), obj
        return repr(obj)
    return json.dumps(obj, ensure_ascii=False)


def text_config(cfg):
    return cfg.get("text_config", cfg)


# ------------------------------------------------------------------------------ tiny tokenizer

def tiny_tokenizer(vocab_size):
    """A deterministic byte-fallback BPE tokenizer.json of exactly vocab_size tokens (>= 231).

    ids 0-4 <pad> <eos> <bos> <unk> <mask>; 5 '▁'; then the 94 printable non-space ASCII chars;
    byte tokens <0x09> <0x0A> <0x0D> and <0x80>..<0xFF> (so any UTF-8 text beyond ASCII falls back to
    bytes; other control bytes become <unk>); then '▁a'..'▁z' with their merges, then '▁tN' fillers.
    """
    vocab = {}

    def add(t):
        assert t not in vocab, t
        vocab[t] = len(vocab)

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    for t in specials:
        add(t)
    add("▁")
    for c in string.printable:
        if c not in " \t\n\r\x0b\x0c":
            add(c)
    for b in [0x09, 0x0A, 0x0D] + list(range(0x80, 0x100)):
        add(f"<0x{b:02X}>")
    assert len(vocab) <= vocab_size, vocab_size
    merges = []
    for c in string.ascii_lowercase:
        if len(vocab) < vocab_size:
            add("▁" + c)
            merges.append(["▁", c])
    i = 0
    while len(vocab) < vocab_size:
        add(f"▁t{i}")
        i += 1
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [dict(id=vocab[t], content=t, single_word=False, lstrip=False, rstrip=False,
                              normalized=False, special=True) for t in specials],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
           "pad_token": "<pad>", "unk_token": "<unk>", "mask_token": "<mask>",
           "add_bos_token": True, "add_eos_token": False}
    return tok, cfg


# ------------------------------------------------------------------------------ KV-sharing check

def kv_sharing(cfg):
    """Which layer each shared layer reads its K/V from: HF semantics vs llama.cpp's rule.

    HF (transformers / spec §3.8): layers >= first = L - num_kv_shared_layers reuse the K/V of the
    last layer < first of the same type. llama.cpp (llama-model.cpp, n_layer_kv_from_start): a
    sliding reuse layer reads layer first-2, a full one first-1.
    """
    t = text_config(cfg)
    types = ["S" if x == "sliding_attention" else "F" for x in t["layer_types"]]
    L, shared = len(types), t.get("num_kv_shared_layers") or 0
    first = L - shared
    if shared == 0:
        return {"layer_types": "".join(types), "num_kv_shared_layers": 0, "llama_cpp_misreads": False}
    hf = {}
    for kind in "SF":
        below = [i for i in range(first) if types[i] == kind]
        hf[kind] = below[-1] if below else None
    llama = {"S": first - 2, "F": first - 1}
    used = {types[i] for i in range(first, L)}
    wrong = [k for k in used if hf[k] != llama[k]]
    return {"layer_types": "".join(types), "num_kv_shared_layers": shared, "first_shared": first,
            "hf_store_layer": {"sliding": hf["S"], "full": hf["F"]},
            "llama_cpp_store_layer": {"sliding": llama["S"], "full": llama["F"]},
            "llama_cpp_misreads": bool(wrong)}


# ----------------------------------------------------------------------------------- GGUF dump

def gguf_summary(path):
    r = gguf.GGUFReader(str(path))
    meta = {}
    for name, field in r.fields.items():
        if name.startswith("GGUF."):
            continue
        vt = field.types[0] if field.types else None
        tname = vt.name if vt is not None else None
        if vt == gguf.GGUFValueType.ARRAY:
            et = field.types[-1].name
            n = len(field.data)
            if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.token_type",):
                if et == "STRING":
                    vals = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data[:8]]
                else:
                    vals = [field.parts[i].tolist()[0] for i in field.data[:8]]
                meta[name] = {"type": f"ARRAY[{et}]", "len": n, "first": vals}
            elif name == "tokenizer.ggml.token_type":
                vals = [int(field.parts[i][0]) for i in field.data]
                counts = {}
                for v in vals:
                    counts[str(v)] = counts.get(str(v), 0) + 1
                meta[name] = {"type": f"ARRAY[{et}]", "len": n, "first": vals[:8], "counts": counts}
            else:
                if et == "STRING":
                    vals = [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]
                else:
                    vals = [field.parts[i].tolist()[0] for i in field.data]
                meta[name] = {"type": f"ARRAY[{et}]", "value": vals}
        elif vt == gguf.GGUFValueType.STRING:
            s = bytes(field.parts[field.data[0]]).decode("utf-8", "replace")
            meta[name] = {"type": "STRING", "value": s if len(s) <= 400 else s[:400] + "…"}
        else:
            v = field.parts[field.data[0]].tolist()[0]
            if isinstance(v, float):
                v = float(np.float32(v))
            meta[name] = {"type": tname, "value": v}
    tensors = [[t.name, t.tensor_type.name, [int(x) for x in t.shape]] for t in r.tensors]
    return meta, tensors


def tokenizer_fingerprint(path):
    r = gguf.GGUFReader(str(path))
    h = hashlib.sha256()
    for name in sorted(n for n in r.fields if n.startswith("tokenizer.")):
        h.update(name.encode())
        for part in r.fields[name].parts:
            h.update(bytes(part))
    return h.hexdigest()


def hf_tensor_names(src):
    names = []
    for f in sorted((ROOT / src).glob("model*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        names += [k for k in json.loads(raw[8:8 + n]) if k != "__metadata__"]
    return sorted(names)


def hf_to_gguf_names(src, arch_name, tensors):
    """HF tensor name -> GGUF tensor name, by gguf-py's tensor map plus the Gemma 4 converter's own
    renames (router.scale, router.per_expert_scale); None where the GGUF has no such tensor."""
    cfg = json.loads((ROOT / src / "config.json").read_text())
    arch = {"gemma4": gguf.MODEL_ARCH.GEMMA4, "gemma4-assistant": gguf.MODEL_ARCH.GEMMA4_ASSISTANT}[arch_name]
    tmap = gguf.get_tensor_name_map(arch, text_config(cfg)["num_hidden_layers"])
    have = {t[0] for t in tensors}
    out = {}
    for k in hf_tensor_names(src):
        n = k
        for pre in ("model.language_model.", "language_model.model."):
            if n.startswith(pre):
                n = "model." + n[len(pre):]
        if n.endswith("per_dim_scale") or n.endswith("layer_scalar"):
            n += ".weight"
        if ".experts." in n and not n.endswith(".weight"):
            n += ".weight"
        g = None
        if n.endswith("router.scale") or n.endswith("router.per_expert_scale"):
            bid = n.split(".layers.")[1].split(".")[0]
            g = f"blk.{bid}.ffn_gate_inp.scale" if n.endswith("router.scale") else f"blk.{bid}.ffn_down_exps.scale"
        else:
            g = tmap.get_name(n, try_suffixes=(".weight", ".bias"))
        out[k] = g if g in have else None
    return out


# ------------------------------------------------------------------------------------ helpers

def build_helpers(work):
    """Build scripts/gguf_goldens/llama_logits.cpp and a token-id variant of llama.cpp's
    examples/speculative-simple against the static libs of LLAMA_BUILD."""
    B, L = LLAMA_BUILD, LLAMA_SRC
    libs = [B / "src/libllama.a", B / "ggml/src/libggml.a", B / "ggml/src/libggml-cpu.a", B / "ggml/src/libggml-base.a"]
    inc = [f"-I{L}/include", f"-I{L}/ggml/include"]
    logits_bin = work / "llama_logits"
    run(["g++", "-O2", "-std=c++17", *inc, HELPERS / "llama_logits.cpp", "-o", logits_bin, *libs,
         "-fopenmp", "-lpthread", "-ldl"])

    src = (L / "examples/speculative-simple/speculative-simple.cpp").read_text()
    patches = [
        ("#include <cstdio>\n", "#include <cstdio>\n#include <cstdlib>\n"),
        ("inp = common_tokenize(ctx_tgt, params.prompt, true, true);",
         '{ const char * e = getenv("GOLDEN_IDS"); std::string s = e ? e : ""; size_t p = 0;'
         " while (p < s.size()) { size_t q = s.find(',', p); if (q == std::string::npos) q = s.size();"
         " inp.push_back(std::stoi(s.substr(p, q - p))); p = q + 1; } }"),
        ("    int n_predict = 0;\n", "    int n_predict = 0;\n    std::vector<llama_token> golden_out;\n"),
        ("            id_last = ids[i];\n", "            id_last = ids[i];\n            golden_out.push_back(id_last);\n"),
        ("    common_speculative_free(spec);\n",
         '    fprintf(stdout, "\\nGOLDEN_OUT {\\"tokens\\": [");'
         ' for (size_t i = 0; i < golden_out.size(); i++) fprintf(stdout, "%s%d", i ? ", " : "", golden_out[i]);'
         ' fprintf(stdout, "], \\"n_drafted\\": %d, \\"n_accept\\": %d}\\n", n_drafted, n_accept); fflush(stdout);\n'
         "    common_speculative_free(spec);\n"),
    ]
    for a, b in patches:
        assert src.count(a) == 1, f"speculative-simple.cpp changed upstream: {a!r}"
        src = src.replace(a, b)
    spec_src = work / "spec_ids.cpp"
    spec_src.write_text(src)
    spec_bin = work / "spec_ids"
    run(["g++", "-O2", "-std=c++17", "-DGGML_USE_CPU", f"-I{L}/common", *inc, f"-I{L}/vendor", spec_src, "-o", spec_bin,
         B / "common/libllama-common.a", *libs, B / "common/libllama-common-base.a",
         B / "vendor/cpp-httplib/libcpp-httplib.a", "-fopenmp", "-lpthread", "-ldl"])
    return logits_bin, spec_bin


def llama_run(logits_bin, gguf_path, ids, n_greedy):
    p = run([logits_bin, gguf_path, n_greedy, ",".join(map(str, ids))])
    d = json.loads(p.stdout)
    d["last_logits"] = [float(np.float32(x)) for x in d["last_logits"]]
    d["greedy_margins"] = [float(np.float32(x)) for x in d["greedy_margins"]]
    return d


def spec_run(spec_bin, target, drafter, ids, n):
    env = dict(os.environ, GOLDEN_IDS=",".join(map(str, ids)))
    p = run([spec_bin, "-m", target, "-md", drafter, "--spec-type", "draft-mtp", "--spec-draft-n-max", N_DRAFT,
             "-n", n, "--temp", "0", "--top-k", "1", "--seed", "1", "-t", "1", "-tb", "1", "-td", "1", "-tbd", "1",
             "-c", "512", "-fa", "off", "-p", "unused"], env=env)
    line = [x for x in p.stdout.splitlines() if x.startswith("GOLDEN_OUT ")]
    assert len(line) == 1, p.stdout[-2000:] + p.stderr[-2000:]
    d = json.loads(line[0][len("GOLDEN_OUT "):])
    d["tokens"] = d["tokens"][:n]
    return d


# -------------------------------------------------------------------------------- conversion

def prepare(src, tmp, name, tokenizer_from=None):
    d = tmp / "hf" / name
    shutil.copytree(ROOT / src, d)
    if (d / "tokenizer.json").exists():
        return d, f"{src}/tokenizer.json"
    if tokenizer_from is not None and (ROOT / tokenizer_from / "tokenizer.json").exists():
        for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]:
            if (ROOT / tokenizer_from / f).exists() and not (d / f).exists():
                shutil.copy(ROOT / tokenizer_from / f, d / f)
        return d, f"{tokenizer_from}/tokenizer.json (copied)"
    V = text_config(json.loads((d / "config.json").read_text()))["vocab_size"]
    tok, tcfg = tiny_tokenizer(V)
    (d / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1))
    return d, f"synthetic byte-fallback BPE, {V} tokens (tiny_tokenizer in scripts/gguf_goldens.py)"


def convert(hf_dir, outtype, out_path):
    p = run([sys.executable, LLAMA_SRC / "convert_hf_to_gguf.py", hf_dir, "--outtype", outtype,
             "--outfile", out_path], check=False)
    log = p.stdout + p.stderr
    if p.returncode != 0 or not out_path.exists():
        err = [x for x in log.splitlines() if x.strip()][-6:]
        return False, err, log
    return True, [x for x in log.splitlines() if x.startswith("WARNING") and "Duplicated key" not in x], log


def quantize(src, dst, qtype):
    p = run([LLAMA_BUILD / "bin/llama-quantize", src, dst, qtype, "1"])
    log = p.stdout + p.stderr
    notes = [x.strip() for x in log.splitlines() if "fallback" in x.lower() or "not divisible" in x.lower()]
    return notes


# -------------------------------------------------------------------------------- prompts / HF

def prompts_for(name, src):
    """[(label, ids, n_greedy, hf_reference or None)]"""
    g = ROOT / src / "golden.json"
    out = []
    if g.exists():
        gj = json.loads(g.read_text())
        ref = {}
        gs = ROOT / src / "golden.safetensors"
        if gs.exists():
            from safetensors.numpy import load_file
            gt = load_file(str(gs))
            if "logits" in gt:
                ref["last_logits"] = gt["logits"][-1].astype(np.float32)
            if "logits_f32_compute" in gt:  # the same rounded weights, computed in float32 by torch
                ref["last_logits_f32_compute"] = gt["logits_f32_compute"][-1].astype(np.float32)
        out.append(("golden.prompt", gj["prompt"], N_GREEDY, ref or None))
        out.append(("golden.greedy_prompt", gj["greedy_prompt"], len(gj["greedy_tokens"]),
                    {"greedy_tokens": gj["greedy_tokens"], "greedy_margins": gj["greedy_margins"]}))
        return out
    tg = ROOT / src / "text_goldens.json"
    if tg.exists():
        for gen in json.loads(tg.read_text())["generation"]:
            out.append((f"text_goldens.generation[mode={gen['mode']}]", gen["prompt_ids"], len(gen["tokens"]),
                        {"greedy_tokens": gen["tokens"], "greedy_margins": gen["margins"]}))
        return out
    # fixed prompt for checkpoints without goldens: HF tokenization (with <bos>) of a fixed text
    from tokenizers import Tokenizer
    text = "The quick brown fox jumps over the lazy dog."
    ids = Tokenizer.from_file(str(ROOT / src / "tokenizer.json")).encode(text, add_special_tokens=True).ids
    out.append((f"fixed: HF tokenizers encode({text!r}, add_special_tokens=True)", ids, N_GREEDY, None))
    return out


def compare(res, ref):
    if not ref:
        return None
    c = {}
    if "last_logits" in ref:
        a = np.array(res["last_logits"], dtype=np.float64)
        b = ref["last_logits"].astype(np.float64)
        c["hf_last_logits_max_abs_diff"] = float(np.max(np.abs(a - b)))
        c["hf_last_argmax"] = int(np.argmax(b))
    if "last_logits_f32_compute" in ref:
        a = np.array(res["last_logits"], dtype=np.float64)
        b = ref["last_logits_f32_compute"].astype(np.float64)
        c["hf_f32_compute_last_logits_max_abs_diff"] = float(np.max(np.abs(a - b)))
    if "greedy_tokens" in ref:
        hf = ref["greedy_tokens"][:len(res["greedy_tokens"])]
        n = 0
        while n < len(hf) and hf[n] == res["greedy_tokens"][n]:
            n += 1
        c["hf_greedy_tokens"] = hf
        c["hf_greedy_margins"] = ref["greedy_margins"][:len(hf)]
        c["greedy_agree_prefix"] = n
    return c


# ------------------------------------------------------------------------------- tokenization

def llama_tokenize(gguf_path, text, tmp, bos, special):
    f = tmp / "tok_input.txt"
    f.write_bytes(text.encode("utf-8"))
    cmd = [LLAMA_BUILD / "bin/llama-tokenize", "-m", gguf_path, "-f", f, "--ids", "--log-disable"]
    if not bos:
        cmd.append("--no-bos")
    if not special:
        cmd.append("--no-parse-special")  # llama-tokenize parses special tokens by default
    p = run(cmd, check=False)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["rc %d" % p.returncode])[-1]}
    line = p.stdout.strip().splitlines()[-1]
    return json.loads(line)


def hf_tokenize(tok, text, add_special, split_special):
    tok.encode_special_tokens = split_special
    return tok.encode(text, add_special_tokens=add_special).ids


def tokenization_goldens(sources, tmp):
    from tokenizers import Tokenizer
    out = {}
    for label, gguf_name, gguf_path, tok_json in sources:
        if not Path(gguf_path).exists():
            print(f"  tokenization: {label}: {gguf_path} missing, skipped")
            continue
        tok = Tokenizer.from_file(str(tok_json))
        cases, n_diff = [], 0
        for s in TOKENIZE_STRINGS:
            case = {"text": s}
            for bos in (True, False):
                for special in (True, False):
                    key = f"{'bos' if bos else 'nobos'}_{'special' if special else 'nospecial'}"
                    lt = llama_tokenize(gguf_path, s, tmp, bos, special)
                    ht = hf_tokenize(tok, s, bos, not special)
                    case[f"llama_{key}"] = lt
                    case[f"hf_{key}"] = ht
                    if lt != ht:
                        n_diff += 1
                        case.setdefault("differs", []).append(key)
            cases.append(case)
        out[label] = {"gguf": gguf_name,
                      "tokenizer_json": str(tok_json).replace(str(ROOT) + "/", "").replace(str(HOME), "~"),
                      "cases": cases, "n_differences": n_diff}
        print(f"  tokenization: {label}: {len(cases)} strings x 4 modes, {n_diff} llama/HF differences")
    return out


# ------------------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--keep-tmp", action="store_true")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.gguf"):
        old.unlink()
    tmp = Path(tempfile.mkdtemp(prefix="gguf_goldens_"))
    print(f"llama.cpp source {LLAMA_SRC}\nllama.cpp build  {LLAMA_BUILD}\nwork dir {tmp}")
    commit = (LLAMA_BUILD / "common/build-info.cpp").read_text().split('LLAMA_COMMIT = "')[1].split('"')[0]
    logits_bin, spec_bin = build_helpers(tmp)
    print("built llama_logits and spec_ids")

    files, refused, made = {}, {}, {}

    def place(fname, committed):
        return (out_dir if committed else tmp / "gguf") / fname

    (tmp / "gguf").mkdir()

    def record(fname, path, committed, info):
        meta, tensors = gguf_summary(path)
        e = {"committed": committed, "size_bytes": path.stat().st_size, "sha256": sha256(path)}
        e.update(info)
        e["metadata"] = meta
        e["tensors"] = tensors
        if "quantized_from" not in info:
            arch = meta["general.architecture"]["value"]
            e["hf_to_gguf"] = hf_to_gguf_names(info["source"], arch, tensors)
            unmapped = {k for k, v in e["hf_to_gguf"].items() if v is None}
            e["hf_tensors_not_in_gguf"] = sorted(unmapped)
            mapped = {v for v in e["hf_to_gguf"].values() if v}
            e["gguf_tensors_not_from_hf"] = sorted(t[0] for t in tensors if t[0] not in mapped)
        counts = {}
        for t in tensors:
            counts[t[1]] = counts.get(t[1], 0) + 1
        e["tensor_type_counts"] = counts
        files[fname] = e
        made[fname] = path
        return e

    # ---- targets
    for name, src, outtypes, quants, committed in TARGETS:
        cfg = json.loads((ROOT / src / "config.json").read_text())
        ks = kv_sharing(cfg)
        hf_dir, tokinfo = prepare(src, tmp, name)
        for ot in outtypes:
            fname = f"{name}-{ot}.gguf"
            path = place(fname, committed)
            ok, notes, log = convert(hf_dir, ot, path)
            if not ok:
                refused[fname] = {"source": src, "outtype": ot, "converter_error": notes}
                print(f"REFUSED {fname}: {notes[-1] if notes else '?'}")
                continue
            record(fname, path, committed, {"kind": "target", "source": src, "outtype": ot, "tokenizer": tokinfo,
                                            "converter_warnings": notes, "kv_sharing": ks})
            print(f"converted {fname} ({path.stat().st_size} bytes){' [llama.cpp misreads KV sharing]' if ks['llama_cpp_misreads'] else ''}")
            if ot == outtypes[0]:
                for q in quants:
                    qname = f"{name}-{q.lower()}.gguf"
                    qpath = place(qname, committed)
                    qnotes = quantize(path, qpath, q)
                    record(qname, qpath, committed, {"kind": "target", "source": src, "quantized_from": fname,
                                                     "quant": q, "tokenizer": tokinfo,
                                                     "llama_quantize_notes": qnotes, "kv_sharing": ks})
                    print(f"quantized {qname} ({qpath.stat().st_size} bytes), {len(qnotes)} fallback notes")

    # ---- llama.cpp runs on every target GGUF
    for fname, e in files.items():
        src = e["source"]
        runs = []
        for label, ids, n, ref in prompts_for(fname, src):
            try:
                res = llama_run(logits_bin, made[fname], ids, n)
            except RuntimeError as ex:
                msg = [x for x in str(ex).splitlines() if "GGML_ASSERT" in x or "error" in x.lower()]
                runs.append({"prompt": label, "prompt_ids": ids, "llama_cpp_error": (msg or [str(ex)[:300]])[-1].strip()})
                print(f"  {fname} {label}: llama.cpp FAILED: {runs[-1]['llama_cpp_error']}")
                continue
            assert res["n_vocab"] == len(res["last_logits"]) > 0
            assert all(np.isfinite(res["last_logits"]))
            r = {"prompt": label, "prompt_ids": ids, "n_vocab": res["n_vocab"], "last_logits": res["last_logits"],
                 "greedy_tokens": res["greedy_tokens"], "greedy_margins": res["greedy_margins"]}
            c = compare(res, ref)
            if c:
                r["vs_hf"] = c
            runs.append(r)
            msg = f"  {fname} {label}: greedy {res['greedy_tokens'][:6]}…"
            if c and "hf_last_logits_max_abs_diff" in c:
                msg += f" | max|Δlogit| vs HF {c['hf_last_logits_max_abs_diff']:.3g}"
            if c and "hf_f32_compute_last_logits_max_abs_diff" in c:
                msg += f" (vs HF f32 compute {c['hf_f32_compute_last_logits_max_abs_diff']:.3g})"
            if c and "greedy_agree_prefix" in c:
                msg += f" | agrees with HF greedy for {c['greedy_agree_prefix']}/{len(c['hf_greedy_tokens'])}"
            print(msg)
        e["runs"] = runs

    # ---- drafters
    for name, src, ot, tname, committed in DRAFTERS:
        tsrc = next(t[1] for t in TARGETS if t[0] == tname)
        tfile = f"{tname}-{next(t[2] for t in TARGETS if t[0] == tname)[0]}.gguf"
        hf_dir, tokinfo = prepare(src, tmp, name, tokenizer_from=tsrc)
        fname = f"{name}-{ot}.gguf"
        path = place(fname, committed)
        ok, notes, log = convert(hf_dir, ot, path)
        if not ok:
            refused[fname] = {"source": src, "outtype": ot, "converter_error": notes}
            print(f"REFUSED {fname}: {notes[-1] if notes else '?'}")
            continue
        e = record(fname, path, committed, {"kind": "drafter", "source": src, "outtype": ot, "tokenizer": tokinfo,
                                           "target": tfile, "converter_warnings": notes})
        dropped = e["hf_tensors_not_in_gguf"]
        print(f"converted {fname} ({path.stat().st_size} bytes); converter dropped {dropped}")
        if tfile not in made:
            e["mtp"] = {"error": f"target {tfile} not converted"}
            continue
        mtp = []
        for run_ in files[tfile]["runs"]:
            if "llama_cpp_error" in run_:
                mtp.append({"prompt": run_["prompt"], "skipped": "llama.cpp cannot run the target"})
                continue
            ids, n = run_["prompt_ids"], len(run_["greedy_tokens"])
            try:
                d = spec_run(spec_bin, made[tfile], path, ids, n)
            except Exception as ex:  # noqa: BLE001
                mtp.append({"prompt": run_["prompt"], "error": str(ex).splitlines()[-1][:300]})
                print(f"  MTP {fname}: failed: {str(ex).splitlines()[-1][:200]}")
                continue
            # speculative-simple stops after an end-of-generation token (no --ignore-eos: that would bias
            # EOG logits to -inf and change the greedy path); compare with the same prefix of plain greedy
            eq = d["tokens"] == run_["greedy_tokens"][:len(d["tokens"])]
            mtp.append({"prompt": run_["prompt"], "prompt_ids": ids, "n_draft_max": N_DRAFT, "tokens": d["tokens"],
                        "stopped_at_eog": len(d["tokens"]) < n,
                        "n_drafted": d["n_drafted"], "n_accept": d["n_accept"], "equals_plain_greedy": eq})
            print(f"  MTP {tfile} + {fname} {run_['prompt']}: accepted {d['n_accept']}/{d['n_drafted']},"
                  f" equals plain greedy: {eq}")
        e["mtp"] = mtp

    # ---- tokenization goldens
    tsrc = []
    if "text-tiny-f32.gguf" in made:
        tsrc.append(("text-tiny", "text-tiny-f32.gguf", made["text-tiny-f32.gguf"],
                     ROOT / "tests/fixtures/text-tiny/tokenizer.json"))
    if "default-target-bf16.gguf" in made:
        # llama-tokenize cannot open the assistant GGUF ("Gemma4Assistant requires ctx_other"), so the
        # (uncommitted) target GGUF is used; its tokenizer.* metadata equals the committed assistant's.
        if "default-assistant-bf16.gguf" in made:
            assert tokenizer_fingerprint(made["default-target-bf16.gguf"]) == \
                tokenizer_fingerprint(made["default-assistant-bf16.gguf"])
        tsrc.append(("default", "default-target-bf16.gguf", made["default-target-bf16.gguf"],
                     ROOT / "models/default/target/tokenizer.json"))
    tsrc.append(("e2b10", str(E2B_GGUF).replace(str(HOME), "~"), E2B_GGUF, E2B_TOKENIZER))
    tokenization = tokenization_goldens(tsrc, tmp)

    import tokenizers
    doc = {
        "llama_cpp": {"commit": commit, "source": "llama_cpp_python-0.3.36 sdist, vendor/llama.cpp",
                      "converter": "convert_hf_to_gguf.py of that tree (gguf-py of that tree)",
                      "run": "CPU, 1 thread, n_ctx 512, one llama_decode for the prompt then one per token, "
                             "flash attention off, f32 K/V cache, no BOS added (ids fed as given)"},
        "generated_by": {"script": "scripts/gguf_goldens.py", "python": sys.version.split()[0],
                         "tokenizers": tokenizers.__version__, "numpy": np.__version__},
        "files": files,
        "refused": refused,
        "tokenization": tokenization,
    }
    (out_dir / "llama_goldens.json").write_text(compact_json(doc) + "\n")

    # ---- sanity
    assert refused.keys() <= {f"{t[0]}-{ot}.gguf" for t in TARGETS for ot in t[2]} | {f"{d[0]}-{d[2]}.gguf" for d in DRAFTERS}
    for must in ["t1-f32-f32.gguf", "t1-bf16-bf16.gguf", "t5-e2b-f32.gguf", "d1-centroid-f32.gguf",
                 "d2-tied-f32.gguf", "text-tiny-f32.gguf", "text-tiny-assistant-f32.gguf"]:
        assert must in files, must
    t1 = files["t1-f32-f32.gguf"]["runs"][0]["vs_hf"]
    assert t1["hf_last_logits_max_abs_diff"] < 1e-2, t1
    total = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    print(f"\nwrote {out_dir}: {len([f for f in files.values() if f['committed']])} GGUF files committed,"
          f" {len(refused)} refused, total {total / 1e6:.1f} MB")
    for f, e in files.items():
        print(f"  {'*' if e['committed'] else ' '} {f:34s} {e['size_bytes']:>10d}")
    if args.keep_tmp:
        print("kept", tmp)
    else:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
