// `text`: a byte-level language-modelling dataset over a file or a directory of text files
// (default: the fortunes corpus of Debian's `fortunes` package). Samples are fixed windows at
// fixed offsets, so the sampler alone decides the order (and N ranks see exactly what one
// device sees).
#include <algorithm>
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>

#include "data.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::data {

namespace {

namespace fs = std::filesystem;

/// Windows of block_size + 1 bytes starting every `stride` bytes of `bytes`.
class TextWindows final : public sdk::Dataset {
 public:
  TextWindows(at::Tensor bytes, std::int64_t block_size, std::int64_t stride)
      : bytes_(std::move(bytes)), block_size_(block_size), stride_(stride) {}
  std::int64_t size() const override {
    return bytes_.numel() <= block_size_ ? 0 : (bytes_.numel() - block_size_ - 1) / stride_ + 1;
  }
  sdk::Batch get_batch(const std::vector<std::int64_t>& indices) const override {
    std::vector<at::Tensor> windows;
    windows.reserve(indices.size());
    for (std::int64_t i : indices) windows.push_back(bytes_.narrow(0, i * stride_, block_size_ + 1));
    at::Tensor batch = at::stack(windows).to(at::kLong);
    return sdk::Batch{batch.narrow(1, 0, block_size_).contiguous(), batch.narrow(1, 1, block_size_).contiguous()};
  }

 private:
  at::Tensor bytes_;
  std::int64_t block_size_, stride_;
};

/// One batch of one sample: the encoded prompt.
class Prompt final : public sdk::Dataset {
 public:
  explicit Prompt(const std::string& text) : text_(text) {}
  std::int64_t size() const override { return 1; }
  sdk::Batch get_batch(const std::vector<std::int64_t>&) const override {
    at::Tensor tokens = at::empty({1, static_cast<std::int64_t>(text_.size())}, at::kLong);
    for (std::size_t i = 0; i < text_.size(); ++i) tokens[0][i] = static_cast<unsigned char>(text_[i]);
    return sdk::Batch{tokens, {}};
  }

 private:
  std::string text_;
};

class Text final : public sdk::DataModule {
 public:
  explicit Text(const sdk::Options& o)
      : options_(o),
        path_(o.get_string("path", "/usr/share/games/fortunes")),
        block_size_(o.get_int("block_size", 128, 1)),
        stride_(o.get_int("stride", block_size_, 1)),
        val_fraction_(o.get_double("val_fraction", 0.05, 0.0, 0.5)),
        prompt_(o.get_string("prompt", "Q: ")) {
    TESSERA_CHECK(!prompt_.empty(), o.locate("prompt"), " must not be empty");
  }

  void setup(const std::string&) override {
    if (bytes_.defined()) return;
    std::string text = read_corpus();
    TESSERA_CHECK(static_cast<std::int64_t>(text.size()) > 4 * (block_size_ + 1), "[data] path = \"", path_,
                  "\" holds only ", text.size(), " bytes: too little for block_size ", block_size_);
    bytes_ = at::empty({static_cast<std::int64_t>(text.size())}, at::kByte);
    std::memcpy(bytes_.data_ptr(), text.data(), text.size());
    std::int64_t split = static_cast<std::int64_t>(static_cast<double>(text.size()) * (1.0 - val_fraction_));
    train_ = std::make_shared<TextWindows>(bytes_.narrow(0, 0, split), block_size_, stride_);
    val_ = std::make_shared<TextWindows>(bytes_.narrow(0, split, bytes_.numel() - split), block_size_, block_size_);
  }
  std::shared_ptr<sdk::Dataset> train_dataset() override { return train_; }
  std::shared_ptr<sdk::Dataset> val_dataset() override { return val_; }
  std::shared_ptr<sdk::Dataset> test_dataset() override { return val_; }  // the held-out tail
  std::shared_ptr<sdk::Dataset> predict_dataset() override { return std::make_shared<Prompt>(prompt_); }

  std::string describe_prediction(const sdk::Batch&, const at::Tensor& output) const override {
    std::string text;
    at::Tensor tokens = output.reshape({-1}).to(at::kLong).cpu();
    for (std::int64_t i = 0; i < tokens.numel(); ++i) {
      auto c = static_cast<unsigned char>(tokens[i].item<std::int64_t>());
      text += (c == '\n' || c == '\t' || (c >= 32 && c < 127) || c >= 128) ? static_cast<char>(c) : '?';
    }
    return text;
  }
  std::string item_unit() const override { return "tokens"; }

 private:
  std::string read_corpus() const {
    std::vector<fs::path> files;
    std::error_code ec;
    if (fs::is_regular_file(path_, ec)) {
      files.push_back(path_);
    } else {
      TESSERA_CHECK(fs::is_directory(path_, ec), options_.locate("path"), " = \"", path_,
                    "\": no such file or directory",
                    path_ == "/usr/share/games/fortunes" ? " (the default corpus comes with Debian's `fortunes` package: "
                                                           "apt-get install fortunes)"
                                                         : "");
      // Plain fortune files only: not the strfile indexes (*.dat), their UTF-8 twins (*.u8)
      // or symlinks, so each text is read once.
      for (const auto& entry : fs::directory_iterator(path_)) {
        const fs::path& p = entry.path();
        if (entry.is_symlink() || !entry.is_regular_file() || p.extension() == ".dat" || p.extension() == ".u8")
          continue;
        files.push_back(p);
      }
      std::sort(files.begin(), files.end());
      TESSERA_CHECK(!files.empty(), options_.locate("path"), " = \"", path_, "\" contains no text files");
    }
    std::string text;
    for (const auto& file : files) {
      std::ifstream in(file, std::ios::binary);
      text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
    return text;
  }

  sdk::Options options_;
  std::string path_;
  std::int64_t block_size_, stride_;
  double val_fraction_;
  std::string prompt_;
  at::Tensor bytes_;
  std::shared_ptr<sdk::Dataset> train_, val_;
};

}  // namespace

sdk::PluginEntry text_entry() {
  return sdk::plugin_entry<Text>("text", "byte-level language modelling over text files (default: fortunes)");
}

}  // namespace tessera::data
