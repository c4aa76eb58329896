// The shipped data plugins through the real loader: `text` windows, splits, directory
// reading and decoding; `fashion_mnist` on gzip IDX files written here, and every error path.
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include <zlib.h>

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "plugin_loader.hpp"
#include "tessera/sdk/data.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/toml_options.hpp"
#include "errors.hpp"
#include "multiprocess.hpp"

namespace {

namespace fs = std::filesystem;
namespace sdk = tessera::sdk;
using tessera::core::PluginLoader;

PluginLoader& loader() {
  static PluginLoader instance({PLUGIN_DIR});
  return instance;
}

std::shared_ptr<sdk::DataModule> make_data(const std::string& name, const std::string& toml_text) {
  sdk::Options options = sdk::make_options("data", "test.toml", toml::parse(toml_text));
  auto data = loader().create_as<sdk::DataModule>(sdk::PluginKind::data, name, options);
  options.check_all_used();
  return data;
}

/// A fresh directory under the temp dir, removed at the end of the test.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("tessera_data_test_" + std::string(info->name()) + "_" + std::to_string(::getpid()));
    tessera::testing::remove_dir(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { tessera::testing::remove_dir(path_); }
  const fs::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  fs::path path_;
};

void write_file(const fs::path& path, const std::string& content) {
  std::ofstream out(path, std::ios::binary);
  out << content;
}

using tessera::testing::error_of;

#define EXPECT_MENTIONS(text, part) EXPECT_NE((text).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (text)

std::vector<std::int64_t> row(const at::Tensor& t, std::int64_t i) {
  at::Tensor r = t[i].contiguous();
  return std::vector<std::int64_t>(r.data_ptr<std::int64_t>(), r.data_ptr<std::int64_t>() + r.numel());
}

std::vector<std::int64_t> bytes_of(const std::string& s, std::size_t start, std::size_t n) {
  std::vector<std::int64_t> out;
  for (std::size_t i = start; i < start + n; ++i) out.push_back(static_cast<unsigned char>(s[i]));
  return out;
}

// ---------------------------------------------------------------- text

TEST(Text, WindowsAreIndexedByStrideAndSplitAtTheEnd) {
  TempDir dir;
  std::string corpus;
  for (int i = 0; i < 100; ++i) corpus += static_cast<char>('!' + i % 90);
  write_file(dir.path() / "corpus.txt", corpus);
  auto data = make_data("text", "path = \"" + (dir.path() / "corpus.txt").string() +
                                    "\"\nblock_size = 4\nstride = 3\nval_fraction = 0.2\n");
  data->setup("fit");
  EXPECT_EQ(data->item_unit(), "tokens");

  // 80 training bytes: windows of 5 bytes at 0, 3, ..., 75.
  auto train = data->train_dataset();
  ASSERT_EQ(train->size(), (80 - 5) / 3 + 1);
  sdk::Batch batch = train->get_batch({0, 7, 25});
  ASSERT_EQ(batch.input.sizes(), (std::vector<std::int64_t>{3, 4}));
  EXPECT_EQ(batch.input.scalar_type(), at::kLong);
  EXPECT_EQ(row(batch.input, 0), bytes_of(corpus, 0, 4));
  EXPECT_EQ(row(batch.target, 0), bytes_of(corpus, 1, 4));
  EXPECT_EQ(row(batch.input, 1), bytes_of(corpus, 21, 4));
  EXPECT_EQ(row(batch.target, 2), bytes_of(corpus, 76, 4));  // the last window ends at byte 79

  // The last 20 bytes, in windows of block_size: never overlapping the training part.
  auto val = data->val_dataset();
  ASSERT_EQ(val->size(), (20 - 5) / 4 + 1);
  sdk::Batch v = val->get_batch({1});
  EXPECT_EQ(row(v.input, 0), bytes_of(corpus, 84, 4));
  EXPECT_EQ(row(v.target, 0), bytes_of(corpus, 85, 4));
  EXPECT_EQ(data->test_dataset(), nullptr) << "no test_fraction: no test split (never the validation part again)";
  EXPECT_MENTIONS(error_of([&] { data->setup("test"); }), "the text plugin has none here: set test.toml: [data] test_fraction");
  // test_fraction: the last bytes, after the validation part (which shrinks by nothing).
  auto split = make_data("text", "path = \"" + (dir.path() / "corpus.txt").string() +
                                     "\"\nblock_size = 4\nstride = 3\nval_fraction = 0.2\ntest_fraction = 0.1\n");
  split->setup("test");
  EXPECT_EQ(split->train_dataset()->size(), (70 - 5) / 3 + 1);
  EXPECT_EQ(split->val_dataset()->size(), (20 - 5) / 4 + 1);
  ASSERT_EQ(split->test_dataset()->size(), (10 - 5) / 4 + 1);
  EXPECT_EQ(row(split->test_dataset()->get_batch({0}).input, 0), bytes_of(corpus, 90, 4));

  // Order is the sampler's alone: the same index gives the same sample, whatever the batch.
  EXPECT_TRUE(at::equal(train->get_batch({7}).input, train->get_batch({3, 7}).input[1].unsqueeze(0)));
  EXPECT_MENTIONS(error_of([&] { train->get_batch({train->size()}); }), "out of range");
}

TEST(Text, DirectoryReadsPlainFilesInSortedOrderOnce) {
  TempDir dir;
  write_file(dir.path() / "b", "bbbbbbbbbbbbbbbbbbbb");
  write_file(dir.path() / "a", "aaaaaaaaaaaaaaaaaaaa");
  write_file(dir.path() / "a.dat", std::string("\x00\x01\x02\x03", 4));  // strfile index
  fs::create_symlink(dir.path() / "a", dir.path() / "a.u8");
  fs::create_directories(dir.path() / "off");
  write_file(dir.path() / "off" / "c", "cccccccccccccccccccc");
  auto data = make_data("text", "path = \"" + dir.str() + "\"\nblock_size = 39\nval_fraction = 0\n");
  data->setup("fit");
  ASSERT_EQ(data->train_dataset()->size(), 1);
  sdk::Batch batch = data->train_dataset()->get_batch({0});
  const std::string expected = std::string(20, 'a') + std::string(20, 'b');
  EXPECT_EQ(row(batch.input, 0), bytes_of(expected, 0, 39));
  EXPECT_EQ(row(batch.target, 0), bytes_of(expected, 1, 39));
}

TEST(Text, DefaultIsTheFortunesCorpus) {
  std::uintmax_t expected = 0;
  for (const auto& entry : fs::directory_iterator("/usr/share/games/fortunes")) {
    const auto ext = entry.path().extension();
    if (!entry.is_symlink() && entry.is_regular_file() && ext != ".dat" && ext != ".u8") expected += entry.file_size();
  }
  ASSERT_GT(expected, 1000000u) << "Debian's fortunes package should be installed";
  auto data = make_data("text", "block_size = 64\n");
  data->setup("fit");
  const std::int64_t train_bytes = static_cast<std::int64_t>(static_cast<double>(expected) * 0.95);
  EXPECT_EQ(data->train_dataset()->size(), (train_bytes - 65) / 64 + 1);
  EXPECT_EQ(data->val_dataset()->size(), (static_cast<std::int64_t>(expected) - train_bytes - 65) / 64 + 1);
  // Text, not strfile indexes: almost all bytes printable ASCII or whitespace.
  at::Tensor sample = data->train_dataset()->get_batch({0, 100, 1000}).input;
  at::Tensor printable = (sample.ge(32) & sample.lt(127)) | sample.eq('\n') | sample.eq('\t');
  EXPECT_GT(printable.to(at::kFloat).mean().item<double>(), 0.95);
}

TEST(Text, MissingPathNamesTheKeyAndThePackage) {
  auto data = make_data("text", "path = \"/nonexistent/corpus\"\n");
  const std::string e = error_of([&] { data->setup("fit"); });
  EXPECT_MENTIONS(e, "/nonexistent/corpus");
  EXPECT_MENTIONS(e, "[data] path");
  EXPECT_MENTIONS(e, "fortunes");
}

TEST(Text, TooShortCorpusIsAnError) {
  TempDir dir;
  write_file(dir.path() / "tiny.txt", "tiny");
  auto data = make_data("text", "path = \"" + (dir.path() / "tiny.txt").string() + "\"\nblock_size = 8\n");
  EXPECT_MENTIONS(error_of([&] { data->setup("fit"); }), "block_size + 1");
  write_file(dir.path() / "small.txt", std::string(40, 'x'));
  auto no_val = make_data("text", "path = \"" + (dir.path() / "small.txt").string() + "\"\nblock_size = 8\n");
  EXPECT_MENTIONS(error_of([&] { no_val->setup("fit"); }), "val_fraction");
}

TEST(Text, PromptIsEncodedAsBytesAndPredictionsDecode) {
  // Predicting reads no corpus: a missing path does not matter.
  auto data = make_data("text", "path = \"/nonexistent/corpus\"\nprompt = \"Hi \\u00e9\"\n");
  data->setup("predict");
  auto predict = data->predict_dataset();
  ASSERT_EQ(predict->size(), 1);
  sdk::Batch prompt = predict->get_batch({0});
  EXPECT_EQ(row(prompt.input, 0), (std::vector<std::int64_t>{'H', 'i', ' ', 0xC3, 0xA9}));

  // Valid UTF-8, newlines and tabs survive; stray continuation bytes, truncated sequences,
  // overlongs and control bytes become U+FFFD.
  const std::string replacement = "\xEF\xBF\xBD";
  at::Tensor output = at::tensor({'H', 'i', 0xC3, 0xA9, '\n', '\t', 0xFF, 0x80, 0x01, 0xC0, 0xAF, 'o', 0xE2, 0x82},
                                 at::kLong)
                          .view({1, -1});
  EXPECT_EQ(data->describe_prediction(prompt, output),
            "Hi\xC3\xA9\n\t" + replacement + replacement + replacement + replacement + replacement + "o" + replacement +
                replacement);
  // Several samples are separated.
  at::Tensor two = at::tensor({'a', 'b'}, at::kLong).view({2, 1});
  EXPECT_EQ(data->describe_prediction(prompt, two), "a\n---\nb");
}

// ---------------------------------------------------------------- fashion_mnist

std::string be32(std::uint32_t v) {
  return std::string{static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
                     static_cast<char>(v)};
}

void write_gzip(const fs::path& path, const std::string& content) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, content.data(), static_cast<unsigned>(content.size())), static_cast<int>(content.size()));
  gzclose(f);
}

std::string idx_images(std::uint32_t n, std::uint32_t magic = 0x803, std::int64_t drop = 0) {
  std::string s = be32(magic) + be32(n) + be32(28) + be32(28);
  for (std::uint32_t i = 0; i < n; ++i) s += std::string(28 * 28, static_cast<char>(i * 20));  // image i is flat
  return s.substr(0, s.size() - static_cast<std::size_t>(drop));
}

std::string idx_labels(std::uint32_t n, std::uint32_t magic = 0x801) {
  std::string s = be32(magic) + be32(n);
  for (std::uint32_t i = 0; i < n; ++i) s += static_cast<char>(i % 10);
  return s;
}

/// A Fashion-MNIST-shaped directory: 12 training and 4 test images.
void write_dataset(const fs::path& root) {
  write_gzip(root / "train-images-idx3-ubyte.gz", idx_images(12));
  write_gzip(root / "train-labels-idx1-ubyte.gz", idx_labels(12));
  write_gzip(root / "t10k-images-idx3-ubyte.gz", idx_images(4));
  write_gzip(root / "t10k-labels-idx1-ubyte.gz", idx_labels(4));
}

TEST(FashionMNIST, ReadsIdxSplitsAndNormalises) {
  TempDir dir;
  write_dataset(dir.path());
  auto data = make_data("fashion_mnist", "root = \"" + dir.str() + "\"\nval_size = 3\ntrain_limit = 5\n");
  data->setup("fit");
  EXPECT_EQ(data->item_unit(), "samples");
  ASSERT_EQ(data->train_dataset()->size(), 5);
  ASSERT_EQ(data->val_dataset()->size(), 3);
  ASSERT_EQ(data->test_dataset()->size(), 4);
  ASSERT_EQ(data->predict_dataset()->size(), 4);  // predict_limit (16) capped by the test set

  sdk::Batch batch = data->train_dataset()->get_batch({4, 1});
  ASSERT_EQ(batch.input.sizes(), (std::vector<std::int64_t>{2, 1, 28, 28}));
  EXPECT_EQ(batch.input.scalar_type(), at::kFloat);
  EXPECT_EQ(batch.target.scalar_type(), at::kLong);
  EXPECT_NEAR(batch.input[0][0][5][7].item<double>(), (80.0 / 255.0 - 0.2860) / 0.3530, 1e-5);
  EXPECT_NEAR(batch.input[1][0][0][0].item<double>(), (20.0 / 255.0 - 0.2860) / 0.3530, 1e-5);
  EXPECT_EQ(batch.target[0].item<std::int64_t>(), 4);
  // Validation is the tail of the training file: images 9, 10, 11.
  sdk::Batch val = data->val_dataset()->get_batch({0, 2});
  EXPECT_EQ(val.target[0].item<std::int64_t>(), 9);
  EXPECT_EQ(val.target[1].item<std::int64_t>(), 1);  // 11 % 10

  sdk::Batch test = data->test_dataset()->get_batch({0, 1});
  EXPECT_EQ(data->describe_prediction(test, at::tensor({9, 1}, at::kLong)),
            "Ankle boot (true: T-shirt/top)\nTrouser (true: Trouser)\n");
  EXPECT_THROW(data->describe_prediction(test, at::tensor({10, 1}, at::kLong)), sdk::Error);
}

TEST(FashionMNIST, BadMagicIsNamed) {
  TempDir dir;
  write_dataset(dir.path());
  write_gzip(dir.path() / "train-images-idx3-ubyte.gz", idx_images(12, 0x801));
  auto data = make_data("fashion_mnist", "root = \"" + dir.str() + "\"\nval_size = 2\n");
  const std::string e = error_of([&] { data->setup("fit"); });
  EXPECT_MENTIONS(e, "train-images-idx3-ubyte.gz");
  EXPECT_MENTIONS(e, "magic 0x801");
  EXPECT_MENTIONS(e, "expected 0x803");
}

TEST(FashionMNIST, TruncatedDataIsNamed) {
  TempDir dir;
  write_dataset(dir.path());
  write_gzip(dir.path() / "t10k-images-idx3-ubyte.gz", idx_images(4, 0x803, 100));
  auto data = make_data("fashion_mnist", "root = \"" + dir.str() + "\"\nval_size = 2\n");
  const std::string e = error_of([&] { data->setup("test"); });
  EXPECT_MENTIONS(e, "t10k-images-idx3-ubyte.gz");
  EXPECT_MENTIONS(e, "truncated");

  write_gzip(dir.path() / "t10k-images-idx3-ubyte.gz", idx_images(4).substr(0, 10));  // inside the header
  EXPECT_MENTIONS(error_of([&] { make_data("fashion_mnist", "root = \"" + dir.str() + "\"\nval_size = 2\n")->setup("test"); }),
                  "header");
}

TEST(FashionMNIST, TruncatedGzipStreamIsNamed) {
  TempDir dir;
  write_dataset(dir.path());
  const fs::path labels = dir.path() / "train-labels-idx1-ubyte.gz";
  std::string compressed;
  {
    std::ifstream in(labels, std::ios::binary);
    compressed.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  write_file(labels, compressed.substr(0, compressed.size() - 12));  // lose the tail and the CRC
  auto data = make_data("fashion_mnist", "root = \"" + dir.str() + "\"\nval_size = 2\n");
  const std::string e = error_of([&] { data->setup("fit"); });
  EXPECT_MENTIONS(e, "train-labels-idx1-ubyte.gz");
  // zlib reports the cut stream ("not a complete gzip file"); zlib 1.3.2 (Debian sid) reads it
  // to its end silently, and the IDX header's sizes catch it instead.
  EXPECT_TRUE(e.find("not a complete gzip file") != std::string::npos || e.find("is truncated") != std::string::npos)
      << e;
}

TEST(FashionMNIST, InconsistentFilesAreNamed) {
  TempDir dir;
  write_dataset(dir.path());
  write_gzip(dir.path() / "train-labels-idx1-ubyte.gz", idx_labels(11));
  EXPECT_MENTIONS(error_of([&] { make_data("fashion_mnist", "root = \"" + dir.str() + "\"\nval_size = 2\n")->setup("fit"); }),
                  "12 images but 11 labels");
  write_dataset(dir.path());
  std::string bad_labels = idx_labels(12);
  bad_labels.back() = 42;
  write_gzip(dir.path() / "train-labels-idx1-ubyte.gz", bad_labels);
  EXPECT_MENTIONS(error_of([&] { make_data("fashion_mnist", "root = \"" + dir.str() + "\"\nval_size = 2\n")->setup("fit"); }),
                  "label 42");
  write_dataset(dir.path());
  EXPECT_MENTIONS(error_of([&] { make_data("fashion_mnist", "root = \"" + dir.str() + "\"\nval_size = 12\n")->setup("fit"); }),
                  "[data] val_size");
}

TEST(FashionMNIST, MissingRootNamesTheKeyAndThePackage) {
  auto data = make_data("fashion_mnist", "root = \"/nonexistent/fmnist\"\n");
  const std::string e = error_of([&] { data->setup("fit"); });
  EXPECT_MENTIONS(e, "/nonexistent/fmnist/train-images-idx3-ubyte.gz");
  EXPECT_MENTIONS(e, "[data] root");
  EXPECT_MENTIONS(e, "dataset-fashion-mnist");
}

TEST(FashionMNIST, TheDebianDatasetHasTheDocumentedSplits) {
  auto data = make_data("fashion_mnist", "");
  data->setup("fit");
  EXPECT_EQ(data->train_dataset()->size(), 55000);
  EXPECT_EQ(data->val_dataset()->size(), 5000);
  EXPECT_EQ(data->test_dataset()->size(), 10000);
  EXPECT_EQ(data->predict_dataset()->size(), 16);
  at::Tensor images = data->train_dataset()->get_batch({0, 1, 2, 3, 4, 5, 6, 7}).input;
  EXPECT_LT(std::abs(images.mean().item<double>()), 0.3);  // normalised around 0
}

}  // namespace
