"""The response of /v1/completions and /v1/chat/completions for a prepared
request: every choice's deltas, as one JSON body or as one SSE stream with
the choices interleaved (each with its own ``index``), logprobs beside the
tokens, echo, tool calls, usage and Ferry's own counters.

NOTE: a stream starts only once a request is placed and a first token (of
any choice) is out: a request that cannot be placed or is refused gets its
own HTTP status (a raised FerryError, answered by the app's handler), never
a 200 followed by an error event; the first SSE chunk carries that token
(with the role, for chat)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from libs.common.errors import FerryError, openai_error
from services.frontend import metrics
from services.frontend.completions import Choice, Delta, Prepared, deltas, usage
from services.frontend.disconnect import ClientGone, unless_disconnected
from services.frontend.event_stream import EventStream
from services.frontend.shapes import chat_logprobs, completion_logprobs, merge_completion_logprobs, prompt_logprobs
from services.frontend.tools import StreamedCalls, calls_of

CLIENT_CLOSED = 499  # nginx's status for a request whose client went away (nobody reads it)


def extras(c: Choice, token_ids: bool = False) -> dict:
    """Ferry's own counters of a choice (the `ferry` object)."""
    gen = c.gen
    out = {"instances": gen.instances, "migrations": gen.num_migrations, "preemptions": gen.num_preemptions,
           "preemption_loss_ms": gen.preemption_loss_ms, "resumes": gen.num_resumes,
           "recomputed_tokens": gen.recomputed_tokens,
           "ttft_ms": (gen.first_token_at - gen.arrival) * 1000 if gen.first_token_at else None}
    if token_ids:
        out["token_ids"] = list(gen.delivered)
    return out


def ferry_object(prep: Prepared, token_ids: bool) -> dict:
    """The first choice's counters, and every choice's where there are several."""
    out = extras(prep.choices[0], token_ids)
    if len(prep.choices) > 1:
        out["choices"] = [extras(c, token_ids) for c in prep.choices]
    return out


@dataclass
class ChoiceText:
    """What a choice said so far (for the whole body, or the stream's echo and tool calls)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)

    def add(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs


class Responder:
    def __init__(self, prep: Prepared, router, tokenizer, model_name: str, max_resumes: int):
        self.prep = prep
        self.router = router
        self.tokenizer = tokenizer
        self.max_resumes = max_resumes
        self.present = prep.present
        self.chat = prep.kind == "chat"
        self.base = {"id": prep.request_id, "created": prep.created, "model": model_name}

    # --- pieces -------------------------------------------------------------------------------
    def _echo(self, c: Choice) -> tuple[str, dict | None]:
        """The echoed prompt's text and (with logprobs) its logprobs."""
        ids = self.prep.prompts[c.prompt]
        text = self.tokenizer.decode(ids, skip_special_tokens=self.present.skip_special)
        lp = None
        if self.present.logprobs is not None:
            plps = c.gen.prompt_logprobs or (None,) * len(ids)
            lp = completion_logprobs(self.tokenizer, self.present, ids, list(plps))
        return text, lp

    def _logprobs(self, c: Choice, ct_ids: list[int], lps: list, offset: int):
        if self.present.logprobs is None or not lps and not ct_ids:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, self.present, ct_ids, lps)
        return completion_logprobs(self.tokenizer, self.present, ct_ids, lps, offset)

    def _prompt_logprobs(self, c: Choice) -> list | None:
        if not self.present.prompt_logprobs:
            return None
        return prompt_logprobs(self.tokenizer, self.prep.prompts[c.prompt], c.gen.prompt_logprobs)

    def _finish(self, c: Choice, called: bool) -> str | None:
        plan = self.present.tools
        return plan.finish_reason if plan is not None and called else c.gen.finish_reason

    # --- the whole body -------------------------------------------------------------------------
    async def _collect(self, c: Choice) -> dict:
        got = ChoiceText()
        async for d in deltas(self.router, self.tokenizer, self.prep, c, self.max_resumes):
            got.add(d)
        out: dict = {"index": c.index}
        if self.chat:
            message: dict = {"role": "assistant", "content": got.text}
            calls = []
            if self.present.tools is not None:
                content, calls = calls_of(self.present.tools, got.text)
                message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            out.update(message=message, logprobs=self._logprobs(c, got.token_ids, got.logprobs, 0),
                       finish_reason=self._finish(c, bool(calls)))
            return out
        text, lp = got.text, self._logprobs(c, got.token_ids, got.logprobs, 0)
        if self.present.echo:
            prompt_text, prompt_lp = self._echo(c)
            text = prompt_text + text
            if self.present.logprobs is not None:
                lp = merge_completion_logprobs(prompt_lp, self._logprobs(c, got.token_ids, got.logprobs,
                                                                         len(prompt_text)) or
                                               completion_logprobs(self.tokenizer, self.present, [], []))
        out.update(text=text, logprobs=lp, finish_reason=c.gen.finish_reason)
        if self.present.prompt_logprobs:
            out["prompt_logprobs"] = self._prompt_logprobs(c)
        return out

    async def whole(self, request: Request, endpoint: str, token_ids: bool, flush_ms: int) -> Response:
        for c in self.prep.choices:
            c.gen.flush_interval_ms = flush_ms
        tasks = [asyncio.ensure_future(self._collect(c)) for c in self.prep.choices]

        async def everything():
            try:
                return await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                raise
        try:
            choices = await unless_disconnected(request.receive, everything(), "before_response")
        except ClientGone:
            metrics.REQUESTS.labels(endpoint, str(CLIENT_CLOSED)).inc()
            return Response(status_code=CLIENT_CLOSED)
        metrics.REQUESTS.labels(endpoint, "200").inc()
        body = {**self.base, "object": "chat.completion" if self.chat else "text_completion", "choices": choices,
                "usage": usage(self.prep), "ferry": ferry_object(self.prep, token_ids)}
        if self.chat and self.present.prompt_logprobs:
            body["prompt_logprobs"] = self._prompt_logprobs(self.prep.choices[0])
        return JSONResponse(body)

    # --- the stream -------------------------------------------------------------------------------
    async def stream(self, request: Request, endpoint: str, token_ids: bool, include_usage: bool,
                     continuous_usage: bool, write_timeout_s: float) -> Response:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(c: Choice) -> None:
            try:
                async for d in deltas(self.router, self.tokenizer, self.prep, c, self.max_resumes):
                    await queue.put((c, d))
                await queue.put((c, done))
            except BaseException as e:  # noqa: BLE001 - handed to the stream, which raises it
                await queue.put((c, e))
                if isinstance(e, asyncio.CancelledError):
                    raise

        tasks = [asyncio.ensure_future(pump(c)) for c in self.prep.choices]

        def stop_all() -> None:
            for t in tasks:
                t.cancel()

        try:
            first = await unless_disconnected(request.receive, queue.get(), "before_first_token")
        except ClientGone:
            stop_all()
            metrics.REQUESTS.labels(endpoint, str(CLIENT_CLOSED)).inc()
            return Response(status_code=CLIENT_CLOSED)
        except BaseException:
            stop_all()
            raise
        if isinstance(first[1], BaseException):
            stop_all()
            raise first[1]
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        states = {c.index: _StreamState(self.present.tools) for c in self.prep.choices}

        def chunk(choices: list, **more) -> str:
            return json.dumps({**self.base, "object": obj, "choices": choices, **more})

        def usage_now() -> dict:
            return {"usage": usage(self.prep)} if continuous_usage else {}

        def render(c: Choice, d: Delta) -> dict | None:
            st = states[c.index]
            text, lp_ids, lps = d.text, d.token_ids, d.logprobs
            prefix_lp = None
            if not st.started and not self.chat and self.present.echo:
                prompt_text, prefix_lp = self._echo(c)
                text = prompt_text + text
            out: dict = {"index": c.index}
            if self.chat:
                delta: dict = {}
                if not st.started:
                    delta["role"] = "assistant"
                if st.calls is not None:
                    content, calls = st.calls.feed(text)
                    if content or not st.started:
                        delta["content"] = content if content else (None if calls else "")
                    if calls:
                        delta["tool_calls"] = calls
                        st.called = True
                else:
                    delta["content"] = text
                out.update(delta=delta, logprobs=self._logprobs(c, lp_ids, lps, 0), finish_reason=None)
            else:
                lp = self._logprobs(c, lp_ids, lps, st.offset)
                if prefix_lp is not None:
                    lp = merge_completion_logprobs(prefix_lp, lp or completion_logprobs(
                        self.tokenizer, self.present, [], []))
                out.update(text=text, logprobs=lp, finish_reason=None)
                if not st.started and self.present.prompt_logprobs:
                    out["prompt_logprobs"] = self._prompt_logprobs(c)
            st.started = True
            st.offset += len(text)
            return out

        def final(c: Choice) -> dict:
            st = states[c.index]
            out = {"index": c.index, "finish_reason": self._finish(c, st.called), "logprobs": None}
            out.update({"delta": {}} if self.chat else {"text": ""})
            return out

        async def rest():
            try:
                pending = [first]
                left = len(tasks)
                while left:
                    c, item = pending.pop() if pending else await queue.get()
                    if isinstance(item, BaseException):
                        raise item
                    if item is done:
                        left -= 1
                        if not states[c.index].started:  # nothing came (an echo only, a max_tokens 0)
                            yield chunk([render(c, Delta("", [], []))], **usage_now())
                        # the last choice's final chunk carries Ferry's counters
                        more = {} if left else {"ferry": ferry_object(self.prep, token_ids)}
                        yield chunk([final(c)], **usage_now(), **more)
                        continue
                    yield chunk([render(c, item)], **usage_now())
                if include_usage:
                    yield chunk([], usage=usage(self.prep))
                metrics.REQUESTS.labels(endpoint, "200").inc()
            except FerryError as e:  # after the response started: an error event is all that is left
                status, body = openai_error(e)
                metrics.REQUESTS.labels(endpoint, str(status)).inc()
                yield json.dumps(body)
            finally:
                stop_all()
                for t in tasks:
                    with contextlib.suppress(BaseException):
                        await t
            yield "[DONE]"

        events = rest()
        head = await anext(events)
        return EventStream(head, events, ping_s=15, write_timeout_s=write_timeout_s)


class _StreamState:
    def __init__(self, plan):
        self.started = False
        self.offset = 0  # characters of this choice's text sent so far
        self.calls = StreamedCalls(plan) if plan is not None else None
        self.called = False
