#!/usr/bin/python3
"""The reference for Tessera's chat templates: Debian's python3-jinja2 configured exactly as
Hugging Face transformers configures it (src/transformers/utils/chat_template_utils.py,
_compile_jinja_template): an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks,
the loopcontrols extension and the AssistantTracker's {% generation %} tag, transformers' own
tojson filter, and its raise_exception and strftime_now globals. strftime_now formats a fixed
time when one is given, so that renders compare.

  jinja_reference.py render < CASES.jsonl
      each line {"template": ..., "variables": {...}, "now": "2024-09-03T10:20:30"}; prints one
      line per case: {"ok": RENDERED} or {"error": "Type: message", "raised": true|false}
  jinja_reference.py chat DIR CONVERSATIONS.jsonl [--add-generation-prompt] [--now ISO]
      apply_chat_template(tokenize=False) of each conversation with the folder's template and
      special tokens (tokenizer_config.json, special_tokens_map.json, chat_template.jinja,
      additional_chat_templates/), one JSON string per line, as `tessera tokenizer chat`
      (a conversation whose render fails prints a line {"error": ..., "raised": ...} instead).
"""
import json
import os
import sys
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class AssistantTracker(jinja2.ext.Extension):
    """transformers' {% generation %} tag; inactive (no mask is asked for), it renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [], body).set_lineno(lineno)

    @jinja2.pass_eval_context
    def _generation_support(self, context, caller):
        return caller()


def environment(now):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return (now or datetime.now()).strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[AssistantTracker, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render_cases():
    for line in sys.stdin:
        case = json.loads(line)
        now = datetime.fromisoformat(case["now"]) if case.get("now") else None
        try:
            out = {"ok": environment(now).from_string(case["template"]).render(**case.get("variables", {}))}
        except Exception as e:  # every failure is compared as a failure
            out = {"error": f"{type(e).__name__}: {e}", "raised": type(e) is jinja2.exceptions.TemplateError}
        print(json.dumps(out, ensure_ascii=False), flush=True)


SPECIAL_TOKENS_ATTRIBUTES = ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                             "mask_token", "additional_special_tokens"]


def token_text(value):
    return value["content"] if isinstance(value, dict) else value


def chat(folder, conversations, add_generation_prompt, now):
    # from_pretrained: tokenizer_config.json, then special_tokens_map.json's tokens, then the
    # chat template files (chat_template.jinja wins over the config's chat_template).
    config = {}
    if os.path.exists(os.path.join(folder, "tokenizer_config.json")):
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    tokens = {k: config[k] for k in SPECIAL_TOKENS_ATTRIBUTES if k in config}
    if os.path.exists(os.path.join(folder, "special_tokens_map.json")):
        with open(os.path.join(folder, "special_tokens_map.json"), encoding="utf-8") as f:
            tokens.update({k: v for k, v in json.load(f).items() if k in SPECIAL_TOKENS_ATTRIBUTES})
    templates = config.get("chat_template")
    if isinstance(templates, list):
        templates = {t["name"]: t["template"] for t in templates}
    elif isinstance(templates, str):
        templates = {"default": templates}
    else:
        templates = {}
    if os.path.exists(os.path.join(folder, "chat_template.jinja")):
        with open(os.path.join(folder, "chat_template.jinja"), encoding="utf-8") as f:
            templates["default"] = f.read()
    extra = os.path.join(folder, "additional_chat_templates")
    if os.path.isdir(extra):
        for name in sorted(os.listdir(extra)):
            if name.endswith(".jinja"):
                with open(os.path.join(extra, name), encoding="utf-8") as f:
                    templates[name[: -len(".jinja")]] = f.read()
    # special_tokens_map: the tokens that are set and not empty, as strings.
    special = {}
    for k, v in tokens.items():
        if k == "additional_special_tokens":
            v = [token_text(t) for t in (v or [])]
        else:
            v = token_text(v)
        if v:
            special[k] = v
    env = environment(now)
    with open(conversations, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            conversation = json.loads(line)
            messages = conversation.pop("messages")
            tools = conversation.pop("tools", None)
            documents = conversation.pop("documents", None)
            name = "tool_use" if tools is not None and "tool_use" in templates else "default"
            try:
                template = env.from_string(templates[name])
                rendered = template.render(messages=messages, tools=tools, documents=documents,
                                           add_generation_prompt=add_generation_prompt, **{**special, **conversation})
                print(json.dumps(rendered, ensure_ascii=False), flush=True)
            except Exception as e:  # one line per conversation: its failure, as render mode reports it
                failure = {"error": f"{type(e).__name__}: {e}", "raised": type(e) is jinja2.exceptions.TemplateError}
                print(json.dumps(failure, ensure_ascii=False), flush=True)


def main():
    if sys.argv[1] == "render":
        render_cases()
    elif sys.argv[1] == "chat":
        args = sys.argv[2:]
        now = None
        if "--now" in args:
            now = datetime.fromisoformat(args[args.index("--now") + 1])
        chat(args[0], args[1], "--add-generation-prompt" in args, now)
    else:
        sys.exit("usage: jinja_reference.py render | chat DIR CONVERSATIONS.jsonl [--add-generation-prompt] [--now ISO]")


if __name__ == "__main__":
    main()
