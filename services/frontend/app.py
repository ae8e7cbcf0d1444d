"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions,
/v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import json

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from libs.common.errors import FerryError, InvalidArgument, openai_error
from libs.common.logging import get_logger
from services.frontend import metrics
from services.frontend.auth import check_bearer
from services.frontend.body_limit import BodyLimit
from services.frontend.completions import Prepared, prepare, text_stream, usage
from services.frontend.config import FrontendConfig
from services.frontend.event_stream import EventStream
from services.frontend.router import Router
from services.frontend.schema import ChatCompletionRequest, CompletionRequest
from services.frontend.tokenizer import Tokenizer

log = get_logger(__name__)

RETRY_AFTER_S = 1  # what a 503 (no instance can take the request now) tells clients


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request body", None
    e = errs[0]
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    if e.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    where = ".".join(loc) if loc else "body"
    return f"{where}: {e.get('msg', 'invalid value')}", (loc[0] if loc else None)


def create_app(config: FrontendConfig, router: Router, tokenizer: Tokenizer) -> FastAPI:
    app = FastAPI(title="Ferry", version="0.1.0")
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    keys = config.api_keys()
    model_name = config.model_name

    def error_response(err: FerryError, endpoint: str = "") -> JSONResponse:
        status, body = openai_error(err)
        if endpoint:
            metrics.REQUESTS.labels(endpoint, str(status)).inc()
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return error_response(InvalidArgument(msg, param=param), request.url.path)

    @app.exception_handler(FerryError)
    async def _ferry(request: Request, exc: FerryError):
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        """Unknown paths and methods answer in OpenAI error JSON too."""
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        body = {"error": {"message": str(exc.detail), "type": kind, "param": None,
                          "code": str(exc.detail).lower().replace(" ", "_")}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    async def require_key(request: Request) -> None:
        # A route dependency, not an HTTP middleware: Starlette's
        # BaseHTTPMiddleware costs about a third of the frontend's CPU per request.
        check_bearer(request.headers.get("authorization"), keys)

    guarded = [Depends(require_key)]

    def max_len() -> int:
        return router.max_model_len(config.default_max_model_len)

    def vocab() -> int:
        return router.vocab_size(tokenizer.vocab_size)

    async def respond(prep: Prepared, stream: bool, include_usage: bool, endpoint: str, token_ids: bool = False):
        gen = prep.gen
        obj = "chat.completion" if prep.kind == "chat" else "text_completion"

        def choice(text: str, finish: str | None, final: bool) -> dict:
            if prep.kind == "chat":
                key = "message" if final else "delta"
                body = {"role": "assistant", "content": text} if final else {"content": text}
                return {"index": 0, key: body, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        def extras() -> dict:
            out = {"instances": gen.instances, "migrations": gen.num_migrations,
                   "preemptions": gen.num_preemptions, "preemption_loss_ms": gen.preemption_loss_ms,
                   "resumes": gen.num_resumes,
                   "ttft_ms": (gen.first_token_at - gen.arrival) * 1000 if gen.first_token_at else None}
            if token_ids:
                out["token_ids"] = list(gen.delivered)
            return out

        base = {"id": gen.request_id, "created": prep.created, "model": model_name}
        if not stream:
            gen.flush_interval_ms = config.nonstream_flush_ms
            text = "".join([t async for t in text_stream(router, tokenizer, prep, config.max_resumes)])
            metrics.REQUESTS.labels(endpoint, "200").inc()
            return JSONResponse({**base, "object": obj, "choices": [choice(text, gen.finish_reason, True)],
                                 "usage": usage(gen), "ferry": extras()})

        chunk_obj = "chat.completion.chunk" if prep.kind == "chat" else "text_completion"

        def chunk(choices: list, **more) -> str:
            return json.dumps({**base, "object": chunk_obj, "choices": choices, **more})

        # NOTE: the response starts only once the request is placed and its
        # first token is out: a request that cannot be placed or is refused
        # gets its own HTTP status (a raised FerryError, answered by the
        # handler above), never a 200 followed by an error event; and the
        # first SSE chunk carries the first token (with the role, for chat).
        texts = text_stream(router, tokenizer, prep, config.max_resumes)
        try:
            first = await anext(texts)
        except StopAsyncIteration:
            first = ""

        def first_choice(text: str) -> dict:
            if prep.kind == "chat":
                return {"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": None,
                        "logprobs": None}
            return choice(text, None, False)

        async def rest():
            try:
                async for text in texts:
                    yield chunk([choice(text, None, False)])
                yield chunk([choice("", gen.finish_reason, False)], ferry=extras())
                if include_usage:
                    yield chunk([], usage=usage(gen))
                metrics.REQUESTS.labels(endpoint, "200").inc()
            except FerryError as e:  # after the response started: an error event is all that is left
                status, body = openai_error(e)
                metrics.REQUESTS.labels(endpoint, str(status)).inc()
                yield json.dumps(body)
            finally:
                await texts.aclose()
            yield "[DONE]"

        return EventStream(chunk([first_choice(first)]), rest(), ping_s=15)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request):
        prep = prepare(body, tokenizer, max_len(), request.headers.get("x-priority"), vocab())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(prep, body.stream, include_usage, "/v1/completions", body.return_token_ids)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        prep = prepare(body, tokenizer, max_len(), request.headers.get("x-priority"), vocab())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(prep, body.stream, include_usage, "/v1/chat/completions")

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "ferry", "max_model_len": max_len()}]}

    @app.get("/health")
    async def health():
        """Readiness: 200 once a request can be placed (an instance has
        reported its status and is not being drained), 503 before."""
        n = len(router.view.records)
        ready = router.serving_instances()
        body = {"status": "ok" if ready else "not_ready", "instances": n, "serving": ready, "bypass": router.bypass}
        return JSONResponse(body, status_code=200 if ready else 503,
                            headers=None if ready else {"Retry-After": str(RETRY_AFTER_S)})

    @app.get("/live")
    async def live():
        """Liveness: the frontend process answers (whatever the cluster's state)."""
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        for iid, rec in router.view.records.items():
            if rec.status is not None:
                metrics.INSTANCE_FREENESS.labels(iid).set(rec.status.freeness)
                metrics.INSTANCE_RUNNING.labels(iid).set(rec.status.num_running)
                metrics.INSTANCE_WAITING.labels(iid).set(rec.status.num_waiting)
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
