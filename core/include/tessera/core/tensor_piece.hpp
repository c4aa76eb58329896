#pragma once
/// One description of "which piece of a global tensor this local tensor is", shared by the
/// sharding layouts, state dicts and checkpoints (DTensor's placement, DCP's
/// ChunkStorageMetadata): a flat range of the flattened tensor (the flat-parameter layout) or
/// an N-D box of offsets and lengths (dim-0 shards, tensor-parallel slices).
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include "tessera/sdk/types.hpp"

namespace tessera::core {

/// Where a local tensor sits in its global tensor (DTensor's placement / DCP's ChunkStorageMetadata).
struct TensorPiece {
  enum class Kind : std::uint8_t { flat, box };
  Kind kind = Kind::box;
  std::vector<std::int64_t> global_shape;
  std::vector<std::int64_t> offsets;  ///< flat: {start} in the flattened row-major tensor; box: one per dim
  std::vector<std::int64_t> lengths;  ///< flat: {length}; box: one per dim

  /// The whole tensor (a box covering every dim).
  static TensorPiece whole(at::IntArrayRef shape);
  /// Elements [start, start + length) of the flattened tensor; throws if out of range.
  static TensorPiece flat_range(at::IntArrayRef shape, std::int64_t start, std::int64_t length);
  /// The box offsets[d] <= i_d < offsets[d] + lengths[d]; throws if out of range.
  static TensorPiece box(at::IntArrayRef shape, std::vector<std::int64_t> offsets, std::vector<std::int64_t> lengths);

  std::int64_t numel() const;                     ///< elements in the piece
  std::vector<std::int64_t> local_shape() const;  ///< flat: {length}; box: lengths
  bool operator==(const TensorPiece& other) const;
  bool operator!=(const TensorPiece& other) const { return !(*this == other); }
  std::string to_string() const;  ///< for error messages: "flat [start, end) of [4, 6]" / "box [0:2, 3:6] of [4, 6]"
};

/// Copies the elements that both pieces cover from `src` (laid out as src_piece.local_shape())
/// into `dst` (laid out as dst_piece.local_shape(); a view of it is written, so a flat `dst`
/// must be contiguous); pieces of different global shapes throw. Returns elements copied.
/// Any kind to any kind: a flat range is handled as the <= 2*ndim-1 boxes it decomposes into,
/// each box pair as one strided copy (no per-element loops). Values are cast to dst's dtype.
std::int64_t copy_overlap(const TensorPiece& src_piece, const at::Tensor& src, const TensorPiece& dst_piece,
                          const at::Tensor& dst);

/// The part of `stored` that `wanted` needs, as a piece whose elements are contiguous in
/// stored's local layout (flat: a sub-range; box: whole rows of dim 0), with the element where
/// it starts there: what a reader fetches as one byte range. numel() == 0 when they do not
/// overlap. It may hold elements `wanted` does not need (copy_overlap skips them).
std::pair<TensorPiece, std::int64_t> needed_extent(const TensorPiece& stored, const TensorPiece& wanted);

/// `piece` as boxes of its global tensor, each with the part of `local` (laid out as
/// piece.local_shape()) that holds it: a box is itself, a flat range the <= 2*ndim-1 boxes it
/// decomposes into (what a format of boxes, DCP's chunks, stores).
std::vector<std::pair<TensorPiece, at::Tensor>> as_boxes(const TensorPiece& piece, const at::Tensor& local);

/// Where tensor pieces are stored in a checkpoint dictionary (pieces_to_ivalue's format).
constexpr const char* kTensorPiecesKey = "tensor_pieces";
/// The key of the format the fsdp strategy wrote before TensorPiece: {name: [start, ndim, dims...]}
/// (flat pieces whose lengths are the stored tensors' element counts).
constexpr const char* kLegacyShardMetadataKey = "fsdp_shard_metadata";

/// A local tensor made of several boxes of its global tensor, stacked along dim 0 in this
/// order (usually one piece). A tensor-parallel slice of a fused q/k/v weight is three boxes of
/// the global tensor; its dim-0 shard spans up to three of them.
using StackedPieces = std::vector<TensorPiece>;
/// Elements in all of them.
std::int64_t numel(const StackedPieces& pieces);
/// The parts of `local` (laid out as `pieces` stack), each viewed as its piece's local shape.
std::vector<at::Tensor> split_stacked(const at::Tensor& local, const StackedPieces& pieces);

/// {name: {"kind": "flat"|"box", "global_shape": [...], "offsets": [...], "lengths": [...]}};
/// stacked pieces as a list of such dictionaries.
c10::IValue pieces_to_ivalue(const std::map<std::string, TensorPiece>& pieces);
c10::IValue pieces_to_ivalue(const std::map<std::string, StackedPieces>& pieces);
/// The inverse of pieces_to_ivalue; also reads the legacy fsdp format {name: [start, ndim, dims...]}
/// as flat pieces, whose lengths come from `stored` (the tensors they describe; required for
/// that format). Throws sdk::Error naming `what` and the entry on anything malformed.
std::map<std::string, StackedPieces> stacked_pieces_from_ivalue(const c10::IValue& value, const std::string& what,
                                                                const sdk::StateDict* stored = nullptr);
/// The same for readers that take one piece per tensor: stacked pieces throw.
std::map<std::string, TensorPiece> pieces_from_ivalue(const c10::IValue& value, const std::string& what,
                                                      const sdk::StateDict* stored = nullptr);

}  // namespace tessera::core
