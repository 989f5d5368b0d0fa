"""When a request stops: after which new token, and why. The role sets the last rule: a PREFILL
worker stops every request after its first token (the decode worker continues it)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import Role
from engine.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class StopRules:
    max_model_len: int
    role: Role

    def append_until_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append ``token_ids`` to the request's output up to the first that stops it (setting
        its finished status); returns those appended."""
        appended = []
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            appended.append(token_id)
            status = self.status(request, token_id)
            if status is not None:
                request.status = status
                break
        return appended

    def status(self, request: Request, token_id: int) -> RequestStatus | None:
        """The finished status once ``token_id``, just appended, ends the request; else None."""
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if self.role == Role.PREFILL:
            return RequestStatus.FINISHED_PREFILLED
        return None
