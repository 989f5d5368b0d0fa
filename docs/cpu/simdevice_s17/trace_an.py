"""Each traced engine's steps (TRACE_DIR=/tmp/trace): durations, gaps, rows; then the steps
[start, start + count) one per line: python trace_an.py [start] [count]."""
import glob
import json
import sys


def pct(xs: list[float], p: float) -> float:
    return sorted(xs)[int(p * (len(xs) - 1))] * 1e3


start = int(sys.argv[1]) if len(sys.argv) > 1 else 40
count = int(sys.argv[2]) if len(sys.argv) > 2 else 20
for path in sorted(glob.glob("/tmp/trace/*.jsonl")):
    with open(path) as f:
        recs = [r for r in map(json.loads, f) if r.get("role")]
    if not recs:
        continue
    print(path, recs[0]["role"], len(recs))
    durs = [r["t1"] - r["t0"] for r in recs]
    gaps = [b["t0"] - a["t1"] for a, b in zip(recs, recs[1:])]
    outs = sum(r["outs"] for r in recs) / len(recs)
    waiting = sum(r["waiting"] for r in recs) / len(recs)
    print(f"  step ms p50 {pct(durs, .5):.2f} p90 {pct(durs, .9):.2f} max {pct(durs, 1):.2f}; "
          f"gap ms p50 {pct(gaps, .5):.2f} p90 {pct(gaps, .9):.2f} max {pct(gaps, 1):.2f}; "
          f"mean outs {outs:.1f} mean waiting {waiting:.1f}")
    for r, nx in list(zip(recs, recs[1:]))[start:start + count]:
        print(f"   {(r['t0'] - recs[0]['t0']) * 1e3:.1f} step {(r['t1'] - r['t0']) * 1e3:.2f} "
              f"gap {(nx['t0'] - r['t1']) * 1e3:.2f} w {r['waiting']} r {r['running']} outs {r['outs']}")
