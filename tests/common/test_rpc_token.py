"""The cluster token on every kind of call through ``rpc.channel`` (the token
as metadata added by the channel's multi-callables), checked by the servers'
TokenInterceptor: with the token each kind of call goes through, with
another token or none it is refused, and a caller's own metadata still
arrives beside the token."""

from __future__ import annotations

import grpc
import pytest

from libs.common import rpc
from libs.common.server import TokenInterceptor

TOKEN = "the-cluster-token"


def _handlers(seen: list):
    def meta(context) -> dict:
        md = dict(context.invocation_metadata())
        seen.append(md)
        return md

    async def uu(request, context):
        meta(context)
        return request + b"!"

    async def us(request, context):
        meta(context)
        for i in range(3):
            yield request + bytes([48 + i])

    async def su(requests, context):
        meta(context)
        return b"".join([r async for r in requests])

    async def ss(requests, context):
        meta(context)
        async for r in requests:
            yield r.upper()

    return grpc.method_handlers_generic_handler("t.T", {
        "UU": grpc.unary_unary_rpc_method_handler(uu),
        "US": grpc.unary_stream_rpc_method_handler(us),
        "SU": grpc.stream_unary_rpc_method_handler(su),
        "SS": grpc.stream_stream_rpc_method_handler(ss),
    })


@pytest.fixture
async def server():
    seen: list[dict] = []
    srv = grpc.aio.server(interceptors=[TokenInterceptor(rpc.Credentials(token=TOKEN))])
    srv.add_generic_rpc_handlers((_handlers(seen),))
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    yield f"127.0.0.1:{port}", seen
    await srv.stop(None)


async def _every_kind(ch) -> list:
    async def two():
        yield b"a"
        yield b"b"

    out = [await ch.unary_unary("/t.T/UU")(b"x", metadata=(("x-mine", "1"),))]
    out.append([r async for r in ch.unary_stream("/t.T/US")(b"y")])
    out.append(await ch.stream_unary("/t.T/SU")(two()))
    out.append([r async for r in ch.stream_stream("/t.T/SS")(two())])
    call = ch.stream_stream("/t.T/SS")()  # no iterator: the caller writes (the status reporter does)
    await call.write(b"c")
    await call.done_writing()
    out.append([r async for r in call])
    return out


async def test_every_kind_of_call_carries_the_token(server):
    address, seen = server
    async with rpc.channel(address, rpc.Credentials(token=TOKEN)) as ch:
        assert await _every_kind(ch) == [b"x!", [b"y0", b"y1", b"y2"], b"ab", [b"A", b"B"], [b"C"]]
    assert len(seen) == 5 and all(md.get(rpc.TOKEN_METADATA) == TOKEN for md in seen)
    assert seen[0]["x-mine"] == "1"  # the caller's own metadata arrives too


@pytest.mark.parametrize("token", ["", "another-token"], ids=["none", "wrong"])
async def test_without_the_token_every_kind_of_call_is_refused(server, token):
    address, seen = server
    async with rpc.channel(address, rpc.Credentials(token=token)) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ch.unary_unary("/t.T/UU")(b"x")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [r async for r in ch.unary_stream("/t.T/US")(b"y")]
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert seen == []  # refused before any handler ran
