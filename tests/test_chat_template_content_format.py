"""vLLM's --chat-template-content-format auto|string|openai: the tokenizer reads off the template whether it takes a
message's content as a string or as OpenAI parts ("auto"); the flag, the cluster config key and
MOEPIPE_CHAT_TEMPLATE_CONTENT_FORMAT override that detection where it guesses wrong. Before, the flag was an
"unrecognized arguments" error."""

from __future__ import annotations

from pathlib import Path

import pytest

import shared
from gateway.cli import build_parser, serve_options
from shared.cluster_config import (CHAT_TEMPLATE_CONTENT_FORMATS, ClusterConfigError, cluster_from_dict, dump_toml,
                                   env_overrides, load_cluster_config)
from shared.tokenizer import Tokenizer

DEMO = Path(shared.__file__).parent / "demo_model"      # a Qwen-style tokenizer

# Loops over the parts through a variable of another name: the syntax-tree heuristic sees no loop over content and
# hands it a string, whose characters the loop then walks (no `.text` on them: the text vanished).
INDIRECT_PARTS = ("{% for message in messages %}<{{ message.role }}>{% set parts = message.content %}"
                  "{% for p in parts %}[{{ p.text }}]{% endfor %}</{{ message.role }}>{% endfor %}")
# Loops over content (detected as parts), yet reads a string too.
EITHER = ("{% for message in messages %}{% if message.content is string %}S:{{ message.content }}{% else %}"
          "{% for p in message.content %}P:{{ p.text }};{% endfor %}{% endif %}|{% endfor %}")

PARTS = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


def tokenizer(tmp_path: Path, template: str, content_format: str = "auto") -> Tokenizer:
    path = tmp_path / f"t{abs(hash((template, content_format)))}.jinja"
    path.write_text(template)
    return Tokenizer.from_dir(DEMO, path, content_format=content_format)


def render(tok: Tokenizer, *messages) -> str:
    return tok.apply_chat_template(list(messages), add_generation_prompt=False)


def test_openai_gives_a_misdetected_template_its_parts(tmp_path):
    user = {"role": "user", "content": PARTS}
    assert render(tokenizer(tmp_path, INDIRECT_PARTS), user) == "<user>[][][]</user>"  # auto: "a\nb" walked
    tok = tokenizer(tmp_path, INDIRECT_PARTS, "openai")
    assert render(tok, user) == "<user>[a][b]</user>"
    # as vLLM's openai format: a string is one text part, null no parts
    assert render(tok, {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}) == \
        "<user>[hi]</user><assistant></assistant>"


def test_string_forces_joined_text(tmp_path):
    user = {"role": "user", "content": PARTS}
    assert render(tokenizer(tmp_path, EITHER), user) == "P:a;P:b;|"                    # auto: parts
    tok = tokenizer(tmp_path, EITHER, "string")
    assert render(tok, user, {"role": "assistant", "content": None}) == "S:a\nb|S:|"
    assert render(tokenizer(tmp_path, EITHER, "auto"), {"role": "user", "content": "x"}) == "S:x|"


def test_an_unknown_format_is_refused_by_the_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="content format 'parts'.*auto, string, openai"):
        tokenizer(tmp_path, EITHER, "parts")


def test_flag_config_key_and_variable(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.delenv("MOEPIPE_CHAT_TEMPLATE_CONTENT_FORMAT", raising=False)

    def options(*argv):
        return serve_options(build_parser().parse_args(["serve", *argv]))

    assert CHAT_TEMPLATE_CONTENT_FORMATS == ("auto", "string", "openai")
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    flag = next(a for a in serve._actions if "--chat-template-content-format" in a.option_strings)
    assert tuple(flag.choices) == CHAT_TEMPLATE_CONTENT_FORMATS      # the parser's own list, kept in step
    for value in CHAT_TEMPLATE_CONTENT_FORMATS:
        opts = options(str(tiny_checkpoint), "--chat-template-content-format", value)
        assert opts.extra["chat_template_content_format"] == value
    assert "chat_template_content_format" not in options(str(tiny_checkpoint)).extra
    with pytest.raises(SystemExit):
        options(str(tiny_checkpoint), "--chat-template-content-format", "parts")

    base = {"model": str(tiny_checkpoint), "stages": [{"start": 0, "end": 1, "endpoint": "ipc://x"}],
            "gateway_endpoint": "ipc://g"}
    assert cluster_from_dict(base).chat_template_content_format == "auto"
    cfg = cluster_from_dict({**base, "chat_template_content_format": "openai"})
    path = tmp_path / "cluster.toml"
    path.write_text(dump_toml(cfg))
    assert load_cluster_config(path).chat_template_content_format == "openai"
    with pytest.raises(ClusterConfigError, match="chat_template_content_format.*'parts'"):
        cluster_from_dict({**base, "chat_template_content_format": "parts"})
    monkeypatch.setenv("MOEPIPE_CHAT_TEMPLATE_CONTENT_FORMAT", " String ")
    assert env_overrides()["chat_template_content_format"] == "string"
    assert cluster_from_dict(base).chat_template_content_format == "string"
    monkeypatch.setenv("MOEPIPE_CHAT_TEMPLATE_CONTENT_FORMAT", "parts")
    with pytest.raises(ClusterConfigError, match="MOEPIPE_CHAT_TEMPLATE_CONTENT_FORMAT"):
        cluster_from_dict(base)


def test_the_gateway_s_tokenizer_takes_the_config_s_format(tmp_path):
    """The processes build the tokenizer from the cluster config (ClusterConfig.load_tokenizer: the gateway, and the
    launcher's check before any stage starts), with the format set there."""
    template = tmp_path / "indirect.jinja"
    template.write_text(INDIRECT_PARTS)
    base = {"model": str(DEMO), "stages": [{"start": 0, "end": 1, "endpoint": "ipc://x"}],
            "gateway_endpoint": "ipc://g", "chat_template": str(template)}
    user = {"role": "user", "content": PARTS}
    assert render(cluster_from_dict(base).load_tokenizer(), user) == "<user>[][][]</user>"
    tok = cluster_from_dict({**base, "chat_template_content_format": "openai"}).load_tokenizer()
    assert render(tok, user) == "<user>[a][b]</user>"
