"""LLMEngine: the synchronous engine behind ``LLM``, driving the engine core in-process."""

from __future__ import annotations

from fastdeploy.config import FDConfig
from fastdeploy.engine.arg_utils import EngineArgs
from fastdeploy.engine.core import EngineCore
from fastdeploy.engine.exceptions import EngineGenerateError
from fastdeploy.engine.output_processor import OutputProcessor
from fastdeploy.engine.processor import Processor
from fastdeploy.engine.request import SchedulerStats
from fastdeploy.inputs import PromptType
from fastdeploy.outputs import RequestOutput
from fastdeploy.sampling_params import SamplingParams
from fastdeploy.spec_decode.metrics import SpecDecodingTotals
from fastdeploy.transformers_utils.tokenizer import get_tokenizer_for_model


class LLMEngine:
    """Tokenize -> engine core step -> detokenize, all in the calling process."""

    def __init__(self, fd_config: FDConfig) -> None:
        if fd_config.scheduler_config.scheduler_name == "global":
            # The global scheduler lives in the engine core process of a server; this engine has none.
            raise ValueError("--scheduler-name global shares requests between served instances (fastdeploy serve); "
                             "the offline LLM runs its requests in-process.")
        if fd_config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs several engine processes behind the API server "
                             "(fastdeploy serve -dp N); the offline LLM drives one engine in-process "
                             "(--data-parallel-size).")
        self.fd_config = fd_config
        self.tokenizer = get_tokenizer_for_model(fd_config.model_config)
        self.processor = Processor(fd_config.model_config, self.tokenizer, fd_config.structured_outputs_config,
                                   fd_config.kv_transfer_config.enabled)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(fd_config, tokenizer=self.tokenizer)
        self.last_stats: SchedulerStats | None = None
        # Speculative decoding: draft and acceptance counts of the whole run.
        spec = fd_config.speculative_config
        self.spec_decode_totals = None if spec is None else SpecDecodingTotals(spec.num_speculative_tokens)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args.create_engine_config())

    def get_tokenizer(self):
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> None:
        """Validate and queue a request (fanned out into n children when n > 1)."""
        processed = self.processor.process_request(request_id, prompt, params, arrival_time, priority)
        for core_request in self.output_processor.add_processed_request(processed):
            self.engine_core.add_request(core_request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.engine_core.abort_requests(self.output_processor.abort_requests(ids))

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        self.last_stats = outputs.scheduler_stats
        if self.spec_decode_totals is not None and outputs.scheduler_stats is not None \
                and outputs.scheduler_stats.spec_decoding_stats is not None:
            self.spec_decode_totals.observe(outputs.scheduler_stats.spec_decoding_stats)
        request_outputs, to_abort, failed = self.output_processor.process_outputs(outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        if failed:
            request_id, error = next(iter(failed.items()))
            raise EngineGenerateError(f"Request {request_id} failed: {error}")
        return request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()
