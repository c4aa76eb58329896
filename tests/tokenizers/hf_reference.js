// The reference side of tokenizer_test: Hugging Face's own `tokenizers` library (its Node
// binding) trains BPE tokenizer.json files shaped like GPT-2's, Llama 3's, Llama 2's and a
// Metaspace one, then encodes and decodes the corpus with them.
// usage: node hf_reference.js WORKDIR   (WORKDIR holds train.txt and corpus.json; writes
// <name>.json tokenizers and <name>.expected.json results)
'use strict'
const fs = require('fs')
const path = require('path')
const hf = require('tokenizers')

const dir = process.argv[2]
const corpus = JSON.parse(fs.readFileSync(path.join(dir, 'corpus.json'), 'utf8'))
const trainFile = path.join(dir, 'train.txt')

const LLAMA3_PATTERN =
  "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"

// The trainer the binding exposes is BpeTrainer's default (vocabulary 30000, alphabet = the
// characters seen); GPT-2's and Llama 2's files carry the full byte alphabet, so the test adds
// what the training text lacked, as `initial_alphabet` does in Python.
function addToVocab(json, tokens) {
  const vocab = json.model.vocab
  let next = Math.max(...Object.values(vocab), ...json.added_tokens.map((t) => t.id)) + 1
  for (const t of tokens) if (!(t in vocab)) vocab[t] = next++
}

function specials(tok, list) {
  tok.addAddedTokens(list.map(([content, special, options]) => new hf.AddedToken(content, special, options || {})))
}

function byteLevel(name, { regexSplit, stringMerges, nfc }) {
  const tok = new hf.Tokenizer(hf.BPE.empty())
  tok.setPreTokenizer(hf.byteLevelPreTokenizer(false, true))
  if (nfc) tok.setNormalizer(hf.nfcNormalizer())
  tok.train([trainFile])
  const json = JSON.parse(saveToString(tok))
  addToVocab(json, hf.byteLevelAlphabet())
  // The binding has no constructor for the ByteLevel decoder; the file names it as GPT-2's does.
  json.decoder = { type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true }
  // Llama 3's layout; the binding's splitPreTokenizer would take the pattern as a literal string.
  if (regexSplit) {
    json.pre_tokenizer = {
      type: 'Sequence',
      pretokenizers: [
        { type: 'Split', pattern: { Regex: LLAMA3_PATTERN }, behavior: 'Isolated', invert: false },
        { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false },
      ],
    }
    json.model.ignore_merges = true
  }
  if (stringMerges) json.model.merges = json.model.merges.map((m) => (Array.isArray(m) ? m.join(' ') : m))
  else json.model.merges = json.model.merges.map((m) => (Array.isArray(m) ? m : m.split(' ')))
  return finish(name, json, (t) => {
    specials(t, [
      ['<|begin_of_text|>', true],
      ['<|end_of_text|>', true],
      ['<|endoftext|>', true],
      ['[MASK]', true, { leftStrip: true, rightStrip: true }],
      ['<tool>', true, { singleWord: true }],
      ['xyzzy', false],
      ['plugh', false, { normalized: false, singleWord: true }],
    ])
    t.setPostProcessor(
      hf.sequenceProcessing([
        hf.byteLevelProcessing(false),
        hf.templateProcessing('<|begin_of_text|> $A <|end_of_text|>', undefined, [
          ['<|begin_of_text|>', t.tokenToId('<|begin_of_text|>')],
          ['<|end_of_text|>', t.tokenToId('<|end_of_text|>')],
        ]),
      ]),
    )
  })
}

// Llama 2's HF layout: no pre-tokenizer, Prepend+Replace normalizer, byte fallback, SentencePiece-like decoder.
function metaspace(name, { llama2 }) {
  const tok = new hf.Tokenizer(hf.BPE.empty())
  tok.setPreTokenizer(hf.metaspacePreTokenizer('▁', 'always', true))
  tok.setDecoder(hf.metaspaceDecoder('▁', 'always', true))
  tok.train([trainFile])
  const json = JSON.parse(saveToString(tok))
  const bytes = []
  for (let b = 0; b < 256; b++) bytes.push('<0x' + b.toString(16).toUpperCase().padStart(2, '0') + '>')
  addToVocab(json, ['<unk>', ...bytes])
  Object.assign(json.model, { byte_fallback: true, unk_token: '<unk>', fuse_unk: true })
  if (llama2) {
    json.normalizer = {
      type: 'Sequence',
      normalizers: [
        { type: 'Prepend', prepend: '▁' },
        { type: 'Replace', pattern: { String: ' ' }, content: '▁' },
      ],
    }
    json.pre_tokenizer = null
    json.decoder = {
      type: 'Sequence',
      decoders: [
        { type: 'Replace', pattern: { String: '▁' }, content: ' ' },
        { type: 'ByteFallback' },
        { type: 'Fuse' },
        { type: 'Strip', content: ' ', start: 1, stop: 0 },
      ],
    }
  } else {
    json.pre_tokenizer.prepend_scheme = 'first'
    json.decoder = { type: 'Sequence', decoders: [{ type: 'ByteFallback' }, json.decoder, { type: 'Fuse' }] }
  }
  return finish(name, json, (t) => {
    specials(t, [
      ['<s>', true],
      ['</s>', true],
      ['<unk>', true],
    ])
    t.setPostProcessor(hf.templateProcessing('<s> $A', undefined, [['<s>', t.tokenToId('<s>')]]))
  })
}

function saveToString(tok) {
  const file = path.join(dir, '.scratch.json')
  tok.save(file)
  return fs.readFileSync(file, 'utf8')
}

// Reloads the edited JSON into the library (it validates it), applies `more`, saves the final
// file and records the library's encodings and decodings of the corpus.
async function finish(name, json, more) {
  let tok = hf.Tokenizer.fromString(JSON.stringify(json))
  more(tok)
  const file = path.join(dir, name + '.json')
  tok.save(file, true)
  tok = hf.Tokenizer.fromFile(file)
  const results = []
  // In batches: one call per text per operation spends its time crossing into Rust.
  for (let start = 0; start < corpus.length; start += 512) {
    const texts = corpus.slice(start, start + 512)
    const plain = await tok.encodeBatch(texts, { addSpecialTokens: false })
    const special = await tok.encodeBatch(texts, { addSpecialTokens: true })
    const specialIds = special.map((e) => e.getIds())
    const decoded = await tok.decodeBatch(specialIds, false)
    const skipped = await tok.decodeBatch(specialIds, true)
    for (let i = 0; i < texts.length; i++) {
      results.push({ ids: plain[i].getIds(), ids_special: specialIds[i], text: decoded[i], text_skip: skipped[i] })
    }
  }
  fs.writeFileSync(path.join(dir, name + '.expected.json'), JSON.stringify(results))
}

;(async () => {
  await byteLevel('llama3_style', { regexSplit: true, stringMerges: false, nfc: false })
  await byteLevel('gpt2_style', { regexSplit: false, stringMerges: true, nfc: true })
  await metaspace('llama2_style', { llama2: true })
  await metaspace('metaspace_style', { llama2: false })
})().catch((e) => {
  console.error(e)
  process.exit(1)
})
