"""Host time per steady decode step at B rows on the simulated device (session 18).

Run from a checkout with ``PYTHONPATH=<checkout>:docs/cpu/simdevice_s17 FAKE_DEV=0.01,0,0
FAKE_GRAPH=1 OMP_NUM_THREADS=1`` (the checkout first: the hook imports the engine before this
script does). Decode steps run the CUDA path's bookkeeping over a constant output with a
near-free device, so a step costs what the host does. B requests of 196 prompt tokens decode
with async scheduling and the CUDA defaults' scheduler limits (prefix caching and the host tier
on, as ``pdserve up`` has them); ROUNDS x STEPS steady steps, each component's ms per step,
min (median) over the rounds. ``detok`` is ``LLM.generate``'s incremental detokenizing."""
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, ".")
import engine.core as ec  # noqa: E402 - after the path
import engine.kv_cache.tiers.host_tier as ht  # noqa: E402
import engine.runner.cuda_graphs as cg  # noqa: E402
import engine.runner.model_runner as mr  # noqa: E402
import engine.scheduler.scheduler as sc  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.models.loader import load_model  # noqa: E402
from engine.sampling.detokenizer import IncrementalDetokenizer  # noqa: E402
from loadtests.prompts import distinct_prompts  # noqa: E402

B = int(os.environ.get("B", 256))
STEPS = int(os.environ.get("STEPS", 100))
ROUNDS = int(os.environ.get("ROUNDS", 4))
loaded = load_model(os.environ.get("MODEL", "/tmp/simdevice-model"))
llm = LLM(loaded, async_scheduling="on", max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=4096)
core = llm.engine
acc: collections.Counter[str] = collections.Counter()


def timed(cls, name):
    fn = getattr(cls, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[f"{cls.__name__}.{name}"] += time.perf_counter() - started
    setattr(cls, name, wrapper)


for cls, name in [(sc.Scheduler, "schedule_chained"), (sc.Scheduler, "update"), (cg.DecodeBuffers, "write"),
                  (mr.ModelRunner, "_execute"), (ec.EngineCore, "_launch"), (ht.HostTier, "flush")]:
    timed(cls, name)
prompts = distinct_prompts(loaded.tokenizer, 196, B, salt=3)
params = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)
rows = []
for r in range(ROUNDS):
    detoks = {}
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{r}-{i}", prompt, params)
        detoks[f"r{r}-{i}"] = IncrementalDetokenizer(loaded.tokenizer, prompt, params)
    sched = core.scheduler
    while sched.waiting or any(q.num_computed_tokens < q.num_prompt_tokens for q in sched.running):
        core.step()
    for _ in range(3):
        core.step()
    acc.clear()
    t0, detok = time.perf_counter(), 0.0
    for _ in range(STEPS):
        outputs = core.step()
        t1 = time.perf_counter()
        for out in outputs:
            detoks[out.request_id].update(out.new_token_ids)
            detoks[out.request_id].get_delta()
        detok += time.perf_counter() - t1
    rows.append({"wall": (time.perf_counter() - t0) / STEPS * 1e3, "detok": detok / STEPS * 1e3,
                 **{k: v / STEPS * 1e3 for k, v in acc.items()}})
    for i in range(B):
        core.abort_request(f"r{r}-{i}")
    while core.has_unfinished_requests():
        core.step()
print(f"B={B}: ms per step, min (median) of {ROUNDS} rounds x {STEPS} steps")
for key in rows[0]:
    values = [row.get(key, 0.0) for row in rows]
    print(f"  {key:28s} {min(values):7.3f} ({statistics.median(values):7.3f})")
