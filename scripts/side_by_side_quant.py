"""tandem vs llama.cpp on quantized weights, interleaved in one run (2 threads each): the side-by-side kit's
E2B-dims model (../shared/bench: 10 layers, random weights) quantized by each engine from the same bf16
source (llama.cpp: `llama-quantize` files written by the kit's convert.sh; tandem: `--quantize` at load).

usage: python3 scripts/side_by_side_quant.py TANDEM_BIN [--reps 3] [--formats q8_0,q4_k_m] [--no-drafting] [--gguf] [--out FILE.json]
env:   A (the kit's directory, default ~/anchors) holding e2b10/, e2b10-assistant/, gguf/e2b10-{bf16,q8_0,q4_k_m}.gguf,
       build/ (llama.cpp's build: bin/ and the static libraries llama_rows links) and prompt128.txt;
       LLAMA_SRC: llama.cpp's source (default: the kit's copy under $A/src)

Per repetition and format, in this order (so drift of the shared machine hits both engines alike):
  llama-completion plain, tandem --no-draft, llama_rows (scripts/side_by_side/llama_rows.cpp: 1 and 5 new
  rows at depth 128 with logits for every row, as verification needs them and as tandem's bench measures,
  and with the last row's only, as llama-bench -p 5 -d 128 measures), tandem bench --model e2b10 --rows 5, llama-speculative-simple with the bf16 drafter (draft-mtp, k=4),
  tandem --draft-tokens 4 and auto (random weights: drafts are almost never accepted, so these measure
  what drafting costs when it does not pay; `--no-drafting` leaves these three out). Summarise with scripts/side_by_side_summary.py --quant.
`--gguf`: tandem runs llama.cpp's own GGUF files too (target e2b10-FORMAT.gguf, drafter e2b10-assistant-bf16.gguf,
as llama.cpp's converter wrote it: tied head, no centroids) instead of quantizing the safetensors at load; formats
may then include bf16.
Run it on an otherwise idle machine, or under `chrt -f 10`: llama.cpp's spinning threads collapse when
anything else wants a core.
"""
import glob, json, os, re, subprocess, sys, tempfile, time

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


def build_llama_rows():
    src = os.environ.get("LLAMA_SRC") or next(iter(glob.glob(f"{A}/src/llama_cpp_python-*/vendor/llama.cpp")), None)
    if not src:
        sys.exit(f"no llama.cpp source under {A}/src: set LLAMA_SRC")
    here = os.path.dirname(os.path.abspath(__file__))
    exe = os.path.join(tempfile.mkdtemp(), "llama_rows")
    libs = [f"{A}/build/src/libllama.a"] + [f"{A}/build/ggml/src/libggml{x}.a" for x in ("", "-cpu", "-base")]
    subprocess.run(["g++", "-O2", "-std=c++17", f"-I{src}/include", f"-I{src}/ggml/include",
                    f"{here}/side_by_side/llama_rows.cpp", "-o", exe, *libs, "-fopenmp", "-lpthread", "-ldl"], check=True)
    return exe


LLAMA_ROWS = build_llama_rows()


def llama_rows(fmt):
    p = run([LLAMA_ROWS, f"{G}/e2b10-{fmt}.gguf", "2", "128", "1,5", "5"])
    try:
        r = json.loads(p.stdout)
        a, l = r["all"], r["last"]
        return dict(ms1=a["1"], ms5=a["5"], ratio_all=a["5"] / a["1"], ms5_last=l["5"], ratio_last=l["5"] / l["1"])
    except (ValueError, KeyError):
        return dict(ratio_all=None)


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
