#!/usr/bin/env python3
"""GGUF files written by `tandem quantize`, run by llama.cpp: goldens for tests/gguf_llama.rs.

Writes tests/fixtures/gguf/tandem/*.gguf (made by the tandem binary given, default target/release/tandem)
and tests/fixtures/gguf/tandem_written.json: for each file, what made it, and llama.cpp's last-position
logits, greedy tokens and top-2 margins on the prompts llama_goldens.json uses for the same fixture; for
the pairs, llama.cpp's MTP run. Uses scripts/gguf_goldens.py's helpers (the same llama.cpp build).

    ~/anchors/convenv/bin/python scripts/gguf_tandem_written.py [path/to/tandem]
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gguf_goldens as g  # noqa: E402

ROOT = g.ROOT
OUT = ROOT / "tests/fixtures/gguf/tandem"
N = 16

# (output name, source fixture dir, recipe or None, tokenizer from: None (its own) or "tiny" (synthetic))
TARGETS = [
    ("text-tiny-f32", "tests/fixtures/text-tiny", None, None),
    ("text-tiny-q8_0", "tests/fixtures/text-tiny", "q8_0", None),
    ("text-tiny-q4_k_m", "tests/fixtures/text-tiny", "q4_k_m", None),
    ("t6-long-q4_k_m", "tests/fixtures/t6-long", "q4_k_m", "tiny"),
    ("t6-long-q4_0", "tests/fixtures/t6-long", "q4_0", "tiny"),
    ("t1-f32-f32", "tests/fixtures/t1-f32", None, "tiny"),
]
# (output name, source dir, recipe, its target's output name, tokenizer from)
DRAFTERS = [
    ("text-tiny-assistant-f32", "tests/fixtures/text-tiny-assistant", None, "text-tiny-f32", "tests/fixtures/text-tiny"),
    ("d1-centroid-f32", "tests/fixtures/d1-centroid", None, "t1-f32-f32", "tiny"),
]


def prompts_for(source, goldens):
    for f in goldens["files"].values():
        if f["source"] == source and f["kind"] == "target":
            return [r["prompt_ids"] for r in f["runs"] if "llama_cpp_error" not in r]
    raise SystemExit(f"no llama_goldens.json runs for {source}")


def with_tokenizer(src, tmp, tok):
    d = tmp / Path(src).name
    if d.exists():
        return d
    shutil.copytree(ROOT / src, d)
    if tok == "tiny":
        vocab = json.loads((d / "config.json").read_text())
        v = vocab.get("vocab_size") or vocab["text_config"]["vocab_size"]
        t, c = g.tiny_tokenizer(v)
        (d / "tokenizer.json").write_text(json.dumps(t))
        (d / "tokenizer_config.json").write_text(json.dumps(c))
    elif tok:
        for f in ["tokenizer.json", "tokenizer_config.json"]:
            shutil.copy(ROOT / tok / f, d / f)
    return d


def main():
    tandem = Path(sys.argv[1] if len(sys.argv) > 1 else ROOT / "target/release/tandem").resolve()
    goldens = json.loads((ROOT / "tests/fixtures/gguf/llama_goldens.json").read_text())
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    out = {"llama_cpp": goldens["llama_cpp"], "generated_by": "scripts/gguf_tandem_written.py", "files": {}}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        logits_bin, spec_bin = g.build_helpers(tmp)
        for name, src, recipe, tok in TARGETS:
            d = with_tokenizer(src, tmp, tok)
            path = OUT / f"{name}.gguf"
            cmd = [tandem, "quantize", "--model", d, "--out", path] + (["--quantize", recipe] if recipe else [])
            g.run(cmd)
            runs = []
            for ids in prompts_for(src, goldens):
                r = g.llama_run(logits_bin, path, ids, N)
                runs.append({"prompt_ids": ids, **{k: r[k] for k in ["last_logits", "greedy_tokens", "greedy_margins"]}})
            out["files"][path.name] = {"kind": "target", "source": src, "recipe": recipe, "tokenizer": tok,
                                       "size_bytes": path.stat().st_size, "sha256": g.sha256(path), "runs": runs}
            print(name, "ok", [r["greedy_tokens"][:6] for r in runs])
        for name, src, recipe, tname, tok in DRAFTERS:
            d = with_tokenizer(src, tmp, tok)
            path = OUT / f"{name}.gguf"
            g.run([tandem, "quantize", "--model", d, "--out", path] + (["--quantize", recipe] if recipe else []))
            target = OUT / f"{tname}.gguf"
            mtp = []
            for r in out["files"][target.name]["runs"]:
                m = g.spec_run(spec_bin, target, path, r["prompt_ids"], N)
                mtp.append({"prompt_ids": r["prompt_ids"], "tokens": m["tokens"], "n_drafted": m["n_drafted"],
                            "n_accept": m["n_accept"], "equals_plain_greedy": m["tokens"] == r["greedy_tokens"][:len(m["tokens"])]})
            out["files"][path.name] = {"kind": "drafter", "source": src, "recipe": recipe, "tokenizer": tok, "target": target.name,
                                       "size_bytes": path.stat().st_size, "sha256": g.sha256(path), "mtp": mtp}
            print(name, "ok", [m["tokens"][:6] for m in mtp])
    (OUT.parent / "tandem_written.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
