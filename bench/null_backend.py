"""A zero-latency vLLM-shaped backend: answers at once, so a benchmark measures the gateway, not the engine.

`python -m bench.null_backend --port 8200` serves /v1/chat/completions and /v1/completions (streaming or not,
`max_tokens` chunks), /v1/models, /health and an empty /metrics, with vLLM 0.11's framing.
`--token-interval-ms` spaces a stream's chunks (default 0: all at once), so each chunk reaches the gateway on its
own as with a real engine, instead of however the scheduler happens to coalesce them.
"""

from __future__ import annotations

import argparse
import asyncio

import orjson
import uvicorn

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
_MODELS = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "vllm",
                                                    "root": MODEL, "parent": None, "max_model_len": 8192}]})
_JSON = [(b"content-type", b"application/json")]
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]


def _completion(chat: bool, n: int) -> bytes:
    usage = {"prompt_tokens": 8, "total_tokens": 8 + n, "completion_tokens": n}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": "hi " * n}, "finish_reason": "length"}
        return orjson.dumps({"id": "chatcmpl-null", "object": "chat.completion", "created": 0, "model": MODEL,
                             "choices": [choice], "usage": usage})
    choice = {"index": 0, "text": "hi " * n, "finish_reason": "length"}
    return orjson.dumps({"id": "cmpl-null", "object": "text_completion", "created": 0, "model": MODEL,
                         "choices": [choice], "usage": usage})


def _chunk(chat: bool) -> bytes:
    if chat:
        body = {"id": "chatcmpl-null", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "delta": {"content": "hi "}, "logprobs": None, "finish_reason": None}]}
    else:
        body = {"id": "cmpl-null", "object": "text_completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "text": "hi ", "logprobs": None, "finish_reason": None}]}
    return b"data: " + orjson.dumps(body) + b"\n\n"


_CHUNK = {True: _chunk(True), False: _chunk(False)}
TOKEN_INTERVAL_S = 0.0  # --token-interval-ms


async def app(scope, receive, send):  # noqa: ANN001 - raw ASGI
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path in ("/v1/chat/completions", "/v1/completions"):
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        req = orjson.loads(body)
        chat = path.endswith("chat/completions")
        n = int(req.get("max_tokens") or 16)
        if not req.get("stream"):
            await send({"type": "http.response.start", "status": 200, "headers": _JSON})
            await send({"type": "http.response.body", "body": _completion(chat, n)})
            return
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        chunk = _CHUNK[chat]
        for _ in range(n):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if TOKEN_INTERVAL_S:
                await asyncio.sleep(TOKEN_INTERVAL_S)
        usage = {"id": "x", "object": "x", "created": 0, "model": MODEL, "choices": [],
                 "usage": {"prompt_tokens": 8, "total_tokens": 8 + n, "completion_tokens": n}}
        tail = b"data: " + orjson.dumps(usage) + b"\n\n" if (req.get("stream_options") or {}).get("include_usage") else b""
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n"})
        return
    if path == "/v1/models":
        await send({"type": "http.response.start", "status": 200, "headers": _JSON})
        await send({"type": "http.response.body", "body": _MODELS})
        return
    status = 200 if path in ("/health", "/metrics") else 404
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8200)
    ap.add_argument("--token-interval-ms", type=float, default=0.0, help="pause between a stream's chunks")
    args = ap.parse_args()
    global TOKEN_INTERVAL_S
    TOKEN_INTERVAL_S = args.token_interval_ms / 1000.0
    uvicorn.run(app, host=args.host, port=args.port, loop="uvloop", http="httptools", access_log=False,
                log_level="warning")


if __name__ == "__main__":
    main()
