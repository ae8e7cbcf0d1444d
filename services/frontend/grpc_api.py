"""The frontend's gRPC Generate API: the semantics of POST /v1/completions."""

from __future__ import annotations

import time
import uuid

from ferry.pb import frontend_pb2 as pb
from ferry.pb import frontend_pb2_grpc as pb_grpc
from libs.common import convert
from libs.common.errors import InvalidArgument
from libs.common.validation import sampling_problem, stops_problem
from services.frontend.auth import check_bearer
from services.frontend.completions import Prepared, check_token_ids, text_stream
from services.frontend.generation import Generation


class FrontendServicer(pb_grpc.FrontendServicer):
    def __init__(self, router, tokenizer, max_len, max_resumes: int = 3, api_keys: frozenset[str] = frozenset()):
        self.router = router
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.max_resumes = max_resumes
        self.api_keys = api_keys

    def vocab_size(self) -> int:
        return self.router.vocab_size(self.tokenizer.vocab_size)

    async def Generate(self, request, context):
        check_bearer(dict(context.invocation_metadata() or ()).get("authorization"), self.api_keys)
        ids = list(request.prompt_token_ids) or (self.tokenizer.encode(request.prompt) if request.prompt else [])
        if not ids:
            raise InvalidArgument("prompt or prompt_token_ids is required", param="prompt")
        check_token_ids(ids, self.vocab_size(), "prompt_token_ids")
        sampling = convert.sampling_from_pb(request.sampling)
        check_token_ids(list(sampling.stop_token_ids), self.vocab_size(), "sampling.stop_token_ids")
        problem = sampling_problem(sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens,
                                   sampling.min_tokens)
        if problem:
            raise InvalidArgument(f"sampling: {problem}", param="sampling")
        priority = convert.priority_from_pb(request.priority)
        problem = stops_problem(list(request.stop))
        if problem:
            raise InvalidArgument(problem, param="stop")
        limit = self.max_len()
        if len(ids) + sampling.max_tokens > limit:
            raise InvalidArgument(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + sampling.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{sampling.max_tokens} for the completion).", param="max_tokens")
        gen = Generation(request.request_id or f"grpc-{uuid.uuid4().hex}", ids, sampling, priority)
        prep = Prepared(gen, list(request.stop), int(time.time()), "completion")
        sent = 0
        async for text in text_stream(self.router, self.tokenizer, prep, self.max_resumes):
            yield pb.TextGenerateResponse(request_id=gen.request_id, text=text,
                                          token_ids=gen.delivered[sent:])
            sent = len(gen.delivered)
        yield pb.TextGenerateResponse(request_id=gen.request_id, token_ids=gen.delivered[sent:],
                                      finish_reason=gen.finish_reason or "stop",
                                      prompt_tokens=len(ids), completion_tokens=len(gen.delivered))
