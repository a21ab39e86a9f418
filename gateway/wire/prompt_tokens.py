"""A request's prompt token ids as the engine will see them, for exact prefix-cache block hashes.

vLLM renders a chat request with the model's chat template (no tokenizer special tokens added: the template
carries them) and tokenizes a completion prompt with the tokenizer's own special tokens (e.g. BOS); a prompt
given as token ids is used as is. Two tokenizers:

- `sim`: the simulator's (simulator/tokenizer.py): exact for simulated workers;
- a directory holding a Hugging Face `tokenizer.json` (and `tokenizer_config.json` / `chat_template.jinja`
  for the chat template): the model's own tokenizer through the `tokenizers` library, the template rendered
  with Jinja2 as transformers' `apply_chat_template` does (messages, add_generation_prompt, bos/eos tokens).

Approximations (documented limits): templates that call functions beyond `raise_exception` and
`strftime_now`, tools, multimodal parts (a request with them hashes to blocks no engine holds, so it is routed
on load alone), and vLLM's `--chat-template` overrides are not modelled. None means "cannot tokenize this
request": it simply gets no cache view.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class PromptTokenizer(Protocol):
    def chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int] | None: ...

    def completion(self, prompt: Any) -> list[int] | None: ...


def _token_list(prompt: Any) -> list[int] | None:
    """A completion prompt given as token ids (one list, or a batch of one)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        return list(prompt[0])
    return None


class SimTokenizer:
    """The simulator's deterministic tokenizer and minimal chat template."""

    def chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int] | None:
        from simulator import tokenizer

        return tokenizer.encode(tokenizer.render_chat(list(messages), add_generation_prompt))

    def completion(self, prompt: Any) -> list[int] | None:
        from simulator import tokenizer

        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return tokenizer.encode(prompt[0])
        return _token_list(prompt)


class HfTokenizer:
    """A model directory's tokenizer.json and chat template."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{d}: no tokenizer.json (kv_events.tokenizer must be 'sim' or a model directory)")
        self.tok = Tokenizer.from_file(str(path))
        cfg: dict[str, Any] = {}
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
        template = None
        if (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        elif isinstance(cfg.get("chat_template"), str):
            template = cfg["chat_template"]
        self.special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        self.template = _compile(template) if template else None

    def chat(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int] | None:
        if self.template is None:
            return None
        try:
            text = self.template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except Exception:  # noqa: BLE001 - a template this renderer cannot run: no cache view, not an error
            return None
        return self.tok.encode(text, add_special_tokens=False).ids

    def completion(self, prompt: Any) -> list[int] | None:
        if isinstance(prompt, str):
            return self.tok.encode(prompt, add_special_tokens=True).ids
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return self.tok.encode(prompt[0], add_special_tokens=True).ids
        return _token_list(prompt)


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):   # AddedToken serialized as {"content": ...}
        return v.get("content")
    return v if isinstance(v, str) else None


def _compile(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: _dt.datetime.now().strftime(fmt)
    return env.from_string(template)


def make_tokenizer(spec: str) -> PromptTokenizer | None:
    """`sim`, a model directory, or `none` (no tokenizer: requests get no cache view)."""
    if spec == "none":
        return None
    if spec == "sim":
        return SimTokenizer()
    return HfTokenizer(spec)
