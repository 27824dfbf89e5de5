"""`ServerThread`: a real uvicorn server for an app, in a background thread of this process.

For embedding the server next to other code (a notebook, a test, a benchmark driver that inspects the
engine): `with ServerThread(app) as srv: openai.OpenAI(base_url=srv.url + "/v1", ...)`. The socket is
bound before uvicorn starts (port 0 = a free port chosen by the OS, no race with other processes), and
the context exits only after uvicorn has shut down (the app's lifespan stops its engine driver).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

__all__ = ["ServerThread"]


class ServerThread:
    """Run `app` under uvicorn on `host:port` (0: any free port) until the context exits."""

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        timeout: float = 60.0,
    ) -> None:
        import uvicorn

        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = int(self._sock.getsockname()[1])
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, name="uvicorn", daemon=True
        )
        self.timeout = timeout

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self.timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self._thread.join(self.timeout)
        self._sock.close()
