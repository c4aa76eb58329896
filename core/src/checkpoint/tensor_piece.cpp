#include "tessera/core/tensor_piece.hpp"

#include <algorithm>
#include <limits>
#include <sstream>

#include <ATen/ATen.h>

#include "tessera/sdk/error.hpp"

namespace tessera::core {

namespace {

std::int64_t product(const std::vector<std::int64_t>& dims) {
  std::int64_t n = 1;
  for (auto d : dims) n *= d;
  return n;
}

std::string dims_string(const std::vector<std::int64_t>& dims) {
  std::ostringstream out;
  out << "[";
  for (std::size_t d = 0; d < dims.size(); ++d) out << (d ? ", " : "") << dims[d];
  out << "]";
  return out.str();
}

/// A box in global coordinates, and the local tensor (shaped as the box) that holds it.
struct Box {
  std::vector<std::int64_t> offsets, lengths;
  at::Tensor data;
};

/// Splits the flat range [a, b) of a row-major `shape` into boxes, each contiguous in the
/// flattened order: a partial run on the innermost dim, then partial blocks outward, one block
/// of whole rows, and back in (at most 2*ndim-1 boxes).
void flat_boxes(const std::vector<std::int64_t>& shape, std::size_t d, std::vector<std::int64_t>& prefix,
                std::int64_t a, std::int64_t b, std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>>& out) {
  if (a >= b) return;
  std::int64_t stride = 1;
  for (std::size_t k = d + 1; k < shape.size(); ++k) stride *= shape[k];
  auto emit = [&](std::int64_t lo, std::int64_t hi) {  // [lo, hi) on dim d, whole dims after it
    std::vector<std::int64_t> offsets = prefix, lengths(prefix.size(), 1);
    offsets.push_back(lo);
    lengths.push_back(hi - lo);
    for (std::size_t k = d + 1; k < shape.size(); ++k) {
      offsets.push_back(0);
      lengths.push_back(shape[k]);
    }
    out.emplace_back(std::move(offsets), std::move(lengths));
  };
  if (d + 1 == shape.size()) return emit(a, b);
  const std::int64_t first = a / stride, last = (b - 1) / stride;
  auto inner = [&](std::int64_t i, std::int64_t lo, std::int64_t hi) {
    prefix.push_back(i);
    flat_boxes(shape, d + 1, prefix, lo, hi, out);
    prefix.pop_back();
  };
  if (first == last && !(a % stride == 0 && b - a == stride)) return inner(first, a - first * stride, b - first * stride);
  std::int64_t lo = first, hi = last + 1;
  if (a % stride != 0) {
    inner(first, a % stride, stride);
    lo = first + 1;
  }
  if (b % stride != 0) hi = last;
  if (hi > lo) emit(lo, hi);
  if (b % stride != 0) inner(last, 0, b - last * stride);
}

/// The piece as boxes over views of `local` (laid out as piece.local_shape()).
std::vector<Box> boxes_of(const TensorPiece& piece, const at::Tensor& local, const char* which) {
  TESSERA_CHECK(local.numel() == piece.numel(), "copy_overlap: the ", which, " tensor has ", local.numel(),
                " elements but its piece ", piece.to_string(), " has ", piece.numel());
  // A 0-d tensor is handled as shape [1].
  std::vector<std::int64_t> shape = piece.global_shape.empty() ? std::vector<std::int64_t>{1} : piece.global_shape;
  std::vector<Box> out;
  if (piece.numel() == 0) return out;
  if (piece.kind == TensorPiece::Kind::box) {
    std::vector<std::int64_t> offsets = piece.offsets, lengths = piece.lengths;
    if (piece.global_shape.empty()) offsets = {0}, lengths = {1};
    out.push_back({offsets, lengths, local.sizes() == at::IntArrayRef(lengths) ? local : local.view(lengths)});
    return out;
  }
  TESSERA_CHECK(local.is_contiguous(), "copy_overlap: the ", which, " tensor of flat piece ", piece.to_string(),
                " must be contiguous");
  at::Tensor flat = local.view({-1});
  std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>> boxes;
  std::vector<std::int64_t> prefix;
  flat_boxes(shape, 0, prefix, piece.offsets[0], piece.offsets[0] + piece.lengths[0], boxes);
  std::int64_t at = 0;
  for (auto& [offsets, lengths] : boxes) {
    const std::int64_t n = product(lengths);
    out.push_back({offsets, lengths, flat.narrow(0, at, n).view(lengths)});
    at += n;
  }
  return out;
}

void check_range(const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& offsets,
                 const std::vector<std::int64_t>& lengths) {
  TESSERA_CHECK(offsets.size() == shape.size() && lengths.size() == shape.size(), "a box of a tensor of shape ",
                dims_string(shape), " needs ", shape.size(), " offsets and lengths; got ", offsets.size(), " and ",
                lengths.size());
  for (std::size_t d = 0; d < shape.size(); ++d)
    TESSERA_CHECK(offsets[d] >= 0 && lengths[d] >= 0 && offsets[d] + lengths[d] <= shape[d], "box offsets ",
                  dims_string(offsets), " lengths ", dims_string(lengths), " fall outside a tensor of shape ",
                  dims_string(shape), " (dim ", d, ")");
}

}  // namespace

TensorPiece TensorPiece::whole(at::IntArrayRef shape) {
  return box(shape, std::vector<std::int64_t>(shape.size(), 0), shape.vec());
}

TensorPiece TensorPiece::flat_range(at::IntArrayRef shape, std::int64_t start, std::int64_t length) {
  TensorPiece piece{Kind::flat, shape.vec(), {start}, {length}};
  const std::int64_t numel = product(piece.global_shape);
  TESSERA_CHECK(start >= 0 && length >= 0 && start + length <= numel, "flat range [", start, ", ", start + length,
                ") falls outside a tensor of shape ", dims_string(piece.global_shape), " (", numel, " elements)");
  return piece;
}

TensorPiece TensorPiece::box(at::IntArrayRef shape, std::vector<std::int64_t> offsets,
                             std::vector<std::int64_t> lengths) {
  TensorPiece piece{Kind::box, shape.vec(), std::move(offsets), std::move(lengths)};
  check_range(piece.global_shape, piece.offsets, piece.lengths);
  return piece;
}

std::int64_t TensorPiece::numel() const { return product(lengths); }

std::vector<std::int64_t> TensorPiece::local_shape() const { return lengths; }

bool TensorPiece::operator==(const TensorPiece& other) const {
  return kind == other.kind && global_shape == other.global_shape && offsets == other.offsets &&
         lengths == other.lengths;
}

std::string TensorPiece::to_string() const {
  std::ostringstream out;
  if (kind == Kind::flat) {
    out << "flat [" << offsets[0] << ", " << offsets[0] + lengths[0] << ")";
  } else {
    out << "box [";
    for (std::size_t d = 0; d < offsets.size(); ++d)
      out << (d ? ", " : "") << offsets[d] << ":" << offsets[d] + lengths[d];
    out << "]";
  }
  out << " of " << dims_string(global_shape);
  return out.str();
}

std::vector<std::pair<TensorPiece, at::Tensor>> as_boxes(const TensorPiece& piece, const at::Tensor& local) {
  if (piece.global_shape.empty()) return {{piece, local}};  // a scalar: one box of no dims
  std::vector<std::pair<TensorPiece, at::Tensor>> out;
  for (Box& b : boxes_of(piece, local, "stored"))
    out.emplace_back(TensorPiece::box(piece.global_shape, b.offsets, b.lengths), std::move(b.data));
  return out;
}

std::int64_t copy_overlap(const TensorPiece& src_piece, const at::Tensor& src, const TensorPiece& dst_piece,
                          const at::Tensor& dst) {
  TESSERA_CHECK(src_piece.global_shape == dst_piece.global_shape, "copy_overlap: pieces of different tensors (",
                src_piece.to_string(), " and ", dst_piece.to_string(), ")");
  const at::Tensor source = src.contiguous();  // read only: a copy is fine where src is strided
  std::int64_t copied = 0;
  for (const Box& s : boxes_of(src_piece, source, "source"))
    for (const Box& d : boxes_of(dst_piece, dst, "destination")) {
      at::Tensor from = s.data, to = d.data;
      std::int64_t n = 1;
      for (std::size_t k = 0; k < s.offsets.size() && n > 0; ++k) {
        const std::int64_t lo = std::max(s.offsets[k], d.offsets[k]);
        const std::int64_t hi = std::min(s.offsets[k] + s.lengths[k], d.offsets[k] + d.lengths[k]);
        n *= std::max<std::int64_t>(0, hi - lo);
        if (n == 0) break;
        from = from.narrow(static_cast<std::int64_t>(k), lo - s.offsets[k], hi - lo);
        to = to.narrow(static_cast<std::int64_t>(k), lo - d.offsets[k], hi - lo);
      }
      if (n == 0) continue;
      to.copy_(from);
      copied += n;
    }
  return copied;
}

std::pair<TensorPiece, std::int64_t> needed_extent(const TensorPiece& stored, const TensorPiece& wanted) {
  TESSERA_CHECK(stored.global_shape == wanted.global_shape, "needed_extent: pieces of different tensors (",
                stored.to_string(), " and ", wanted.to_string(), ")");
  std::vector<std::int64_t> shape = stored.global_shape.empty() ? std::vector<std::int64_t>{1} : stored.global_shape;
  std::vector<std::int64_t> strides(shape.size(), 1);
  for (std::size_t d = shape.size(); d-- > 1;) strides[d - 1] = strides[d] * shape[d];
  // The wanted piece as boxes (global coordinates).
  std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>> boxes;
  if (wanted.numel() > 0) {
    if (wanted.kind == TensorPiece::Kind::flat) {
      std::vector<std::int64_t> prefix;
      flat_boxes(shape, 0, prefix, wanted.offsets[0], wanted.offsets[0] + wanted.lengths[0], boxes);
    } else {
      boxes.emplace_back(wanted.global_shape.empty() ? std::vector<std::int64_t>{0} : wanted.offsets,
                         wanted.global_shape.empty() ? std::vector<std::int64_t>{1} : wanted.lengths);
    }
  }
  std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = -1;
  if (stored.kind == TensorPiece::Kind::flat) {
    // Exact: the first and last element of each (stored box) x (wanted box) intersection.
    const std::int64_t a = stored.offsets[0], b = a + stored.lengths[0];
    std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::int64_t>>> stored_boxes;
    std::vector<std::int64_t> prefix;
    flat_boxes(shape, 0, prefix, a, b, stored_boxes);
    for (const auto& [so, sl] : stored_boxes)
      for (const auto& [offsets, lengths] : boxes) {
        std::int64_t first = 0, last = 0;
        bool overlap = true;
        for (std::size_t d = 0; d < shape.size() && overlap; ++d) {
          const std::int64_t from = std::max(so[d], offsets[d]), to = std::min(so[d] + sl[d], offsets[d] + lengths[d]);
          overlap = from < to;
          first += from * strides[d];
          last += (to - 1) * strides[d];
        }
        if (!overlap) continue;
        lo = std::min(lo, first);
        hi = std::max(hi, last + 1);
      }
    if (hi < 0) return {TensorPiece::flat_range(stored.global_shape, a, 0), 0};
    return {TensorPiece::flat_range(stored.global_shape, lo, hi - lo), lo - a};
  }
  std::vector<std::int64_t> so = stored.global_shape.empty() ? std::vector<std::int64_t>{0} : stored.offsets;
  std::vector<std::int64_t> sl = stored.global_shape.empty() ? std::vector<std::int64_t>{1} : stored.lengths;
  for (const auto& [offsets, lengths] : boxes) {
    bool overlap = true;
    for (std::size_t d = 0; d < shape.size() && overlap; ++d)
      overlap = std::max(so[d], offsets[d]) < std::min(so[d] + sl[d], offsets[d] + lengths[d]);
    if (!overlap) continue;
    lo = std::min(lo, std::max(so[0], offsets[0]));
    hi = std::max(hi, std::min(so[0] + sl[0], offsets[0] + lengths[0]));
  }
  if (stored.global_shape.empty()) return {stored, 0};  // 0-d: the one element, needed or not
  std::vector<std::int64_t> offsets = stored.offsets, lengths = stored.lengths;
  if (hi < 0) lo = hi = so[0];
  offsets[0] = lo;
  lengths[0] = hi - lo;
  const std::int64_t row = lengths.size() > 1 ? product(std::vector<std::int64_t>(lengths.begin() + 1, lengths.end())) : 1;
  return {TensorPiece::box(stored.global_shape, offsets, lengths), (lo - so[0]) * row};
}

namespace {

std::vector<std::int64_t> int_list(const c10::IValue& value, const std::string& where) {
  TESSERA_CHECK(value.isIntList(), where, " is not a list of integers");
  return value.toIntVector();
}

c10::IValue piece_to_ivalue(const TensorPiece& piece) {
  c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
  entry.insert("kind", piece.kind == TensorPiece::Kind::flat ? "flat" : "box");
  entry.insert("global_shape", c10::List<std::int64_t>(piece.global_shape));
  entry.insert("offsets", c10::List<std::int64_t>(piece.offsets));
  entry.insert("lengths", c10::List<std::int64_t>(piece.lengths));
  return entry;
}

TensorPiece piece_from_ivalue(const c10::IValue& value, const std::string& where) {
  TESSERA_CHECK(value.isGenericDict(), where, " is neither a piece dictionary nor [start, ndim, dims...]");
  sdk::Checkpoint entry = value.toGenericDict();
  for (const char* key : {"kind", "global_shape", "offsets", "lengths"})
    TESSERA_CHECK(entry.contains(key), where, " has no '", key, "'");
  const c10::IValue& kind = entry.at("kind");
  TESSERA_CHECK(kind.isString() && (kind.toStringRef() == "flat" || kind.toStringRef() == "box"), where,
                "['kind'] must be \"flat\" or \"box\"");
  auto shape = int_list(entry.at("global_shape"), where + "['global_shape']");
  auto offsets = int_list(entry.at("offsets"), where + "['offsets']");
  auto lengths = int_list(entry.at("lengths"), where + "['lengths']");
  if (kind.toStringRef() == "box") return TensorPiece::box(shape, offsets, lengths);
  TESSERA_CHECK(offsets.size() == 1 && lengths.size() == 1, where, " is flat: it needs one offset and one length");
  return TensorPiece::flat_range(shape, offsets[0], lengths[0]);
}

}  // namespace

std::int64_t numel(const StackedPieces& pieces) {
  std::int64_t n = 0;
  for (const auto& p : pieces) n += p.numel();
  return n;
}

std::vector<at::Tensor> split_stacked(const at::Tensor& local, const StackedPieces& pieces) {
  TESSERA_CHECK(local.numel() == numel(pieces), "a local tensor of ", local.numel(), " elements cannot hold pieces of ",
                numel(pieces));
  const at::Tensor flat = local.reshape({-1});
  std::vector<at::Tensor> parts;
  std::int64_t start = 0;
  for (const auto& p : pieces) {
    parts.push_back(flat.narrow(0, start, p.numel()).view(p.local_shape()));
    start += p.numel();
  }
  return parts;
}

c10::IValue pieces_to_ivalue(const std::map<std::string, StackedPieces>& pieces) {
  c10::impl::GenericDict out(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [name, stack] : pieces) {
    if (stack.size() == 1) {
      out.insert(name, piece_to_ivalue(stack[0]));
      continue;
    }
    c10::impl::GenericList list(c10::AnyType::get());
    for (const auto& p : stack) list.push_back(piece_to_ivalue(p));
    out.insert(name, list);
  }
  return out;
}

c10::IValue pieces_to_ivalue(const std::map<std::string, TensorPiece>& pieces) {
  std::map<std::string, StackedPieces> stacks;
  for (const auto& [name, piece] : pieces) stacks.emplace(name, StackedPieces{piece});
  return pieces_to_ivalue(stacks);
}

std::map<std::string, StackedPieces> stacked_pieces_from_ivalue(const c10::IValue& value, const std::string& what,
                                                                const sdk::StateDict* stored) {
  TESSERA_CHECK(value.isGenericDict(), what, " is not a dictionary of tensor pieces");
  std::map<std::string, StackedPieces> out;
  for (const auto& item : value.toGenericDict()) {
    TESSERA_CHECK(item.key().isString(), what, " has a non-string key");
    const std::string name = item.key().toStringRef();
    const std::string where = what + "['" + name + "']";
    try {
      if (item.value().isIntList()) {  // legacy fsdp metadata: [start, ndim, dims...]
        std::vector<std::int64_t> m = item.value().toIntVector();
        TESSERA_CHECK(m.size() >= 2 && m[1] >= 0 && static_cast<std::int64_t>(m.size()) == 2 + m[1], where,
                      " is not [start, ndim, dims...]");
        TESSERA_CHECK(stored != nullptr, where, " is in the legacy fsdp format, which needs the stored tensors");
        const at::Tensor* tensor = stored->find(name);
        TESSERA_CHECK(tensor != nullptr, where, " describes a tensor that is not stored beside it");
        out[name].push_back(
            TensorPiece::flat_range(std::vector<std::int64_t>(m.begin() + 2, m.end()), m[0], tensor->numel()));
      } else if (item.value().isList()) {  // stacked pieces
        const auto list = item.value().toListRef();
        TESSERA_CHECK(!list.empty(), where, " is an empty list of pieces");
        for (std::size_t i = 0; i < list.size(); ++i)
          out[name].push_back(piece_from_ivalue(list[i], where + "[" + std::to_string(i) + "]"));
        const auto& first = out[name].front();
        for (const auto& p : out[name])
          TESSERA_CHECK(p.kind == TensorPiece::Kind::box && p.global_shape == first.global_shape &&
                            std::equal(p.lengths.begin() + 1, p.lengths.end(), first.lengths.begin() + 1),
                        where, ": stacked pieces must be boxes of one tensor with the same lengths after dim 0; ",
                        p.to_string(), " and ", first.to_string(), " are not");
      } else {
        out[name].push_back(piece_from_ivalue(item.value(), where));
      }
    } catch (const sdk::Error& e) {
      const std::string message = e.what();
      if (message.find(where) != std::string::npos) throw;
      TESSERA_FAIL(where, ": ", message);
    }
  }
  return out;
}

std::map<std::string, TensorPiece> pieces_from_ivalue(const c10::IValue& value, const std::string& what,
                                                      const sdk::StateDict* stored) {
  std::map<std::string, TensorPiece> out;
  for (auto& [name, stack] : stacked_pieces_from_ivalue(value, what, stored)) {
    TESSERA_CHECK(stack.size() == 1, what, "['", name, "'] is ", stack.size(),
                  " stacked pieces, which this reader does not take (a tensor-parallel sharded checkpoint: ",
                  "read it with the distributed checkpoint IO)");
    out.emplace(name, std::move(stack[0]));
  }
  return out;
}

}  // namespace tessera::core
