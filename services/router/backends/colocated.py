"""ColocatedBackend: one EngineCore in this process (COLOCATED role) doing prefill and decode.

The engine runs on its own thread (AsyncEngine); ``generate`` maps its RequestOutputs to
TokenEvents. Torch and the model code are imported in ``start`` only, so importing this module
stays cheap for a router that never runs colocated.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from engine.args import EngineArgs
from engine.config import Role
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from services.router.backends.backend import Backend, TokenEvent
from services.router.errors import BackendError, Overloaded
from services.router.model_info import ModelInfo

if TYPE_CHECKING:
    from engine.core import EngineCore
    from engine.models.tokenizer import Tokenizer
    from services.common.async_engine import AsyncEngine
    from services.router.metrics import RouterMetrics
    from services.worker.request_timer import WorkerMetrics


# Requests admitted at once (running + queued) before new ones get Overloaded.
MAX_ACTIVE_REQUESTS = 1024


class ColocatedBackend(Backend):
    def __init__(self, model_path: str | None = None, engine_args: EngineArgs = EngineArgs(),
                 max_active_requests: int = MAX_ACTIVE_REQUESTS) -> None:
        self.model_path = model_path
        self.engine_args = engine_args
        self.max_active_requests = max_active_requests
        self.engine: AsyncEngine | None = None
        self.tokenizer: Tokenizer | None = None
        self.model_info: ModelInfo | None = None
        self._num_active = 0
        self._router_metrics: RouterMetrics | None = None
        self.worker_metrics: WorkerMetrics | None = None  # set by start

    async def start(self) -> None:
        """Load the model and start the engine, both on the engine thread (off the event loop)."""
        from services.common.async_engine import AsyncEngine

        self.engine = AsyncEngine()
        core = await self.engine.build(self._build_core)
        from services.worker.request_timer import WorkerMetrics

        router_metrics = self._router_metrics
        self.worker_metrics = (WorkerMetrics.disabled() if router_metrics is None else WorkerMetrics.create(
            self.engine, core.config.model.name, "router", "colocated", router_metrics.registry))

    def _build_core(self) -> EngineCore:
        from engine.core import EngineCore
        from engine.models.loader import load_model

        loaded = load_model(self.model_path)
        config = self.engine_args.build(loaded.config, Role.COLOCATED)
        self.tokenizer = loaded.tokenizer
        self.model_info = ModelInfo(config.model.name, config.model.vocab_size,
                                    config.model.max_model_len)
        return EngineCore(config, loaded)

    def attach_metrics(self, metrics: RouterMetrics) -> None:
        """The engine's vLLM names join the router's /metrics (role ``colocated``, worker ``router``)."""
        self._router_metrics = metrics

    async def close(self) -> None:
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop)

    async def is_healthy(self) -> bool:
        return self.engine is not None and self.engine.is_alive

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncGenerator[TokenEvent, None]:
        if self.engine is None or not self.engine.is_alive:
            raise BackendError("the colocated engine is not running")
        if self._num_active >= self.max_active_requests:
            raise Overloaded(f"{self._num_active} requests in flight (the limit); retry later")
        self._num_active += 1
        outputs = self.engine.generate(request_id, prompt_token_ids, params)
        assert self.worker_metrics is not None  # start() set it with the engine checked above
        timer = self.worker_metrics.request()  # queue time is not split out here: it reads 0
        started = time.monotonic()
        num_finished = 0
        has_first = False
        try:
            async for output in outputs:
                timer.on_output(len(output.new_token_ids))
                num_finished += output.finished
                if output.finished and num_finished == params.n:
                    timer.on_finished(output.finish_reason, len(prompt_token_ids))
                # one TTFT stage here (the engine's queue is not split out): submitted to first token
                stages = None if has_first else {"prefill_compute": time.monotonic() - started}
                has_first = True
                yield TokenEvent(ttft_stages=stages,
                    index=output.index, token_ids=output.new_token_ids,
                    logprobs=output.new_logprobs, prompt_logprobs=output.prompt_logprobs,
                    finish_reason=output.finish_reason,
                    stop_token_id=output.stop_reason if isinstance(output.stop_reason, int) else None,
                    num_prompt_tokens=output.num_prompt_tokens,
                    num_cached_tokens=output.num_cached_tokens)
        except (BackendError, Overloaded):
            raise
        except RuntimeError as error:  # EngineDead: the engine thread stopped
            raise BackendError(f"the colocated engine failed: {error}") from error
        finally:
            self._num_active -= 1
            await outputs.aclose()  # aborts the request in the engine if it still runs

    async def stats(self) -> EngineStats:
        """Block pool and queue sizes, read between two engine steps."""
        if self.engine is None:
            raise BackendError("the colocated engine is not running")
        return await self.engine.call(lambda core: core.stats())
