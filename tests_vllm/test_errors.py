"""Error bodies through the gateway: the gateway's own (unknown model) and vLLM's, same status and message, in
OpenAI's shape (vLLM's `type: BadRequestError, code: 400` becomes `type: invalid_request_error, code: null`)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests_vllm.conftest import MODEL, direct_client

# ~3 BPE tokens per repetition: far past max_model_len=1024 once the server tokenizes it.
LONG_PROMPT = "route the request to the least loaded worker " * 400


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"}, body
    return body["error"]


def test_unknown_model_is_404_with_an_openai_error_body(gateway) -> None:  # noqa: ANN001
    with pytest.raises(openai.NotFoundError) as info:
        gateway.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    err = _error(info.value)
    assert info.value.status_code == 404
    assert "nope" in err["message"] and err["type"]


def test_prompt_too_long_is_vllms_400_in_openais_shape(gateway, plain_server) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as direct:
        direct_client(plain_server.url).completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as via_gateway:
        gateway.client().completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
    assert via_gateway.value.status_code == 400
    ref, got = _error(direct.value), _error(via_gateway.value)
    assert "maximum context length is 1024 tokens" in ref["message"]
    assert (ref["type"], ref["code"]) == ("BadRequestError", 400)  # vLLM's own shape, direct
    assert got == {"message": ref["message"], "type": "invalid_request_error",
                   "param": ref["param"] if isinstance(ref["param"], str) else None, "code": None}


def test_max_tokens_over_the_context_is_400(gateway) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as info:
        gateway.client().completions.create(model=MODEL, prompt="hi", max_tokens=5000)
    assert "5000" in _error(info.value)["message"]


def test_non_integer_priority_is_400(gateway) -> None:  # noqa: ANN001
    with pytest.raises(openai.BadRequestError) as info:
        gateway.client().completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                            extra_body={"priority": "high"})
    assert "priority" in str(_error(info.value)).lower()


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"model": "tiny"}'])
def test_malformed_bodies_are_4xx_never_5xx(gateway, body: bytes) -> None:  # noqa: ANN001
    resp = httpx.post(gateway.url + "/v1/completions", content=body,
                      headers={"Content-Type": "application/json"}, timeout=30)
    assert 400 <= resp.status_code < 500, resp.text
    assert resp.json()["error"]["message"]
