// `text`: a byte-level language-modelling dataset over a file or a directory of text files
// (default: the fortunes corpus of Debian's `fortunes` package). Samples are fixed windows at
// fixed offsets, so the sampler alone decides the order (and N ranks see exactly what one
// device sees).
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <ATen/ATen.h>

#include "data.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::data {

namespace {

namespace fs = std::filesystem;

/// Bytes as printable UTF-8 text: valid UTF-8 sequences, newlines and tabs are kept; any
/// other control byte or invalid sequence becomes U+FFFD, so a terminal never sees raw junk.
std::string decode_bytes(const std::string& bytes) {
  static const std::string kReplacement = "\xEF\xBF\xBD";
  std::string out;
  const std::size_t n = bytes.size();
  auto byte = [&](std::size_t i) { return static_cast<unsigned char>(bytes[i]); };
  for (std::size_t i = 0; i < n;) {
    const unsigned char c = byte(i);
    if (c < 0x80) {
      const bool printable = (c >= 0x20 && c != 0x7F) || c == '\n' || c == '\t';
      if (printable) out += static_cast<char>(c);
      else out += kReplacement;
      ++i;
      continue;
    }
    // Length and the allowed range of the second byte (RFC 3629: no overlongs, no surrogates).
    std::size_t length = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) length = 2;
    else if (c == 0xE0) length = 3, lo = 0xA0;
    else if (c >= 0xE1 && c <= 0xEC) length = 3;
    else if (c == 0xED) length = 3, hi = 0x9F;
    else if (c >= 0xEE && c <= 0xEF) length = 3;
    else if (c == 0xF0) length = 4, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3) length = 4;
    else if (c == 0xF4) length = 4, hi = 0x8F;
    bool valid = length > 0 && i + length <= n;
    for (std::size_t k = 1; valid && k < length; ++k) {
      const unsigned char b = byte(i + k);
      valid = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    }
    if (valid) {
      out.append(bytes, i, length);
      i += length;
    } else {
      out += kReplacement;
      ++i;
    }
  }
  return out;
}

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
    const std::int64_t n = size();
    for (std::int64_t i : indices) {
      TESSERA_CHECK(i >= 0 && i < n, "text: sample index ", i, " is out of range [0, ", n, ")");
      windows.push_back(bytes_.narrow(0, i * stride_, block_size_ + 1));
    }
    at::Tensor batch = at::stack(windows).to(at::kLong);
    return sdk::Batch{batch.narrow(1, 0, block_size_).contiguous(), batch.narrow(1, 1, block_size_).contiguous()};
  }

 private:
  at::Tensor bytes_;
  std::int64_t block_size_, stride_;
};

class Text final : public sdk::DataModule {
 public:
  explicit Text(const sdk::Options& o)
      : options_(o),
        path_(o.get_string({"path", "the text file, or a folder of text files, read as bytes (byte-level tokens)"},
                           "/usr/share/games/fortunes")),
        block_size_(
            o.get_int({"block_size", "sequence length of a sample, at most the model's [model] block_size"}, 128, 1)),
        stride_(
            o.get_int({"stride", "bytes between the starts of consecutive samples (default block_size: no overlap)"},
                      block_size_, 1)),
        val_fraction_(
            o.get_double({"val_fraction", "the share of the text held out for validation (its end)"}, 0.05, 0.0, 0.5)),
        test_fraction_(o.get_double({"test_fraction", "the share of the text held out for `tessera test` (after the "
                                                      "validation part); 0: no test split"},
                                    0.0, 0.0, 0.5)),
        prompt_(o.get_string({"prompt", "the text predict continues"}, "Q: ")) {
    TESSERA_CHECK(!prompt_.empty(), o.locate("prompt"), " must not be empty");
  }

  void setup(const std::string& stage) override {
    // Predicting needs only the prompt: no corpus has to be installed for it.
    // Held-out data is never reported under another split's name.
    TESSERA_CHECK(stage != "test" || test_fraction_ > 0, "tessera test evaluates the data's test split, and the text ",
                  "plugin has none here: set ", options_.locate("test_fraction"), " (e.g. 0.05: the last 5% of the ",
                  "text, after the validation part)");
    if (stage == "predict" || bytes_.defined()) return;
    std::string text = read_corpus();
    at::Tensor bytes = at::empty({static_cast<std::int64_t>(text.size())}, at::kByte);
    std::memcpy(bytes.data_ptr(), text.data(), text.size());
    const auto at_fraction = [&](double f) { return static_cast<std::int64_t>(static_cast<double>(text.size()) * f); };
    const std::int64_t split = at_fraction(1.0 - val_fraction_ - test_fraction_);
    const std::int64_t test_start = test_fraction_ > 0 ? at_fraction(1.0 - test_fraction_) : bytes.numel();
    auto train = std::make_shared<TextWindows>(bytes.narrow(0, 0, split), block_size_, stride_);
    auto val = std::make_shared<TextWindows>(bytes.narrow(0, split, test_start - split), block_size_, block_size_);
    if (test_fraction_ > 0) {
      test_ = std::make_shared<TextWindows>(bytes.narrow(0, test_start, bytes.numel() - test_start), block_size_,
                                            block_size_);
      TESSERA_CHECK(test_->size() > 0, options_.locate("test_fraction"), " = ", test_fraction_, " leaves ",
                    bytes.numel() - test_start, " bytes in the test part of \"", path_, "\", too few for one window ",
                    "of block_size + 1 = ", block_size_ + 1, " bytes; raise test_fraction");
    }
    const char* hint = " bytes, too few for one window of block_size + 1 = ";
    TESSERA_CHECK(train->size() > 0, options_.locate("path"), " = \"", path_, "\": the training part holds ", split, hint,
                  block_size_ + 1, " bytes");
    TESSERA_CHECK(val_fraction_ == 0.0 || val->size() > 0, options_.locate("val_fraction"), " = ", val_fraction_,
                  " leaves ", bytes.numel() - split, hint, block_size_ + 1, " bytes in the validation part of \"", path_,
                  "\"; raise val_fraction or set it to 0");
    bytes_ = bytes;
    train_ = train;
    val_ = val;
  }
  std::shared_ptr<sdk::Dataset> train_dataset() override { return train_; }
  std::shared_ptr<sdk::Dataset> val_dataset() override { return val_; }
  std::shared_ptr<sdk::Dataset> test_dataset() override { return test_; }  // null without test_fraction
  std::shared_ptr<sdk::Dataset> predict_dataset() override {  // the prompt's bytes are its ids
    const at::Tensor bytes = at::from_blob(prompt_.data(), {1, static_cast<std::int64_t>(prompt_.size())}, at::kByte);
    return std::make_shared<PromptDataset>(bytes.to(at::kLong));
  }

  std::string describe_prediction(const sdk::Batch&, const at::Tensor& output) const override {
    at::Tensor tokens = output.to(at::kLong).clamp(0, 255).to(at::kByte).cpu().contiguous();
    if (tokens.dim() < 2) tokens = tokens.reshape({1, -1});
    std::string text;
    for (std::int64_t row = 0; row < tokens.size(0); ++row) {
      if (row > 0) text += "\n---\n";
      const at::Tensor r = tokens[row].contiguous();
      text += decode_bytes(std::string(static_cast<const char*>(r.data_ptr()), static_cast<std::size_t>(r.numel())));
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
      TESSERA_CHECK(!fs::exists(path_, ec) || fs::is_directory(path_, ec), options_.locate("path"), " = \"", path_,
                    "\" is neither a regular file nor a directory (a device, FIFO or socket): give a text file or "
                    "a directory of text files");
      TESSERA_CHECK(fs::is_directory(path_, ec), options_.locate("path"), " = \"", path_,
                    "\": no such file or directory",
                    "; give a text file or a directory of text files (the default, /usr/share/games/fortunes, "
                    "comes with Debian's `fortunes` package: apt-get install fortunes)");
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
      int error = in.is_open() ? 0 : errno;
      bool failed = !in.is_open();
      try {
        if (!failed) text.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      } catch (const std::exception&) {  // libstdc++ throws from a failed read(2) (a /proc file, an I/O error)
        failed = true, error = errno;
      }
      TESSERA_CHECK(!failed && !in.bad(), options_.locate("path"), " = \"", path_, "\": cannot read ", file.string(),
                    error != 0 ? std::string(": ") + std::strerror(error) : std::string(),
                    ": give a text file or a directory of text files");
    }
    return text;
  }

  sdk::Options options_;
  std::string path_;
  std::int64_t block_size_, stride_;
  double val_fraction_, test_fraction_;
  std::string prompt_;
  at::Tensor bytes_;
  std::shared_ptr<sdk::Dataset> train_, val_, test_;
};

}  // namespace

sdk::PluginEntry text_entry() {
  return sdk::plugin_entry<Text>("text", "byte-level language modelling over text files (default: fortunes)");
}

}  // namespace tessera::data
