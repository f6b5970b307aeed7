"""tandem vs llama.cpp on quantized weights, interleaved in one run (2 threads each): the side-by-side kit's
E2B-dims model (../shared/bench: 10 layers, random weights) quantized by each engine from the same bf16
source (llama.cpp: `llama-quantize` files written by the kit's convert.sh; tandem: `--quantize` at load).

usage: python3 scripts/side_by_side_quant.py TANDEM_BIN [--reps 3] [--formats q8_0,q4_k_m] [--no-drafting] [--gguf] [--out FILE.json]
env:   A (the kit's directory, default ~/anchors) holding e2b10/, e2b10-assistant/, gguf/e2b10-{bf16,q8_0,q4_k_m}.gguf,
       build/bin/ and prompt128.txt

Per repetition and format, in this order (so drift of the shared machine hits both engines alike):
  llama-completion plain, tandem --no-draft, llama-bench -p 1,5 -d 128 (5 rows vs 1 at depth 128),
  tandem bench --model e2b10 --rows 5, llama-speculative-simple with the bf16 drafter (draft-mtp, k=4),
  tandem --draft-tokens 4 and auto (random weights: drafts are almost never accepted, so these measure
  what drafting costs when it does not pay; `--no-drafting` leaves these three out). Summarise with scripts/side_by_side_summary.py --quant.
`--gguf`: tandem runs llama.cpp's own GGUF files too (target e2b10-FORMAT.gguf, drafter e2b10-assistant-bf16.gguf,
as llama.cpp's converter wrote it: tied head, no centroids) instead of quantizing the safetensors at load; formats
may then include bf16.
Run it on an otherwise idle machine, or under `chrt -f 10`: llama.cpp's spinning threads collapse when
anything else wants a core.
"""
import json, os, re, subprocess, sys, time

A = os.environ.get("A", os.path.expanduser("~/anchors"))
B, G = f"{A}/build/bin", f"{A}/gguf"
tandem = sys.argv[1]
arg = lambda name, default: sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default
reps = int(arg("--reps", "3"))
formats = arg("--formats", "q8_0,q4_k_m").split(",")
out = arg("--out", None)
drafting = "--no-drafting" not in sys.argv
gguf = "--gguf" in sys.argv
prompt = open(f"{A}/prompt128.txt").read()
R = {}


def add(key, val):
    R.setdefault(key, []).append(val)
    print(f"{time.strftime('%H:%M:%S')} {key}: {val}", flush=True)


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        print("FAILED", " ".join(cmd[:4]), p.stderr[-600:], flush=True)
    return p


def llama_completion(fmt):
    p = run([f"{B}/llama-completion", "-m", f"{G}/e2b10-{fmt}.gguf", "-p", prompt, "-n", "64", "--ignore-eos",
             "--temp", "0", "-t", "2", "-c", "1024", "-no-cnv"])
    pe = re.search(r"prompt eval time =\s*([0-9.]+) ms /\s*(\d+) tokens", p.stderr)
    ev = re.search(r"\s eval time =\s*([0-9.]+) ms /\s*(\d+) runs", p.stderr)
    if not (pe and ev):
        return dict(decode=None, prefill=None)
    return dict(prefill=int(pe.group(2)) / float(pe.group(1)) * 1e3, decode=int(ev.group(2)) / float(ev.group(1)) * 1e3)


def llama_mtp(fmt):
    p = run([f"{B}/llama-speculative-simple", "-m", f"{G}/e2b10-{fmt}.gguf", "-md", f"{G}/e2b10-assistant-bf16.gguf",
             "--spec-type", "draft-mtp", "--spec-draft-n-max", "4", "-p", prompt, "-n", "64", "--ignore-eos",
             "--temp", "0", "-t", "2", "-td", "2", "-c", "1024"])
    m = re.search(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds, speed:\s+([0-9.]+) t/s", p.stderr + p.stdout)
    return dict(decode=float(m.group(3)) if m else None)


def quant_args(fmt):
    return [] if fmt == "bf16" or gguf else ["--quantize", fmt]


def model(fmt):
    return f"{G}/e2b10-{fmt}.gguf" if gguf else f"{A}/e2b10"


def assistant():
    return f"{G}/e2b10-assistant-bf16.gguf" if gguf else f"{A}/e2b10-assistant"


def tandem_gen(fmt, extra):
    p = run([tandem, "--threads", "2"] + quant_args(fmt) + ["generate", "--model", model(fmt), "--assistant",
            assistant(), "--prompt", prompt, "--max-new-tokens", "64", "--ignore-eos", "--json"] + extra)
    if p.returncode != 0:
        return dict(decode=None, prefill=None)
    s = json.loads(p.stdout)["stats"]
    return dict(prefill=s["prefill_tokens_per_s"], decode=s["decode_tokens_per_s"],
                drafted=s.get("drafted_tokens"), accepted=s.get("accepted_tokens"))


def llama_rows(fmt):
    p = run([f"{B}/llama-bench", "-m", f"{G}/e2b10-{fmt}.gguf", "-p", "1,5", "-n", "0", "-d", "128", "-t", "2",
             "-r", "3", "-o", "json"])
    try:
        rows = {r["n_prompt"]: r["avg_ns"] / 1e6 for r in json.loads(p.stdout)}
        return dict(ms1=rows[1], ms5=rows[5], ratio=rows[5] / rows[1])
    except (ValueError, KeyError):
        return dict(ratio=None)


def tandem_rows(fmt):
    p = run([tandem, "--threads", "2"] + quant_args(fmt) + ["bench", "--model", model(fmt), "--rows", "5",
            "--decode", "16", "--prefill", "128", "--json"])
    if p.returncode != 0:
        return dict(ratio=None)
    r = json.loads(p.stdout)
    return dict(ms1=r["rows"][0][1], ms5=r["rows"][4][1], ratio=r["rows"][4][2], decode=r["decode_tokens_per_s"])


for rep in range(reps):
    for fmt in formats:
        add(f"llama {fmt} plain", llama_completion(fmt))
        add(f"tandem {fmt} plain", tandem_gen(fmt, ["--no-draft"]))
        add(f"llama {fmt} rows", llama_rows(fmt))
        add(f"tandem {fmt} rows", tandem_rows(fmt))
        if drafting:
            add(f"llama {fmt} mtp k4", llama_mtp(fmt))
            add(f"tandem {fmt} mtp k4", tandem_gen(fmt, ["--draft-tokens", "4"]))
            add(f"tandem {fmt} mtp auto", tandem_gen(fmt, ["--draft-tokens", "auto"]))

if out:
    json.dump(R, open(out, "w"), indent=1)
