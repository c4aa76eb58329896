#!/usr/bin/python3
"""The reference side of finetune_test, independent of Tessera's code.

  folder OUT_DIR CORPUS   a Hugging Face Llama folder as save_pretrained writes one with its
                          LlamaTokenizer: a SentencePiece BPE tokenizer trained on CORPUS by
                          python3-sentencepiece (tokenizer.model, tokenizer_config.json,
                          special_tokens_map.json) and a random LlamaForCausalLM of that vocabulary
                          (config.json, model.safetensors), modelled by tests/models/llama_reference.py
                          (a transcription of transformers' modeling_llama.py)
  greedy HF_DIR PROMPT N  the folder's own tokenizer encodes PROMPT (no BOS: add_special_tokens=False),
                          its model generates N tokens greedily (generate(do_sample=False,
                          use_cache=False); after an EOS the pad token), in fp32; prints JSON
                          {"ids": prompt + generated, "text": the ids decoded, special tokens skipped}
"""
import json
import os
import sys

import sentencepiece
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "models"))
sys.path.insert(0, os.path.join(HERE, "..", "checkpoint"))
import llama_reference  # noqa: E402
import read_safetensors  # noqa: E402

# Small enough to fine-tune in seconds on two cores; max_position_embeddings above the test's
# block_size (160: two query blocks of the default blocked kernel) and below 512.
MODEL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def folder(out_dir, corpus):
    os.makedirs(out_dir, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        input=corpus, model_prefix=os.path.join(out_dir, "tokenizer"), vocab_size=300, model_type="bpe",
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1, minloglevel=2)
    processor = sentencepiece.SentencePieceProcessor(model_file=os.path.join(out_dir, "tokenizer.model"))
    os.remove(os.path.join(out_dir, "tokenizer.vocab"))  # the trainer's listing; save_pretrained writes none
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                   "unk_token": "<unk>", "pad_token": None, "legacy": False, "model_max_length": 256,
                   "tokenizer_class": "LlamaTokenizer", "clean_up_tokenization_spaces": False}, f, indent=2)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f, indent=2)

    overrides = dict(MODEL, vocab_size=processor.get_piece_size())
    torch.manual_seed(60)
    model = llama_reference.LlamaForCausalLM(llama_reference.Config(overrides)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" not in name else 0.2) + (1.0 if "norm" in name else 0.0))
    cfg = {**llama_reference.DEFAULTS, **overrides, "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32",
           "transformers_version": "4.48.0"}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    llama_reference.write_safetensors(os.path.join(out_dir, "model.safetensors"), model.state_dict())


def greedy(hf_dir, prompt, n):
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    known = set(llama_reference.DEFAULTS) | set(MODEL) | {"vocab_size", "head_dim"}
    config = llama_reference.Config({k: v for k, v in cfg.items() if k in known})
    model = llama_reference.LlamaForCausalLM(config).float()
    files = [os.path.join(hf_dir, "model.safetensors")]
    if not os.path.exists(files[0]):
        with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
            files = sorted({os.path.join(hf_dir, v) for v in json.load(f)["weight_map"].values()})
    state = {}
    for file in files:
        state.update(read_safetensors.load(file)[0])
    state = {k: v.float() for k, v in state.items()}
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    processor = sentencepiece.SentencePieceProcessor(model_file=os.path.join(hf_dir, "tokenizer.model"))
    tokens = torch.tensor([processor.encode(prompt)], dtype=torch.long)
    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
    pad = cfg.get("pad_token_id") if cfg.get("pad_token_id") is not None else eos[0]
    unfinished = torch.ones(1, dtype=torch.bool)
    with torch.no_grad():
        for _ in range(n):
            nxt = model(tokens)[:, -1].argmax(-1)
            nxt = torch.where(unfinished, nxt, torch.full_like(nxt, pad))
            tokens = torch.cat([tokens, nxt[:, None]], 1)
            unfinished &= ~torch.isin(nxt, torch.tensor(eos, dtype=torch.long))
    ids = tokens[0].tolist()
    print(json.dumps({"ids": ids, "text": processor.decode(ids)}))


if __name__ == "__main__":
    if sys.argv[1] == "folder":
        folder(sys.argv[2], sys.argv[3])
    else:
        greedy(sys.argv[2], sys.argv[3], int(sys.argv[4]))
