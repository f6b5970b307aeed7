"""The shipped model pair as GGUF in both engines, interleaved: plain and speculative (draft-mtp, k = 4) decode
speed on the held-out prompts, 2 threads each, greedy.

usage: python3 scripts/side_by_side_pair_gguf.py TANDEM_BIN [--reps 3] [--prompts 5] [--tokens 64] [--out FILE.json]
env:   A (the side-by-side kit's directory, default ~/anchors) holding build/bin/ (llama-completion,
       llama-speculative-simple)

The GGUF files are written by `TANDEM_BIN quantize` from models/default (bf16; the drafter's centroid head
travels in metadata, which llama.cpp ignores: it drafts with the tied head, tandem with the centroid head).
Per repetition and prompt, in this order: llama.cpp plain, llama.cpp with its drafter, tandem plain, tandem
k = 4, tandem auto. Both engines get the same token ids (llama.cpp tokenizes the prompt text with the file's
tokenizer; tandem is given the same text). Each engine's speed-up is its speculative decode speed over its
own plain decode speed in the same repetition; the medians of those ratios are printed.
"""
import json, os, re, statistics, subprocess, sys, tempfile, time

A = os.environ.get("A", os.path.expanduser("~/anchors"))
B = f"{A}/build/bin"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
tandem = sys.argv[1]
arg = lambda name, default: sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default
reps, n_prompts, n_tok = int(arg("--reps", "3")), int(arg("--prompts", "5")), arg("--tokens", "64")
out = arg("--out", None)
R = {}


def add(key, val):
    R.setdefault(key, []).append(val)
    print(f"{time.strftime('%H:%M:%S')} {key}: {val}", flush=True)


def run(cmd):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        print("FAILED", " ".join(map(str, cmd[:4])), p.stderr[-800:], flush=True)
    return p


tmp = tempfile.mkdtemp()
target, drafter = f"{tmp}/default-target.gguf", f"{tmp}/default-assistant.gguf"
run([tandem, "quantize", "--model", f"{ROOT}/models/default/target", "--out", target])
run([tandem, "quantize", "--model", f"{ROOT}/models/default/assistant", "--out", drafter])
prompts = [p["text"] for p in json.load(open(f"{ROOT}/models/default/heldout_prompts.json"))[:n_prompts]]


def llama(prompt, spec):
    if spec:
        cmd = [f"{B}/llama-speculative-simple", "-m", target, "-md", drafter, "--spec-type", "draft-mtp",
               "--spec-draft-n-max", "4", "-td", "2"]
    else:
        cmd = [f"{B}/llama-completion", "-m", target, "-no-cnv"]
    p = run(cmd + ["-p", prompt, "-n", n_tok, "--ignore-eos", "--temp", "0", "-t", "2", "-c", "1024"])
    if spec:
        m = re.search(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds, speed:\s+([0-9.]+) t/s", p.stderr + p.stdout)
        acc = re.search(r"accept\s+=\s+([0-9.]+)%", p.stderr + p.stdout)
        return dict(decode=float(m.group(3)) if m else None, accept=float(acc.group(1)) if acc else None)
    ev = re.search(r"\s eval time =\s*([0-9.]+) ms /\s*(\d+) runs", p.stderr)
    return dict(decode=int(ev.group(2)) / float(ev.group(1)) * 1e3 if ev else None)


def tand(prompt, extra):
    p = run([tandem, "--threads", "2", "generate", "--model", target, "--assistant", drafter, "--prompt", prompt,
             "--max-new-tokens", n_tok, "--ignore-eos", "--json"] + extra)
    if p.returncode != 0:
        return dict(decode=None)
    s = json.loads(p.stdout)["stats"]
    return dict(decode=s["decode_tokens_per_s"], accepted_per_round=s.get("mean_accepted_per_round"))


for rep in range(reps):
    for i, prompt in enumerate(prompts):
        lp, ls = llama(prompt, False), llama(prompt, True)
        tp, tk, ta = tand(prompt, ["--no-draft"]), tand(prompt, ["--draft-tokens", "4"]), tand(prompt, ["--draft-tokens", "auto"])
        add("llama plain", lp)
        add("llama mtp k4", ls)
        add("tandem plain", tp)
        add("tandem mtp k4", tk)
        add("tandem mtp auto", ta)
        ok = lambda *d: all(x["decode"] for x in d)
        if ok(lp, ls):
            add("llama speedup k4", ls["decode"] / lp["decode"])
        if ok(tp, tk, ta):
            add("tandem speedup k4", tk["decode"] / tp["decode"])
            add("tandem speedup auto", ta["decode"] / tp["decode"])
        if ok(lp, tp):
            add("tandem/llama plain", tp["decode"] / lp["decode"])

print()
for k, v in R.items():
    if "speedup" in k or "/" in k:
        print(f"{k}: median {statistics.median(v):.2f} (range {min(v):.2f}-{max(v):.2f}, {len(v)} pairs)")
    else:
        d = [x["decode"] for x in v if x["decode"]]
        if d:
            print(f"{k}: median {statistics.median(d):.1f} tok/s")
if out:
    json.dump(R, open(out, "w"), indent=1)
