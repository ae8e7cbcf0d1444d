"""The OpenAI-compatible HTTP API (FastAPI): /v1/completions,
/v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations


from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from libs.common import tracing
from libs.common.errors import (
    RETRY_AFTER_S,
    FerryError,
    InvalidArgument,
    NotFound,
    Unavailable,
    openai_error,
    openai_headers,
)
from libs.common.logging import get_logger
from services.frontend import metrics
from services.frontend.admission import Admission
from services.frontend.auth import check_priority
from services.frontend.body_limit import BodyLimit
from services.frontend.completions import SESSION_HEADER, check_token_ids, parse_priority, prepare
from services.frontend.disconnect import ClientGone, unless_disconnected
from services.frontend.event_stream import EventStream
from services.frontend.responses import Responses, ResponsesRequest
from services.frontend.config import FrontendConfig
from services.frontend.edge import PRIVILEGED, Edge
from services.frontend.respond import CLIENT_CLOSED, Responder
from services.frontend.router import Router
from services.frontend.schema import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from services.frontend.tokenizer import Tokenizer
from services.frontend.tracing import TraceRequests

log = get_logger(__name__)

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
    msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
    if e.get("type") == "extra_forbidden":
        msg = "unknown field: not supported by Ferry (a field no API here takes is refused, not ignored)"
    return f"{where}: {msg}", (loc[0] if loc else None)


def create_app(config: FrontendConfig, router: Router, tokenizer: Tokenizer,
               admission: Admission | None = None, tool_parser=None, response_store=None) -> FastAPI:
    """``admission``: the in-flight bound and drain this frontend's APIs share;
    ``tool_parser(tools)``: what reads tool_choice auto's calls (tools.HermesParser), or None."""
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
        if status >= 500 and status != 503:  # a failure of ours, not the client's nor a known absence: in the log
            log.error("request failed", status=status, endpoint=endpoint, code=err.code.value, error=err.message)
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

    async def respond(request: Request, body, endpoint: str):
        prep = prepare(body, tokenizer, max_len(), request.headers.get("x-priority"), vocab(), model_name,
                       tool_parser, request.headers.get(SESSION_HEADER))
        check_priority(prep.choices[0].gen.priority, request.scope.get("state", {}).get(PRIVILEGED, False))
        program = prep.choices[0].gen.program_id
        if body.user or body.safety_identifier or program:  # who asked (OpenAI's end-user ids), for which program
            log.info("request", request_id=prep.request_id, user=body.user, safety_identifier=body.safety_identifier,
                     program_id=program or None)
        r = Responder(prep, router, tokenizer, model_name, config.max_resumes)
        token_ids = bool(getattr(body, "return_token_ids", False))
        if not body.stream:
            return await r.whole(request, endpoint, token_ids, config.nonstream_flush_ms)
        so = body.stream_options
        return await r.stream(request, endpoint, token_ids, bool(so and so.include_usage),
                              bool(so and so.continuous_usage_stats), config.client_timeout_s)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(request, body, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(request, body, "/v1/chat/completions")

    responses = Responses(response_store, router, tokenizer, model_name, config.max_resumes, max_len, vocab,
                          tool_parser) if response_store is not None else None

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        if responses is None:
            raise Unavailable("the Responses API needs the meta store's document store")
        check_priority(parse_priority(None, request.headers.get("x-priority")),
                       request.scope.get("state", {}).get(PRIVILEGED, False))
        header = request.headers.get("x-priority")
        try:
            if not body.stream:
                out = await unless_disconnected(request.receive, responses.whole(body, header), "before_response")
                metrics.REQUESTS.labels("/v1/responses", "200").inc()
                return JSONResponse(out)
            events = responses.events(body, header)
            head = await unless_disconnected(request.receive, anext(events), "before_first_token")
        except ClientGone:
            metrics.REQUESTS.labels("/v1/responses", str(CLIENT_CLOSED)).inc()
            return Response(status_code=CLIENT_CLOSED)
        return EventStream(head, events, ping_s=15, write_timeout_s=config.client_timeout_s)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        if responses is None:
            raise Unavailable("the Responses API needs the meta store's document store")
        return (await response_store.get(response_id))["response"]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        if responses is None or not await response_store.delete(response_id):
            raise NotFound(f"no stored response {response_id!r}")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's /tokenize: a prompt or chat messages -> token ids."""
        if body.messages is not None:
            try:
                ids = tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages],
                                                    add_generation_prompt=body.add_generation_prompt,
                                                    continue_final_message=body.continue_final_message)
            except Exception as e:  # noqa: BLE001 - the template is a program over the client's messages
                # as for a chat completion (completions.prepare): its refusal is the request's problem
                raise InvalidArgument(f"the model's chat template cannot format these messages: {e}",
                                      param="messages") from e
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": max_len(), "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.token_text(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """vLLM's /detokenize: token ids -> text."""
        check_token_ids(body.tokens, vocab(), "tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

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
