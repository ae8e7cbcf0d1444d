"""Reading one streamed completion from the frontend (SSE), for benchmarks
and tests: the text, when each piece arrived, and the final `ferry` object."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx


class StreamError(RuntimeError):
    """The frontend refused the request or ended the stream with an error."""

    def __init__(self, kind: str, message: str = ""):
        super().__init__(f"{kind}: {message}" if message else kind)
        self.kind = kind


@dataclass
class Completion:
    text: str = ""
    token_times: list[float] = field(default_factory=list)  # perf_counter of each non-empty chunk
    final: dict | None = None  # the `ferry` object of the last chunk
    request_id: str | None = None
    usage: dict | None = None  # with stream_options.include_usage: the usage chunk's


async def stream_completion(http: httpx.AsyncClient, body: dict,
                            on_chunk: Callable[[Completion], Awaitable[None]] | None = None) -> Completion:
    """POST /v1/completions with stream=true; ``on_chunk`` runs after each chunk."""
    c = Completion()
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise StreamError(f"http_{r.status_code}", (await r.aread()).decode(errors="replace"))
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise StreamError(f"stream_{chunk['error'].get('type', 'error')}", chunk["error"].get("message", ""))
            c.request_id = chunk["id"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                c.token_times.append(time.perf_counter())
                c.text += chunk["choices"][0]["text"]
            if chunk.get("ferry"):
                c.final = chunk["ferry"]
            if chunk.get("usage"):
                c.usage = chunk["usage"]
            if on_chunk is not None:
                await on_chunk(c)
    return c
