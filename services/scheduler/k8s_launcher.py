"""A launcher on the Kubernetes API (``--launcher kubernetes``): the
instances are the pods of one StatefulSet (deploy/k8s), and launching or
stopping one is changing its ``replicas`` through the ``scale`` subresource,
with the official ``kubernetes`` client.

- The scheduler's ServiceAccount may only ``get`` and ``patch``
  ``statefulsets/scale`` of that one StatefulSet (deploy/k8s/base/scheduler.yaml):
  the launcher reads nothing else. It learns that a new instance serves from
  the cluster view (the pod registers itself with the meta store, its id and
  address from the downward API), not from the pods' API;
- a StatefulSet removes its highest ordinal first, so that one is the only
  instance a scale-in may pick (``stoppable``); the autoscaler drains it by
  migration (terminating mark) before the launcher lowers ``replicas``, and
  Kubernetes then stops the empty pod (SIGTERM);
- nothing to hand over between leaders: the StatefulSet itself is the record
  of what was launched; a scheduler that stops scales nothing down.

NOTE: tested against a stub of the API server that speaks the two calls used
(tests/scheduler/test_k8s_launcher.py), never against a real cluster."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from libs.common.logging import get_logger
from services.scheduler.launcher import LaunchError, Launcher

log = get_logger(__name__)

NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
MERGE_PATCH = "application/merge-patch+json"


def pod_namespace() -> str:
    try:
        with open(NAMESPACE_FILE) as f:
            return f.read().strip()
    except OSError:
        return "default"


class KubernetesLauncher(Launcher):
    def __init__(self, statefulset: str, namespace: str = "", *, serving: Callable[[str], bool], api=None,
                 ready_timeout_s: float = 900.0, poll_s: float = 0.5, sync_every_s: float = 10.0):
        """``serving(instance_id)``: whether the instance has registered and
        reported (the scheduler's view); ``api``: an ``AppsV1Api`` (default:
        the in-cluster configuration: the pod's ServiceAccount token)."""
        self.statefulset = statefulset
        self.namespace = namespace or pod_namespace()
        self.serving = serving
        self.ready_timeout_s = ready_timeout_s
        self.poll_s = poll_s
        self.sync_every_s = sync_every_s
        self._api = api
        self._lock = asyncio.Lock()
        self.replicas: int | None = None
        self._synced_at = 0.0
        self.launched = 0
        self.stopped = 0

    def _apps(self):
        if self._api is None:
            from kubernetes import client, config

            config.load_incluster_config()
            self._api = client.AppsV1Api()
        return self._api

    def pod(self, ordinal: int) -> str:
        return f"{self.statefulset}-{ordinal}"

    async def _read(self) -> int:
        scale = await asyncio.to_thread(self._apps().read_namespaced_stateful_set_scale,
                                        self.statefulset, self.namespace)
        self.replicas, self._synced_at = int(scale.spec.replicas or 0), time.monotonic()
        return self.replicas

    async def _write(self, replicas: int) -> None:
        await asyncio.to_thread(self._apps().patch_namespaced_stateful_set_scale, self.statefulset,
                                self.namespace, {"spec": {"replicas": replicas}}, _content_type=MERGE_PATCH)
        self.replicas, self._synced_at = replicas, time.monotonic()

    # --- Launcher ------------------------------------------------------------------------
    async def adopt(self) -> None:
        await self._read()
        log.info("kubernetes launcher", statefulset=self.statefulset, namespace=self.namespace,
                 replicas=self.replicas)

    async def sync(self) -> None:
        """Re-read ``replicas`` now and then (someone may scale by hand)."""
        if time.monotonic() - self._synced_at >= self.sync_every_s:
            async with self._lock:
                await self._read()

    def instances(self) -> list[str]:
        return [self.pod(i) for i in range(self.replicas or 0)]

    def stoppable(self) -> list[str]:
        return [self.pod(self.replicas - 1)] if self.replicas else []

    async def launch(self) -> str:
        async with self._lock:
            n = await self._read()
            await self._write(n + 1)
        iid = self.pod(n)
        self.launched += 1
        log.info("launching instance", instance_id=iid, replicas=n + 1)
        deadline = time.monotonic() + self.ready_timeout_s
        while not self.serving(iid):
            if time.monotonic() > deadline:
                raise LaunchError(f"instance {iid} did not serve within {self.ready_timeout_s:.0f}s "
                                  f"(the StatefulSet keeps it: look at the pod)")
            await asyncio.sleep(self.poll_s)
        log.info("instance launched", instance_id=iid)
        return iid

    async def stop(self, instance_id: str) -> None:
        async with self._lock:
            n = await self._read()
            if not n or instance_id != self.pod(n - 1):
                raise LaunchError(f"{instance_id} is not the highest ordinal of {self.statefulset} "
                                  f"({n} replicas): a StatefulSet stops that one first")
            await self._write(n - 1)
        self.stopped += 1
        log.info("instance stopped (replicas lowered; the pod gets SIGTERM)", instance_id=instance_id,
                 replicas=n - 1)

    async def close(self) -> None:
        """A scheduler that stops leaves the StatefulSet as it is."""

    @staticmethod
    def from_host(host: str, token: str, statefulset: str, namespace: str, *, serving, **kw) -> "KubernetesLauncher":
        """One that talks to ``host`` with a bearer token (tests, tools)."""
        from kubernetes import client

        cfg = client.Configuration(host=host, api_key={"authorization": token},
                                   api_key_prefix={"authorization": "Bearer"})
        return KubernetesLauncher(statefulset, namespace, serving=serving,
                                  api=client.AppsV1Api(client.ApiClient(cfg)), **kw)
