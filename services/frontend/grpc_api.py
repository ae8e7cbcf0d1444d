"""The frontend's gRPC Generate API: the semantics of POST /v1/completions.

NOTE: the request id is the frontend's own, as over HTTP: a client's id
(``request_id``) is kept as metadata, bounded, and echoed back as
``client_request_id``; it never reaches an instance, where two clients' ids
collided ("already running here") and a 7.9 MB id was copied into every
status report."""

from __future__ import annotations

import time
import uuid

from libs.pb import frontend_pb2 as pb
from libs.pb import frontend_pb2_grpc as pb_grpc
from libs.common import convert
from libs.common.errors import InvalidArgument
from libs.common.validation import MAX_CLIENT_REQUEST_ID, sampling_problem, stops_problem
from services.frontend.admission import Admission
from services.frontend.auth import Keys, check_priority
from services.frontend.completions import Choice, Prepared, Present, check_token_ids, deltas, grammar_problem
from services.frontend.generation import Generation


class FrontendServicer(pb_grpc.FrontendServicer):
    def __init__(self, router, tokenizer, max_len, max_resumes: int = 1, keys: Keys | frozenset[str] = Keys(),
                 admission: Admission | None = None):
        self.router = router
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.max_resumes = max_resumes
        self.keys = keys if isinstance(keys, Keys) else Keys(keys)
        self.admission = admission or Admission()

    def vocab_size(self) -> int:
        return self.router.vocab_size(self.tokenizer.vocab_size)

    async def Generate(self, request, context):
        privileged = self.keys.check(dict(context.invocation_metadata() or ()).get("authorization"))
        with self.admission.slot():
            async for m in self._generate(request, privileged):
                yield m

    async def _generate(self, request, privileged: bool):
        if len(request.request_id) > MAX_CLIENT_REQUEST_ID:
            raise InvalidArgument(f"request_id has at most {MAX_CLIENT_REQUEST_ID} characters, got "
                                  f"{len(request.request_id)}", param="request_id")
        ids = list(request.prompt_token_ids) or (self.tokenizer.encode(request.prompt) if request.prompt else [])
        if not ids:
            raise InvalidArgument("prompt or prompt_token_ids is required", param="prompt")
        check_token_ids(ids, self.vocab_size(), "prompt_token_ids")
        sampling = convert.sampling_from_pb(request.sampling)
        problem = sampling_problem(sampling, self.vocab_size())
        if problem:
            raise InvalidArgument(f"sampling: {problem}", param="sampling")
        if sampling.grammar is not None:
            problem = grammar_problem(sampling.grammar)
            if problem:
                raise InvalidArgument(f"sampling.grammar: {problem}", param="sampling.grammar")
        priority = convert.priority_from_pb(request.priority)
        check_priority(priority, privileged)
        problem = stops_problem(list(request.stop))
        if problem:
            raise InvalidArgument(problem, param="stop")
        limit = self.max_len()
        if len(ids) + sampling.max_tokens > limit:
            raise InvalidArgument(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + sampling.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{sampling.max_tokens} for the completion).", param="max_tokens")
        gen = Generation(f"grpc-{uuid.uuid4().hex}", ids, sampling, priority)
        present = Present("completion", list(request.stop), request.include_stop_str_in_output,
                          not request.keep_special_tokens, sampling.logprobs)
        prep = Prepared(gen.request_id, int(time.time()), present, [ids], [Choice(0, gen, 0)])
        client_id = request.request_id
        prompt_sent = False
        async for d in deltas(self.router, self.tokenizer, prep, prep.choices[0], self.max_resumes):
            m = pb.TextGenerateResponse(request_id=gen.request_id, text=d.text, token_ids=d.token_ids,
                                        client_request_id=client_id,
                                        logprobs=[convert.logprobs_to_pb(lp) for lp in d.logprobs])
            if gen.prompt_logprobs and not prompt_sent:
                m.prompt_logprobs.extend(convert.logprobs_to_pb(lp) for lp in gen.prompt_logprobs)
                prompt_sent = True
            yield m
        final = pb.TextGenerateResponse(request_id=gen.request_id, finish_reason=gen.finish_reason or "stop",
                                        client_request_id=client_id, prompt_tokens=len(ids),
                                        completion_tokens=len(gen.delivered))
        if gen.prompt_logprobs and not prompt_sent:
            final.prompt_logprobs.extend(convert.logprobs_to_pb(lp) for lp in gen.prompt_logprobs)
        yield final
