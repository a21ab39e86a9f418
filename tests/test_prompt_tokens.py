"""The gateway's prompt tokenizers: a model directory's tokenizer.json and chat template, and the simulator's."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors

from gateway.wire.prompt_tokens import HfTokenizer, SimTokenizer, make_tokenizer
from simulator import tokenizer as simtok

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def _model_dir(tmp_path: Path, template: str | None = TEMPLATE) -> Path:
    vocab = {w: i for i, w in enumerate(["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|end|>", "hello",
                                         "world", "\n", "<|system|>", "be", "brief"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|[a-z]+\|>|\n| "), behavior="isolated")
    tok.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>"}}
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_hf_tokenizer_renders_the_chat_template_and_adds_bos_to_completions(tmp_path: Path) -> None:
    t = HfTokenizer(_model_dir(tmp_path))
    ids = t.chat([{"role": "user", "content": "hello world"}])
    # <s> <|user|> \n hello world <|end|> \n <|assistant|> \n  (spaces are unknown words here: <unk>)
    assert ids[:4] == [0, 3, 8, 6] and ids[-3:] == [8, 4, 8] and 5 in ids
    assert t.chat([{"role": "user", "content": "hello"}], add_generation_prompt=False)[-2:] == [5, 8]
    assert t.completion("hello") == [0, 6]                   # the tokenizer's own special tokens: BOS
    assert t.completion([6, 7]) == [6, 7] and t.completion([[6]]) == [6]
    assert t.completion(["hello"]) == [0, 6]


def test_hf_tokenizer_without_template_or_with_a_failing_one(tmp_path: Path) -> None:
    assert HfTokenizer(_model_dir(tmp_path, None)).chat([{"role": "user", "content": "hi"}]) is None
    bad = HfTokenizer(_model_dir(tmp_path, "{{ raise_exception('no system role') }}"))
    assert bad.chat([{"role": "user", "content": "hi"}]) is None


def test_sim_tokenizer_is_the_simulators(tmp_path: Path) -> None:
    msgs = [{"role": "user", "content": "hello there"}]
    assert SimTokenizer().chat(msgs) == simtok.encode(simtok.render_chat(msgs))
    assert SimTokenizer().completion("abcdefgh") == simtok.encode("abcdefgh")
    assert make_tokenizer("none") is None and isinstance(make_tokenizer("sim"), SimTokenizer)
    assert isinstance(make_tokenizer(str(_model_dir(tmp_path))), HfTokenizer)
