"""The offline API: ``LLM(model=None).generate(prompts, params)`` and ``LLM.stream``."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from engine.args import EngineArgs
from engine.config import Role
from engine.core import EngineCore
from engine.heap import frozen_during
from engine.models.loader import LoadedModel, load_model
from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling.logprobs import PositionLogprobs
from engine.sampling_params import SamplingParams
from engine.scheduler.output import RequestOutput

Prompts = str | Sequence[int] | Sequence[str | Sequence[int]]
Params = SamplingParams | Sequence[SamplingParams] | None


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None


@dataclass
class GenerationOutput:
    """One prompt's result; ``.token_ids`` and ``.text`` are those of the first sample."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text


@dataclass(slots=True)
class StreamDelta:
    """New output of one sample after one engine step."""

    prompt_index: int
    sample_index: int
    token_ids: list[int]
    text: str
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None


class LLM:
    """Loads a model (``None`` = the embedded default; a path; or a LoadedModel) and generates.

    Keyword arguments are EngineArgs fields (engine/args.py: block_size, num_kv_blocks,
    kv_cache_memory, max_num_seqs, ..., the spec_* fields); an unknown one raises TypeError.
    """

    def __init__(self, model: str | LoadedModel | None = None, **engine_args: Any) -> None:
        args = EngineArgs(**engine_args)
        loaded = model if isinstance(model, LoadedModel) else load_model(model)
        config = args.build(loaded.config, Role.COLOCATED)
        self.tokenizer = loaded.tokenizer
        self.model_config = config.model
        self.engine = EngineCore(config, loaded)
        self._ids = itertools.count()

    def generate(self, prompts: Prompts, params: Params = None,
                 ) -> list[GenerationOutput]:
        """Generate for each prompt (text or token ids). Returns results in prompt order."""
        prompt_ids, params_list = self._normalise(prompts, params)
        results = [GenerationOutput(str(i), ids, [CompletionOutput(j) for j in range(p.n)])
                   for i, (ids, p) in enumerate(zip(prompt_ids, params_list))]
        with frozen_during():  # the collector walks only what this call makes (engine/heap.py)
            for delta in self._run(prompt_ids, params_list, results):
                completion = results[delta.prompt_index].outputs[delta.sample_index]
                completion.token_ids += delta.token_ids
                completion.text += delta.text
                if delta.logprobs:
                    completion.logprobs = (completion.logprobs or []) + delta.logprobs
                if delta.finish_reason is not None:
                    completion.finish_reason, completion.stop_reason = delta.finish_reason, delta.stop_reason
        return results

    def stream(self, prompts: Prompts, params: Params = None,
               ) -> Iterator[StreamDelta]:
        """Yield each sample's new tokens and text as the engine produces them. Text is held
        back while it could still be the start of a stop string."""
        prompt_ids, params_list = self._normalise(prompts, params)
        yield from self._run(prompt_ids, params_list, None)

    def _normalise(self, prompts: Prompts, params: Params
                   ) -> tuple[list[list[int]], list[SamplingParams]]:
        one = isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int))
        prompt_list = cast("list[str | Sequence[int]]", [prompts] if one else list(prompts))
        params = SamplingParams() if params is None else params
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompt_list)
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts")
        prompt_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt_list]
        return prompt_ids, params_list

    def _run(self, prompt_ids: list[list[int]], params_list: list[SamplingParams],
             results: list[GenerationOutput] | None) -> Iterator[StreamDelta]:
        samples: dict[str, tuple[int, IncrementalDetokenizer]] = {}
        request_ids = []
        try:
            for prompt_index, (ids, p) in enumerate(zip(prompt_ids, params_list)):
                request_id = f"llm-{next(self._ids)}"
                request_ids.append(request_id)
                for sample_id in self.engine.add_request(request_id, ids, p):
                    samples[sample_id] = (prompt_index, IncrementalDetokenizer(self.tokenizer, ids, p))
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    prompt_index, detok = samples[out.request_id]
                    if results is not None and out.prompt_logprobs is not None:
                        results[prompt_index].prompt_logprobs = out.prompt_logprobs
                        results[prompt_index].num_cached_tokens = out.num_cached_tokens
                    yield self._delta(prompt_index, out, detok)
        finally:  # an abandoned stream or an error must not leave requests holding blocks
            for request_id in request_ids:
                self.engine.abort_request(request_id)

    def _delta(self, prompt_index: int, out: RequestOutput,
               detok: IncrementalDetokenizer) -> StreamDelta:
        stop = detok.update(out.new_token_ids, stop_terminated=out.finish_reason == "stop")
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        if stop.is_stopped:
            if not out.finished:
                self.engine.finish_request(out.request_id)
            finish_reason, stop_reason = "stop", stop.stop_str
        elif finish_reason is not None:
            detok.finish()
        return StreamDelta(prompt_index, out.index, out.new_token_ids, detok.get_delta(),
                           out.new_logprobs, finish_reason, stop_reason)
