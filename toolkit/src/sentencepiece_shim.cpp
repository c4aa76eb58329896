// libtessera_sentencepiece.so: SentencePiece behind a C interface, loaded in its own link-map
// namespace (see [Note: SentencePiece in its own namespace] in sentencepiece_shim.h).
#include "sentencepiece_shim.h"

#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#define TSPP_EXPORT __attribute__((visibility("default")))

struct TsppModel {
  sentencepiece::SentencePieceProcessor processor;
};

namespace {

char* copy(const std::string& text) {
  char* out = static_cast<char*>(std::malloc(text.size() + 1));
  std::memcpy(out, text.data(), text.size());
  out[text.size()] = '\0';
  return out;
}

class CallbackLines final : public sentencepiece::SentenceIterator {
 public:
  CallbackLines(int (*next_line)(void*, const char**, size_t*), void* context) : next_(next_line), context_(context) {
    Next();
  }
  bool done() const override { return done_; }
  void Next() override {
    const char* line = nullptr;
    size_t size = 0;
    done_ = next_(context_, &line, &size) == 0;
    if (!done_) value_.assign(line, size);
  }
  const std::string& value() const override { return value_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  int (*next_)(void*, const char**, size_t*);
  void* context_;
  std::string value_;
  bool done_ = false;
};

}  // namespace

extern "C" {

TSPP_EXPORT TsppModel* tspp_load(const char* proto, size_t size, char** error) {
  try {
    auto* model = new TsppModel;
    const auto status = model->processor.LoadFromSerializedProto({proto, size});
    if (status.ok()) return model;
    *error = copy(status.ToString());
    delete model;
  } catch (const std::exception& e) {
    *error = copy(e.what());
  }
  return nullptr;
}

TSPP_EXPORT void tspp_free(TsppModel* model) { delete model; }
TSPP_EXPORT void tspp_release(void* pointer) { std::free(pointer); }

TSPP_EXPORT int tspp_encode(const TsppModel* model, const char* text, size_t size, int32_t** ids, size_t* count,
                            char** error) {
  try {
    std::vector<int> out;
    const auto status = model->processor.Encode({text, size}, &out);
    if (!status.ok()) {
      *error = copy(status.ToString());
      return 1;
    }
    *ids = static_cast<int32_t*>(std::malloc(sizeof(int32_t) * (out.size() + 1)));
    for (size_t i = 0; i < out.size(); ++i) (*ids)[i] = out[i];
    *count = out.size();
    return 0;
  } catch (const std::exception& e) {
    *error = copy(e.what());
    return 1;
  }
}

TSPP_EXPORT int tspp_decode(const TsppModel* model, const int32_t* ids, size_t count, char** text, size_t* size,
                            char** error) {
  try {
    std::string out;
    const auto status = model->processor.Decode(std::vector<int>(ids, ids + count), &out);
    if (!status.ok()) {
      *error = copy(status.ToString());
      return 1;
    }
    *text = copy(out);
    *size = out.size();
    return 0;
  } catch (const std::exception& e) {
    *error = copy(e.what());
    return 1;
  }
}

TSPP_EXPORT int tspp_piece_size(const TsppModel* model) { return model->processor.GetPieceSize(); }

TSPP_EXPORT void tspp_special_ids(const TsppModel* model, int* bos, int* eos, int* pad, int* unk) {
  *bos = model->processor.bos_id();
  *eos = model->processor.eos_id();
  *pad = model->processor.pad_id();
  *unk = model->processor.unk_id();
}

TSPP_EXPORT int tspp_is_special(const TsppModel* model, int id) {
  return model->processor.IsControl(id) || model->processor.IsUnknown(id) ? 1 : 0;
}

TSPP_EXPORT const char* tspp_piece(const TsppModel* model, int id) { return model->processor.IdToPiece(id).c_str(); }

TSPP_EXPORT int tspp_train(const char* const* keys, const char* const* values, size_t count,
                           int (*next_line)(void*, const char**, size_t*), void* context, char** error) {
  try {
    std::unordered_map<std::string, std::string> kwargs;
    for (size_t i = 0; i < count; ++i) kwargs[keys[i]] = values[i];
    CallbackLines lines(next_line, context);
    const auto status = sentencepiece::SentencePieceTrainer::Train(kwargs, &lines);
    if (status.ok()) return 0;
    *error = copy(status.ToString());
  } catch (const std::exception& e) {
    *error = copy(e.what());
  }
  return 1;
}

}  // extern "C"
