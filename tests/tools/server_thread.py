"""An aiohttp app served on its own event loop in a background thread, for tests and benchmarks."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class ServerThread:
    """``with ServerThread(app) as srv:`` serves ``app`` on 127.0.0.1 at ``srv.url``."""

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app, self.host, self.port = app, host, port
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()

        async def up() -> None:
            self._runner = web.AppRunner(self.app, shutdown_timeout=5.0, access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, self.host, self.port).start()
            self.port = self._runner.addresses[0][1]

        asyncio.run_coroutine_threadsafe(up(), self.loop).result(timeout)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout)
            self._runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
