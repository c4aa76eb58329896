#include "dcp.hpp"

#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "checkpoint_json.hpp"
#include "durable.hpp"
#include "embedded_archives.hpp"
#include "pickle_tree.hpp"
#include "tessera/core/checkpoint.hpp"
#include "tessera/core/checkpoint_folder.hpp"  // remove_tree
#include "tessera/core/safetensors.hpp"
#include "tessera/core/sharded_checkpoint.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/sdk/huggingface.hpp"
#include "tessera/sdk/module.hpp"

namespace tessera::core {

namespace fs = std::filesystem;
using detail::PickleNode;
using Kind = PickleNode::Kind;

namespace {

constexpr const char* kMetadataModule = "torch.distributed.checkpoint.metadata.";

const std::map<std::string, at::ScalarType>& dtypes() {
  static const std::map<std::string, at::ScalarType> names{
      {"torch.float32", at::kFloat},  {"torch.float", at::kFloat},     {"torch.float64", at::kDouble},
      {"torch.double", at::kDouble},  {"torch.float16", at::kHalf},    {"torch.half", at::kHalf},
      {"torch.bfloat16", at::kBFloat16}, {"torch.int64", at::kLong},   {"torch.long", at::kLong},
      {"torch.int32", at::kInt},      {"torch.int", at::kInt},         {"torch.int16", at::kShort},
      {"torch.int8", at::kChar},      {"torch.uint8", at::kByte},      {"torch.bool", at::kBool}};
  return names;
}

/// The globals a DCP `.metadata` names (PyTorch 2.x): its dataclasses, torch.Size, dtypes, the
/// layout and memory format of TensorProperties, and the checkpoint id's path type.
bool allowed_global(const std::string& name) {
  static const std::set<std::string> classes{
      "torch.distributed.checkpoint.metadata.Metadata",
      "torch.distributed.checkpoint.metadata.MetadataIndex",
      "torch.distributed.checkpoint.metadata.TensorStorageMetadata",
      "torch.distributed.checkpoint.metadata.BytesStorageMetadata",
      "torch.distributed.checkpoint.metadata.ChunkStorageMetadata",
      "torch.distributed.checkpoint.metadata.TensorProperties",
      "torch.distributed.checkpoint.metadata.StorageMeta",
      "torch.distributed._shard.sharded_tensor.metadata.TensorProperties",
      "torch.distributed.checkpoint.filesystem._StorageInfo",
      "torch.distributed.checkpoint.planner.LoadItemType",
      "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",  // TensorProperties' memory format
      "torch.serialization._get_layout",                              // and its layout, by name
      "torch.Size", "torch.strided", "torch.contiguous_format", "torch.preserve_format", "torch.channels_last",
      "collections.OrderedDict", "pathlib.PosixPath", "pathlib._local.PosixPath"};  // StorageMeta's checkpoint_id
  return classes.count(name) > 0 || dtypes().count(name) > 0;
}

/// Reading one part of the tree, with where it is for errors.
struct Reader {
  std::string what;

  template <typename... Args>
  [[noreturn]] void fail(const std::string& where, const Args&... args) const {
    TESSERA_FAIL(what, ": ", where, ": ", args...);
  }
  const PickleNode& object(const PickleNode* n, std::string_view type, const std::string& where) const {
    if (!n || n->kind != Kind::object || n->type.size() < type.size() ||
        n->type.compare(n->type.size() - type.size(), type.size(), type) != 0)
      fail(where, "expected an object of ", type, ", found ", n ? n->describe() : "nothing");
    return *n;
  }
  /// A dataclass's field: BUILD's state is its __dict__, or (None, slots) for slotted classes.
  const PickleNode* field(const PickleNode& o, std::string_view name, const std::string& where,
                          bool required = true) const {
    const PickleNode* state = o.state;
    if (state && state->kind == Kind::tuple && state->items.size() == 2 && state->items[1]->kind == Kind::dict)
      state = state->items[1];
    const PickleNode* v = state ? state->get(name) : nullptr;
    if (!v && required) fail(where, o.type, " has no field '", name, "'");
    return v;
  }
  std::int64_t integer(const PickleNode* n, const std::string& where) const {
    if (!n || n->kind != Kind::integer) fail(where, "expected an int, found ", n ? n->describe() : "nothing");
    return n->integer;
  }
  std::string string(const PickleNode* n, const std::string& where) const {
    if (!n || n->kind != Kind::string) fail(where, "expected a str, found ", n ? n->describe() : "nothing");
    return n->text;
  }
  /// torch.Size((...)) or a plain tuple/list of non-negative ints.
  std::vector<std::int64_t> size(const PickleNode* n, const std::string& where) const {
    if (n && n->kind == Kind::object && n->type == "torch.Size") {
      if (!n->args || n->args->items.size() != 1) fail(where, "torch.Size without its one argument");
      n = n->args->items[0];
    }
    if (!n || (n->kind != Kind::tuple && n->kind != Kind::list))
      fail(where, "expected a torch.Size, found ", n ? n->describe() : "nothing");
    std::vector<std::int64_t> out;
    for (const PickleNode* d : n->items) {
      const std::int64_t v = integer(d, where);
      if (v < 0) fail(where, "a negative size or offset (", v, ")");
      out.push_back(v);
    }
    return out;
  }
  at::ScalarType dtype(const PickleNode& properties, const std::string& where) const {
    // TensorProperties pickles through __getstate__ as (dtype, layout, requires_grad,
    // memory_format, pin_memory); older PyTorch kept its __dict__.
    const PickleNode* d = nullptr;
    if (properties.state && properties.state->kind == Kind::tuple && !properties.state->items.empty())
      d = properties.state->items[0];
    else
      d = field(properties, "dtype", where);
    if (!d || d->kind != Kind::global || !dtypes().count(d->text))
      fail(where, "a tensor dtype tessera does not read (", d ? d->describe() : "nothing", "); valid: float32, ",
           "float64, float16, bfloat16, int64, int32, int16, int8, uint8, bool");
    return dtypes().at(d->text);
  }
  DcpStorage storage(const PickleNode* n, const std::string& where) const {
    const PickleNode& info = object(n, "._StorageInfo", where);
    DcpStorage s;
    s.file = string(field(info, "relative_path", where), where + " relative_path");
    const std::int64_t offset = integer(field(info, "offset", where), where + " offset");
    const std::int64_t length = integer(field(info, "length", where), where + " length");
    if (offset < 0 || length < 0) fail(where, "a negative byte offset or length (", offset, ", ", length, ")");
    s.offset = static_cast<std::uint64_t>(offset);
    s.length = static_cast<std::uint64_t>(length);
    const fs::path file(s.file);
    if (s.file.empty() || file.is_absolute() || file.has_parent_path() || s.file == "." || s.file == "..")
      fail(where, "data file \"", s.file, "\" is not a file name inside the checkpoint folder");
    if (const PickleNode* t = field(info, "transform_descriptors", where, false);
        t && t->kind != Kind::none && !t->items.empty())
      fail(where, "is stored through transforms (compression?), which tessera does not read");
    return s;
  }
};

/// DCP keys that are not model weights: optimizer state, torchtitan's other Stateful entries.
bool is_training_state_key(const std::string& key) {
  for (const char* prefix : {"optimizer.", "optim.", "state.", "param_groups.", "train_state.", "lr_scheduler.",
                             "dataloader.", "tessera."})
    if (key.rfind(prefix, 0) == 0) return true;
  return false;
}

/// Where a DCP save of tessera's keeps rank r's trainer state (a bytes item).
std::string trainer_state_key(std::int64_t rank) { return "tessera.trainer_state.rank_" + std::to_string(rank); }

/// Rank `rank`'s trainer state in a DCP save of tessera's (rank 0's when the save had fewer
/// ranks); none in a folder another program wrote.
std::optional<sdk::Checkpoint> saved_trainer_state(const std::string& path, const DcpMetadata& m, std::int64_t rank) {
  for (const std::int64_t r : {rank, std::int64_t{0}})
    if (auto it = m.bytes.find(trainer_state_key(r)); it != m.bytes.end())
      return checkpoint_dict(
          EmbeddedArchives((fs::path(path) / it->second.file).string()).load(it->second.offset, it->second.length),
          "DCP checkpoint " + path + " [" + it->first + "]");
  return std::nullopt;
}

/// The per-parameter optimizer tensors read: Adam's and AdamW's moments, SGD's momentum.
const std::vector<std::string> kMoments{"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer"};

bool is_optimizer_moment(const std::string& key) {
  if (!is_training_state_key(key)) return false;
  for (const std::string& m : kMoments)
    if (key.size() > m.size() && key.compare(key.size() - m.size() - 1, m.size() + 1, "." + m) == 0) return true;
  return false;
}

std::string key_text(const std::string& fqn, const std::vector<std::int64_t>& offsets) {
  std::ostringstream out;
  out << fqn << " at offsets [";
  for (std::size_t i = 0; i < offsets.size(); ++i) out << (i ? ", " : "") << offsets[i];
  out << "]";
  return out.str();
}

}  // namespace

DcpMetadata parse_dcp_metadata(std::string_view pickle, const std::string& what) {
  const detail::PickleTree tree = detail::read_pickle_tree(pickle, allowed_global, what);
  const Reader r{what};
  const PickleNode& metadata = r.object(tree.root, ".Metadata", "the top value");
  const PickleNode* entries = r.field(metadata, "state_dict_metadata", "Metadata");
  if (entries->kind != Kind::dict) r.fail("state_dict_metadata", "expected a dict, found ", entries->describe());
  const PickleNode* storage = r.field(metadata, "storage_data", "Metadata");
  if (storage->kind != Kind::dict) r.fail("storage_data", "expected a dict, found ", storage->describe(),
                                         " (saved by a storage writer other than FileSystemWriter?)");
  // storage_data: MetadataIndex(fqn, offset) -> _StorageInfo(file, offset, length).
  std::map<std::pair<std::string, std::vector<std::int64_t>>, DcpStorage> stored;
  for (std::size_t i = 0; i + 1 < storage->items.size(); i += 2) {
    const std::string where = "storage_data entry " + std::to_string(i / 2);
    const PickleNode& index = r.object(storage->items[i], ".MetadataIndex", where);
    const std::string fqn = r.string(r.field(index, "fqn", where), where + " fqn");
    const PickleNode* offset = r.field(index, "offset", where, false);
    std::vector<std::int64_t> offsets =
        offset && offset->kind != Kind::none ? r.size(offset, where + " offset") : std::vector<std::int64_t>{};
    if (!stored.emplace(std::make_pair(fqn, offsets), r.storage(storage->items[i + 1], where)).second)
      r.fail(where, "a second storage record for ", key_text(fqn, offsets));
  }

  DcpMetadata out;
  for (std::size_t i = 0; i + 1 < entries->items.size(); i += 2) {
    const std::string fqn = r.string(entries->items[i], "state_dict_metadata key " + std::to_string(i / 2));
    const std::string where = "state_dict_metadata['" + fqn + "']";
    const PickleNode* entry = entries->items[i + 1];
    if (entry && entry->kind == Kind::object && entry->type == std::string(kMetadataModule) + "BytesStorageMetadata") {
      auto it = stored.find({fqn, {}});
      if (it == stored.end()) r.fail(where, "no storage_data record for it");
      out.bytes.emplace(fqn, it->second);
      continue;
    }
    const PickleNode& meta = r.object(entry, ".TensorStorageMetadata", where);
    DcpTensor t;
    t.dtype = r.dtype(r.object(r.field(meta, "properties", where), ".TensorProperties", where + " properties"),
                      where + " properties");
    t.size = r.size(r.field(meta, "size", where), where + " size");
    std::int64_t numel = 1;
    for (std::int64_t d : t.size) {
      if (d != 0 && numel > std::numeric_limits<std::int64_t>::max() / 16 / d)
        r.fail(where, "a tensor too large to be real (size overflows)");
      numel *= d;
    }
    const PickleNode* chunks = r.field(meta, "chunks", where);
    if (chunks->kind != Kind::list) r.fail(where, "chunks: expected a list, found ", chunks->describe());
    std::int64_t covered = 0;
    for (std::size_t c = 0; c < chunks->items.size(); ++c) {
      const std::string at = where + " chunk " + std::to_string(c);
      const PickleNode& chunk = r.object(chunks->items[c], ".ChunkStorageMetadata", at);
      DcpChunk k;
      k.offsets = r.size(r.field(chunk, "offsets", at), at + " offsets");
      k.sizes = r.size(r.field(chunk, "sizes", at), at + " sizes");
      if (k.offsets.size() != t.size.size() || k.sizes.size() != t.size.size())
        r.fail(at, "has ", k.offsets.size(), "-d offsets and ", k.sizes.size(), "-d sizes for a ", t.size.size(),
               "-d tensor");
      std::int64_t elements = 1;
      for (std::size_t d = 0; d < t.size.size(); ++d) {
        if (k.offsets[d] > t.size[d] || k.sizes[d] > t.size[d] - k.offsets[d])
          r.fail(at, "lies outside the tensor (dim ", d, ": offset ", k.offsets[d], " + size ", k.sizes[d], " > ",
                 t.size[d], ")");
        elements *= k.sizes[d];
      }
      covered += elements;
      auto it = stored.find({fqn, k.offsets});
      if (it == stored.end()) r.fail(at, "no storage_data record for ", key_text(fqn, k.offsets));
      k.storage = it->second;
      t.chunks.push_back(std::move(k));
    }
    // Chunks do not overlap (each element is saved once), so together they are the tensor.
    if (covered != numel)
      r.fail(where, "its chunks hold ", covered, " elements but the tensor has ", numel,
             covered < numel ? " (chunks missing)" : " (chunks overlap)");
    out.tensors.emplace(fqn, std::move(t));
  }
  return out;
}

DcpMetadata read_dcp_metadata(const std::string& folder) {
  const fs::path file = fs::path(folder) / kDcpMetadataName;
  std::error_code ec;
  TESSERA_CHECK(fs::is_regular_file(file, ec), "DCP checkpoint ", folder, " has no ", kDcpMetadataName, " file");
  const auto bytes = fs::file_size(file, ec);
  TESSERA_CHECK(!ec && bytes < (std::uintmax_t{1} << 31), file.string(), " cannot be read (",
                ec ? ec.message() : std::to_string(bytes) + " bytes: too large for a metadata file", ")");
  std::ifstream in(file, std::ios::binary);
  std::string pickle(static_cast<std::size_t>(bytes), '\0');
  in.read(pickle.data(), static_cast<std::streamsize>(pickle.size()));
  TESSERA_CHECK(in.gcount() == static_cast<std::streamsize>(pickle.size()), "cannot read ", file.string());
  DcpMetadata m = parse_dcp_metadata(pickle, file.string());
  // Every byte range inside its file, before anything is read.
  std::map<std::string, std::uintmax_t> sizes;
  auto check = [&](const std::string& fqn, const DcpStorage& s) {
    auto it = sizes.find(s.file);
    if (it == sizes.end()) {
      const fs::path data = fs::path(folder) / s.file;
      TESSERA_CHECK(fs::is_regular_file(data, ec), "DCP checkpoint ", folder, ": '", fqn, "' is stored in ", s.file,
                    ", which is missing");
      it = sizes.emplace(s.file, fs::file_size(data, ec)).first;
    }
    TESSERA_CHECK(s.offset <= it->second && s.length <= it->second - s.offset, "DCP checkpoint ", folder, ": '", fqn,
                  "' is stored at bytes [", s.offset, ", ", s.offset + s.length, ") of ", s.file, ", which has ",
                  it->second, " bytes (truncated?)");
  };
  for (const auto& [fqn, t] : m.tensors)
    for (const auto& c : t.chunks) check(fqn, c.storage);
  for (const auto& [fqn, s] : m.bytes) check(fqn, s);
  return m;
}

sdk::Checkpoint dcp_trainer_state(const std::string& path) {
  const DcpMetadata metadata = read_dcp_metadata(path);
  if (std::optional<sdk::Checkpoint> saved = saved_trainer_state(path, metadata, 0)) {  // a save of tessera's
    (void)saved->erase("optimizer_states");
    return *saved;
  }
  sdk::Checkpoint state = sdk::make_checkpoint();
  bool moments = false;
  for (const auto& [key, t] : metadata.tensors) moments = moments || is_optimizer_moment(key);
  if (!moments) state.insert(kWeightsOnlyKey, true);
  state.insert("tessera_source", std::string("dcp"));
  return state;
}

DcpModelShape dcp_model_shape(const std::string& hf_config_json) {
  DcpModelShape shape;
  if (hf_config_json.empty()) return shape;
  const auto config = nlohmann::json::parse(hf_config_json, nullptr, false);
  if (!config.is_object() || !config.contains("num_attention_heads")) return shape;
  shape.heads = config.value("num_attention_heads", std::int64_t{0});
  shape.kv_heads = config.value("num_key_value_heads", shape.heads);
  return shape;
}

DcpModelShape dcp_model_shape(const sdk::Module& model) {
  const auto* hf = dynamic_cast<const sdk::HuggingFaceModel*>(&model);
  return hf ? dcp_model_shape(hf->hf_config_json()) : DcpModelShape{};
}

namespace {

/// How one wanted tensor is found in the folder.
struct Source {
  std::string key;       ///< its DCP key
  std::string fqn;       ///< the key without a ModelWrapper `model.` prefix (what optimizer keys use)
  std::int64_t heads = 0;  ///< > 0: a torchtitan q/k weight, rows permuted by this many heads
};

/// torchtitan's Llama name (torchtitan/models/llama3 state_dict_adapter) for a Hugging Face name,
/// and 'q' / 'k' for the weights its converter permutes by the query / key-value head count.
std::optional<std::pair<std::string, char>> torchtitan_name(const std::string& hf) {
  struct Rename {
    const char *hf, *torchtitan;
    char permuted;
  };
  static const std::vector<Rename> layer{
      {"self_attn.q_proj.weight", "attention.wq.weight", 'q'},
      {"self_attn.k_proj.weight", "attention.wk.weight", 'k'},
      {"self_attn.v_proj.weight", "attention.wv.weight", ' '},
      {"self_attn.o_proj.weight", "attention.wo.weight", ' '},
      {"mlp.gate_proj.weight", "feed_forward.w1.weight", ' '},
      {"mlp.up_proj.weight", "feed_forward.w3.weight", ' '},
      {"mlp.down_proj.weight", "feed_forward.w2.weight", ' '},
      {"input_layernorm.weight", "attention_norm.weight", ' '},
      {"post_attention_layernorm.weight", "ffn_norm.weight", ' '}};
  if (hf == "model.embed_tokens.weight") return std::make_pair("tok_embeddings.weight", ' ');
  if (hf == "model.norm.weight") return std::make_pair("norm.weight", ' ');
  if (hf == "lm_head.weight") return std::make_pair("output.weight", ' ');
  const std::string prefix = "model.layers.";
  if (hf.rfind(prefix, 0) != 0) return std::nullopt;
  const std::size_t dot = hf.find('.', prefix.size());
  if (dot == std::string::npos) return std::nullopt;
  const std::string index = hf.substr(prefix.size(), dot - prefix.size()), rest = hf.substr(dot + 1);
  for (const Rename& r : layer)
    if (rest == r.hf) return std::make_pair("layers." + index + "." + r.torchtitan, r.permuted);
  return std::nullopt;
}

std::optional<Source> find_source(const std::string& name, const DcpMetadata& m, const DcpModelShape& shape) {
  if (m.tensors.count(name)) return Source{name, name, 0};
  if (m.tensors.count("model." + name)) return Source{"model." + name, name, 0};
  if (auto tt = torchtitan_name(name)) {
    const std::int64_t heads = tt->second == 'q' ? shape.heads : tt->second == 'k' ? shape.kv_heads : 0;
    for (const std::string& key : {tt->first, "model." + tt->first})
      if (m.tensors.count(key)) {
        TESSERA_CHECK(tt->second == ' ' || heads > 0, "DCP key ", key, " is a torchtitan Llama's ",
                      tt->second == 'q' ? "query" : "key", " weight, whose rows are permuted by head; the model does ",
                      "not say its head counts (num_attention_heads in its Hugging Face config)");
        return Source{key, tt->first, heads};
      }
  }
  return std::nullopt;
}

/// torchtitan's `_permute` (its Llama's interleaved rotary pairs to Hugging Face's halves).
at::Tensor to_hf_rotary_layout(const at::Tensor& w, std::int64_t heads) {
  const std::int64_t rows = w.size(0);
  TESSERA_CHECK(rows % (2 * heads) == 0, "a torchtitan q/k weight of ", rows, " rows does not split into ", heads,
                " heads of an even head dimension");
  std::vector<std::int64_t> shape{heads, rows / heads / 2, 2};
  for (std::int64_t d = 1; d < w.dim(); ++d) shape.push_back(w.size(d));
  return w.reshape(shape).transpose(1, 2).reshape(w.sizes()).contiguous();
}

/// Reads chunks of the folder's tensors, mapping each data file once.
class ChunkReader {
 public:
  ChunkReader(std::string folder, const DcpMetadata& m) : folder_(std::move(folder)), m_(m) {}

  /// `want` of tensor `key` (laid out as want.local_shape()), from the chunks that overlap it.
  at::Tensor read(const std::string& key, const TensorPiece& want) {
    const DcpTensor& t = m_.tensors.at(key);
    if (t.size.empty()) {  // a scalar (an optimizer's step): its one chunk
      TESSERA_CHECK(t.chunks.size() == 1, "DCP checkpoint ", folder_, ": scalar '", key, "' has ", t.chunks.size(),
                    " chunks");
      return load(key, t.chunks[0], TensorPiece::whole({})).clone();
    }
    at::Tensor out = at::empty(want.local_shape(), at::TensorOptions().dtype(t.dtype));
    std::int64_t copied = 0;
    for (const DcpChunk& c : t.chunks) {
      const TensorPiece piece = TensorPiece::box(t.size, c.offsets, c.sizes);
      if (needed_extent(piece, want).first.numel() == 0) continue;
      const at::Tensor stored = load(key, c, piece);
      copied += copy_overlap(piece, stored, want, out);
      release_loaded_pages(stored);
    }
    TESSERA_CHECK(copied == want.numel(), "DCP checkpoint ", folder_, ": the chunks of '", key, "' cover ", copied,
                  " of the ", want.numel(), " elements of ", want.to_string());
    return out;
  }

 private:
  at::Tensor load(const std::string& key, const DcpChunk& c, const TensorPiece& piece) {
    auto it = files_.find(c.storage.file);
    if (it == files_.end())
      it = files_.emplace(c.storage.file, EmbeddedArchives((fs::path(folder_) / c.storage.file).string())).first;
    const c10::IValue v = it->second.load(c.storage.offset, c.storage.length);
    const std::string where = "DCP checkpoint " + folder_ + ": '" + key + "' " + piece.to_string() + " (" +
                              c.storage.file + " bytes " + std::to_string(c.storage.offset) + "+" +
                              std::to_string(c.storage.length) + ")";
    TESSERA_CHECK(v.isTensor(), where, " is not a tensor record");
    const at::Tensor stored = v.toTensor();
    TESSERA_CHECK(stored.sizes().vec() == piece.local_shape() && stored.scalar_type() == m_.tensors.at(key).dtype,
                  where, " holds a ", stored.scalar_type(), " tensor of shape ", stored.sizes(),
                  " where .metadata says ", m_.tensors.at(key).dtype, " ", c10::IntArrayRef(piece.local_shape()));
    return stored;
  }

  std::string folder_;
  const DcpMetadata& m_;
  std::map<std::string, EmbeddedArchives> files_;
};

}  // namespace

sdk::Checkpoint load_dcp(const std::string& path, const std::map<std::string, StackedPieces>& wanted,
                         const DcpModelShape& shape, std::int64_t rank) {
  const DcpMetadata m = read_dcp_metadata(path);
  // Names and shapes first: every wanted tensor found, every model key in the folder used.
  std::map<std::string, Source> sources;
  std::set<std::string> used;
  std::map<std::string, std::vector<std::int64_t>> saved;
  std::map<std::string, TensorPiece> first_pieces;
  for (const auto& [name, stack] : wanted) {
    TESSERA_CHECK(!stack.empty(), "no piece of '", name, "' is wanted");
    first_pieces.emplace(name, stack[0]);
    if (auto s = find_source(name, m, shape)) {
      sources.emplace(name, *s);
      used.insert(s->key);
      saved.emplace(name, m.tensors.at(s->key).size);
    }
  }
  for (const auto& [key, t] : m.tensors)
    if (!used.count(key) && !is_training_state_key(key)) saved.emplace(key, t.size);
  check_against_wanted(saved, first_pieces, "DCP checkpoint " + path);

  ChunkReader reader(path, m);
  auto assemble = [&](const std::string& key, std::int64_t heads, const StackedPieces& want) {
    std::vector<at::Tensor> parts;
    for (const TensorPiece& piece : want) {
      if (heads == 0) {
        parts.push_back(reader.read(key, piece));
        continue;
      }
      // A permuted weight is read whole (one tensor, one unit at most) and cut after the permutation.
      const TensorPiece whole = TensorPiece::whole(m.tensors.at(key).size);
      const at::Tensor hf = to_hf_rotary_layout(reader.read(key, whole), heads);
      at::Tensor out = at::empty(piece.local_shape(), hf.options());
      copy_overlap(whole, hf, piece, out);
      parts.push_back(out);
    }
    return parts.size() == 1 ? parts[0] : at::cat(parts, 0);
  };

  sdk::Checkpoint out = sdk::make_checkpoint();
  sdk::StateDict state;
  for (const auto& [name, stack] : wanted) {
    const Source& s = sources.at(name);
    state.insert(name, assemble(s.key, s.heads, stack));
  }
  out.insert("state_dict", to_ivalue(state));

  // Optimizer moments: all parameters or none (a partial state would train some from zero).
  const std::vector<std::string> optimizer_prefixes{"optimizer.state.", "optim.state.", "state."};
  std::vector<std::string> names, missing;
  c10::impl::GenericDict opt_state(c10::IntType::get(), c10::AnyType::get());
  double step = -1;
  for (const auto& [name, stack] : wanted) {
    const Source& s = sources.at(name);
    sdk::Checkpoint entry = sdk::make_checkpoint();
    for (const std::string& prefix : optimizer_prefixes) {
      const std::string base = prefix + s.fqn + ".";
      for (const std::string& moment : kMoments)
        if (m.tensors.count(base + moment)) entry.insert(moment, assemble(base + moment, s.heads, stack));
      if (auto it = m.tensors.find(base + "step"); it != m.tensors.end() && it->second.size.empty()) {
        const at::Tensor t = reader.read(base + "step", TensorPiece::whole({}));
        entry.insert("step", t.to(at::kFloat));
        step = std::max(step, t.item<double>());
      }
      if (entry.size() > 0) break;
    }
    if (entry.size() == 0) {
      missing.push_back(name);
      continue;
    }
    opt_state.insert(static_cast<std::int64_t>(names.size()), entry);
    names.push_back(name);
  }
  TESSERA_CHECK(names.empty() || missing.empty(), "DCP checkpoint ", path, " has optimizer state for ", names.size(),
                " parameters but none for ", sdk::join(missing), ": resuming would train those from zero moments; ",
                "load its weights with [trainer] init_from instead");
  // A folder tessera saved: its own trainer state, this rank's (rank 0's when the save had fewer).
  const std::optional<sdk::Checkpoint> own = saved_trainer_state(path, m, rank);
  if (names.empty()) {
    if (!own) out.insert(kWeightsOnlyKey, true);
    else
      for (const auto& e : *own)
        if (e.key().toStringRef() != "state_dict") out.insert_or_assign(e.key(), e.value());
    return out;
  }
  sdk::Checkpoint optimizer = sdk::make_checkpoint();
  optimizer.insert("state", opt_state);
  // Hyper-parameters are this run's ([optimizer] in the TOML): DCP keeps PyTorch's param_groups as
  // a pickled Python object, which tessera does not run.
  optimizer.insert("param_groups", c10::impl::GenericList(c10::AnyType::get()));
  c10::impl::GenericList param_names(c10::StringType::get());
  for (const auto& n : names) param_names.push_back(n);
  optimizer.insert("param_names", param_names);
  c10::impl::GenericList states(c10::AnyType::get());
  states.push_back(optimizer);
  out.insert("optimizer_states", states);

  if (own) {  // everything but the tensors, as saved; the optimizer's hyper-parameters too
    for (const auto& e : *own) {
      const std::string key = e.key().toStringRef();
      if (key == "optimizer_states" && !e.value().toListRef().empty())
        optimizer.insert_or_assign("param_groups", checkpoint_get(checkpoint_dict(e.value().toListRef()[0],
                                                                                  "[optimizer_states][0]"),
                                                                  "param_groups"));
      else if (key != "state_dict" && key != "optimizer_states")
        out.insert_or_assign(e.key(), e.value());
    }
    return out;
  }
  // The step: torchtitan's train_state.step, else the optimizer's (one per optimizer step).
  std::int64_t global_step = step < 0 ? 0 : static_cast<std::int64_t>(step + 0.5);
  if (auto it = m.tensors.find("train_state.step"); it != m.tensors.end() && it->second.size.empty())
    global_step = reader.read("train_state.step", TensorPiece::whole({})).item<std::int64_t>();
  out.insert("global_step", global_step);
  out.insert("epoch", std::int64_t{0});
  out.insert("batch_in_epoch", global_step);
  out.insert("rng_state", at::detail::getDefaultCPUGenerator().get_state());
  out.insert("precision_plugin", sdk::make_checkpoint());
  out.insert("tessera_source", std::string("dcp"));
  return out;
}

// ---- writing ------------------------------------------------------------------------------

namespace {

constexpr const char* kDataFile = "__0_0.distcp";

/// DCP's planner_data for a key tessera writes: optimizer entries nested under "optimizer" (the
/// state dict {"optimizer": {"state.<name>.<m>": t}}, torchtitan's), train_state.step under
/// "train_state", every other key at the top level.
std::vector<std::string> planner_path(const std::string& key) {
  if (key.rfind("optimizer.", 0) == 0) return {"optimizer", key.substr(10)};
  if (key == "train_state.step") return {"train_state", "step"};
  return {key};
}

/// The few pickle opcodes .metadata needs (protocol 2, which every Python 3 reads), written as
/// Python's pickler writes the same dataclasses: NEWOBJ of the class, then BUILD with its state.
class Pickler {
 public:
  std::string bytes{"\x80\x02"};

  void global(const std::string& module, const std::string& name) { bytes += "c" + module + "\n" + name + "\n"; }
  void none() { bytes += 'N'; }
  void boolean(bool b) { bytes += b ? '\x88' : '\x89'; }
  void integer(std::int64_t v) {
    if (v >= std::numeric_limits<std::int32_t>::min() && v <= std::numeric_limits<std::int32_t>::max()) {
      bytes += 'J';
      little(static_cast<std::uint64_t>(v), 4);
    } else {
      bytes += "\x8a\x08";  // LONG1 of 8 bytes, two's complement
      little(static_cast<std::uint64_t>(v), 8);
    }
  }
  void string(const std::string& s) {
    bytes += 'X';
    little(s.size(), 4);
    bytes += s;
  }
  void mark() { bytes += '('; }
  void tuple() { bytes += 't'; }  // MARK ... TUPLE
  void empty_tuple() { bytes += ')'; }
  void tuple1() { bytes += '\x85'; }
  void reduce() { bytes += 'R'; }
  void empty_dict() { bytes += '}'; }
  void set_items() { bytes += 'u'; }  // MARK key value ... SETITEMS
  void empty_list() { bytes += ']'; }
  void appends() { bytes += 'e'; }  // MARK item ... APPENDS
  void stop() { bytes += '.'; }

  /// `module.name()`: NEWOBJ of the class with no arguments.
  void new_object(const std::string& module, const std::string& name) {
    global(module, name);
    empty_tuple();
    bytes += '\x81';  // NEWOBJ
  }
  void build() { bytes += 'b'; }  // BUILD: the object below gets the state on top
  /// `module.name()` then BUILD with the dict `fields` writes: what a dataclass pickles as.
  template <typename Fields>
  void dataclass(const std::string& module, const std::string& name, Fields fields) {
    new_object(module, name);
    empty_dict();
    mark();
    fields();
    set_items();
    build();
  }
  void size(const std::vector<std::int64_t>& dims) {  // torch.Size((...))
    global("torch", "Size");
    if (dims.empty()) {
      empty_tuple();
    } else {
      mark();
      for (std::int64_t d : dims) integer(d);
      tuple();
    }
    tuple1();
    reduce();
  }

 private:
  void little(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) bytes += static_cast<char>((v >> (8 * i)) & 0xff);
  }
};

std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: TESSERA_FAIL("a ", dtype, " tensor cannot be written to a DCP folder");
  }
}

}  // namespace

std::string dcp_metadata_pickle(const DcpMetadata& metadata) {
  const std::string meta = "torch.distributed.checkpoint.metadata";
  Pickler p;
  p.dataclass(meta, "Metadata", [&] {
    p.string("state_dict_metadata");
    p.empty_dict();
    p.mark();
    for (const auto& tensor : metadata.tensors) {
      const std::string& fqn = tensor.first;
      const DcpTensor& t = tensor.second;
      p.string(fqn);
      p.dataclass(meta, "TensorStorageMetadata", [&] {
        p.string("properties");
        // TensorProperties pickles through __getstate__: (dtype, layout, requires_grad,
        // memory_format, pin_memory), the layout and memory format by name and by number.
        p.new_object(meta, "TensorProperties");
        p.mark();
        p.global("torch", dtype_name(t.dtype));
        p.global("torch.serialization", "_get_layout");
        p.string("torch.strided");
        p.tuple1();
        p.reduce();
        p.boolean(false);
        p.global(meta, "_MEM_FORMAT_ENCODING");
        p.integer(0);  // TORCH_CONTIGUOUS_FORMAT
        p.tuple1();
        p.reduce();
        p.boolean(false);
        p.tuple();
        p.build();
        p.string("size");
        p.size(t.size);
        p.string("chunks");
        p.empty_list();
        p.mark();
        for (const DcpChunk& c : t.chunks)
          p.dataclass(meta, "ChunkStorageMetadata", [&] {
            p.string("offsets");
            p.size(c.offsets);
            p.string("sizes");
            p.size(c.sizes);
          });
        p.appends();
      });
    }
    for (const auto& item : metadata.bytes) {
      p.string(item.first);
      p.new_object(meta, "BytesStorageMetadata");  // a dataclass without fields: no BUILD
    }
    p.set_items();
    // planner_data: each key's path in the nested state dict it was flattened from.
    p.string("planner_data");
    p.empty_dict();
    p.mark();
    auto planner_entry = [&](const std::string& fqn) {
      p.string(fqn);
      p.mark();
      for (const std::string& part : planner_path(fqn)) p.string(part);
      p.tuple();
    };
    for (const auto& tensor : metadata.tensors) planner_entry(tensor.first);
    for (const auto& item : metadata.bytes) planner_entry(item.first);
    p.set_items();
    p.string("storage_data");
    p.empty_dict();
    p.mark();
    auto storage_info = [&](const DcpStorage& storage) {
      p.dataclass("torch.distributed.checkpoint.filesystem", "_StorageInfo", [&] {
        p.string("relative_path");
        p.string(storage.file);
        p.string("offset");
        p.integer(static_cast<std::int64_t>(storage.offset));
        p.string("length");
        p.integer(static_cast<std::int64_t>(storage.length));
      });
    };
    for (const auto& item : metadata.bytes) {
      const std::string& fqn = item.first;
      const DcpStorage& b = item.second;
      p.dataclass(meta, "MetadataIndex", [&] {
        p.string("fqn");
        p.string(fqn);
        p.string("offset");
        p.none();
        p.string("index");
        p.none();
      });
      storage_info(b);
    }
    for (const auto& tensor : metadata.tensors)
      for (std::size_t i = 0; i < tensor.second.chunks.size(); ++i) {
        const std::string& fqn = tensor.first;
        const DcpChunk& c = tensor.second.chunks[i];
        p.dataclass(meta, "MetadataIndex", [&] {
          p.string("fqn");
          p.string(fqn);
          p.string("offset");
          p.size(c.offsets);
          p.string("index");
          p.integer(static_cast<std::int64_t>(i));
        });
        storage_info(c.storage);
      }
    p.set_items();
    p.string("storage_meta");
    p.none();
  });
  p.stop();
  return p.bytes;
}

DcpWriter::DcpWriter(std::string path) : path_(fs::absolute(path).lexically_normal().string()) {
  std::error_code ec;
  TESSERA_CHECK(!fs::exists(path_, ec), path_, " exists: export writes a new folder (remove it, or pick another)");
  temp_ = temporary_folder(path_, new_save_id());
  fs::create_directories(temp_, ec);
  TESSERA_CHECK(!ec, "cannot create ", temp_, ": ", ec.message());
  data_ = std::make_unique<std::ofstream>(fs::path(temp_) / kDataFile, std::ios::binary);
  TESSERA_CHECK(data_->good(), "cannot write ", temp_, "/", kDataFile);
}

DcpWriter::~DcpWriter() {
  if (committed_) return;
  data_.reset();
  std::error_code ignored;
  remove_tree(temp_, ignored);
}

void DcpWriter::add(const std::string& key, const at::Tensor& value) {
  TESSERA_CHECK(!committed_ && !metadata_.tensors.count(key), "DCP export: '", key, "' written twice");
  const at::Tensor t = value.detach().cpu().contiguous();
  DcpTensor entry;
  entry.dtype = t.scalar_type();
  (void)dtype_name(entry.dtype);  // refuses what the metadata cannot name, before writing
  entry.size = t.sizes().vec();
  DcpChunk chunk;
  chunk.offsets.assign(entry.size.size(), 0);
  chunk.sizes = entry.size;
  chunk.storage = {kDataFile, written_, write_archive(t, *data_)};
  TESSERA_CHECK(data_->good(), "cannot write ", temp_, "/", kDataFile, " (disk full?)");
  written_ += chunk.storage.length;
  entry.chunks.push_back(std::move(chunk));
  metadata_.tensors.emplace(key, std::move(entry));
}

void DcpWriter::commit() {
  data_->close();
  TESSERA_CHECK(data_->good(), "cannot write ", temp_, "/", kDataFile);
  detail::fsync_path(fs::path(temp_) / kDataFile, false);
  {
    std::ofstream out(fs::path(temp_) / kDcpMetadataName, std::ios::binary);
    out << dcp_metadata_pickle(metadata_);
    out.close();
    TESSERA_CHECK(out.good(), "cannot write ", temp_, "/", kDcpMetadataName);
  }
  detail::fsync_path(fs::path(temp_) / kDcpMetadataName, false);
  detail::fsync_path(temp_, true);
  std::error_code ec;
  fs::rename(temp_, path_, ec);
  TESSERA_CHECK(!ec, "cannot rename ", temp_, " to ", path_, ": ", ec.message());
  detail::fsync_path(fs::path(path_).parent_path(), true);
  committed_ = true;
}

namespace {

/// An optimizer's per-parameter value as a tensor ("step" may be a number).
at::Tensor state_tensor(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor();
  if (v.isInt()) return at::scalar_tensor(static_cast<double>(v.toInt()), at::kFloat);
  TESSERA_CHECK(v.isDouble(), "optimizer state holds a ", v.tagKind(), ", which a DCP folder cannot hold");
  return at::scalar_tensor(v.toDouble(), at::kFloat);
}

void add_optimizer_entry(DcpWriter& writer, const std::string& param, const std::string& key, const at::Tensor& t) {
  writer.add("optimizer.state." + param + "." + key, t);
}

}  // namespace

std::size_t export_dcp(const std::string& checkpoint, const std::string& to) {
  DcpWriter writer(to);
  std::size_t count = 0;
  std::int64_t global_step = -1;
  if (is_sharded_checkpoint(checkpoint)) {
    ShardedReader reader(read_manifest(checkpoint));
    const Manifest& m = reader.manifest();
    TESSERA_CHECK(!holds_rank_local_state(m), "checkpoint ", checkpoint, " holds rank-local state (fsdp ",
                  "state_dict_type = \"local\"), not the model's tensors: resume it so and save with [strategy] ",
                  "state_dict_type = \"sharded\" or \"full\" to export it");
    for (const auto& [name, t] : model_tensors(m)) {  // each assembled from its pieces, then written
      writer.add(name, reader.read(model_tensor_key(name), TensorPiece::whole(t->global_shape)));
      ++count;
    }
    for (const auto& [key, t] : m.tensors) {
      if (key.rfind("optimizer/", 0) != 0) continue;
      const std::size_t slash = key.rfind('/');
      add_optimizer_entry(writer, key.substr(10, slash - 10), key.substr(slash + 1),
                          reader.read(key, TensorPiece::whole(t.global_shape)));
      ++count;
    }
    // The steps are scalars in rank 0's own entries (its file's tessera.tree).
    SafetensorsReader& own = reader.file("rank-0-of-" + std::to_string(m.world_size) + ".safetensors");
    const auto tree = nlohmann::ordered_json::parse(own.metadata().at("tessera.tree"));
    if (tree.contains("optimizer_states") && !tree["optimizer_states"].empty()) {
      const auto& optimizer = tree["optimizer_states"][0];
      const auto& names = optimizer.at("param_names");
      if (optimizer.at("state").contains("__int_dict__"))
        for (const auto& kv : optimizer.at("state").at("__int_dict__"))
          if (kv.at(1).contains("step")) {
            const c10::IValue step = checkpoint_json::decode(kv.at(1).at("step"), [&](const std::string& n) { return own.read(n); });
            add_optimizer_entry(writer, names.at(kv.at(0).get<std::size_t>()).get<std::string>(), "step",
                                state_tensor(step));
            ++count;
          }
    }
    const sdk::Checkpoint state = read_trainer_state(checkpoint);
    if (state.contains("global_step")) global_step = state.at("global_step").toInt();
  } else {
    const sdk::Checkpoint c = load_checkpoint_file(checkpoint);
    check_tensor_checksums(c, checkpoint);
    for (const auto& item : state_dict_from(checkpoint_get(c, "state_dict"), checkpoint + " [state_dict]")) {
      writer.add(item.key(), item.value());
      release_loaded_pages(item.value());
      ++count;
    }
    if (c.contains("optimizer_states") && !c.at("optimizer_states").toListRef().empty()) {
      const sdk::Checkpoint by_name = rekey_optim_state_dict(
          checkpoint_dict(c.at("optimizer_states").toListRef()[0], checkpoint + " [optimizer_states][0]"),
          OptimStateKeyType::PARAM_NAME);
      for (const auto& param : checkpoint_dict(checkpoint_get(by_name, "state"), checkpoint + " optimizer state"))
        for (const auto& entry : checkpoint_dict(param.value(), checkpoint + " optimizer state")) {
          const at::Tensor t = state_tensor(entry.value());
          add_optimizer_entry(writer, param.key().toStringRef(), entry.key().toStringRef(), t);
          release_loaded_pages(t);
          ++count;
        }
    }
    if (c.contains("global_step")) global_step = c.at("global_step").toInt();
  }
  if (global_step >= 0) {
    writer.add("train_state.step", at::scalar_tensor(global_step, at::kLong));
    ++count;
  }
  writer.commit();
  return count;
}

// ---- saves during training ([checkpoint_io] plugin = "dcp") ----------------------------------

namespace {

std::string shard_data_file(std::int64_t rank) { return "__" + std::to_string(rank) + "_0.distcp"; }
std::string shard_record(std::int64_t rank) { return "rank-" + std::to_string(rank) + ".dcp.json"; }

}  // namespace

void write_dcp_shard(const sdk::Checkpoint& checkpoint, const std::string& path, std::int64_t rank,
                     std::int64_t world, const std::string& save_id) {
  TESSERA_CHECK(!checkpoint.contains("fsdp_state_dict_type") ||
                    checkpoint.at("fsdp_state_dict_type").toStringRef() != "local",
                "checkpoint_io \"dcp\" writes pieces of global tensors, and [strategy] state_dict_type = \"local\" ",
                "saves rank-local flat shards: use state_dict_type = \"sharded\" or \"full\"");
  const fs::path folder = temporary_folder(path, save_id);
  std::error_code ec;
  fs::create_directories(folder, ec);
  TESSERA_CHECK(!ec, "cannot create ", folder.string(), ": ", ec.message());
  const sdk::StateDict state = state_dict_from(checkpoint_get(checkpoint, "state_dict"), "checkpoint [state_dict]");
  std::map<std::string, StackedPieces> pieces;
  if (checkpoint.contains(kTensorPiecesKey) || checkpoint.contains(kLegacyShardMetadataKey))
    pieces = stacked_pieces_from_ivalue(
        checkpoint.at(checkpoint.contains(kTensorPiecesKey) ? kTensorPiecesKey : kLegacyShardMetadataKey),
        "checkpoint [" + std::string(kTensorPiecesKey) + "]", &state);
  else  // a full save (rank 0 alone) or a replicated one: whole tensors
    for (const auto& item : state) pieces[item.key()] = {TensorPiece::whole(item.value().sizes())};

  const std::string data_name = shard_data_file(rank);
  std::ofstream data(folder / data_name, std::ios::binary);
  checkpoint_json::json record = {{"save_id", save_id}, {"file", data_name}, {"tensors", checkpoint_json::json::array()},
                                  {"bytes", checkpoint_json::json::array()}};
  std::uint64_t written = 0;
  auto add_chunk = [&](const std::string& key, const TensorPiece& box, const at::Tensor& part) {
    const at::Tensor t = part.detach().cpu().contiguous();
    const std::uint64_t length = write_archive(t, data);
    record["tensors"].push_back({{"key", key}, {"dtype", dtype_name(t.scalar_type())},
                                 {"size", box.global_shape}, {"offsets", box.offsets}, {"sizes", box.lengths},
                                 {"offset", written}, {"length", length}});
    written += length;
  };
  auto add_pieces = [&](const std::string& key, const std::string& param, const at::Tensor& local) {
    auto it = pieces.find(param);
    TESSERA_CHECK(it != pieces.end(), "checkpoint tensor ", key, ": '", param, "' has no piece description");
    const StackedPieces& stack = it->second;
    const std::vector<at::Tensor> parts = stack.size() == 1 ? std::vector<at::Tensor>{local} : split_stacked(local, stack);
    for (std::size_t k = 0; k < stack.size(); ++k)
      for (const auto& [box, part] : as_boxes(stack[k], parts[k].contiguous())) add_chunk(key, box, part);
  };
  for (const auto& item : state) add_pieces(item.key(), item.key(), item.value());

  // The rest of this rank's checkpoint: the optimizer's moments as pieces, its steps once
  // (rank 0), the other entries as this rank's trainer state.
  sdk::Checkpoint rest = sdk::make_checkpoint();
  for (const auto& e : checkpoint) {
    const std::string key = e.key().toStringRef();
    if (key == "state_dict" || key == kTensorPiecesKey || key == kLegacyShardMetadataKey) continue;
    if (key != "optimizer_states" || e.value().toListRef().empty()) {
      rest.insert(e.key(), e.value());
      continue;
    }
    const sdk::Checkpoint opt = checkpoint_dict(e.value().toListRef()[0], "checkpoint [optimizer_states][0]");
    std::vector<std::string> names;
    for (const c10::IValue& n : checkpoint_get(opt, "param_names").toListRef()) names.push_back(n.toStringRef());
    for (const auto& entry : checkpoint_dict(checkpoint_get(opt, "state"), "optimizer state")) {
      const std::int64_t index = entry.key().toInt();
      TESSERA_CHECK(index >= 0 && index < static_cast<std::int64_t>(names.size()), "optimizer state of parameter ",
                    "index ", index, " but 'param_names' has ", names.size(), " entries");
      const std::string& name = names[static_cast<std::size_t>(index)];
      for (const auto& m : checkpoint_dict(entry.value(), "optimizer state of " + name)) {
        const std::string key_m = "optimizer.state." + name + "." + m.key().toStringRef();
        if (m.key().toStringRef() == "step") {
          if (rank == 0) add_chunk(key_m, TensorPiece::whole({}), state_tensor(m.value()));
        } else {
          add_pieces(key_m, name, m.value().toTensor());
        }
      }
    }
    sdk::Checkpoint groups = sdk::make_checkpoint();  // hyper-parameters and names, no tensors
    groups.insert("param_groups", checkpoint_get(opt, "param_groups"));
    groups.insert("param_names", checkpoint_get(opt, "param_names"));
    c10::impl::GenericList list(c10::AnyType::get());
    list.push_back(groups);
    rest.insert("optimizer_states", list);
  }
  const std::uint64_t length = write_archive(rest, data);
  record["bytes"].push_back({{"key", trainer_state_key(rank)}, {"offset", written}, {"length", length}});
  data.close();
  TESSERA_CHECK(data.good(), "cannot write ", (folder / data_name).string(), " (disk full?)");
  detail::fsync_path(folder / data_name, false);
  // The record last: rank 0 commits only what every rank finished.
  const fs::path record_file = folder / shard_record(rank);
  checkpoint_json::write_json(record_file.string() + ".tmp", record);
  detail::fsync_path(record_file.string() + ".tmp", false);
  fs::rename(record_file.string() + ".tmp", record_file, ec);
  TESSERA_CHECK(!ec, "cannot rename ", record_file.string(), ".tmp: ", ec.message());
}

void commit_dcp(const std::string& path, std::int64_t world, const std::string& save_id) {
  const fs::path folder = temporary_folder(path, save_id);
  std::error_code ec;
  try {
    DcpMetadata m;
    for (std::int64_t r = 0; r < world; ++r) {
      const fs::path record_file = folder / shard_record(r);
      TESSERA_CHECK(fs::exists(record_file, ec), "DCP checkpoint ", path, ": rank ", r, " of ", world,
                    " did not finish writing its part; the previous checkpoint is kept");
      const auto record = checkpoint_json::read_json(record_file, "the save record");
      TESSERA_CHECK(record.at("save_id").get<std::string>() == save_id, record_file.string(),
                    " belongs to another save");
      const std::string file = record.at("file").get<std::string>();
      for (const auto& t : record.at("tensors")) {
        const std::string key = t.at("key").get<std::string>();
        DcpTensor& entry = m.tensors[key];
        const auto size = t.at("size").get<std::vector<std::int64_t>>();
        const at::ScalarType dtype = dtypes().at("torch." + t.at("dtype").get<std::string>());
        if (entry.chunks.empty()) entry.size = size, entry.dtype = dtype;
        TESSERA_CHECK(entry.size == size && entry.dtype == dtype, "DCP checkpoint ", path, ": rank ", r, " saved ",
                      key, " with another shape or dtype than the rank before it");
        entry.chunks.push_back({t.at("offsets").get<std::vector<std::int64_t>>(),
                                t.at("sizes").get<std::vector<std::int64_t>>(),
                                {file, t.at("offset").get<std::uint64_t>(), t.at("length").get<std::uint64_t>()}});
      }
      for (const auto& b : record.at("bytes"))
        m.bytes[b.at("key").get<std::string>()] = {file, b.at("offset").get<std::uint64_t>(),
                                                   b.at("length").get<std::uint64_t>()};
    }
    const std::string pickle = dcp_metadata_pickle(m);
    (void)parse_dcp_metadata(pickle, "the .metadata of " + path);  // every tensor covered exactly, as a reader checks
    for (std::int64_t r = 0; r < world; ++r) fs::remove(folder / shard_record(r), ec);
    {
      std::ofstream out(folder / kDcpMetadataName, std::ios::binary);
      out << pickle;
      out.close();
      TESSERA_CHECK(out.good(), "cannot write ", (folder / kDcpMetadataName).string());
    }
    detail::fsync_path(folder / kDcpMetadataName, false);
    detail::fsync_path(folder, true);
    detail::publish_folder(folder, path);
  } catch (...) {
    remove_tree(folder.string(), ec);
    throw;
  }
}

}  // namespace tessera::core
