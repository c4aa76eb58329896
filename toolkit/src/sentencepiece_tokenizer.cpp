// SentencePiece models through the library itself (Debian's libsentencepiece), so ids equal
// `spm_encode` and python3-sentencepiece by construction. The library runs in its own link-map
// namespace: see [Note: SentencePiece in its own namespace] in sentencepiece_shim.h.
#include <dlfcn.h>

#include <algorithm>
#include <exception>
#include <filesystem>

#include "sentencepiece_shim.h"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/tokenizer.hpp"
#include "utf8.hpp"

namespace tessera::toolkit {
namespace {

// The shim's entry points, resolved once per process.
struct Shim {
  decltype(&tspp_load) load;
  decltype(&tspp_free) free;
  decltype(&tspp_release) release;
  decltype(&tspp_encode) encode;
  decltype(&tspp_decode) decode;
  decltype(&tspp_piece_size) piece_size;
  decltype(&tspp_special_ids) special_ids;
  decltype(&tspp_is_special) is_special;
  decltype(&tspp_piece) piece;
  decltype(&tspp_train) train;

  std::string take_error(char* error) const {
    std::string text = error != nullptr ? error : "unknown error";
    release(error);
    return text;
  }
};

const Shim& shim() {
  static const Shim loaded = [] {
    Dl_info self{};
    dladdr(reinterpret_cast<void*>(&shim), &self);
    const auto path = std::filesystem::path(self.dli_fname).parent_path() / "libtessera_sentencepiece.so";
    void* handle = dlmopen(LM_ID_NEWLM, path.c_str(), RTLD_NOW | RTLD_LOCAL);
    TESSERA_CHECK(handle != nullptr, "cannot load SentencePiece support ", path.string(), ": ", dlerror(),
                  " (it is built and installed beside libtessera_toolkit)");
    Shim s{};
    const auto bind = [&](auto& slot, const char* name) {
      slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(dlsym(handle, name));
      TESSERA_CHECK(slot != nullptr, path.string(), " lacks ", name);
    };
    bind(s.load, "tspp_load");
    bind(s.free, "tspp_free");
    bind(s.release, "tspp_release");
    bind(s.encode, "tspp_encode");
    bind(s.decode, "tspp_decode");
    bind(s.piece_size, "tspp_piece_size");
    bind(s.special_ids, "tspp_special_ids");
    bind(s.is_special, "tspp_is_special");
    bind(s.piece, "tspp_piece");
    bind(s.train, "tspp_train");
    return s;
  }();
  return loaded;
}

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(std::string_view model_proto, const std::string& source) : shim_(shim()), source_(source) {
    char* error = nullptr;
    model_ = shim_.load(model_proto.data(), model_proto.size(), &error);
    TESSERA_CHECK(model_ != nullptr, "tokenizer ", source,
                  " is neither a Hugging Face tokenizer.json nor a SentencePiece model (SentencePiece says: ",
                  shim_.take_error(error), ")");
    size_ = shim_.piece_size(model_);
    if (size_ <= 0) shim_.free(model_);
    TESSERA_CHECK(size_ > 0, "SentencePiece model ", source, " has an empty vocabulary");
    int unk = -1;
    shim_.special_ids(model_, &bos_, &eos_, &pad_, &unk);
    for (int id = 0; id < size_; ++id)
      if (shim_.is_special(model_, id)) specials_.push_back({shim_.piece(model_, id), id});
    // Longest first: at one position the longer piece wins, as in Hugging Face's trie.
    std::stable_sort(specials_.begin(), specials_.end(),
                     [](const Special& a, const Special& b) { return a.piece.size() > b.piece.size(); });
  }
  ~SentencePieceTokenizer() override { shim_.free(model_); }

  // Hugging Face's Llama tokenizers split a text on its special tokens first, so "<s>[INST]" in a
  // rendered chat is BOS, then "[INST]" encoded alone (SentencePiece's dummy prefix included:
  // "▁["); SentencePiece never makes a control symbol from text and would spell "<s>" out.
  std::vector<TokenId> encode(std::string_view text, bool add_special_tokens) const override {
    check_utf8(text, source_);
    std::vector<TokenId> out;
    // Llama's (and spm's --add_bos) convention: BOS first, no EOS (data prepare appends EOS per document).
    if (add_special_tokens && bos_ >= 0) out.push_back(bos_);
    // Each special's next occurrence, searched again only once the scan has passed it: one pass
    // over the text per special, however many of them the text spells.
    constexpr std::size_t none = std::string_view::npos;
    std::vector<std::size_t> next(specials_.size());
    for (std::size_t i = 0; i < specials_.size(); ++i) next[i] = text.find(specials_[i].piece);
    for (std::size_t begin = 0;;) {
      std::size_t at = none, hit = 0;
      for (std::size_t i = 0; i < specials_.size(); ++i) {
        if (next[i] != none && next[i] < begin) next[i] = text.find(specials_[i].piece, begin);
        if (next[i] < at) at = next[i], hit = i;  // strict: the longer piece at one position
      }
      encode_plain(text.substr(begin, (at == none ? text.size() : at) - begin), out);
      if (at == none) return out;
      out.push_back(specials_[hit].id);
      begin = at + specials_[hit].piece.size();
    }
  }

  std::string decode(const std::vector<TokenId>& ids, bool skip_special_tokens) const override {
    std::vector<int32_t> kept;
    kept.reserve(ids.size());
    for (const TokenId id : ids) {
      TESSERA_CHECK(id >= 0 && id < size_, "token id ", id, " is outside SentencePiece ", source_,
                    "'s vocabulary [0, ", size_, ")");
      // Control symbols (<s>, </s>, <pad>) always decode to nothing in SentencePiece; skipping
      // special tokens also drops <unk>, which otherwise reads " ⁇ ".
      if (skip_special_tokens && shim_.is_special(model_, id)) continue;
      kept.push_back(id);
    }
    char* text = nullptr;
    size_t size = 0;
    char* error = nullptr;
    TESSERA_CHECK(shim_.decode(model_, kept.data(), kept.size(), &text, &size, &error) == 0, "SentencePiece ", source_,
                  " could not decode: ", shim_.take_error(error));
    std::string out(text, size);
    shim_.release(text);
    return out;
  }

  std::int64_t vocab_size() const override { return size_; }
  std::optional<TokenId> bos_id() const override { return optional_id(bos_); }
  std::optional<TokenId> eos_id() const override { return optional_id(eos_); }
  std::optional<TokenId> pad_id() const override { return optional_id(pad_); }

  std::vector<std::string> special_tokens() const override {
    std::vector<std::string> tokens;
    for (int id = 0; id < size_; ++id) {
      if (shim_.is_special(model_, id)) tokens.emplace_back(shim_.piece(model_, id));
    }
    return tokens;
  }

  std::string kind() const override { return "sentencepiece"; }

 private:
  static std::optional<TokenId> optional_id(int id) {
    return id >= 0 ? std::optional<TokenId>(id) : std::nullopt;
  }

  void encode_plain(std::string_view text, std::vector<TokenId>& out) const {
    if (text.empty()) return;
    int32_t* ids = nullptr;
    size_t count = 0;
    char* error = nullptr;
    TESSERA_CHECK(shim_.encode(model_, text.data(), text.size(), &ids, &count, &error) == 0, "SentencePiece ", source_,
                  " could not encode: ", shim_.take_error(error));
    out.insert(out.end(), ids, ids + count);
    shim_.release(ids);
  }

  struct Special {
    std::string piece;  ///< its text ("<s>")
    TokenId id;
  };

  const Shim& shim_;
  TsppModel* model_ = nullptr;
  std::string source_;
  int size_ = 0, bos_ = -1, eos_ = -1, pad_ = -1;
  std::vector<Special> specials_;  ///< control and unknown pieces, longest first
};

struct LineSource {
  const std::function<std::optional<std::string_view>()>* next;
  std::exception_ptr failure;
};

// Called from the shim's namespace: no exception may cross, so one is kept and rethrown after.
int next_line(void* context, const char** line, size_t* size) {
  auto* source = static_cast<LineSource*>(context);
  try {
    const auto value = (*source->next)();
    if (!value) return 0;
    *line = value->data();
    *size = value->size();
    return 1;
  } catch (...) {
    source->failure = std::current_exception();
    return 0;
  }
}

}  // namespace

std::unique_ptr<Tokenizer> parse_sentencepiece_tokenizer(std::string_view model_proto, const std::string& source) {
  return std::make_unique<SentencePieceTokenizer>(model_proto, source);
}

void train_sentencepiece(const std::vector<std::pair<std::string, std::string>>& flags,
                         const std::function<std::optional<std::string_view>()>& next) {
  std::vector<const char*> keys, values;
  for (const auto& [key, value] : flags) {
    keys.push_back(key.c_str());
    values.push_back(value.c_str());
  }
  LineSource source{&next, nullptr};
  char* error = nullptr;
  const int rc = shim().train(keys.data(), values.data(), keys.size(), &next_line, &source, &error);
  if (source.failure) {
    if (error != nullptr) shim().release(error);
    std::rethrow_exception(source.failure);
  }
  TESSERA_CHECK(rc == 0, "SentencePiece training failed: ", shim().take_error(error));
}

}  // namespace tessera::toolkit
