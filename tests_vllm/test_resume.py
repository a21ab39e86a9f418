"""A stream cut mid-way on a real vLLM server resumes on the other one (gateway/wire/resume.py): the continuation is
a chat with `continue_final_message` (completions: the prompt plus the text sent), and with greedy decoding on
identical weights the client reads the same text and usage as one uninterrupted answer would give.

The cut comes from loopback proxies in front of the two servers: the first streamed generation they carry is
dropped (the connection closed, no [DONE]) after a few events, as a dying worker's would be.
"""

from __future__ import annotations

import asyncio
import functools
import threading

import pytest
from aiohttp import ClientSession, web

from tests_vllm.conftest import MODEL, direct_client, metric_sum, run_gateway, wait_until

MESSAGES = [{"role": "user", "content": "Tell me about routers."}]
PROMPT = "def route(request, workers):\n    "
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
_SKIP = ("host", "content-length", "transfer-encoding", "connection")


class CuttingProxies:
    """One loopback proxy per server (a thread with its own event loop); the first streamed generation any of
    them carries is cut after `after` events."""

    def __init__(self, targets: list[str], after: int) -> None:
        self.targets = targets
        self.after = after
        self.cut: str | None = None  # the path of the request that was cut
        self.urls: list[str] = []
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._session: ClientSession | None = None

    def __enter__(self) -> CuttingProxies:
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        self.urls = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)

    async def _start(self) -> list[str]:
        self._session = ClientSession()
        urls = []
        for target in self.targets:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", functools.partial(self._forward, target=target))
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self._runners.append(runner)
            urls.append(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
        return urls

    async def _stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        await self._session.close()

    async def _forward(self, request: web.Request, *, target: str) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP}
        async with self._session.request(request.method, target + request.path_qs, data=await request.read(),
                                         headers=headers) as up:
            ctype = up.headers.get("content-type", "application/json")
            if not ctype.startswith("text/event-stream"):
                return web.Response(status=up.status, body=await up.read(), headers={"content-type": ctype})
            resp = web.StreamResponse(status=up.status, headers={"content-type": ctype})
            await resp.prepare(request)
            cut = self.cut is None
            if cut:
                self.cut = request.path
            events = 0
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
                events += chunk.count(b"\n\n")
                if cut and events >= self.after:
                    request.transport.abort()  # the worker dies: no more bytes, no [DONE]
                    return resp
            await resp.write_eof()
            return resp


@pytest.fixture
def servers(vllm_fleet) -> list[str]:  # noqa: ANN001
    return [s.url for s in vllm_fleet.servers.values()]


def test_chat_stream_cut_on_one_server_resumes_on_the_other(servers) -> None:
    ref = direct_client(servers[0]).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, **GREEDY)
    with CuttingProxies(servers, after=12) as proxies, run_gateway(proxies.urls) as gw:
        wait_until(lambda: len(gw.workers()) == 2 and all(w["healthy"] for w in gw.workers()), 30,
                   "both proxied workers healthy")
        chunks = list(gw.client().chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=40, stream=True, stream_options={"include_usage": True},
            **GREEDY))
        assert proxies.cut == "/v1/chat/completions"
        assert metric_sum(gw.metrics(), "fleetgate_stream_breaks_total", outcome="resumed") == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.choices[0].message.content  # one answer, as if nothing had happened
    assert len({c.id for c in chunks}) == 1
    assert len([c for c in chunks if c.choices and c.choices[0].delta.role]) == 1
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1
    assert (usage[0].prompt_tokens, usage[0].completion_tokens) == (ref.usage.prompt_tokens, 40)


def test_completion_stream_cut_on_one_server_resumes_on_the_other(servers) -> None:
    ref = direct_client(servers[1]).completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, **GREEDY)
    with CuttingProxies(servers, after=10) as proxies, run_gateway(proxies.urls) as gw:
        wait_until(lambda: len(gw.workers()) == 2 and all(w["healthy"] for w in gw.workers()), 30,
                   "both proxied workers healthy")
        chunks = list(gw.client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=32, stream=True, stream_options={"include_usage": True},
            **GREEDY))
        assert proxies.cut == "/v1/completions"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.choices[0].text
    usage = [c.usage for c in chunks if c.usage is not None]
    assert (usage[0].prompt_tokens, usage[0].completion_tokens) == (ref.usage.prompt_tokens, 32)
