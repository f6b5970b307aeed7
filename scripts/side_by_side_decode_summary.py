"""Summarise scripts/side_by_side_decode.sh output (from a file or stdin): per format, the decode tok/s of tandem (and
of each tandem variant run with TANDEM_OPTS) and of each llama.cpp build, and tandem / build as the median of the
per-repetition ratios (range, n)."""
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
    engines = sorted({e for r in reps for e in r})
    for t in [e for e in engines if e.startswith("tandem")]:
        for engine in [e for e in engines if not e.startswith("tandem")] + (["tandem"] if t != "tandem" else []):
            ratio = [r[t] / r[engine] for r in reps if t in r and engine in r]
            print(f"{fmt} {t} / {engine}: median {st.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f}, n={len(ratio)})")
