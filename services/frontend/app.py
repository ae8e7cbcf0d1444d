"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions,
/v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from libs.common import tracing
from libs.common.errors import RETRY_AFTER_S, FerryError, InvalidArgument, openai_error, openai_headers
from libs.common.logging import get_logger
from services.frontend import metrics
from services.frontend.admission import Admission
from services.frontend.auth import check_priority
from services.frontend.body_limit import BodyLimit
from services.frontend.completions import Prepared, prepare, text_stream, usage
from services.frontend.config import FrontendConfig
from services.frontend.disconnect import ClientGone, unless_disconnected
from services.frontend.edge import PRIVILEGED, Edge
from services.frontend.event_stream import EventStream
from services.frontend.router import Router
from services.frontend.schema import ChatCompletionRequest, CompletionRequest
from services.frontend.tokenizer import Tokenizer
from services.frontend.tracing import TraceRequests

log = get_logger(__name__)

CLIENT_CLOSED = 499  # nginx's status for a request whose client went away (nobody reads it)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"})


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request body", None
    # A union's branches each add an error; a check of ours (value_error) says more than a type mismatch.
    e = next((x for x in errs if x.get("type") == "value_error"), errs[0])
    # the union's branch tags ("function-after[...]", "list[int]") name no field
    loc = [str(x) for x in e.get("loc", ()) if x != "body" and not (
        isinstance(x, str) and ("[" in x or x in _TYPE_TAGS))]
    if e.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    where = ".".join(loc) if loc else "body"
    return f"{where}: {e.get('msg', 'invalid value')}", (loc[0] if loc else None)


def create_app(config: FrontendConfig, router: Router, tokenizer: Tokenizer,
               admission: Admission | None = None) -> FastAPI:
    """``admission``: the in-flight bound and drain this frontend's APIs share."""
    app = FastAPI(title="Ferry", version="0.1.0")
    admission = admission or Admission(config.max_in_flight)
    # Outermost last: the key and admission before the body is read.
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes, timeout_s=config.client_timeout_s)
    app.add_middleware(Edge, keys=config.keys(), admission=admission)
    if tracing.enabled():  # outermost: a request's span covers all of it (services/frontend/tracing.py)
        app.add_middleware(TraceRequests)
    model_name = config.model_name

    def error_response(err: FerryError, endpoint: str = "") -> JSONResponse:
        status, body = openai_error(err)
        if endpoint:
            metrics.REQUESTS.labels(endpoint, str(status)).inc()
        return JSONResponse(body, status_code=status, headers=openai_headers(err) or None)

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

    def max_len() -> int:
        return router.max_model_len(config.default_max_model_len)

    def vocab() -> int:
        return router.vocab_size(tokenizer.vocab_size)

    async def respond(request: Request, prep: Prepared, stream: bool, include_usage: bool, endpoint: str,
                      token_ids: bool = False):
        check_priority(prep.gen.priority, request.scope.get("state", {}).get(PRIVILEGED, False))
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
                   "resumes": gen.num_resumes, "recomputed_tokens": gen.recomputed_tokens,
                   "ttft_ms": (gen.first_token_at - gen.arrival) * 1000 if gen.first_token_at else None}
            if token_ids:
                out["token_ids"] = list(gen.delivered)
            return out

        base = {"id": gen.request_id, "created": prep.created, "model": model_name}
        if not stream:
            gen.flush_interval_ms = config.nonstream_flush_ms

            async def whole() -> str:
                return "".join([t async for t in text_stream(router, tokenizer, prep, config.max_resumes)])
            try:
                text = await unless_disconnected(request.receive, whole(), "before_response")
            except ClientGone:
                metrics.REQUESTS.labels(endpoint, str(CLIENT_CLOSED)).inc()
                return Response(status_code=CLIENT_CLOSED)
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
            first = await unless_disconnected(request.receive, anext(texts), "before_first_token")
        except StopAsyncIteration:
            first = ""
        except ClientGone:
            await texts.aclose()
            metrics.REQUESTS.labels(endpoint, str(CLIENT_CLOSED)).inc()
            return Response(status_code=CLIENT_CLOSED)

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

        return EventStream(chunk([first_choice(first)]), rest(), ping_s=15, write_timeout_s=config.client_timeout_s)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prep = prepare(body, tokenizer, max_len(), request.headers.get("x-priority"), vocab())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(request, prep, body.stream, include_usage, "/v1/completions", body.return_token_ids)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        prep = prepare(body, tokenizer, max_len(), request.headers.get("x-priority"), vocab())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await respond(request, prep, body.stream, include_usage, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "ferry", "max_model_len": max_len()}]}

    @app.get("/health")
    async def health():
        """Readiness: 200 once a request can be placed (an instance has
        reported its status and is not being drained), 503 before, and 503
        again while this frontend drains (SIGTERM)."""
        n = len(router.view.records)
        serving = router.serving_instances()
        ready = serving and not admission.draining
        status = "ok" if ready else ("draining" if admission.draining else "not_ready")
        body = {"status": status, "instances": n, "serving": serving, "bypass": router.bypass,
                "in_flight": admission.in_flight}
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
        metrics.BYPASS_PREFIX_INSTANCES.set(router.prefix_synced())
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app
