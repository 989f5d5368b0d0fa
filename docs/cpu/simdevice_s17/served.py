"""Per-process CPU seconds per output token under a c=64 streaming load on pdserve up."""

import asyncio
import os
import subprocess
import sys
import time

sys.path.insert(0, os.environ.get("ROOT", "."))
import aiohttp

from loadtests.cluster import running_cluster, stream_completion
from loadtests.prompts import distinct_prompts

MODEL = os.environ.get("MODEL", "/tmp/simdevice-model")
UP = sys.argv[1].split() if len(sys.argv) > 1 else ["--transfer", "grpc"]
CONC = int(os.environ.get("CONC", 64))
N = int(os.environ.get("N", 128))
TOK = int(os.environ.get("TOK", 128))
SPY = os.environ.get("SPY")  # role to py-spy: router|decode|prefill

SYS = {}


def procs(pgid):
    out = {}
    ppids = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        ppids[int(pid)] = int(fields[1])
        ticks = int(fields[11]) + int(fields[12])
        out[int(pid)] = (cmd[:160], ticks / os.sysconf("SC_CLK_TCK"))
        SYS[int(pid)] = int(fields[12]) / os.sysconf("SC_CLK_TCK")
    keep = {pgid}
    changed = True
    while changed:
        changed = False
        for p, pp in ppids.items():
            if pp in keep and p not in keep:
                keep.add(p)
                changed = True
    return {p: v for p, v in out.items() if p in keep}


def threads(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = open(f"/proc/{pid}/task/{tid}/stat").read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        f = stat.rsplit(")", 1)[1].split()
        out[(tid, name)] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return out


def role(cmd):
    for key, r in (
        ("serve prefill", "prefill"),
        ("serve decode", "decode"),
        ("serve kvstore", "kvstore"),
        ("serve router", "router"),
        ("redis", "redis"),
        (" up ", "up"),
    ):
        if key in cmd:
            return r
    return cmd[:40]


async def load(url, model, prompts):
    sem = asyncio.Semaphore(CONC)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=CONC)) as s:

        async def one(p):
            async with sem:
                return await stream_completion(s, url, model, p, max_tokens=TOK)

        return await asyncio.gather(*(one(p) for p in prompts))


def main():
    from engine.models.loader import load_model

    tok = load_model(MODEL).tokenizer
    prompts = distinct_prompts(tok, 196, N + 16, salt=7)
    with running_cluster(["--model", MODEL, *UP]) as c:
        model = c.model
        asyncio.run(load(c.http_url, model, prompts[N : N + 16]))  # warm
        pg = os.getpgid(c.proc.pid)
        before = procs(pg)
        global SYS0
        SYS0 = dict(SYS)
        spy = None
        if SPY:
            pid = next(p for p, (cmd, _) in before.items() if role(cmd) == SPY)
            spy = subprocess.Popen(
                [
                    os.path.join(os.path.dirname(sys.executable), "py-spy"),
                    "record",
                    "-r",
                    os.environ.get("RATE", "200"),
                    "-p",
                    str(pid),
                    "-f",
                    "raw",
                    "-o",
                    f"/tmp/spy_{SPY}.txt",
                    "--threads",
                ]
                + ([] if os.environ.get("BLOCK") else ["--nonblocking"])
                + (["--gil"] if os.environ.get("SPYGIL") else [])
                + (["--native"] if os.environ.get("NATIVE") else [])
                + (["--idle"] if os.environ.get("IDLE") else []),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1)
        watch = {role(cmd): p for p, (cmd, _) in before.items() if role(cmd) in ("decode", "router", "prefill")}
        tb = {r: threads(p) for r, p in watch.items()}
        t0, cpu0 = time.perf_counter(), time.process_time()
        results = asyncio.run(load(c.http_url, model, prompts[:N]))
        wall, client_cpu = time.perf_counter() - t0, time.process_time() - cpu0
        after = procs(pg)
        ta = {r: threads(p) for r, p in watch.items()}
        names = {}
        import re

        for p in watch.values():
            dump = subprocess.run(
                [os.path.join(os.path.dirname(sys.executable), "py-spy"), "dump", "-p", str(p), "--nonblocking"],
                capture_output=True,
                text=True,
            ).stdout
            for m in re.finditer(r'Thread (0x[0-9A-Fa-f]+|\d+) \((?:idle|active)[^)]*\): "([^"]+)"', dump):
                names[m.group(1)] = m.group(2)

        if spy:
            spy.send_signal(2)
            spy.wait(20)
        import collections
        import urllib.request

        text = urllib.request.urlopen(c.http_url + "/metrics").read().decode()
        sums = collections.defaultdict(dict)
        for line in text.splitlines():
            if line.startswith("pdserve_ttft_stage_seconds_sum") or line.startswith("pdserve_ttft_stage_seconds_count"):
                name, val = line.rsplit(" ", 1)
                stage = name.split('stage="')[1].split('"')[0]
                sums[stage]["sum" if "_sum" in name else "count"] = float(val)
        print(
            "  ttft stages ms (mean, incl. warm-up):",
            {k: round(v["sum"] / max(v["count"], 1) * 1e3, 1) for k, v in sums.items()},
        )
        gaps = sorted(g for r in results if r.ok for g in r.gaps)
        if gaps:  # (session 19) the streams' inter-token gaps
            print(f"ITL p50 {gaps[len(gaps) // 2] * 1e3:.3f} ms mean {sum(gaps) / len(gaps) * 1e3:.3f} ms "
                  f"over {len(gaps)} gaps")
        toks = sum(r.completion_tokens for r in results if r.ok)
        chunks = sum(len(r.stamps) for r in results if r.ok)
        print(
            f"{' '.join(UP)} c={CONC}: {toks} tokens in {wall:.2f} s = {toks / wall:.0f} tok/s, "
            f"{toks / chunks:.2f} tokens per SSE chunk, failed {sum(not r.ok for r in results)}"
        )
        print(f"  client   (this load generator): {client_cpu:6.2f} CPU s = {client_cpu / toks * 1e6:7.0f} us/token "
              f"({client_cpu / wall * 100:.0f}% of a core)")
        for pid, (cmd, t) in sorted(after.items()):
            d = t - before.get(pid, (cmd, 0.0))[1]
            if d > 0.05:
                print(
                    f"  {role(cmd):8s} pid {pid}: {d:6.2f} CPU s = {d / toks * 1e6:7.0f} us/token "
                    f"({d / wall * 100:.0f}% of a core); sys {(SYS[pid] - SYS0.get(pid, 0)) / toks * 1e6:.0f} us/token"
                )
                r = role(cmd)
                if r in ta:
                    for key, t in sorted(ta[r].items(), key=lambda kv: -(kv[1] - tb[r].get(kv[0], 0))):
                        dt = t - tb[r].get(key, 0)
                        if dt > 0.03:
                            print(
                                f"      {names.get(key[0], key[1]):26s} {dt:6.2f} s = {dt / toks * 1e6:6.0f} us/token"
                            )


main()
