"""Engine-thread commands of each traced worker (TRACE_DIR=/tmp/trace): how long each waited
for the engine thread, ran on it, and took to reach its caller; then run time by command."""
import collections
import glob
import json


def pct(xs: list[float], p: float) -> float:
    return sorted(xs)[int(p * (len(xs) - 1))] * 1e3


def spread(xs: list[float]) -> str:
    return f"p50 {pct(xs, .5):.2f} p90 {pct(xs, .9):.2f} max {pct(xs, 1):.2f}"


for path in sorted(glob.glob("/tmp/trace/*.jsonl")):
    with open(path) as f:
        recs = [json.loads(line) for line in f]
    calls = [r for r in recs if r.get("kind") == "call" and "t_start" in r]
    steps = [r for r in recs if r.get("role")]
    if not calls:
        continue
    role = steps[0]["role"] if steps else "?"
    waited = [c["t_start"] - c["t_call"] for c in calls]
    ran = [c["t_end"] - c["t_start"] for c in calls]
    back = [c["t_done"] - c["t_end"] for c in calls]
    print(path, role, len(calls), f"wait {spread(waited)} | exec {spread(ran)} | back {spread(back)} ms")
    by_fn = collections.defaultdict(list)
    for c in calls:
        by_fn[c.get("fn")].append(c["t_end"] - c["t_start"])
    for fn, times in by_fn.items():
        print(f"  {fn} {len(times)} exec {spread(times)} ms")
