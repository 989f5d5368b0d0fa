"""A simulated device for measuring the served path's host costs without a GPU (session 17).

With ``PYTHONPATH=docs/cpu/simdevice_s17`` every Python process of a run (the benchmark and each
``pdserve up`` child) imports this first. ``FAKE_DEV=a,b,c`` (ms): every engine step also takes
a device time of a + b*rows + c*prefill_tokens on a timeline beside the host (a deferred step's
tokens are ready when it ends, async scheduling overlaps it; a synchronous step waits for it);
1.8,0.019,0.0066 is the 1.7B shape on the H100 of 2026-11-26 (run4: 1.81 ms of kernels at
batch 1, ~4.5 ms per step at 64, 152k prefill tokens/s). ``FAKE_GRAPH=1``: decode steps run the
CUDA path's bookkeeping (``DecodeBuffers`` staging, one replay) over a constant output instead
of the model, so the host work is a GPU decode step's. Use a near-free model
(``make.py``: 1 layer, 512-token BPE) and ``OMP_NUM_THREADS=1``. ``TRACE_DIR``: each engine's
steps and engine-thread commands as JSON lines (``trace_an.py``, ``calls_an.py``).
``SWI``: sys.setswitchinterval. It patches engine internals: a measuring aid, not a component."""
import os
import sys
import time

if os.environ.get("SWI"):
    sys.setswitchinterval(float(os.environ["SWI"]))
spec = os.environ.get("FAKE_DEV")
if spec:
    A, B, C = (float(x) / 1e3 for x in spec.split(","))
    import engine.runner.deferred as dd
    import engine.runner.model_runner as mr
    state = {"busy": 0.0}
    done_at = {}
    orig_launch = mr.ModelRunner.launch
    orig_output = dd.DeferredTokens.output

    def launch(self, sched, block_ids, draft_probs=None, defer=False, chain=None):
        started = time.perf_counter()
        out = orig_launch(self, sched, block_ids, draft_probs, defer, chain)
        rows = len(sched.scheduled)
        toks = sched.total_num_scheduled_tokens
        prefill = max(0, toks - rows)
        done = max(started, state["busy"]) + A + B * rows + C * prefill
        state["busy"] = done
        if isinstance(out, dd.DeferredTokens):
            done_at[id(out)] = done
        else:
            wait = done - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        return out

    def output(self):
        done = done_at.pop(id(self), None)
        if done is not None:
            wait = done - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        return orig_output(self)

    mr.ModelRunner.launch = launch
    dd.DeferredTokens.output = output
    print(f"fakedev: {spec} ms in pid {os.getpid()}", file=sys.stderr)

if spec and os.environ.get("FAKE_GRAPH"):
    # decode steps as the CUDA path runs them (DecodeBuffers staging, a replay), the replay
    # itself a constant output: the host work of a GPU decode step, with no model compute
    import torch

    from engine.runner import cuda_graphs as cg

    class FakeGraphs(cg.DecodeGraphs):
        def _step(self, bucket, num_blocks=None):
            vocab = self.model.config.vocab_size
            out = cg.StepLogits(torch.zeros(bucket, vocab), torch.full((bucket,), 300, dtype=torch.int64))
            return lambda: out

    orig_init = mr.ModelRunner.__init__

    def init(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        from engine.config import Role
        if self.config.scheduler.role == Role.PREFILL:
            return
        self.decode_graphs = FakeGraphs(self.model, self.kv_cache, self.config.scheduler.max_num_seqs,
                                        self.config.model.max_model_len,
                                        self.block_size, cg.EagerCapture())
        self.decode_graphs.capture_all()

    mr.ModelRunner.__init__ = init

if os.environ.get("TRACE_DIR"):
    import json
    import threading

    import engine.core as ec
    _recs = []
    _lock = threading.Lock()
    _path = os.path.join(os.environ["TRACE_DIR"], f"trace-{os.getpid()}.jsonl")
    _orig_step = ec.EngineCore.step

    def _flush():
        with _lock:
            recs = list(_recs)
            _recs.clear()
        with open(_path, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")

    def step(self):
        t0 = time.perf_counter()
        nw, nr = len(self.scheduler.waiting), len(self.scheduler.running)
        out = _orig_step(self)
        t1 = time.perf_counter()
        _recs.append({"role": str(self.config.scheduler.role), "t0": t0, "t1": t1, "waiting": nw, "running": nr,
                      "outs": len(out)})
        if len(_recs) >= 20:
            _flush()
        return out
    ec.EngineCore.step = step
    import atexit
    atexit.register(_flush)

if os.environ.get("TRACE_DIR"):
    import services.common.async_engine as ae
    _orig_call = ae.AsyncEngine.call

    async def call(self, fn):
        rec = {"kind": "call", "pid": os.getpid(), "t_call": time.perf_counter(),
               "fn": f"{fn.__code__.co_filename.rsplit('/', 2)[-1]}:{fn.__code__.co_firstlineno}"}

        def timed(core):
            rec["t_start"] = time.perf_counter()
            try:
                return fn(core)
            finally:
                rec["t_end"] = time.perf_counter()
        try:
            return await _orig_call(self, timed)
        finally:
            rec["t_done"] = time.perf_counter()
            _recs.append(rec)
    ae.AsyncEngine.call = call
