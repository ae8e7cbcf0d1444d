"""OpenAI's Responses API (POST /v1/responses, GET and DELETE
/v1/responses/{id}) over the chat path: the input items, the instructions and
a previous response's conversation become chat messages; tools and
``text.format`` become the chat body's tools and response_format; the output
is message and function_call items, streamed as OpenAI's event sequence.

``store`` (OpenAI's default: true) keeps the response and its conversation in
the meta store (services/meta_store/documents.py), so a continuation
(``previous_response_id``) that lands on another frontend replica finds it."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

import grpc
from pydantic import Field

from libs.pb import meta_store_pb2 as mpb
from libs.pb import meta_store_pb2_grpc as mpb_grpc
from libs.common import rpc
from libs.common.errors import FerryError, InvalidArgument, NotFound, from_grpc
from services.frontend.completions import Choice, Prepared, cached_tokens, deltas, prepare
from services.frontend.schema import HONOURED, ChatCompletionRequest, Text, _Body, refused
from services.frontend.tools import StreamedCalls, calls_of

KIND = "response"


class InputText(_Body):
    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: list | None = None  # output_text's (none here)
    logprobs: list | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[InputText]
    id: Text | None = None
    status: Text | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text
    id: Text | None = None
    status: Text | None = None


class FunctionTool(_Body):
    type: Literal["function"]
    name: Text
    description: Text | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: Text


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Text | None = refused("the served model has no verbosity setting")


class ResponsesRequest(_Body):
    model: Text | None = None
    input: Text | list[MessageItem | FunctionCallItem | FunctionCallOutputItem]
    instructions: Text | None = None
    previous_response_id: Text | None = None
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    metadata: dict[str, Text] | None = None  # kept with the stored response
    user: Text | None = None
    safety_identifier: Text | None = None
    service_tier: Literal["auto", "default"] | None = None
    truncation: Literal["disabled"] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)  # vLLM's extension
    reasoning: dict | None = refused("the served model does not reason")
    include: list | None = refused("no extra output items are available to include", allowed=([],))
    background: bool = refused("background responses are not supported", default=False)
    conversation: Any = refused("conversations are not supported: use previous_response_id")
    prompt: Any = refused("prompt templates are not supported")
    prompt_cache_key: Text | None = refused("prompt_cache_key is not supported yet")
    max_tool_calls: int | None = refused("a bound on tool calls is not supported")


HONOURED_RESPONSES = HONOURED | {"input", "instructions", "previous_response_id", "store", "text",
                                 "max_output_tokens", "metadata", "truncation"}


def _now() -> int:
    return int(time.time())


class ResponseStore:
    """The stored responses, in the meta store (any frontend replica reads them)."""

    def __init__(self, meta_store: str):
        self._stub = mpb_grpc.MetaStoreStub(rpc.channel(meta_store))

    async def put(self, response_id: str, doc: dict) -> None:
        try:
            await self._stub.PutDocument(mpb.PutDocumentRequest(key=mpb.DocumentKey(kind=KIND, key=response_id),
                                                                data=json.dumps(doc).encode()), timeout=5)
        except grpc.RpcError as e:
            raise from_grpc(e) from e

    async def get(self, response_id: str) -> dict:
        try:
            got = await self._stub.GetDocument(mpb.DocumentKey(kind=KIND, key=response_id), timeout=5)
        except grpc.RpcError as e:
            raise from_grpc(e) from e
        if not got.found:
            raise NotFound(f"no stored response {response_id!r} (a response is stored with store: true)",
                           param="previous_response_id")
        return json.loads(got.data)

    async def delete(self, response_id: str) -> bool:
        try:
            return (await self._stub.DeleteDocument(mpb.DocumentKey(kind=KIND, key=response_id), timeout=5)).existed
        except grpc.RpcError as e:
            raise from_grpc(e) from e


def _messages(items) -> list[dict]:
    """Input items as chat messages (a function call as the assistant's tool
    call, its output as a tool message)."""
    out: list[dict] = []
    for it in items:
        if isinstance(it, MessageItem):
            out.append({"role": it.role, "content": it.text()})
        elif isinstance(it, FunctionCallItem):
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": it.call_id, "content": it.output})
    return out


def _output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the chat messages a continuation sees."""
    items = []
    for o in output:
        if o["type"] == "message":
            items.append(MessageItem(role="assistant", content="".join(p["text"] for p in o["content"])))
        else:
            items.append(FunctionCallItem(type="function_call", call_id=o["call_id"], name=o["name"],
                                          arguments=o["arguments"]))
    return _messages(items)


def chat_body(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The request as a chat body: instructions (a system message), the
    previous conversation, the input."""
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) else req.input
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history \
        + _messages(items)
    body: dict = {"messages": messages, "temperature": req.temperature, "top_p": req.top_p,
                  "parallel_tool_calls": req.parallel_tool_calls, "seed": req.seed}
    if req.model:
        body["model"] = req.model
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.top_logprobs is not None:
        body.update(logprobs=True, top_logprobs=req.top_logprobs)
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in req.tools]
    if req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else {
            "type": "function", "function": {"name": req.tool_choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        body["response_format"] = ({"type": "json_object"} if fmt.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": fmt.name or "schema", "schema": fmt.schema_ or {},
                                                   "strict": fmt.strict}})
    try:
        return ChatCompletionRequest.model_validate(body)
    except Exception as e:  # noqa: BLE001 - a mapped value the chat API refuses is the request's problem
        raise InvalidArgument(f"cannot run this response: {e}") from e


class Responses:
    """The handler of /v1/responses (app.py's routes call it)."""

    def __init__(self, store: ResponseStore, router, tokenizer, model_name: str, max_resumes: int,
                 max_model_len, vocab, tool_parser=None):
        self.store = store
        self.router = router
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_resumes = max_resumes
        self.max_model_len = max_model_len
        self.vocab = vocab
        self.tool_parser = tool_parser

    async def prepare(self, req: ResponsesRequest, priority_header: str | None) -> tuple[Prepared, list[dict]]:
        """The prepared chat request, and the conversation it continues (stored with it)."""
        history: list[dict] = []
        if req.previous_response_id:
            prev = await self.store.get(req.previous_response_id)
            history = prev["conversation"] + _output_messages(prev["response"]["output"])
        body = chat_body(req, history)
        prep = prepare(body, self.tokenizer, self.max_model_len(), priority_header, self.vocab(), self.model_name,
                       self.tool_parser)
        return prep, [m for m in body.model_dump()["messages"]]

    def shell(self, req: ResponsesRequest, rid: str, created: int, status: str, output: list,
              usage: dict | None = None) -> dict:
        """The response object (OpenAI's fields)."""
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else \
            {"type": "text"}
        choice = req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None else \
            req.tool_choice.model_dump()
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": self.model_name,
                "output": output, "error": None, "incomplete_details": None, "instructions": req.instructions,
                "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls,
                "previous_response_id": req.previous_response_id, "store": req.store, "temperature": req.temperature,
                "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
                "tool_choice": choice or ("auto" if req.tools else "none"),
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()], "text": {"format": fmt},
                "truncation": "disabled", "usage": usage, "user": req.user}

    @staticmethod
    def usage(prep: Prepared) -> dict:
        n_in = sum(len(p) for p in prep.prompts)
        n_out = sum(len(c.gen.delivered) for c in prep.choices)
        return {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": cached_tokens(prep)},
                "output_tokens": n_out,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": n_in + n_out}

    def output_items(self, prep: Prepared, text: str) -> list[dict]:
        plan = prep.present.tools
        c = prep.choices[0]
        status = "incomplete" if c.gen.finish_reason == "length" else "completed"
        content, calls = (text, []) if plan is None else calls_of(plan, text)
        out = []
        if content:
            out.append(_message(f"msg_{uuid.uuid4().hex}", content, status))
        for call in calls:
            out.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                        "status": "completed"})
        return out or [_message(f"msg_{uuid.uuid4().hex}", "", status)]

    async def finish(self, req: ResponsesRequest, prep: Prepared, conversation: list[dict], rid: str, created: int,
                     output: list[dict]) -> dict:
        c = prep.choices[0]
        status = "incomplete" if c.gen.finish_reason == "length" else "completed"
        resp = self.shell(req, rid, created, status, output, self.usage(prep))
        if status == "incomplete":
            resp["incomplete_details"] = {"reason": "max_output_tokens"}
        if req.store:
            await self.store.put(rid, {"response": resp, "conversation": conversation})
        return resp

    async def whole(self, req: ResponsesRequest, priority_header: str | None) -> dict:
        prep, conversation = await self.prepare(req, priority_header)
        c = prep.choices[0]
        text = "".join([d.text async for d in deltas(self.router, self.tokenizer, prep, c, self.max_resumes)])
        rid = f"resp_{uuid.uuid4().hex}"
        return await self.finish(req, prep, conversation, rid, _now(), self.output_items(prep, text))

    async def events(self, req: ResponsesRequest, priority_header: str | None):
        """OpenAI's streaming events in their order; the first is yielded once
        the first token is out (the request placed), as the chat stream does."""
        prep, conversation = await self.prepare(req, priority_header)
        c: Choice = prep.choices[0]
        rid, created = f"resp_{uuid.uuid4().hex}", _now()
        seq = iter(range(1 << 62))

        def ev(kind: str, **fields) -> str:
            return json.dumps({"type": kind, "sequence_number": next(seq), **fields})

        stream = deltas(self.router, self.tokenizer, prep, c, self.max_resumes)
        try:
            first = await anext(stream)
        except StopAsyncIteration:
            first = None
        shell = self.shell(req, rid, created, "in_progress", [])
        yield ev("response.created", response=shell)
        yield ev("response.in_progress", response=shell)
        plan = prep.present.tools
        calls = StreamedCalls(plan) if plan is not None else None
        msg_id, text, output = f"msg_{uuid.uuid4().hex}", "", []
        open_msg = False
        items: dict[int, dict] = {}  # tool call index -> its function_call item

        def start_message():
            nonlocal open_msg
            open_msg = True
            yield ev("response.output_item.added", output_index=len(output),
                     item={"type": "message", "id": msg_id, "status": "in_progress", "role": "assistant",
                           "content": []})
            yield ev("response.content_part.added", item_id=msg_id, output_index=len(output), content_index=0,
                     part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

        async def pieces():
            if first is not None:
                yield first
            async for d in stream:
                yield d
        async for d in pieces():
            content, tool_deltas = (d.text, []) if calls is None else calls.feed(d.text)
            if content:
                if not open_msg:
                    for e in start_message():
                        yield e
                text += content
                yield ev("response.output_text.delta", item_id=msg_id, output_index=len(output), content_index=0,
                         delta=content, logprobs=[])
            for td in tool_deltas:
                fn = td.get("function", {})
                if "id" in td:  # a new call: its item, then its arguments
                    item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": td["id"],
                            "name": fn.get("name", ""), "arguments": "", "status": "in_progress"}
                    items[td["index"]] = item
                    yield ev("response.output_item.added", output_index=len(output) + int(open_msg) + td["index"],
                             item=dict(item))
                item = items[td["index"]]
                if fn.get("arguments"):
                    item["arguments"] += fn["arguments"]
                    yield ev("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=len(output) + int(open_msg) + td["index"], delta=fn["arguments"])
        status = "incomplete" if c.gen.finish_reason == "length" else "completed"
        if open_msg or not items:
            if not open_msg:
                for e in start_message():
                    yield e
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield ev("response.output_text.done", item_id=msg_id, output_index=len(output), content_index=0,
                     text=text, logprobs=[])
            yield ev("response.content_part.done", item_id=msg_id, output_index=len(output), content_index=0,
                     part=part)
            msg = {"type": "message", "id": msg_id, "status": status, "role": "assistant", "content": [part]}
            yield ev("response.output_item.done", output_index=len(output), item=msg)
            output.append(msg)
        for index in sorted(items):
            item = {**items[index], "status": "completed"}
            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=len(output),
                     arguments=item["arguments"])
            yield ev("response.output_item.done", output_index=len(output), item=item)
            output.append(item)
        try:
            resp = await self.finish(req, prep, conversation, rid, created, output)
        except FerryError as e:
            yield ev("error", code=e.code.value, message=str(e), param=None)
            return
        yield ev("response.completed" if status == "completed" else "response.incomplete", response=resp)


def _message(msg_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": msg_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}
