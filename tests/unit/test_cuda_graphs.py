"""The decode graphs (engine/runner/cuda_graphs.py): buckets, the persistent buffers, padding
rows that store nothing, stale block-table rows, refusals. On the CPU the step is replayed by
``EagerCapture`` (the same buffers, no graph) on the torch ops, and again on the Triton ops under
the interpreter; where CUDA is present the same cases run again as captured CUDA graphs on the
Triton ops (marked ``gpu``; skipped with the reason elsewhere)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, ModelConfig
from engine.kv_cache.storage import allocate_kv_cache
from engine.models.llama import LlamaForCausalLM
from engine.runner.cuda_graphs import (
    BATCHED_STAGING_ROWS,
    CudaGraphCapture,
    DecodeBuffers,
    DecodeGraphs,
    EagerCapture,
    NoDecodeGraphs,
    bucket_for,
    capture_sizes,
)
from engine.runner.inputs import ScheduledSeq, build_model_input
from kernels.gemv import GEMV_ENV
from kernels.ops import get_ops

CONFIG = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_model_len=64)
BLOCK_SIZE = 4


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    weights = {"model.embed_tokens.weight": w(config.vocab_size, h), "model.norm.weight": 1 + w(h) / 4,
               "lm_head.weight": w(config.vocab_size, h)}
    for n in range(config.num_layers):
        p = f"model.layers.{n}"
        weights |= {f"{p}.self_attn.q_proj.weight": w(q, h), f"{p}.self_attn.k_proj.weight": w(kv, h),
                    f"{p}.self_attn.v_proj.weight": w(kv, h), f"{p}.self_attn.o_proj.weight": w(h, q),
                    f"{p}.mlp.gate_proj.weight": w(i, h), f"{p}.mlp.up_proj.weight": w(i, h),
                    f"{p}.mlp.down_proj.weight": w(h, i), f"{p}.input_layernorm.weight": 1 + w(h) / 4,
                    f"{p}.post_attention_layernorm.weight": 1 + w(h) / 4}
    return weights


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
INTERPRETED = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="Triton on a CPU needs TRITON_INTERPRET=1 (make test sets it)")


@pytest.fixture(scope="module", params=[
    ("cpu", "torch"),
    # the Triton ops interpreted: the decode steps' fused attention over padding rows and stale
    # block-table rows, as the graphs run it
    pytest.param(("cpu", "triton"), marks=INTERPRETED, id="cpu-triton"),
    # and every matmul of the decode steps as the fused GEMV (kernels.gemv, forced on)
    pytest.param(("cpu", "triton-gemv"), marks=INTERPRETED, id="cpu-triton-gemv"),
    pytest.param(("cuda", "triton"), marks=[GPU, pytest.mark.gpu], id="cuda"),
    pytest.param(("cuda", "triton-gemv"), marks=[GPU, pytest.mark.gpu], id="cuda-gemv")], ids=lambda p: p[0])
def setup(request):
    return request.param


@pytest.fixture(scope="module")
def device(setup):
    return setup[0]


@pytest.fixture(scope="module")
def model(setup):
    device, backend = setup
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(GEMV_ENV, "on" if backend == "triton-gemv" else "off")
        return LlamaForCausalLM(CONFIG, random_weights(CONFIG), get_ops(backend.removesuffix("-gemv")), device)


def _capture(device):
    return EagerCapture() if device == "cpu" else CudaGraphCapture()


def test_buckets():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    sizes = capture_sizes(256)
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-1] == 256 and len(sizes) == 35
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 255, 256, 257)] == [1, 4, 8, 16, 256, 256, None]
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        capture_sizes(0)


def _prefill(model, kv_cache, prompts, tables):
    seqs = [ScheduledSeq(p, 0, t) for p, t in zip(prompts, tables)]
    batch = build_model_input(seqs, BLOCK_SIZE, kv_cache.device)
    model.forward(batch.input_ids, batch.positions, batch.attn, kv_cache)


def _eager_decode(model, kv_cache, seqs):
    batch = build_model_input(seqs, BLOCK_SIZE, kv_cache.device)
    hidden = model.forward(batch.input_ids, batch.positions, batch.attn, kv_cache)
    return model.compute_logits(hidden)


def test_a_padded_bucket_replays_the_eager_step(model, device):
    cache_config = CacheConfig(block_size=BLOCK_SIZE, num_blocks=24)
    kv_cache = allocate_kv_cache(CONFIG, cache_config, device)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    tables = [[3, 7], [0], [11, 2, 9]]
    _prefill(model, kv_cache, prompts, tables)
    graphs = DecodeGraphs(model, kv_cache, max_num_seqs=8, max_model_len=CONFIG.max_model_len,
                          block_size=BLOCK_SIZE, capture=_capture(device))
    graphs.capture_all()
    assert graphs.sizes == (1, 2, 4, 8)
    expected_cache = kv_cache.clone()

    steps = [  # 3 sequences in the bucket of 4 (one padding row), then 1 in the bucket of 1
        [ScheduledSeq([21], 5, tables[0]), ScheduledSeq([22], 2, tables[1] + [5]),
         ScheduledSeq([23], 9, tables[2])],
        [ScheduledSeq([24], 3, [6])],  # a new, short table in row 0: the stale ids after it unread
    ]
    for seqs in steps:
        assert graphs.can_run(seqs)
        actual, greedy = graphs.run(seqs)
        expected = _eager_decode(model, expected_cache, seqs)
        assert actual.shape == (len(seqs), CONFIG.vocab_size)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
        # the replay's own argmax: one per real row, the same as the eager logits' argmax
        assert greedy is not None and greedy.tolist() == expected.argmax(-1).tolist()
        # the real rows' K/V landed where the eager step put them; the padding row stored nothing
        torch.testing.assert_close(kv_cache, expected_cache, rtol=1e-4, atol=1e-4)


def test_input_ids_on_the_device_replace_the_staged_tokens(model, device):
    # a chained step (async scheduling): its tokens come from the step before, on the device
    kv_cache = allocate_kv_cache(CONFIG, CacheConfig(block_size=BLOCK_SIZE, num_blocks=24), device)
    prompts, tables = [[5, 6, 7, 8, 9], [10, 11]], [[3, 7], [0, 4]]
    _prefill(model, kv_cache, prompts, tables)
    graphs = DecodeGraphs(model, kv_cache, max_num_seqs=4, max_model_len=CONFIG.max_model_len,
                          block_size=BLOCK_SIZE, capture=_capture(device))
    graphs.capture_all()
    expected_cache = kv_cache.clone()
    fed = [ScheduledSeq([0], 5, tables[0]), ScheduledSeq([0], 2, tables[1])]  # placeholders
    actual, _ = graphs.run(fed, torch.tensor([21, 22], device=device))
    expected = _eager_decode(model, expected_cache, [ScheduledSeq([21], 5, tables[0]),
                                                     ScheduledSeq([22], 2, tables[1])])
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_cache, expected_cache, rtol=1e-4, atol=1e-4)


def test_a_step_of_short_contexts_replays_the_narrow_graph(model, device):
    # short graphs over 2-block tables (on a GPU: where the full width would split the keys):
    # a step whose contexts all fit 2 blocks replays its bucket's narrow graph, one that does
    # not the full one, both as the eager forward computes them
    kv_cache = allocate_kv_cache(CONFIG, CacheConfig(block_size=BLOCK_SIZE, num_blocks=24), device)
    prompts, tables = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16, 17, 18, 19, 20]], [[3, 7], [0], [11, 2, 9]]
    _prefill(model, kv_cache, prompts, tables)
    graphs = DecodeGraphs(model, kv_cache, max_num_seqs=4, max_model_len=CONFIG.max_model_len,
                          block_size=BLOCK_SIZE, capture=_capture(device), short_graphs=True, short_blocks=2)
    replayed = []
    build = graphs._step

    def tagged(bucket, num_blocks=None):  # which step each replay runs (only seen without graphs)
        step = build(bucket, num_blocks)
        return lambda: (replayed.append((bucket, num_blocks)), step())[1]

    graphs._step = tagged
    graphs.capture_all()
    assert graphs.short_sizes == {1: 2, 2: 2, 4: 2}
    expected_cache = kv_cache.clone()
    steps = [[ScheduledSeq([21], 5, tables[0]), ScheduledSeq([22], 2, tables[1] + [5])],  # 2 blocks at most
             [ScheduledSeq([23], 9, tables[2])],  # 3 blocks: the full width
             [ScheduledSeq([24], 6, tables[0])]]
    for seqs in steps:
        replayed.clear()
        actual, greedy = graphs.run(seqs)
        expected = _eager_decode(model, expected_cache, seqs)
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
        assert greedy is not None and greedy.tolist() == expected.argmax(-1).tolist()
        torch.testing.assert_close(kv_cache, expected_cache, rtol=1e-4, atol=1e-4)
        if device == "cpu":
            most = max(s.start_pos // BLOCK_SIZE + 1 for s in seqs)
            assert replayed == [(bucket_for(len(seqs), graphs.sizes), 2 if most <= 2 else None)]
    plain = DecodeGraphs(model, kv_cache, max_num_seqs=2, max_model_len=CONFIG.max_model_len,
                         block_size=BLOCK_SIZE, capture=_capture(device), short_blocks=2)
    plain.capture_all()
    # without splits to save (a CPU; on a GPU this 64-token context), no narrow graphs
    assert plain.short_sizes == {}


def test_what_the_graphs_do_not_take(model, device):
    kv_cache = allocate_kv_cache(CONFIG, CacheConfig(block_size=BLOCK_SIZE, num_blocks=24), device)
    graphs = DecodeGraphs(model, kv_cache, max_num_seqs=2, max_model_len=CONFIG.max_model_len,
                          block_size=BLOCK_SIZE, capture=_capture(device))
    graphs.capture_all()
    decode = ScheduledSeq([1], 4, [0, 1])
    assert not graphs.can_run([])
    assert not graphs.can_run([decode] * 3)  # more sequences than the largest bucket
    assert not graphs.can_run([ScheduledSeq([1, 2], 4, [0, 1])])  # a prefill chunk
    assert not graphs.can_run([ScheduledSeq([1], 4, [0, 1], num_logits=2)])  # verification rows
    with pytest.raises(ValueError, match="sequence 0 needs 2 blocks for 5 tokens, its block table has 1"):
        graphs.run([ScheduledSeq([1], 4, [0])])
    assert not NoDecodeGraphs().can_run([decode])


@pytest.mark.parametrize("num_seqs", [BATCHED_STAGING_ROWS - 1, BATCHED_STAGING_ROWS + 5])
def test_staged_inputs_row_by_row_and_batched(num_seqs):
    """Either side of BATCHED_STAGING_ROWS a step stages the same values: each row's token,
    position, slot and context, its block table's first columns, then padding."""
    gen = torch.Generator().manual_seed(num_seqs)
    buffers = DecodeBuffers(64, 12, BLOCK_SIZE, torch.device("cpu"))
    seqs = []
    for i in range(num_seqs):
        pos = int(torch.randint(0, 12 * BLOCK_SIZE, (), generator=gen))
        table = torch.randperm(500, generator=gen)[:pos // BLOCK_SIZE + 1 + i % 3].tolist()  # some longer
        seqs.append(ScheduledSeq([1000 + i], pos, table))
    bucket = num_seqs + 3
    most = buffers.write(seqs, bucket)
    input_ids, positions, attn = buffers.inputs(bucket)
    needed = [s.start_pos // BLOCK_SIZE + 1 for s in seqs]
    assert most == max(needed)
    assert input_ids.tolist() == [1000 + i for i in range(num_seqs)] + [0] * 3
    assert positions.tolist() == [s.start_pos for s in seqs] + [0] * 3
    assert attn.slot_mapping.tolist() == [s.block_ids[s.start_pos // BLOCK_SIZE] * BLOCK_SIZE
                                          + s.start_pos % BLOCK_SIZE for s in seqs] + [-1] * 3
    assert attn.seq_lens.tolist() == [s.start_pos + 1 for s in seqs] + [1] * 3
    for row, (s, n) in enumerate(zip(seqs, needed)):
        assert attn.block_tables[row, :n].tolist() == s.block_ids[:n]
    short = [*seqs[:-1], ScheduledSeq([1], 2 * BLOCK_SIZE, [7, 8])]
    with pytest.raises(ValueError, match=f"sequence {num_seqs - 1} needs 3 blocks for {2 * BLOCK_SIZE + 1} "
                                         "tokens, its block table has 2"):
        buffers.write(short, bucket)


def test_batched_staging_over_steps_converts_each_table_tuple_once():
    """Steps of 48 rows as a running batch has them: requests leave and join (rows shift),
    tables grow (the manager hands a new tuple), one is copied on write (a new tuple, same
    length), a list is changed in place between steps, a tuple appears twice. Every step stages
    each row's slot and its table's needed columns, and converts only the tables that are new
    since the step before, and the list."""

    class CountingRows(list):  # the free rows: each conversion takes one
        pops = 0

        def pop(self, *args):
            CountingRows.pops += 1
            return super().pop(*args)

    rng = np.random.default_rng(5)
    buffers = DecodeBuffers(64, 40, BLOCK_SIZE, torch.device("cpu"))
    buffers._free_rows = CountingRows(buffers._free_rows)
    pos = {r: int(rng.integers(0, 20 * BLOCK_SIZE)) for r in range(48)}
    tables: dict[int, tuple[int, ...] | list[int]] = {
        r: tuple(rng.permutation(3000)[:pos[r] // BLOCK_SIZE + 2].tolist()) for r in pos}
    tables[7] = list(tables[7])  # a caller's list: converted every step
    next_id, fresh = 48, set(pos)
    for step in range(40):
        if step % 5 == 4:  # one leaves, one joins: every row after it shifts
            del pos[sorted(pos)[step % len(pos)]]
            pos[next_id] = int(rng.integers(0, 10 * BLOCK_SIZE))
            tables[next_id] = tuple(rng.permutation(3000)[:pos[next_id] // BLOCK_SIZE + 1].tolist())
            fresh.add(next_id)
            next_id += 1
        order = sorted(pos)
        if step == 10:  # copy on write: the same length, a new block in the middle
            r = order[3]
            tables[r] = (*tables[r][:1], 2999, *tables[r][2:])
            fresh.add(r)
        if step == 12:
            tables[7][0] = 2998  # in place
        seqs = [ScheduledSeq([r], pos[r], tables[r]) for r in order]
        if step == 20:
            seqs.append(ScheduledSeq([0], pos[order[0]], tables[order[0]]))  # a table twice
        CountingRows.pops = 0
        buffers.write(seqs, len(seqs))
        assert CountingRows.pops == len(fresh | ({7} & pos.keys())), step
        _, _, attn = buffers.inputs(len(seqs))
        for row, s in enumerate(seqs):
            n = s.start_pos // BLOCK_SIZE + 1
            assert attn.block_tables[row, :n].tolist() == list(s.block_ids[:n]), (step, row)
            assert attn.slot_mapping[row] == s.block_ids[n - 1] * BLOCK_SIZE + s.start_pos % BLOCK_SIZE
        fresh = set()
        for r in pos:  # the next token; a block appended when it does not fit
            pos[r] += 1
            if pos[r] // BLOCK_SIZE + 1 > len(tables[r]):
                table = tables[r]
                tables[r] = table + [int(rng.integers(3000))] if isinstance(table, list) else (
                    *table, int(rng.integers(3000)))
                fresh.add(r)


def test_warm_up_launches_every_attention_variant_without_writing_the_cache(model, device, monkeypatch):
    """The warm-up's kernel calls (Triton interpreted on the CPU) leave the cache as it was."""
    from engine.runner.warmup import warm_up
    from kernels import paged_attention

    if device == "cpu":
        monkeypatch.setattr(paged_attention, "warm_up", lambda *args: 0)  # Triton-only (tests/kernels)
    kv_cache = allocate_kv_cache(CONFIG, CacheConfig(block_size=BLOCK_SIZE, num_blocks=8), device)
    kv_cache.normal_()
    before = kv_cache.clone()
    assert warm_up(model, kv_cache, max_num_batched_tokens=100) >= 0
    assert torch.equal(kv_cache, before)


def test_narrow_graphs_go_where_the_full_width_splits_the_keys(monkeypatch):
    # the choice, without a GPU: the attention's own split decision (kernels.paged_attention)
    # on an H100's 132 SMs, for a 4096-token table of 16-token blocks
    from engine.runner import cuda_graphs
    from kernels import paged_attention

    monkeypatch.setattr(paged_attention, "_num_sms", lambda device: 132)
    calls = []

    def splits(device, num_seqs, num_kv_heads, max_context):
        calls.append((num_seqs, num_kv_heads, max_context))
        return paged_attention._auto_num_splits(torch.device("cuda"), num_seqs * num_kv_heads, max_context, 1)

    monkeypatch.setattr(cuda_graphs, "decode_num_splits", splits)
    config = ModelConfig(architecture="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_layers=1, num_heads=9, num_kv_heads=3, head_dim=8, max_model_len=4096)
    model = LlamaForCausalLM(config, random_weights(config), get_ops("torch"), "cpu")
    kv_cache = allocate_kv_cache(config, CacheConfig(block_size=16, num_blocks=4), "cpu")
    graphs = DecodeGraphs(model, kv_cache, max_num_seqs=64, max_model_len=4096, block_size=16,
                          capture=EagerCapture())
    graphs.capture_all()
    # 3 KV heads: a batch of fewer than 44 leaves SMs idle and splits the 4096 slots, into 8
    # spans of 32 blocks up to a batch of 16 (at most 4096 // 512 splits), then 4 of 64 blocks
    assert graphs.short_sizes == {1: 32, 2: 32, 4: 32, 8: 32, 16: 32, 24: 64, 32: 64, 40: 64}
    assert (1, 3, 4096) in calls
