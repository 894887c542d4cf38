"""A model-free engine core for fast tests of the engine process, AsyncLLM and the server plumbing.

It runs the real scheduler and KV-cache manager; only the model is replaced: the
"sampled" token is the previous token + 1 (so outputs are deterministic), and
logprobs are made up but well formed.
"""

from __future__ import annotations

import time

from fastdeploy.config import FDConfig
from fastdeploy.engine.request import EngineCoreOutputs, EngineCoreRequest, LogprobsLists, Request, RequestStatus
from fastdeploy.engine.sched.scheduler import Scheduler
from fastdeploy.worker.model_runner_output import ModelRunnerOutput

FAKE_NUM_BLOCKS = 64
# A request whose prompt starts with this token is refused by add_request (tests the rejection path).
POISON_TOKEN = 49151
# Seconds each step pretends to compute, so that aborts can land mid-request.
FAKE_STEP_S = 0.002


def _lists(token_ids: list[int], k: int) -> LogprobsLists:
    rows = [[t] + [t + j for j in range(k)] for t in token_ids]
    return LogprobsLists(rows, [[-0.5] + [-0.5 - j for j in range(k)] for _ in token_ids], [1] * len(token_ids))


class FakeEngineCore:
    """Same interface as ``EngineCore``; no model, no paddle."""

    def __init__(self, fd_config: FDConfig) -> None:
        self.fd_config = fd_config
        cache = fd_config.cache_config
        cache.num_blocks = FAKE_NUM_BLOCKS
        self.vocab_size = fd_config.model_config.vocab_size
        self.scheduler = Scheduler(fd_config.scheduler_config, cache, fd_config.model_config.max_model_len)

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.prompt_token_ids and request.prompt_token_ids[0] == POISON_TOKEN:
            raise RuntimeError("poisoned request")
        self.scheduler.add_request(Request(request, self.fd_config.model_config.max_model_len))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats(), timestamp=time.time())
        so = self.scheduler.schedule()
        out = ModelRunnerOutput()
        for req_id, n in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            sp = request.sampling_params
            start = request.num_computed_tokens
            if sp.prompt_logprobs is not None:
                end = min(start + n, request.num_prompt_tokens - 1)
                if end > start:
                    out.prompt_logprobs[req_id] = _lists(request.all_token_ids[start + 1 : end + 1], sp.prompt_logprobs)
            if start + n >= request.num_tokens:
                token = (request.all_token_ids[-1] + 1) % self.vocab_size
                out.sampled_token_ids[req_id] = [token]
                if sp.logprobs is not None:
                    out.logprobs[req_id] = _lists([token], sp.logprobs)
        time.sleep(FAKE_STEP_S)
        return self.scheduler.update_from_output(so, out)
