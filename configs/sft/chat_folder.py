#!/usr/bin/python3
"""The SFT example's inputs, from files Debian ships (configs/llama-sft.sh).

Usage: chat_folder.py OUT_DIR

OUT_DIR/tokenizer/: a Hugging Face tokenizer folder. tokenizer.json is byte-level BPE with no
merges (GPT-2's byte alphabet, so any text encodes) plus ChatML's special tokens; its
tokenizer_config.json carries the ChatML chat template (Qwen2's, without the default system
prompt) with <|im_end|> as eos_token, the end of every turn.
OUT_DIR/riddles.jsonl: the question-and-answer riddles of the `fortunes` package
(/usr/share/games/fortunes/riddles: records of "Q:" and "A:" lines) as conversations
{"messages": [user: the question, assistant: the answer]}.
"""
import json
import os
import sys


def bytes_to_unicode():
    """GPT-2's printable stand-in of each byte (tokenizers' ByteLevel alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def tokenizer_folder(out):
    os.makedirs(out, exist_ok=True)
    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    added = [{"id": 256 + i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(SPECIAL)]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": []}}
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "model_max_length": 512, "chat_template": TEMPLATE}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def riddles(path):
    """(question, answer) of each record holding a Q: and an A: line (continuation lines joined)."""
    with open(path, encoding="latin-1") as f:
        records = f.read().split("\n%\n")
    for record in records:
        fields, current = {}, None
        for line in record.splitlines():
            if line[:2] in ("Q:", "A:"):
                current = line[0]
                fields[current] = line[2:].strip()
            elif current and line.strip():
                fields[current] += " " + line.strip()
        if "Q" in fields and "A" in fields:
            yield fields["Q"], fields["A"]


def main():
    out = sys.argv[1]
    tokenizer_folder(os.path.join(out, "tokenizer"))
    count = 0
    with open(os.path.join(out, "riddles.jsonl"), "w") as f:
        for question, answer in riddles("/usr/share/games/fortunes/riddles"):
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            f.write(json.dumps({"messages": messages}) + "\n")
            count += 1
    print(f"{out}/tokenizer (byte-level BPE, ChatML template) and {out}/riddles.jsonl ({count} conversations)")


if __name__ == "__main__":
    main()
