"""The serving end of the test webs that hold a built hub and no broker
(:mod:`tests.support.hostsweb`, :mod:`tests.support.metricsweb`): the real app on gevent's
WSGI server, an ephemeral loopback port printed as ``port N`` for the parent to read.

The caller has monkey-patched already (``web.serve.patch``, as the real web does): gevent is
imported here only when :func:`serve` runs, so importing this module patches nothing.
"""
from __future__ import annotations

from typing import Any


def serve(hub: Any) -> None:
    """Serve ``hub`` until the process is killed."""
    from gevent.pywsgi import WSGIServer

    from web.app import create_app

    server = WSGIServer(("127.0.0.1", 0), create_app(hub), log=None)
    server.start()
    print(f"port {server.server_port}", flush=True)
    server.serve_forever()
