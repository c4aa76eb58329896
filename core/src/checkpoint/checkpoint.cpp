#include "tessera/core/checkpoint.hpp"
#include "tessera/core/checkpoint_folder.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <type_traits>

#include <nlohmann/json.hpp>
#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/csrc/jit/serialization/unpickler.h>

#include <c10/util/strides.h>

#include "embedded_archives.hpp"
#include "loaded_weights.hpp"
#include "python_pickle.hpp"
#include "checkpoint/huggingface.hpp"
#include "tessera/core/safetensors.hpp"
#include "tessera/core/sharded_checkpoint.hpp"  // kManifestName
#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace fs = std::filesystem;
using c10::IValue;

c10::IValue to_ivalue(const sdk::StateDict& state) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& item : state) dict.insert(item.key(), item.value());
  return dict;
}

sdk::StateDict state_dict_from(const IValue& value, const std::string& what) {
  TESSERA_CHECK(value.isGenericDict(), what, " is not a dictionary of tensors");
  sdk::StateDict state;
  for (const auto& item : value.toGenericDict()) {
    TESSERA_CHECK(item.key().isString() && item.value().isTensor(), what, " holds a non-tensor entry");
    state.insert(item.key().toStringRef(), item.value().toTensor());
  }
  return state;
}

void check_weight_dtype(const std::string& name, const at::Tensor& value, const at::Tensor& parameter) {
  if (!at::isFloatingType(parameter.scalar_type()) || at::isFloatingType(value.scalar_type())) return;
  std::string stored = c10::toString(value.scalar_type());
  try {
    stored = safetensors_dtype(value.scalar_type()) + " (" + stored + ")";
  } catch (const sdk::Error&) {  // not a safetensors dtype: LibTorch's name alone
  }
  TESSERA_FAIL("checkpoint state_dict['", name, "'] is stored as ", stored, ", which is not a weight's dtype: ",
               "loading it would convert integers into the ", parameter.scalar_type(), " parameter; valid: F32, BF16, ",
               "F16 or F64 (float32, bfloat16, float16, float64)");
}

std::string first_non_finite(const at::Tensor& t) {
  if (!at::isFloatingType(t.scalar_type()) || t.numel() == 0) return "";
  const at::Tensor flat = t.detach().reshape({-1});
  constexpr std::int64_t kBlock = std::int64_t{1} << 22;  // 4 Mi elements: a bounded temporary
  for (std::int64_t begin = 0; begin < flat.numel(); begin += kBlock) {
    const at::Tensor block = flat.narrow(0, begin, std::min(kBlock, flat.numel() - begin));
    const at::Tensor bad = at::isfinite(block).logical_not();
    if (!bad.any().item<bool>()) continue;
    const std::int64_t index = bad.nonzero().select(1, 0)[0].item<std::int64_t>();
    const double v = block[index].item<double>();
    return std::string(std::isnan(v) ? "NaN" : v > 0 ? "inf" : "-inf") + " at element " +
           std::to_string(begin + index) + " of " + std::to_string(flat.numel());
  }
  return "";
}

void check_finite_weight(const std::string& name, const at::Tensor& value) {
  const std::string where = first_non_finite(value);
  TESSERA_CHECK(where.empty(), "checkpoint state_dict['", name, "'] holds ", where, ": a weight must be finite ",
                "(a NaN or an infinity trains to a NaN loss); valid: finite numbers only. Was it saved after the ",
                "training diverged, or is the file damaged?");
}

const IValue& checkpoint_get(const sdk::Checkpoint& checkpoint, const std::string& key) {
  auto it = checkpoint.find(key);
  if (it == checkpoint.end()) {
    std::vector<std::string> keys;
    for (const auto& item : checkpoint) keys.push_back(item.key().toStringRef());
    TESSERA_FAIL("checkpoint has no '", key, "' entry; it has: ", sdk::join(keys));
  }
  return it->value();
}

sdk::Checkpoint checkpoint_dict(const IValue& value, const std::string& what) {
  TESSERA_CHECK(value.isGenericDict(), what, " is not a dictionary");
  return value.toGenericDict();
}

namespace {

[[noreturn]] void fail_io(const std::string& what, const fs::path& path, int error) {
  TESSERA_FAIL("cannot ", what, " ", path.string(), ": ", std::strerror(error));
}

}  // namespace

void atomic_write(const std::string& path, const std::function<void(std::ostream&)>& write) {
  atomic_write_file(path, [&](const std::string& temp) {
    {
      std::ofstream out(temp, std::ios::binary | std::ios::trunc);
      if (!out.good()) fail_io("create", temp, errno);
      write(out);
      out.flush();
      TESSERA_CHECK(out.good(), "writing ", temp, " failed (disk full?)");
    }
    int fd = ::open(temp.c_str(), O_RDONLY);
    if (fd < 0) fail_io("open", temp, errno);
    const bool synced = ::fsync(fd) == 0;
    const int sync_error = errno;
    ::close(fd);
    if (!synced) fail_io("fsync", temp, sync_error);
  });
}

namespace {

// PyTorch 2.6 made torch.load weights-only by default, and its safe unpickler refuses the
// type tags and typed-list constructors LibTorch's pickle_save writes (torch.jit._pickle's
// restore_type_tag, build_intlist...). So Tessera pickles plain containers, as Python's
// torch.save does, and gives lists their element type back on load.

/// `v` with every list (typed or not) a generic one, recursively; tensors shared.
IValue plain_containers(const IValue& v) {
  if (v.isGenericDict()) {
    c10::impl::GenericDict out(v.toGenericDict().keyType(), c10::AnyType::get());
    for (const auto& item : v.toGenericDict()) out.insert(item.key(), plain_containers(item.value()));
    return out;
  }
  if (v.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const IValue& item : v.toListRef()) out.push_back(plain_containers(item));
    return out;
  }
  if (v.isTuple()) {
    std::vector<IValue> items;
    for (const IValue& item : v.toTupleRef().elements()) items.push_back(plain_containers(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return v;
}

/// A list of ints, floats, bools, strings or tensors (all one kind) as LibTorch's typed list;
/// other lists and every dict and tuple likewise inside. Loaded pickles carry no types.
IValue typed_containers(const IValue& v) {
  if (v.isGenericDict()) {
    c10::impl::GenericDict out(v.toGenericDict().keyType(), v.toGenericDict().valueType());
    for (const auto& item : v.toGenericDict())
      if (!(item.key().isString() && item.key().toStringRef() == detail::kOrderedDictAttributes))
        out.insert(item.key(), typed_containers(item.value()));
    return out;
  }
  if (v.isTuple()) {
    std::vector<IValue> items;
    for (const IValue& item : v.toTupleRef().elements()) items.push_back(typed_containers(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  if (!v.isList()) return v;
  std::vector<IValue> items;
  for (const IValue& item : v.toListRef()) items.push_back(typed_containers(item));
  auto all = [&](bool (IValue::*is)() const) {
    return !items.empty() && std::all_of(items.begin(), items.end(), [&](const IValue& x) { return (x.*is)(); });
  };
  auto typed = [&](auto element, auto get) {
    c10::List<decltype(element)> out;
    for (const IValue& x : items) out.push_back(get(x));
    return IValue(out);
  };
  if (all(&IValue::isInt)) return typed(std::int64_t{}, [](const IValue& x) { return x.toInt(); });
  if (all(&IValue::isDouble)) return typed(double{}, [](const IValue& x) { return x.toDouble(); });
  if (all(&IValue::isBool)) return typed(bool{}, [](const IValue& x) { return x.toBool(); });
  if (all(&IValue::isString)) return typed(std::string{}, [](const IValue& x) { return x.toStringRef(); });
  if (all(&IValue::isTensor)) return typed(at::Tensor{}, [](const IValue& x) { return x.toTensor(); });
  c10::impl::GenericList out(c10::AnyType::get());
  for (IValue& x : items) out.push_back(std::move(x));
  return out;
}

}  // namespace

void save_pickle(const IValue& value, const std::string& path) {
  atomic_write(path, [&](std::ostream& out) { write_archive(value, out); });
}

std::size_t write_archive(const IValue& value, std::ostream& out) {
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&](const char* data, std::size_t n) { pickle.insert(pickle.end(), data, data + n); },
                              /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
                              /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(plain_containers(value));
  pickler.stop();
  // torch.save's container: data.pkl, then each storage as data/<index> (pickle_save's own),
  // streamed into the file: pickle_save built the whole file in memory first (a second copy
  // of the checkpoint, tens of GB for a large model's full state on rank 0).
  std::size_t written = 0;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, std::size_t n) {
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    written += n;
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return written;
}

namespace {

/// A checkpoint file mapped privately (copy-on-write): tensors loaded from it point into the
/// mapping, so a rank that needs a piece of each tensor reads and keeps resident only the pages
/// it touches (torch.load(mmap=True)). Unmapped when the last tensor pointing into it goes.
struct MappedFile {
  char* base = nullptr;
  std::size_t size = 0;
  MappedFile(char* b, std::size_t n) : base(b), size(n) {}
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile() { ::munmap(base, size); }
};

void release_mapping(void* context) { delete static_cast<std::shared_ptr<MappedFile>*>(context); }

bool points_into_mapping(const at::Tensor& t) {
  return t.defined() && t.has_storage() && t.storage().data_ptr().get_deleter() == &release_mapping;
}

/// The zip reader's view of bytes [begin, begin + size) of the mapping: a whole file, or one
/// archive embedded in it (DCP's .distcp). The archive's directory and the pickle are copied out.
class MappedAdapter final : public caffe2::serialize::ReadAdapterInterface {
 public:
  MappedAdapter(std::shared_ptr<MappedFile> file, std::size_t begin, std::size_t size)
      : file_(std::move(file)), begin_(begin), size_(size) {}
  std::size_t size() const override { return size_; }
  std::size_t read(std::uint64_t pos, void* buf, std::size_t n, const char*) const override {
    if (pos >= size_) return 0;
    n = std::min<std::size_t>(n, size_ - pos);
    std::memcpy(buf, file_->base + begin_ + pos, n);
    return n;
  }

 private:
  std::shared_ptr<MappedFile> file_;
  std::size_t begin_, size_;
};

void for_each_tensor(const IValue& v, const std::string& path,
                     const std::function<void(const std::string&, const at::Tensor&)>& fn);

}  // namespace

namespace {

/// `path` mapped privately; a missing, empty or unreadable file throws naming it.
std::shared_ptr<MappedFile> map_file(const std::string& path) {
  std::error_code ec;
  TESSERA_CHECK(fs::exists(path, ec), "checkpoint ", path, " does not exist");
  TESSERA_CHECK(!fs::is_directory(path, ec), "checkpoint ", path, " is a folder without ", kManifestName,
                ": not a committed sharded checkpoint (an interrupted save, or not a checkpoint folder); pass a .ckpt ",
                "file, or a folder tessera's distributed checkpoint_io committed (its checkpoints/last link names the ",
                "newest)");
  TESSERA_CHECK(fs::is_regular_file(path, ec), "checkpoint ", path, " is not a regular file (a device, FIFO or ",
                "socket): pass a .ckpt file or a sharded checkpoint folder");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TESSERA_CHECK(fd >= 0, "cannot open checkpoint ", path, ": ", std::strerror(errno));
  struct stat st {};
  const bool stat_ok = ::fstat(fd, &st) == 0;
  const int stat_errno = errno;
  if (!stat_ok || st.st_size == 0) ::close(fd);
  TESSERA_CHECK(stat_ok, "cannot stat checkpoint ", path, ": ", std::strerror(stat_errno));
  TESSERA_CHECK(st.st_size > 0, "checkpoint ", path, " is empty (an interrupted copy?)");
  const auto size = static_cast<std::size_t>(st.st_size);
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  TESSERA_CHECK(base != MAP_FAILED, "cannot map checkpoint ", path, ": ", std::strerror(map_errno));
  return std::make_shared<MappedFile>(static_cast<char*>(base), size);
}

/// Storage for `bytes` at `offset` of the mapping, which it keeps alive.
at::DataPtr mapped_bytes(const std::shared_ptr<MappedFile>& file, std::size_t offset) {
  return at::DataPtr(file->base + offset, new std::shared_ptr<MappedFile>(file), &release_mapping, at::kCPU);
}

/// A safetensors file starts with its header's length and the header's opening brace.
bool looks_like_safetensors(const MappedFile& file) {
  if (file.size < 10 || file.base[8] != '{') return false;
  std::uint64_t length = 0;
  std::memcpy(&length, file.base, 8);
  return length <= file.size - 8;
}

/// A safetensors file's tensors, pointing into the mapping (copied out where a tensor's offset
/// is not aligned to its element size, which from_blob-style storage needs).
sdk::StateDict map_safetensors(const std::string& path, const std::shared_ptr<MappedFile>& file) {
  SafetensorsReader reader(path);
  sdk::StateDict state;
  for (const auto& [name, e] : reader.tensors()) {
    const at::ScalarType dtype = e.dtype;
    const std::size_t element = c10::elementSize(dtype);
    const auto offset = static_cast<std::size_t>(e.begin);
    at::Tensor t;
    if (reinterpret_cast<std::uintptr_t>(file->base + offset) % element == 0) {
      const auto bytes = static_cast<std::size_t>(e.end - e.begin);
      c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, mapped_bytes(file, offset), nullptr, false);
      t = at::empty({0}, at::TensorOptions().dtype(dtype)).set_(storage, 0, e.shape, c10::contiguous_strides(e.shape));
    } else {
      t = reader.read(name);
    }
    state.insert(name, t);
  }
  return state;
}

/// load_pickle of bytes [begin, begin + size) of a file mapped already (its whole size by default).
IValue unpickle(const std::string& path, const std::shared_ptr<MappedFile>& file, std::size_t begin = 0,
                std::size_t size = std::numeric_limits<std::size_t>::max()) {
  if (size == std::numeric_limits<std::size_t>::max()) size = file->size - begin;
  TESSERA_CHECK(begin <= file->size && size <= file->size - begin, path, ": bytes [", begin, ", ", begin + size,
                ") lie past its end (", file->size, " bytes): truncated, or not the file its index describes");
  const char* const base = file->base + begin;
  // torch.save's format is a zip archive: anything else is not a checkpoint at all.
  TESSERA_CHECK(size >= 4 && std::memcmp(base, "PK\x03\x04", 4) == 0, path,
                begin == 0 ? std::string() : " bytes [" + std::to_string(begin) + ", " + std::to_string(begin + size) + ")",
                " is not a checkpoint: it is not in torch.save's zip format");
  IValue value;
  try {
    // pickle_load's reading (torch/csrc/jit/serialization/import_read.cpp), except that each
    // storage points at its record in the mapped file instead of being copied out of it:
    // torch.save and pickle_save store records uncompressed, 64-byte aligned.
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<MappedAdapter>(file, begin, size));
    auto [record, record_size] = reader.getRecord("data.pkl");
    std::vector<std::string> globals;
    const std::string pickle =
        detail::readable_by_libtorch(std::string_view(static_cast<const char*>(record.get()), record_size), &globals);
    for (const std::string& global : globals)
      TESSERA_CHECK(detail::allowed_global(global), path, ": its pickle asks for the Python global ", global,
                    ", which no checkpoint needs (torch.save writes tensors, storages and containers only): refused. ",
                    "Python's torch.load would run it (code execution); do not open this file with torch.load either");
    std::size_t consumed = 0;
    auto read = [&, n = pickle.size()](char* out, std::size_t len) {
      len = std::min(len, n - std::min(consumed, n));
      std::memcpy(out, pickle.data() + consumed, len);
      consumed += len;
      return len;
    };
    auto read_record = [&](const std::string& key) {
      const std::size_t offset = reader.getRecordOffset("data/" + key);
      TESSERA_CHECK(offset <= size, path, ": tensor record ", key, " starts past the end of the file (truncated)");
      return mapped_bytes(file, begin + offset);
    };
    torch::jit::Unpickler unpickler(read, nullptr, nullptr, read_record, c10::nullopt);
    unpickler.set_version(reader.version());
    value = unpickler.parse_ivalue();
  } catch (const sdk::Error&) {
    throw;
  } catch (const std::exception& e) {
    std::string reason = e.what();
    TESSERA_FAIL(path, " is not a readable checkpoint (truncated or damaged; ", size,
                 " bytes): ", reason.substr(0, reason.find('\n')));
  }
  value = typed_containers(value);
  // Before any tensor is touched: every storage lies inside the file.
  for_each_tensor(value, "", [&](const std::string& name, const at::Tensor& t) {
    if (!points_into_mapping(t)) return;
    const char* start = static_cast<const char*>(t.storage().data());
    TESSERA_CHECK(start + t.storage().nbytes() <= base + size, path, ": tensor ", name, " extends past the end of ",
                  base == file->base ? "" : "its archive in ", "the file (truncated or damaged)");
  });
  return value;
}

}  // namespace

IValue load_pickle(const std::string& path) { return unpickle(path, map_file(path)); }

EmbeddedArchives::EmbeddedArchives(const std::string& path) : path_(path), file_(map_file(path)) {}

std::size_t EmbeddedArchives::size() const { return std::static_pointer_cast<MappedFile>(file_)->size; }

IValue EmbeddedArchives::load(std::uint64_t offset, std::uint64_t length) const {
  return unpickle(path_, std::static_pointer_cast<MappedFile>(file_), offset, length);
}

namespace {

constexpr const char kSafetensorsIndex[] = ".safetensors.index.json";

/// A model saved as several safetensors files (Hugging Face's save_pretrained of a large model):
/// the index's {"weight_map": {tensor: file}} names each tensor's file, beside the index. Every
/// file is mapped, as one safetensors file is.
sdk::StateDict map_safetensors_index(const std::string& path) {
  const fs::path folder = fs::path(path).parent_path();
  std::map<std::string, sdk::StateDict> files;
  sdk::StateDict state;
  for (const auto& [name, file] : read_safetensors_index(path)) {
    auto it = files.find(file);
    if (it == files.end()) {
      const std::string full = (folder / file).string();
      it = files.emplace(file, map_safetensors(full, map_file(full))).first;
    }
    const at::Tensor* tensor = it->second.find(name);
    TESSERA_CHECK(tensor != nullptr, path, " puts '", name, "' in ", it->first, ", which has no tensor of that name");
    state.insert(name, *tensor);
  }
  return state;
}

}  // namespace

sdk::Checkpoint load_checkpoint_file(const std::string& path) {
  auto weights_only = [](const sdk::StateDict& state) {
    sdk::Checkpoint c = sdk::make_checkpoint();
    c.insert("state_dict", to_ivalue(state));
    c.insert(kWeightsOnlyKey, true);
    return c;
  };
  const std::size_t n = sizeof(kSafetensorsIndex) - 1;
  if (path.size() > n && path.compare(path.size() - n, n, kSafetensorsIndex) == 0)
    return weights_only(map_safetensors_index(path));
  const auto file = map_file(path);
  if (looks_like_safetensors(*file)) return weights_only(map_safetensors(path, file));
  sdk::Checkpoint c = checkpoint_dict(unpickle(path, file), "checkpoint " + path);
  if (c.contains("state_dict") || c.empty()) return c;
  for (const auto& item : c)
    if (!item.value().isTensor()) return c;  // not a bare state dict: the caller names what it lacks
  return weights_only(state_dict_from(c, "checkpoint " + path));
}

namespace {

/// Drops the resident pages that lie wholly inside `bytes` bytes at `data` of a mapping.
void drop_pages(const char* data, std::size_t bytes) {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  const std::uintptr_t lo = (reinterpret_cast<std::uintptr_t>(data) + page - 1) / page * page;
  const std::uintptr_t hi = reinterpret_cast<std::uintptr_t>(data + bytes) / page * page;
  if (hi > lo) ::madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_DONTNEED);
}

/// The xxh64 of a tensor's bytes. `release`: a tensor loaded by load_pickle and not modified
/// since is hashed in blocks whose pages are dropped after (read again from the file if touched
/// later), so checking a whole checkpoint keeps about one block resident, not the file.
std::string xxh64_of(const at::Tensor& t, bool release = false) {
  const at::Tensor cpu = t.detach().to(at::kCPU).contiguous();
  const char* data = static_cast<const char*>(cpu.data_ptr());
  const std::size_t bytes = static_cast<std::size_t>(cpu.numel()) * cpu.element_size();
  XXH64_hash_t digest = 0;
  if (release && points_into_mapping(cpu)) {
    constexpr std::size_t kBlock = std::size_t{8} << 20;
    XXH64_state_t* state = XXH64_createState();
    XXH64_reset(state, 0);
    for (std::size_t done = 0; done < bytes; done += kBlock) {
      const std::size_t n = std::min(kBlock, bytes - done);
      XXH64_update(state, data + done, n);
      drop_pages(data + done, n);  // whole pages only: one shared with another tensor stays
    }
    digest = XXH64_digest(state);
    XXH64_freeState(state);
  } else {
    digest = XXH64(data, bytes, 0);
  }
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(digest));
  return text;
}

/// Every tensor in a checkpoint value, with its path ("state_dict/w", "optimizer_states/0/state/3/exp_avg").
void for_each_tensor(const IValue& v, const std::string& path,
                     const std::function<void(const std::string&, const at::Tensor&)>& fn) {
  auto child = [&](const std::string& key) { return path.empty() ? key : path + "/" + key; };
  if (v.isTensor()) return fn(path, v.toTensor());
  if (v.isGenericDict())
    for (const auto& item : v.toGenericDict())
      for_each_tensor(item.value(), child(item.key().isString() ? item.key().toStringRef()
                                                                : std::to_string(item.key().toInt())), fn);
  if (v.isList() || v.isTuple()) {
    auto items = v.isList() ? v.toListRef() : v.toTupleRef().elements();
    for (std::size_t i = 0; i < items.size(); ++i) for_each_tensor(items[i], child(std::to_string(i)), fn);
  }
}

}  // namespace

sdk::Checkpoint with_tensor_checksums(const sdk::Checkpoint& checkpoint) {
  sdk::Checkpoint out = checkpoint.copy();
  (void)out.erase(kTensorChecksumsKey);  // a re-save recomputes them
  c10::Dict<std::string, std::string> sums;
  for_each_tensor(out, "", [&](const std::string& path, const at::Tensor& t) { sums.insert(path, xxh64_of(t)); });
  out.insert(kTensorChecksumsKey, sums);
  return out;
}

void release_loaded_pages(const at::Tensor& t) {
  if (!points_into_mapping(t) || !t.is_contiguous()) return;
  drop_pages(static_cast<const char*>(t.data_ptr()), static_cast<std::size_t>(t.numel()) * t.element_size());
}

void check_tensor_checksums(const sdk::Checkpoint& checkpoint, const std::string& path) {
  if (!checkpoint.contains(kTensorChecksumsKey)) return;
  const IValue& sums = checkpoint.at(kTensorChecksumsKey);
  TESSERA_CHECK(sums.isGenericDict(), path, " [", kTensorChecksumsKey, "] is not a dictionary");
  std::map<std::string, std::string> expected;
  for (const auto& item : sums.toGenericDict()) expected[item.key().toStringRef()] = item.value().toStringRef();
  std::size_t seen = 0;
  for_each_tensor(checkpoint, "", [&](const std::string& name, const at::Tensor& t) {
    auto it = expected.find(name);
    if (it == expected.end()) return;
    ++seen;
    TESSERA_CHECK(xxh64_of(t, /*release=*/true) == it->second, path, ": tensor ", name,
                  " does not match its checksum: the file is damaged");
  });
  TESSERA_CHECK(seen == expected.size(), path, ": ", expected.size() - seen,
                " tensor(s) listed in its checksums are missing");
}

void atomic_write_file(const std::string& path, const std::function<void(const std::string& temp)>& write) {
  fs::path target(path);
  fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  fs::create_directories(dir, ec);
  TESSERA_CHECK(!ec, "cannot create directory ", dir.string(), " for ", path, ": ", ec.message());
  static std::atomic<std::uint64_t> counter{0};
  fs::path temp = dir / ("." + target.filename().string() + ".tmp-" + std::to_string(::getpid()) + "-" +
                         std::to_string(counter++));
  try {
    const WriterLock lock(temp.string(), /*create=*/true);  // a sweep leaves this temporary alone until we are done
    write(temp.string());
    fs::rename(temp, target, ec);
    TESSERA_CHECK(!ec, "cannot rename ", temp.string(), " to ", path, ": ", ec.message());
    int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
    if (dir_fd >= 0) {
      ::fsync(dir_fd);
      ::close(dir_fd);
    }
  } catch (...) {
    fs::remove(temp, ec);
    throw;
  }
}

namespace {
IValue snapshot_value(const IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (!t.is_cuda()) return t.detach().clone();
    at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    host.copy_(t.detach());
    return host;
  }
  if (v.isGenericDict()) {
    auto dict = v.toGenericDict();
    c10::impl::GenericDict out(dict.keyType(), dict.valueType());
    for (const auto& item : dict) out.insert(item.key(), snapshot_value(item.value()));
    return out;
  }
  if (v.isList()) {
    auto list = v.toList();
    c10::impl::GenericList out(list.elementType());
    for (const IValue& item : list) out.push_back(snapshot_value(item));
    return out;
  }
  if (v.isTuple()) {
    std::vector<IValue> items;
    for (const IValue& item : v.toTupleRef().elements()) items.push_back(snapshot_value(item));
    return c10::ivalue::Tuple::create(std::move(items));
  }
  return v;  // immutable plain values
}
}  // namespace

sdk::Checkpoint snapshot_to_host(const sdk::Checkpoint& checkpoint) {
  return snapshot_value(checkpoint).toGenericDict();
}

bool is_model_shaped_key(const std::string& key) {
  return std::find(kModelShapedKeys.begin(), kModelShapedKeys.end(), key) != kModelShapedKeys.end();
}

}  // namespace tessera::core
