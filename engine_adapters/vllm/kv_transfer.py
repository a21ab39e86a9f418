"""Request shapes of vLLM's prefill/decode protocol over `kv_transfer_params` (NIXL;
docs/reference/vllm-interface.md §4.2).

The two legs exactly as vLLM's toy proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py)
and llm-d's sidecar (connector_nixlv2.go) build them (docs/reference/peer-routers.md §8):

- prefill leg: the client's body with `max_tokens` 1 (and `max_completion_tokens` 1 if present),
  `stream` false, no `stream_options`, no `min_tokens` / `min_completion_tokens`, and
  `kv_transfer_params` = PREFILL_LEG_PARAMS;
- the prefill worker's JSON answer carries `kv_transfer_params` (an opaque object: 0.11 and 0.33 differ);
- decode leg: the client's body unchanged except `kv_transfer_params`, the object returned above,
  copied as is. Without params (the prefill failed or answered none) the decode worker prefills locally.

Both legs carry the same `X-Request-Id` (the caller sets headers; nothing here does I/O).
"""

from __future__ import annotations

from typing import Any

import orjson

# docs/reference/vllm-interface.md §4.2 step 1: what the prefill leg asks of the producer.
PREFILL_LEG_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None,
}
# Fields vLLM's P side rejects or ignores on the prefill leg (toy proxy; production-stack; AIBrix).
_DROPPED_ON_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill leg's JSON body from the client's parsed body (which is left untouched)."""
    leg = {k: v for k, v in body.items() if k not in _DROPPED_ON_PREFILL}
    leg["max_tokens"] = 1
    if "max_completion_tokens" in body:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg["kv_transfer_params"] = dict(PREFILL_LEG_PARAMS)
    return orjson.dumps(leg)


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> bytes:
    """The decode leg: the client's body with the producer's params (opaque) or, with None, without any
    `kv_transfer_params`, so the worker prefills locally."""
    leg = dict(body)
    if kv_transfer_params is None:
        leg.pop("kv_transfer_params", None)
    else:
        leg["kv_transfer_params"] = kv_transfer_params
    return orjson.dumps(leg)


def extract_kv_transfer_params(response: bytes) -> dict[str, Any] | None:
    """`kv_transfer_params` of a prefill answer, if it is a usable producer hand-off, else None.

    Usable means an object with `do_remote_prefill: true` (what the NIXL producer returns for a
    length-capped finish; docs/reference/vllm-interface.md §4.2 step 2). The object is returned as parsed, untouched.
    """
    try:
        obj = orjson.loads(response)
    except orjson.JSONDecodeError:
        return None
    params = obj.get("kv_transfer_params") if isinstance(obj, dict) else None
    if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
        return None
    return params


def params_expired(params: dict[str, Any], received_at_unix: float, now_unix: float, hold_s: float) -> bool:
    """Whether the producer has probably freed the blocks the params name.

    vLLM 0.33 says so itself (`remote_blocks_expiry_time`, unix seconds); 0.11 holds them for
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT (120 s) after the answer (docs/reference/vllm-interface.md §4.1), passed as `hold_s`.
    """
    expiry = params.get("remote_blocks_expiry_time")
    if isinstance(expiry, (int, float)) and not isinstance(expiry, bool) and now_unix >= expiry:
        return True
    return now_unix - received_at_unix >= hold_s
