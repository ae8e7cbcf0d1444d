"""The launcher on the Kubernetes API against a stub API server that speaks
the two calls it uses (GET and PATCH of a StatefulSet's scale subresource)
the way a real one does: bearer token checked, a JSON-patch content type
refused for an object body, unknown paths 404. No real cluster is used."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

pytest.importorskip("kubernetes")

from services.scheduler.k8s_launcher import KubernetesLauncher
from services.scheduler.launcher import LaunchError

TOKEN = "sa-token"
NS, STS = "ferry", "ferry-instance"
SCALE = f"/apis/apps/v1/namespaces/{NS}/statefulsets/{STS}/scale"


class StubApiServer:
    def __init__(self, replicas: int = 2):
        self.replicas = replicas
        self.calls: list[tuple[str, str, str]] = []  # method, path, content type
        self.url = ""
        self._runner = None

    def _scale(self) -> dict:
        return {"kind": "Scale", "apiVersion": "autoscaling/v1",
                "metadata": {"name": STS, "namespace": NS, "resourceVersion": str(len(self.calls))},
                "spec": {"replicas": self.replicas}, "status": {"replicas": self.replicas, "selector": "app=x"}}

    async def handle(self, request: web.Request) -> web.Response:
        ctype = request.headers.get("Content-Type", "")
        self.calls.append((request.method, request.path, ctype))
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"kind": "Status", "code": 401, "reason": "Unauthorized"}, status=401)
        if request.path != SCALE:
            return web.json_response({"kind": "Status", "code": 404, "reason": "NotFound"}, status=404)
        if request.method == "GET":
            return web.json_response(self._scale())
        if request.method == "PATCH":
            body = json.loads(await request.read())
            if ctype.startswith("application/json-patch+json") and not isinstance(body, list):
                return web.json_response({"kind": "Status", "code": 400, "message": "json patch: not a list"},
                                         status=400)
            if not ctype.startswith(("application/merge-patch+json", "application/strategic-merge-patch+json")):
                return web.json_response({"kind": "Status", "code": 415}, status=415)
            self.replicas = int(body["spec"]["replicas"])
            return web.json_response(self._scale())
        return web.json_response({"kind": "Status", "code": 405}, status=405)

    async def start(self) -> "StubApiServer":
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()


@pytest.fixture
async def api():
    server = await StubApiServer(replicas=2).start()
    yield server
    await server.stop()


def _launcher(api, serving, token=TOKEN, **kw) -> KubernetesLauncher:
    return KubernetesLauncher.from_host(api.url, token, STS, NS, serving=serving, poll_s=0.01, **kw)


async def test_adopt_reads_the_statefulset_and_only_the_highest_ordinal_is_stoppable(api):
    launcher = _launcher(api, serving=lambda i: True)
    await launcher.adopt()
    assert launcher.instances() == ["ferry-instance-0", "ferry-instance-1"]
    assert launcher.stoppable() == ["ferry-instance-1"]
    assert api.calls == [("GET", SCALE, "")]


async def test_launch_scales_out_by_one_and_waits_until_the_pod_serves(api):
    ready: set[str] = set()
    launcher = _launcher(api, serving=lambda i: i in ready)
    await launcher.adopt()
    task = asyncio.create_task(launcher.launch())
    await asyncio.sleep(0.2)
    assert api.replicas == 3 and not task.done()  # scaled, waiting for ferry-instance-2 to register
    ready.add("ferry-instance-2")
    assert await asyncio.wait_for(task, 5) == "ferry-instance-2"
    patches = [c for c in api.calls if c[0] == "PATCH"]
    assert patches == [("PATCH", SCALE, "application/merge-patch+json")]
    assert {c[1] for c in api.calls} == {SCALE}  # nothing but the scale subresource


async def test_concurrent_launches_each_add_one(api):
    launcher = _launcher(api, serving=lambda i: True)
    await launcher.adopt()
    ids = await asyncio.gather(*(launcher.launch() for _ in range(3)))
    assert sorted(ids) == ["ferry-instance-2", "ferry-instance-3", "ferry-instance-4"]
    assert api.replicas == 5


async def test_stop_lowers_replicas_only_for_the_highest_ordinal(api):
    launcher = _launcher(api, serving=lambda i: True)
    await launcher.adopt()
    with pytest.raises(LaunchError, match="highest ordinal"):
        await launcher.stop("ferry-instance-0")
    assert api.replicas == 2
    await launcher.stop("ferry-instance-1")
    assert api.replicas == 1 and launcher.instances() == ["ferry-instance-0"]
    await launcher.close()  # a scheduler that stops scales nothing down
    assert api.replicas == 1


async def test_a_wrong_token_is_refused(api):
    from kubernetes.client.exceptions import ApiException

    launcher = _launcher(api, serving=lambda i: True, token="wrong")
    with pytest.raises(ApiException) as e:
        await launcher.adopt()
    assert e.value.status == 401


async def test_a_launch_that_never_serves_fails_after_the_timeout(api):
    launcher = _launcher(api, serving=lambda i: False, ready_timeout_s=0.1)
    await launcher.adopt()
    with pytest.raises(LaunchError, match="did not serve"):
        await launcher.launch()
