"""Summarize the JSON that the side-by-side kit (`side_by_side.py --out FILE`) writes: medians, ranges and
pairwise ratios (each repetition runs both engines back to back, so a ratio within a repetition is what
the shared machine can compare; see README, "Performance").

usage: python3 scripts/side_by_side_summary.py RUN.json [RUN.json ...]   (repetitions of all runs pooled)
Also reads scripts/side_by_side_quant.py's output: a block per weight format it measured.
"""
import json
import statistics
import sys

runs = [json.load(open(p)) for p in sys.argv[1:]]
if not runs:
    sys.exit(__doc__)
R = {}
for r in runs:
    for k, v in r.items():
        R.setdefault(k, []).extend(v)


def col(key, field):
    return [x.get(field) if isinstance(x, dict) else None for x in R.get(key, [])]


def fmt(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return f"median {statistics.median(xs):.2f} (range {min(xs):.2f}-{max(xs):.2f}, n={len(xs)})"


def ratios(a, b):
    return [x / y for x, y in zip(a, b) if x is not None and y]


rows = [
    ("llama.cpp bf16 decode tok/s", col("llama bf16 plain", "decode")),
    ("tandem bf16 decode tok/s", col("tandem bf16 plain", "decode")),
    ("tandem / llama.cpp decode, pairwise", ratios(col("tandem bf16 plain", "decode"), col("llama bf16 plain", "decode"))),
    ("llama.cpp bf16 prefill tok/s", col("llama bf16 plain", "prefill")),
    ("tandem bf16 prefill tok/s", col("tandem bf16 plain", "prefill")),
    ("tandem / llama.cpp prefill, pairwise", ratios(col("tandem bf16 plain", "prefill"), col("llama bf16 plain", "prefill"))),
    ("llama.cpp Q8_0 decode tok/s", col("llama q8_0 plain", "decode")),
    ("llama.cpp k=4 MTP decode tok/s", col("llama bf16 mtp k4", "decode")),
    ("llama.cpp k=4 / plain, pairwise", ratios(col("llama bf16 mtp k4", "decode"), col("llama bf16 plain", "decode"))),
    ("tandem k=4 / plain, pairwise", ratios(col("tandem bf16 mtp k4", "decode"), col("tandem bf16 plain", "decode"))),
    ("tandem auto / plain, pairwise", ratios(col("tandem bf16 mtp auto", "decode"), col("tandem bf16 plain", "decode"))),
    ("llama-bench 5 rows / 1 row", col("llama bf16 rows", "ratio")),
    ("tandem bench 5 rows / 1 row", [x["rows"][4][2] if isinstance(x, dict) and len(x.get("rows", [])) > 4 else None
                                     for x in R.get("tandem bench rows", [])]),
]
if "tandem bench rows" not in R:
    rows = []  # not the kit's side_by_side.py output
# scripts/side_by_side_quant.py's blocks: one per format it measured ("tandem FMT rows").
for f in [k.split()[1] for k in R if k.startswith("tandem ") and k.endswith(" rows") and k != "tandem bench rows"]:
    rows += [
        (f"llama.cpp {f} decode tok/s", col(f"llama {f} plain", "decode")),
        (f"tandem {f} decode tok/s", col(f"tandem {f} plain", "decode")),
        (f"tandem / llama.cpp {f} decode, pairwise", ratios(col(f"tandem {f} plain", "decode"), col(f"llama {f} plain", "decode"))),
        (f"tandem / llama.cpp {f} prefill, pairwise", ratios(col(f"tandem {f} plain", "prefill"), col(f"llama {f} plain", "prefill"))),
        (f"llama.cpp {f} 5 rows / 1 row, all logits", col(f"llama {f} rows", "ratio_all")),
        # Older runs measured with llama-bench -p 1,5 (a prompt batch: the last row's logits only).
        (f"llama.cpp {f} 5 rows / 1 row, last logits",
         col(f"llama {f} rows", "ratio_last") + [x for x in col(f"llama {f} rows", "ratio")]),
        (f"tandem {f} 5 rows / 1 row", col(f"tandem {f} rows", "ratio")),
        (f"llama.cpp {f} k=4 / plain, pairwise", ratios(col(f"llama {f} mtp k4", "decode"), col(f"llama {f} plain", "decode"))),
        (f"tandem {f} k=4 / plain, pairwise", ratios(col(f"tandem {f} mtp k4", "decode"), col(f"tandem {f} plain", "decode"))),
        (f"tandem {f} auto / plain, pairwise", ratios(col(f"tandem {f} mtp auto", "decode"), col(f"tandem {f} plain", "decode"))),
    ]
for name, xs in rows:
    print(f"{name:<44} {fmt(xs)}")
