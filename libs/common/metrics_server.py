"""The /metrics endpoint of a service without an HTTP server of its own
(instance, scheduler, meta store: ``--metrics-port``): this process's
Prometheus registry on a thread, always in the text format 0.0.4.

NOTE: not OpenMetrics, whatever the scraper asks: prometheus_client 0.26
writes OpenMetrics sample lines with ':' turned into '_' (it checks the
names against the label-name characters), so a Prometheus scrape would store
``vllm_num_requests_running`` instead of the ``vllm:num_requests_running``
that gateways, autoscalers and the dashboards read."""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's signature
        pass


def serve_metrics(port: int, host: str = "127.0.0.1"):
    """Serve /metrics on ``host:port`` (0: any free port) from a daemon
    thread; returns the server (``server_port``, ``shutdown()``)."""
    app = make_wsgi_app(REGISTRY)

    def text_format(environ, start_response):
        environ.pop("HTTP_ACCEPT", None)  # the text format (see the module's note)
        return app(environ, start_response)

    server = make_server(host, port, text_format, ThreadingWSGIServer, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
