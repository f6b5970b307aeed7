"""Summarise scripts/side_by_side_decode.sh output (from a file or stdin): per format, tandem's decode tok/s and each
llama.cpp build's, and tandem / build as the median of the per-repetition ratios (range, n)."""
import collections, statistics as st, sys

runs = collections.defaultdict(dict)
for line in (open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin):
    parts = line.split()
    if len(parts) == 4:
        rep, fmt, engine, v = parts
        try:
            runs[(rep, fmt)][engine] = float(v)
        except ValueError:
            pass
for fmt in sorted({f for _, f in runs}):
    reps = [r for (_, f), r in runs.items() if f == fmt and "tandem" in r]
    for engine in sorted({e for r in reps for e in r}):
        vals = [r[engine] for r in reps if engine in r]
        print(f"{fmt} {engine} decode tok/s: median {st.median(vals):.2f} ({min(vals):.2f}-{max(vals):.2f}, n={len(vals)})")
        if engine != "tandem":
            ratio = [r["tandem"] / r[engine] for r in reps if engine in r]
            print(f"{fmt} tandem / {engine}: median {st.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}, n={len(ratio)})")
