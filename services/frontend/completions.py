"""From a validated OpenAI body to generations and their text: the prompts
(a batch of them, chat templates with tools), ``n`` choices per prompt,
limits, the sampling parameters every field maps to, and each choice's text
stream (detokenization, stop strings, logprobs beside the text).

``n`` > 1: each choice is a request of its own (its own seed, derived as
vLLM derives it: seed + index), which the scheduler may migrate on its own;
the first choice of a prompt goes first, and the others are dispatched once
its first token is out, with an affinity for the instance that computed the
prompt, whose cached blocks they share (computed once)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from libs.common.errors import InvalidArgument
from libs.common.validation import out_of_vocab_message, sampling_problem
from libs.common.types import Grammar, GrammarKind, Logprobs, Priority, SamplingParams
from services.frontend import metrics
from services.frontend.generation import Generation, run_generation
from services.frontend.router import Router
from services.frontend.schema import PROGRAM_ID_MAX, ChatCompletionRequest, CompletionRequest
from services.frontend.stops import StopMatcher
from services.frontend.tokenizer import Tokenizer
from services.frontend.tools import ToolPlan
from services.frontend.tools import plan as tool_plan


@dataclass
class Present:
    """How a response shows its tokens."""

    kind: str  # "completion" | "chat"
    stops: list[str] = field(default_factory=list)
    include_stop: bool = False
    skip_special: bool = True
    logprobs: int | None = None  # top logprobs per token to show (None: no logprobs)
    echo: bool = False
    tokens_as_ids: bool = False  # return_tokens_as_token_ids
    prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in the response
    tools: ToolPlan | None = None


@dataclass
class Choice:
    index: int
    gen: Generation
    prompt: int  # which of the batch's prompts
    leader: "Choice | None" = None  # the first choice of its prompt, if this is not it
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # a leader: its first token is out (or it ended)


@dataclass
class Prepared:
    request_id: str
    created: int
    present: Present
    prompts: list[list[int]]
    choices: list[Choice]

    @property
    def kind(self) -> str:
        return self.present.kind

    @property
    def gen(self) -> Generation:
        """The only choice's generation (callers that make one)."""
        return self.choices[0].gen


def parse_priority(body_value: str | None, header_value: str | None) -> Priority:
    value = body_value or header_value
    try:
        return Priority.parse(value)
    except ValueError as e:
        raise InvalidArgument(str(e), param="priority") from e


SESSION_HEADER = "x-session-id"


def program_of(body_value: str | None, header_value: str | None) -> str:
    """The program (an agent's session) a request is a turn of: the body's
    ``prompt_cache_key`` (validated by the schema), else the ``x-session-id``
    header; "" when neither names one. A header that is empty, longer than
    PROGRAM_ID_MAX or not printable ASCII is a 400 naming it."""
    if body_value is not None:
        return body_value
    if header_value is None:
        return ""
    v = header_value.strip()
    if not v or len(v) > PROGRAM_ID_MAX or not v.isascii() or not v.isprintable():
        raise InvalidArgument(f"the {SESSION_HEADER} header names a program: 1 to {PROGRAM_ID_MAX} printable "
                              f"ASCII characters, got {len(v)} characters", param=SESSION_HEADER)
    return v


def check_token_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """A 400 naming the first id outside the model's vocabulary: such an id
    must never reach an engine."""
    message = out_of_vocab_message(param, ids, vocab_size)
    if message:
        raise InvalidArgument(message, param=param)


def grammar_of(body) -> Grammar | None:
    """The body's structured output (at most one way of asking for it)."""
    asked = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            asked.append(("response_format", Grammar(GrammarKind.JSON_OBJECT)))
        else:
            if rf.json_schema is None:
                raise InvalidArgument("response_format json_schema needs its json_schema", param="response_format")
            asked.append(("response_format", Grammar(GrammarKind.JSON, json.dumps(rf.json_schema.schema_),
                                                     strict=bool(rf.json_schema.strict))))
    so = body.structured_outputs
    if so is not None:
        ways = [(k, v) for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                    ("grammar", so.grammar), ("json_object", so.json_object)) if v]
        if len(ways) != 1:
            raise InvalidArgument("structured_outputs takes exactly one of json, regex, choice, grammar, "
                                  "json_object", param="structured_outputs")
        k, v = ways[0]
        asked.append(("structured_outputs", _grammar(k, v, compact=so.disable_any_whitespace,
                                                     strict=so.disable_additional_properties)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        v = getattr(body, name)
        if v:
            asked.append((name, _grammar(kind, v)))
    if len(asked) > 1:
        raise InvalidArgument(f"one structured output at a time, got {', '.join(n for n, _ in asked)}",
                              param=asked[1][0])
    if not asked:
        return None
    name, g = asked[0]
    problem = grammar_problem(g)
    if problem:
        raise InvalidArgument(problem, param=name)
    return g


def _grammar(kind: str, v, compact: bool = False, strict: bool = False) -> Grammar:
    if kind == "json":
        return Grammar(GrammarKind.JSON, v if isinstance(v, str) else json.dumps(v), strict=strict, compact=compact)
    if kind == "json_object":
        return Grammar(GrammarKind.JSON_OBJECT, compact=compact)
    if kind == "choice":
        return Grammar(GrammarKind.CHOICE, json.dumps(list(v)))
    return Grammar(GrammarKind(kind), v)


def grammar_problem(g: Grammar) -> str | None:
    """Whether xgrammar can build the grammar (without a tokenizer: a 400
    here, not a failed request on an instance)."""
    import xgrammar as xgr

    try:
        if g.kind is GrammarKind.JSON:
            xgr.Grammar.from_json_schema(g.spec, strict_mode=g.strict)
        elif g.kind is GrammarKind.REGEX:
            xgr.Grammar.from_regex(g.spec)
        elif g.kind is GrammarKind.GRAMMAR:
            xgr.Grammar.from_ebnf(g.spec)
        elif g.kind is GrammarKind.CHOICE and not json.loads(g.spec):
            return "choice needs at least one string"
    except (RuntimeError, ValueError, TypeError) as e:
        return f"invalid {g.kind.value}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    return None


def _bad_words(words: list[str] | None, tokenizer: Tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's: each word as its tokens, and again with a leading space."""
    out = []
    for w in words or ():
        for text in (w, " " + w.lstrip()):
            ids = tuple(tokenizer.encode(text))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def _messages(body: ChatCompletionRequest) -> list[dict]:
    out = []
    for m in body.messages:
        d = {"role": m.role, "content": m.text() if m.content is not None else None}
        if m.content is None and not m.tool_calls:
            d["content"] = ""
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def prepare(body: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer, max_model_len: int,
            priority_header: str | None = None, vocab_size: int | None = None, model_name: str | None = None,
            tool_parser=None, session_header: str | None = None) -> Prepared:
    """``session_header``: the x-session-id header (program_of);
    ``vocab_size``: the served model's (default: the tokenizer's);
    ``model_name``: the one it serves (another is a 404, as vLLM answers);
    ``tool_parser(tools)``: what reads ``tool_choice: auto``'s calls (none: refused)."""
    vocab = vocab_size or tokenizer.vocab_size
    if model_name and body.model and body.model != model_name:
        from libs.common.errors import NotFound

        raise NotFound(f"The model `{body.model}` does not exist; this server serves `{model_name}`", param="model")
    chat = isinstance(body, ChatCompletionRequest)
    tools, tool_grammar = (tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls, tool_parser)
                           if chat else (None, None))
    grammar = grammar_of(body)
    if tool_grammar is not None:
        if grammar is not None:
            raise InvalidArgument("tool_choice required or a named function sets the output's format: no "
                                  "response_format or structured output besides", param="tool_choice")
        grammar = tool_grammar
    if chat:
        try:
            prompt_ids = tokenizer.apply_chat_template(
                _messages(body), add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message,
                tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
                documents=body.documents, chat_template=body.chat_template, kwargs=body.chat_template_kwargs)
        except Exception as e:  # noqa: BLE001 - the template is a program over the client's messages
            # (SmolLM2's raises on some role orders): its refusal is the request's problem
            raise InvalidArgument(f"the model's chat template cannot format these messages: {e}",
                                  param="messages") from e
        prompts = [prompt_ids]
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = body.top_logprobs or 0 if body.logprobs else None
    else:
        prompts = []
        for p in body.prompts():
            if isinstance(p, list):
                check_token_ids(p, vocab)
                prompts.append(list(p))
            else:
                prompts.append(tokenizer.encode(p, add_special_tokens=body.add_special_tokens))
        max_tokens = body.max_tokens
        logprobs = body.logprobs
    if body.truncate_prompt_tokens:
        prompts = [p[-body.truncate_prompt_tokens:] for p in prompts]
    param = "messages" if chat else "prompt"
    for ids in prompts:
        n_prompt = len(ids)
        if n_prompt >= max_model_len:
            raise InvalidArgument(
                f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                f"{n_prompt} tokens. Shorten the prompt.", param=param)
        want = max_tokens if max_tokens is not None else max_model_len - n_prompt
        if n_prompt + want > max_model_len:
            raise InvalidArgument(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{n_prompt + want} tokens ({n_prompt} in the prompt, {want} for the completion). "
                f"Reduce the prompt or max_tokens.", param="max_tokens")
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise InvalidArgument("min_tokens must not exceed max_tokens", param="min_tokens")
    echo = not chat and body.echo
    present = Present("chat" if chat else "completion", body.stop_list(), body.include_stop_str_in_output,
                      body.skip_special_tokens, logprobs, echo, body.return_tokens_as_token_ids,
                      body.prompt_logprobs is not None, tools)
    # prompt logprobs: vLLM's prompt_logprobs, or echo's (the prompt's tokens shown with theirs)
    prompt_k = body.prompt_logprobs if body.prompt_logprobs is not None else (
        logprobs if echo and logprobs is not None else None)
    base = SamplingParams(
        temperature=body.temperature, top_p=body.top_p, top_k=max(0, body.top_k), seed=body.seed,
        ignore_eos=body.ignore_eos, min_tokens=body.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_k,
        stop_token_ids=tuple(body.stop_token_ids or ()), presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty if body.repetition_penalty is not None else 1.0,
        min_p=body.min_p, logit_bias=tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items())),
        allowed_token_ids=tuple(body.allowed_token_ids or ()), bad_words=_bad_words(body.bad_words, tokenizer),
        grammar=grammar)
    priority = parse_priority(body.priority, priority_header)
    program = program_of(body.prompt_cache_key, session_header)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    choices: list[Choice] = []
    for pi, ids in enumerate(prompts):
        mt = max_tokens if max_tokens is not None else max_model_len - len(ids)
        leader = None
        for j in range(body.n):
            index = pi * body.n + j
            seed = None if body.seed is None else (body.seed + j) % (2**63)  # vLLM's: a child's seed is seed + index
            sp = SamplingParams(**{**base.__dict__, "max_tokens": mt, "seed": seed})
            if mt == 0 and sp.prompt_logprobs is None and not echo:
                raise InvalidArgument("max_tokens 0 makes nothing: ask for echo or prompt_logprobs",
                                      param="max_tokens")
            problem = sampling_problem(sp, vocab)
            if problem:
                raise InvalidArgument(problem, param=problem.split(" ", 1)[0])
            rid = request_id if len(prompts) * body.n == 1 else f"{request_id}-{index}"
            c = Choice(index, Generation(rid, ids, sp, priority, program_id=program), pi, leader)
            choices.append(c)
            leader = leader or c
    return Prepared(request_id, int(time.time()), present, prompts, choices)


@dataclass
class Delta:
    """A piece of a choice's text and the tokens (with logprobs) that made it."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprobs]


async def deltas(router: Router, tokenizer: Tokenizer, prep: Prepared, choice: Choice,
                 max_resumes: int = 3) -> AsyncIterator[Delta]:
    """A choice's text deltas; sets its generation's finish_reason at the end.
    The first token always yields, even when it makes no text yet (an
    incomplete character, a held-back stop prefix): a stream starts with its
    first token. Stops early (finish_reason "stop") on a stop string, which
    cancels the instance call and so aborts the request there."""
    gen, present = choice.gen, prep.present
    if choice.leader is not None:  # a sibling: where the leader's prompt is, once it is computed
        await choice.leader.ready.wait()
        gen.affinity = choice.leader.gen.instances[0] if choice.leader.gen.instances else ""
    if gen.sampling.max_tokens == 0 and gen.sampling.prompt_logprobs is None:  # echo only: nothing to compute
        gen.finish_reason = "length"
        choice.ready.set()
        return
    detok = tokenizer.detokenizer(gen.prompt_ids, skip_special_tokens=present.skip_special)
    stops = StopMatcher(present.stops, include=present.include_stop)
    metrics.IN_FLIGHT.inc()
    sent = 0  # tokens already given to a delta
    try:
        first = True
        async for token_id in run_generation(router, gen, max_resumes):
            metrics.TOKENS.inc()
            choice.ready.set()
            text = stops.feed(detok.add(token_id))
            if text or first or stops.stopped:
                yield Delta(text, gen.delivered[sent:], gen.logprobs[sent:])
                sent = len(gen.delivered)
            first = False
            if stops.stopped:
                gen.finish_reason = "stop"
                return
        tail = stops.feed(detok.flush())
        if stops.stopped:
            gen.finish_reason = "stop"
        tail += stops.flush()
        if tail or sent < len(gen.delivered):
            yield Delta(tail, gen.delivered[sent:], gen.logprobs[sent:])
    finally:
        choice.ready.set()
        metrics.IN_FLIGHT.dec()
        metrics.E2E.observe(time.perf_counter() - gen.arrival)


async def text_stream(router: Router, tokenizer: Tokenizer, prep: Prepared, max_resumes: int = 3) -> AsyncIterator[str]:
    """The only choice's text deltas (callers that make one choice: the gRPC API)."""
    async for d in deltas(router, tokenizer, prep, prep.choices[0], max_resumes):
        yield d.text


def cached_tokens(prep: Prepared) -> int:
    """Prompt tokens served from a prefix cache, once per prompt (its first
    choice's, the one that computed it; 0 until that choice finished)."""
    return sum(c.gen.cached_tokens for c in prep.choices if c.leader is None)


def usage(prep: Prepared) -> dict:
    """Prompt tokens once per prompt (of them, those a prefix cache served:
    OpenAI's prompt_tokens_details.cached_tokens), completion tokens of every choice."""
    n_prompt = sum(len(p) for p in prep.prompts)
    n_out = sum(len(c.gen.delivered) for c in prep.choices)
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": cached_tokens(prep)}}
