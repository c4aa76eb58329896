"""The reference side of tokenizer_test for SentencePiece: python3-sentencepiece encodes and
decodes the corpus with a model `tessera tokenizer train` wrote.
usage: /usr/bin/python3 spm_reference.py MODEL CORPUS.json OUT.json"""
import json
import sys

import sentencepiece

model, corpus_file, out_file = sys.argv[1:4]
processor = sentencepiece.SentencePieceProcessor(model_file=model)
with open(corpus_file, encoding="utf-8") as f:
    corpus = json.load(f)
results = []
for text in corpus:
    ids = processor.encode(text)
    results.append({"ids": ids, "ids_special": processor.encode(text, add_bos=True), "text": processor.decode(ids)})
with open(out_file, "w", encoding="utf-8") as f:
    json.dump(results, f)
