"""Write tests/fixtures/quant/llama_quantize.json: rows of real weight tensors and the bytes llama.cpp's `llama-quantize`
makes of them in every block format tandem implements (tests/quant_goldens.rs checks tandem's quantizers
against them byte for byte).

usage: python scripts/quant_goldens.py SOURCE.gguf LLAMA_QUANTIZE [--rows 2]
  SOURCE.gguf     a bf16 GGUF written by llama.cpp's convert_hf_to_gguf.py (the side-by-side kit's
                  e2b10-assistant-bf16.gguf: matrices 256, 2048 and 3072 wide)
  LLAMA_QUANTIZE  the llama-quantize binary built by the kit (../shared/bench/get_llamacpp.sh)
needs gguf-py (the kit's converter venv has it: $A/convenv/bin/python).

Each format is produced with `--pure` (every matrix in that one format, no mixture) so that every tensor's
bytes come from the format's own quantizer; without an importance matrix llama.cpp quantizes row by row,
so a few rows of a tensor are a complete test case.
"""
import json, os, subprocess, sys, tempfile

import numpy as np
from gguf import GGUFReader

src, quantize = sys.argv[1], sys.argv[2]
rows = int(sys.argv[sys.argv.index("--rows") + 1]) if "--rows" in sys.argv else 2
# llama-quantize's names for a pure file of each block format.
FTYPES = {"Q8_0": "Q8_0", "Q4_0": "Q4_0", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "Q4_K": "Q4_K_S", "Q5_K": "Q5_K_S", "Q6_K": "Q6_K",
          "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS"}


def raw_rows(t, n):
    """The first n rows of tensor t as bytes, and its width in elements."""
    data = np.asarray(t.data).view(np.uint8).reshape(-1)
    cols = int(t.shape[0])
    n_rows = int(np.prod([int(d) for d in t.shape[1:]]))
    row_bytes = len(data) // n_rows
    return data[: n * row_bytes].tobytes(), cols


reader = GGUFReader(src)
# One tensor per width, 2-D, bf16 in the source.
picked = {}
for t in reader.tensors:
    if t.tensor_type.name != "BF16" or len(t.shape) != 2:
        continue
    cols = int(t.shape[0])
    if cols % 256 == 0 and cols not in picked:
        picked[cols] = t.name
names = [picked[c] for c in sorted(picked)]
print("tensors:", names, flush=True)
by_name = {t.name: t for t in reader.tensors}
out = {
    "source": os.path.basename(src),
    "rows": rows,
    "tensors": [],
    "quantized": {},
}
for n in names:
    b, cols = raw_rows(by_name[n], rows)
    out["tensors"].append({"name": n, "cols": cols, "bf16": b.hex()})

with tempfile.TemporaryDirectory() as tmp:
    for fmt, ftype in FTYPES.items():
        dst = os.path.join(tmp, f"{fmt}.gguf")
        p = subprocess.run([quantize, "--pure", src, dst, ftype, "2"], capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"llama-quantize {ftype} failed:\n{p.stderr[-2000:]}")
        q = {t.name: t for t in GGUFReader(dst).tensors}
        out["quantized"][fmt] = {}
        for n in names:
            t = q[n]
            if t.tensor_type.name != fmt:
                sys.exit(f"{fmt}: tensor {n} came out as {t.tensor_type.name}")
            b, _ = raw_rows(t, rows)
            out["quantized"][fmt][n] = b.hex()
        print(fmt, "ok", flush=True)

dst = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "quant", "llama_quantize.json")
with open(dst, "w") as f:
    json.dump(out, f, indent=1)
    f.write("\n")
print("wrote", os.path.normpath(dst))
