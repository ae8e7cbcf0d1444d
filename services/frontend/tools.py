"""Tool calls (OpenAI's tools / tool_choice): what the model may write, and
how its text becomes ``tool_calls``.

- ``required`` and a named function are constrained by a grammar, so their
  output always parses: for ``required`` a compact JSON array of
  ``{"name": ..., "arguments": ...}`` objects, each one of the tools with its
  own parameters' schema (one element unless parallel_tool_calls); for a
  named function, the function's arguments object.
- ``auto`` leaves the model free and reads its calls with vLLM's Hermes tool
  parser (the format of Ferry's ChatML tools template), where the frontend
  runs with --tool-call-parser hermes; without a parser it is refused.
- ``none`` (and no tools): plain text.

Streaming sends what OpenAI sends: per call, a first delta with its index,
id, type and name (arguments ""), then the arguments' text as it comes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from libs.common.errors import InvalidArgument
from libs.common.types import Grammar, GrammarKind


# The start of one call in the output of ``required``: its name, then where its arguments begin.
_HEAD = re.compile(r'\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """How a chat request's tools shape its output."""

    mode: str  # "required" | "named" | "auto"
    names: list[str]
    parallel: bool = True
    named: str = ""  # the function of a named tool_choice
    parser: object = None  # auto: the tool-call parser

    @property
    def finish_reason(self) -> str:
        """OpenAI's: a forced function call ends with "stop", the model's own calls with "tool_calls"."""
        return "stop" if self.mode == "named" else "tool_calls"


def plan(tools: list | None, tool_choice, parallel: bool, parser_factory=None) -> tuple[ToolPlan | None, Grammar | None]:
    """(the plan, the grammar its output follows) for a chat body's tools;
    (None, None) for plain text."""
    if not tools or tool_choice == "none":
        return None, None
    names = [t.function.name for t in tools]
    params = {t.function.name: t.function.parameters or {"type": "object"} for t in tools}
    if tool_choice is not None and not isinstance(tool_choice, str):
        name = tool_choice.function.name
        return ToolPlan("named", names, parallel, named=name), Grammar(GrammarKind.JSON, json.dumps(params[name]),
                                                                        strict=False, compact=True)
    if tool_choice == "required":
        one = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "arguments": params[n]},
                          "required": ["name", "arguments"], "additionalProperties": False} for n in names]}
        schema = {"type": "array", "items": one, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return ToolPlan("required", names, parallel), Grammar(GrammarKind.JSON, json.dumps(schema), strict=False,
                                                              compact=True)
    # auto (OpenAI's default with tools)
    if parser_factory is None:
        raise InvalidArgument('tool_choice "auto" needs a tool-call parser: start the frontend with '
                              '--tool-call-parser hermes (or ask for "required" or a named function)',
                              param="tool_choice")
    return ToolPlan("auto", names, parallel, parser=parser_factory(tools)), None


def calls_of(plan: ToolPlan, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished output."""
    if plan.mode == "named":
        return None, [_call(plan.named, text)]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except ValueError:  # cut short (max_tokens): what there is, as content
            return text, []
        return None, [_call(c["name"], json.dumps(c["arguments"], separators=(",", ":"))) for c in items]
    content, calls = plan.parser.extract(text)
    return content, [_call(c["name"], c["arguments"]) for c in calls]


def _call(name: str, arguments: str) -> dict:
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class StreamedCalls:
    """A streamed output as tool-call deltas (OpenAI's): the compact JSON of
    ``required`` read character by character, or a named function's arguments."""

    plan: ToolPlan
    index: int = -1  # the call being streamed
    _state: str = "array"  # array -> object -> name -> args -> object
    _buf: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    ids: list[str] = field(default_factory=list)
    text: str = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, tool_calls deltas) this text makes."""
        self.text += text
        if self.plan.mode == "named":
            out = []
            if self.index < 0:
                self.index = 0
                self.ids.append(call_id())
                out.append(self._start(self.plan.named))
            if text:
                out.append({"index": 0, "function": {"arguments": text}})
            return "", out
        if self.plan.mode == "auto":
            return self.plan.parser.stream(self.text, text)
        return "", self._required(text)

    def _required(self, text: str) -> list[dict]:
        out, args = [], ""
        for ch in text:
            if self._state == "array":
                if ch == "{":
                    self._state, self._buf = "head", ""
            elif self._state == "head":  # {"name": "X", "arguments": ...
                self._buf += ch
                m = _HEAD.fullmatch(self._buf)
                if m is not None:
                    name = json.loads(m.group(1))
                    self.index += 1
                    self.ids.append(call_id())
                    out.append(self._start(name))
                    self._state, self._depth = "args", 0
            elif self._state == "args":
                if self._depth == 0 and not self._in_string and ch.isspace():
                    continue  # between the arguments' value and what surrounds it
                if self._depth == 0 and not self._in_string and ch == "}":
                    if args:
                        out.append({"index": self.index, "function": {"arguments": args}})
                        args = ""
                    self._state = "array"  # this call's object closed
                    continue
                args += ch
                self._track(ch)
        if args:
            out.append({"index": self.index, "function": {"arguments": args}})
        return out

    def _track(self, ch: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1

    def _start(self, name: str) -> dict:
        return {"index": self.index, "id": self.ids[-1], "type": "function",
                "function": {"name": name, "arguments": ""}}


class HermesParser:
    """``auto``: vLLM's Hermes2ProToolParser (vllm.tool_parsers), reading
    <tool_call> JSON </tool_call> blocks from the model's text; vLLM is
    imported when the frontend starts with --tool-call-parser hermes."""

    def __init__(self, tokenizer, tools: list):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VRequest
        from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

        self._request = VRequest(model="ferry", messages=[{"role": "user", "content": ""}],
                                 tools=[t.model_dump(exclude_none=True) for t in tools], tool_choice="auto")
        self._parser = Hermes2ProToolParser(tokenizer)
        self._prev_text = ""

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        info = self._parser.extract_tool_calls(text, self._request)
        if not info.tools_called:
            return text, []
        return info.content or None, [{"name": c.function.name, "arguments": c.function.arguments}
                                      for c in info.tool_calls]

    def stream(self, current: str, delta: str) -> tuple[str, list[dict]]:
        prev, self._prev_text = self._prev_text, current
        msg = self._parser.extract_tool_calls_streaming(prev, current, delta, [], [], [], self._request)
        if msg is None:
            return "", []
        return msg.content or "", [c.model_dump(exclude_none=True) for c in msg.tool_calls or ()]
