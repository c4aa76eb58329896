// `fashion_mnist`: the gzip IDX files of Debian's `dataset-fashion-mnist` package.
#include <sys/mman.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include "data.hpp"
#include "tessera/sdk/error.hpp"

namespace tessera::data {

namespace {

const char* const kClasses[] = {"T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                                "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

/// Asks for 2 MiB pages over the whole 2 MiB blocks of [data, data + bytes), before the first
/// write: where transparent huge pages are "madvise" (Debian's default), a buffer of 4 KiB pages
/// takes a page fault per page as it is first written, and the training images as floats
/// (172 MB) took ~42,000 of them, a third of a one-step fit's CPU time on a 2-core VM. A hint:
/// where it is refused, the pages are small.
void prefer_huge_pages(void* data, std::size_t bytes) {
  constexpr std::uintptr_t kHuge = std::uintptr_t{2} << 20;
  const std::uintptr_t begin = (reinterpret_cast<std::uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const std::uintptr_t end = (reinterpret_cast<std::uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) ::madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
}

/// The size a gzip file says its content has (its trailer's ISIZE: the size modulo 2^32), 0 if
/// it cannot be read: a hint for one allocation, never trusted as the size (a damaged file's
/// trailer may say anything: at most 16 times the file's own size is believed).
std::size_t gzip_size_hint(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  const std::streamoff compressed = in ? static_cast<std::streamoff>(in.tellg()) : 0;
  if (compressed < 4) return 0;
  in.seekg(-4, std::ios::end);
  unsigned char b[4] = {};
  in.read(reinterpret_cast<char*>(b), 4);
  const std::size_t isize = std::size_t{b[0]} | std::size_t{b[1]} << 8 | std::size_t{b[2]} << 16 | std::size_t{b[3]} << 24;
  return in && isize <= 16 * static_cast<std::size_t>(compressed) ? isize : 0;
}

/// The whole decompressed content of a gzip file, as bytes (read in place: one allocation of
/// huge pages, never zero-filled first, no copies).
at::Tensor read_gzip(const std::string& path, const std::string& key_hint) {
  gzFile file = gzopen(path.c_str(), "rb");
  TESSERA_CHECK(file != nullptr, "cannot open ", path, ": ", std::strerror(errno), " (the directory is ", key_hint,
                "; the default, /usr/share/datasets/fashion-mnist, comes with Debian's `dataset-fashion-mnist` "
                "package)");
  const auto capacity = static_cast<std::int64_t>(std::max<std::size_t>(gzip_size_hint(path), 1 << 16));
  at::Tensor out = at::empty({capacity}, at::kByte);
  prefer_huge_pages(out.data_ptr(), out.nbytes());
  std::size_t size = 0;
  int n;
  for (;;) {
    if (size == out.nbytes()) {  // full: grow only if there is more
      std::uint8_t next;
      if ((n = gzread(file, &next, 1)) <= 0) break;
      out.resize_({out.size(0) * 2});  // keeps the content
      out.data_ptr<std::uint8_t>()[size++] = next;
    }
    n = gzread(file, out.data_ptr<std::uint8_t>() + size,
               static_cast<unsigned>(std::min<std::size_t>(out.nbytes() - size, 1u << 30)));
    if (n <= 0) break;
    size += static_cast<std::size_t>(n);
  }
  int error = Z_OK;
  const std::string message = gzerror(file, &error);  // copied: the text dies with the handle
  gzclose(file);
  TESSERA_CHECK(n == 0 && error == Z_OK, path, " is not a complete gzip file: ", message);
  return out.narrow(0, 0, static_cast<std::int64_t>(size));
}

std::uint32_t big_endian(const std::uint8_t* data) {
  return (std::uint32_t{data[0]} << 24) | (std::uint32_t{data[1]} << 16) | (std::uint32_t{data[2]} << 8) | data[3];
}

/// Parses an IDX file of unsigned bytes with `dims` dimensions, checking magic and size.
at::Tensor read_idx(const std::string& path, std::size_t dims, const std::string& key_hint) {
  const at::Tensor data = read_gzip(path, key_hint);
  const std::uint8_t* bytes = data.data_ptr<std::uint8_t>();
  const std::size_t size = data.nbytes(), header = 4 + 4 * dims;
  TESSERA_CHECK(size >= header, path, " is truncated: ", size, " bytes, less than its IDX header");
  const std::uint32_t magic = big_endian(bytes);
  TESSERA_CHECK(magic == 0x800u + dims, path, " is not an IDX file of ", dims,
                "-D unsigned bytes (magic 0x", std::hex, magic, ", expected 0x", 0x800u + dims, ")");
  std::vector<std::int64_t> shape;
  std::size_t count = 1;
  for (std::size_t d = 0; d < dims; ++d) {
    shape.push_back(big_endian(bytes + 4 + 4 * d));
    count *= static_cast<std::size_t>(shape.back());
  }
  TESSERA_CHECK(size == header + count, path, " is truncated or padded: ", size - header,
                " data bytes for a header that announces ", count);
  // A view of the decompressed bytes where they are.
  return data.narrow(0, static_cast<std::int64_t>(header), static_cast<std::int64_t>(count)).view(shape);
}

class Images final : public sdk::Dataset {
 public:
  Images(at::Tensor images, at::Tensor labels) : images_(std::move(images)), labels_(std::move(labels)) {}
  std::int64_t size() const override { return images_.size(0); }
  sdk::Batch get_batch(const std::vector<std::int64_t>& indices) const override {
    at::Tensor index = at::tensor(indices, at::kLong);
    return sdk::Batch{images_.index_select(0, index), labels_.index_select(0, index)};
  }

 private:
  at::Tensor images_, labels_;
};

class FashionMNIST final : public sdk::DataModule {
 public:
  explicit FashionMNIST(const sdk::Options& o)
      : root_(o.get_string({"root", "the folder of Fashion-MNIST's idx files (train-images-idx3-ubyte.gz ...)"},
                           "/usr/share/datasets/fashion-mnist")),
        val_size_(o.get_int({"val_size", "training images held out for validation (the last ones)"}, 5000, 0, 59000)),
        train_limit_(o.get_int({"train_limit", "use only the first N training images; 0: all"}, 0, 0)),
        test_limit_(o.get_int({"test_limit", "use only the first N test images; 0: all"}, 0, 0)),
        predict_limit_(o.get_int({"predict_limit", "test images whose classes predict prints"}, 16, 0)),
        root_key_(o.locate("root")),
        o_val_key_(o.locate("val_size")) {}

  void setup(const std::string&) override {
    if (train_) return;
    auto [train_images, train_labels] = load("train");
    auto [test_images, test_labels] = load("t10k");
    TESSERA_CHECK(val_size_ < train_images.size(0), o_val_key_, " = ", val_size_, " leaves no training images: ", root_,
                  " has ", train_images.size(0), " in its train split");
    const std::int64_t n_train = train_images.size(0) - val_size_;
    auto take = [](const at::Tensor& t, std::int64_t start, std::int64_t n) { return t.narrow(0, start, n); };
    // Only the images a split uses become floats (train_limit = 600 converts 600, not 55,000),
    // normalised with the training set's mean and standard deviation: [N, 1, 28, 28].
    auto normalised = [](const at::Tensor& bytes) {
      at::Tensor images = at::empty({bytes.size(0), 1, bytes.size(1), bytes.size(2)}, at::kFloat);
      prefer_huge_pages(images.data_ptr(), images.nbytes());
      return images.copy_(bytes.unsqueeze(1)).div_(255.0).sub_(0.2860).div_(0.3530);
    };
    std::int64_t train_n = train_limit_ > 0 ? std::min(train_limit_, n_train) : n_train;
    train_ = std::make_shared<Images>(normalised(take(train_images, 0, train_n)), take(train_labels, 0, train_n));
    val_ = std::make_shared<Images>(normalised(take(train_images, n_train, val_size_)),
                                    take(train_labels, n_train, val_size_));
    std::int64_t test_n = test_limit_ > 0 ? std::min(test_limit_, test_images.size(0)) : test_images.size(0);
    const at::Tensor test_x = normalised(take(test_images, 0, test_n));
    test_ = std::make_shared<Images>(test_x, take(test_labels, 0, test_n));
    // `tessera predict` prints one line per image: the first few test images by default.
    const std::int64_t predict_n = predict_limit_ > 0 ? std::min(predict_limit_, test_n) : test_n;
    predict_ = std::make_shared<Images>(take(test_x, 0, predict_n), take(test_labels, 0, predict_n));
  }
  std::shared_ptr<sdk::Dataset> train_dataset() override { return train_; }
  std::shared_ptr<sdk::Dataset> val_dataset() override { return val_; }
  std::shared_ptr<sdk::Dataset> test_dataset() override { return test_; }
  std::shared_ptr<sdk::Dataset> predict_dataset() override { return predict_; }
  std::string describe_prediction(const sdk::Batch& batch, const at::Tensor& output) const override {
    std::string out;
    at::Tensor predicted = output.reshape({-1}).cpu();
    for (std::int64_t i = 0; i < predicted.numel(); ++i) {
      const std::int64_t c = predicted[i].item<std::int64_t>();
      TESSERA_CHECK(c >= 0 && c < 10, "fashion_mnist: a prediction names class ", c, "; the classes are 0..9");
      out += kClasses[c];
      if (batch.target.defined()) out += std::string(" (true: ") + kClasses[batch.target[i].item<std::int64_t>()] + ")";
      out += "\n";
    }
    return out;
  }
  std::string item_unit() const override { return "samples"; }

 private:
  std::pair<at::Tensor, at::Tensor> load(const std::string& split) const {
    const std::string images_path = root_ + "/" + split + "-images-idx3-ubyte.gz";
    const std::string labels_path = root_ + "/" + split + "-labels-idx1-ubyte.gz";
    at::Tensor images = read_idx(images_path, 3, root_key_);
    at::Tensor labels = read_idx(labels_path, 1, root_key_);
    TESSERA_CHECK(images.size(1) == 28 && images.size(2) == 28, images_path, " holds images of ", images.size(1), "x",
                  images.size(2), " pixels; Fashion-MNIST's are 28x28");
    TESSERA_CHECK(images.size(0) == labels.size(0), root_, ": ", split, " has ", images.size(0), " images but ",
                  labels.size(0), " labels");
    if (labels.numel() > 0) {
      const std::int64_t max_label = labels.max().item<std::int64_t>();
      TESSERA_CHECK(max_label < 10, labels_path, " holds label ", max_label, "; Fashion-MNIST's classes are 0..9");
    }
    return {images, labels.to(at::kLong)};
  }

  std::string root_;
  std::int64_t val_size_, train_limit_, test_limit_, predict_limit_;
  std::string root_key_, o_val_key_;
  std::shared_ptr<sdk::Dataset> train_, val_, test_, predict_;
};

}  // namespace

sdk::PluginEntry fashion_mnist_entry() {
  return sdk::plugin_entry<FashionMNIST>("fashion_mnist", "Fashion-MNIST images from dataset-fashion-mnist");
}

}  // namespace tessera::data
