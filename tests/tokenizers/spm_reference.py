"""The reference side of tokenizer_test for SentencePiece: python3-sentencepiece encodes and
decodes the corpus with a model `tessera tokenizer train` wrote, splitting each text on the
special tokens first as Hugging Face's tokenizers do (PreTrainedTokenizer.tokenize).
usage: /usr/bin/python3 spm_reference.py MODEL CORPUS.json OUT.json"""
import json
import re
import sys

import sentencepiece

model, corpus_file, out_file = sys.argv[1:4]
processor = sentencepiece.SentencePieceProcessor(model_file=model)
special = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())
           if processor.is_control(i) or processor.is_unknown(i)}
# Leftmost, and the longest at one position (Hugging Face's trie).
splitter = re.compile("|".join(re.escape(p) for p in sorted(special, key=len, reverse=True)))


def encode(text, add_bos=False):
    """The special tokens' ids where the text spells them; each piece between encoded alone."""
    ids, begin = [processor.bos_id()] if add_bos else [], 0
    for match in splitter.finditer(text):
        if match.start() > begin:
            ids += processor.encode(text[begin:match.start()])
        ids.append(special[match.group()])
        begin = match.end()
    if begin < len(text):
        ids += processor.encode(text[begin:])
    return ids

with open(corpus_file, encoding="utf-8") as f:
    corpus = json.load(f)
results = []
for text in corpus:
    ids = encode(text)
    results.append({"ids": ids, "ids_special": encode(text, add_bos=True), "text": processor.decode(ids)})
with open(out_file, "w", encoding="utf-8") as f:
    json.dump(results, f)
