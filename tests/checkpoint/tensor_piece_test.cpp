// core::TensorPiece: flat ranges and boxes of a global tensor, copy_overlap between any two
// kinds (checked against a mask computed on the whole tensor), and the checkpoint format.
#include <gtest/gtest.h>

#include <random>

#include <ATen/ATen.h>

#include "pieces_fixture.hpp"

namespace {

using namespace tessera::testing;

/// A bool tensor of the global shape, true where `piece` is.
at::Tensor mask_of(const std::vector<std::int64_t>& shape, const TensorPiece& piece) {
  at::Tensor mask = at::zeros(shape, at::kBool);
  if (piece.kind == TensorPiece::Kind::flat) {
    mask.view({-1}).narrow(0, piece.offsets[0], piece.lengths[0]).fill_(true);
    return mask;
  }
  at::Tensor t = mask;
  for (std::size_t d = 0; d < piece.offsets.size(); ++d)
    t = t.narrow(static_cast<std::int64_t>(d), piece.offsets[d], piece.lengths[d]);
  t.fill_(true);
  return mask;
}

TensorPiece random_piece(const std::vector<std::int64_t>& shape, std::mt19937& rng) {
  auto pick = [&](std::int64_t lo, std::int64_t hi) { return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng); };
  if (pick(0, 1) == 0) {
    std::int64_t numel = 1;
    for (auto d : shape) numel *= d;
    const std::int64_t start = pick(0, numel);
    return TensorPiece::flat_range(shape, start, pick(0, numel - start));
  }
  std::vector<std::int64_t> offsets, lengths;
  for (auto d : shape) {
    offsets.push_back(pick(0, d));
    lengths.push_back(pick(0, d - offsets.back()));
  }
  return TensorPiece::box(shape, offsets, lengths);
}

/// copy_overlap from `src` to `dst` pieces of arange(global), checked against the masks.
void expect_overlap_copied(const std::vector<std::int64_t>& shape, const TensorPiece& src, const TensorPiece& dst) {
  at::Tensor global = at::arange(TensorPiece::whole(shape).numel(), at::kDouble).view(shape);
  at::Tensor out = at::full(dst.local_shape(), -1.0, at::kDouble);
  const std::int64_t copied = core::copy_overlap(src, cut(global, src), dst, out);
  at::Tensor both = mask_of(shape, src) & mask_of(shape, dst);
  at::Tensor expected = cut(at::where(both, global, at::full_like(global, -1.0)), dst);
  EXPECT_EQ(copied, both.sum().item<std::int64_t>()) << src.to_string() << " -> " << dst.to_string();
  EXPECT_TRUE(at::equal(out, expected)) << src.to_string() << " -> " << dst.to_string();
}

TEST(TensorPiece, FactoriesShapesAndDescriptions) {
  TensorPiece whole = TensorPiece::whole({4, 6});
  EXPECT_EQ(whole.kind, TensorPiece::Kind::box);
  EXPECT_EQ(whole.numel(), 24);
  EXPECT_EQ(whole.local_shape(), (std::vector<std::int64_t>{4, 6}));
  EXPECT_EQ(whole.to_string(), "box [0:4, 0:6] of [4, 6]");
  TensorPiece flat = TensorPiece::flat_range({4, 6}, 5, 10);
  EXPECT_EQ(flat.numel(), 10);
  EXPECT_EQ(flat.local_shape(), (std::vector<std::int64_t>{10}));
  EXPECT_EQ(flat.to_string(), "flat [5, 15) of [4, 6]");
  TensorPiece box = TensorPiece::box({4, 6}, {1, 3}, {2, 3});
  EXPECT_EQ(box.numel(), 6);
  EXPECT_EQ(box.local_shape(), (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(box, TensorPiece::box({4, 6}, {1, 3}, {2, 3}));
  EXPECT_NE(box, TensorPiece::box({4, 6}, {1, 3}, {2, 2}));
  EXPECT_NE(TensorPiece::flat_range({24}, 0, 24), TensorPiece::whole({24}));  // same elements, another kind
  EXPECT_EQ(TensorPiece::whole({}).numel(), 1);  // a 0-d tensor
  EXPECT_NE(error_of([] { TensorPiece::flat_range({4, 6}, 20, 5); }).find("flat range [20, 25) falls outside a tensor "
                                                                           "of shape [4, 6] (24 elements)"),
            std::string::npos);
  EXPECT_NE(error_of([] { TensorPiece::box({4, 6}, {3, 0}, {2, 6}); }).find("(dim 0)"), std::string::npos);
  EXPECT_NE(error_of([] { TensorPiece::box({4, 6}, {0}, {4}); }).find("needs 2 offsets and lengths"), std::string::npos);
}

TEST(TensorPiece, EveryFlatRangeOfA3DTensorCopiesIntoTheWholeAndBack) {
  const std::vector<std::int64_t> shape{3, 4, 5};
  for (std::int64_t start = 0; start <= 60; ++start)
    for (std::int64_t length = 0; start + length <= 60; ++length) {
      TensorPiece flat = TensorPiece::flat_range(shape, start, length);
      expect_overlap_copied(shape, flat, TensorPiece::whole(shape));
      expect_overlap_copied(shape, TensorPiece::whole(shape), flat);
      if (::testing::Test::HasFailure()) return;
    }
}

TEST(TensorPiece, AnyKindToAnyKindMatchesTheMasks) {
  std::mt19937 rng(7);
  for (const std::vector<std::int64_t>& shape :
       std::vector<std::vector<std::int64_t>>{{17}, {5, 7}, {3, 4, 5}, {2, 3, 2, 3}, {6, 1, 4}}) {
    for (int trial = 0; trial < 150; ++trial) {
      expect_overlap_copied(shape, random_piece(shape, rng), random_piece(shape, rng));
      if (::testing::Test::HasFailure()) return;
    }
  }
}

// What a reader fetches: one contiguous range of the stored piece that holds all it needs.
TEST(TensorPiece, NeededExtentIsOneContiguousRangeHoldingTheOverlap) {
  std::mt19937 rng(11);
  for (const std::vector<std::int64_t>& shape : std::vector<std::vector<std::int64_t>>{{17}, {5, 7}, {3, 4, 5}, {}}) {
    at::Tensor global = at::arange(TensorPiece::whole(shape).numel(), at::kDouble).view(shape);
    for (int trial = 0; trial < 200; ++trial) {
      TensorPiece stored = shape.empty() ? TensorPiece::whole({}) : random_piece(shape, rng);
      TensorPiece wanted = shape.empty() ? TensorPiece::flat_range({}, 0, 1) : random_piece(shape, rng);
      auto [extent, start] = core::needed_extent(stored, wanted);
      const std::int64_t overlap = (mask_of(shape, stored) & mask_of(shape, wanted)).sum().item<std::int64_t>();
      if (overlap == 0) {
        EXPECT_EQ(extent.numel(), 0) << stored.to_string() << " / " << wanted.to_string();
        continue;
      }
      EXPECT_EQ(extent.kind, stored.kind);
      // The extent lies inside the stored piece, at `start` of its flattened local layout...
      at::Tensor local = cut(global, stored).reshape({-1});
      ASSERT_LE(start + extent.numel(), local.numel()) << stored.to_string() << " / " << wanted.to_string();
      EXPECT_TRUE(at::equal(local.narrow(0, start, extent.numel()), cut(global, extent).reshape({-1})))
          << stored.to_string() << " -> " << extent.to_string() << " at " << start;
      // ...and gives the wanted piece everything the whole stored piece would.
      at::Tensor out = at::full(wanted.local_shape(), -1.0, at::kDouble);
      EXPECT_EQ(core::copy_overlap(extent, cut(global, extent), wanted, out), overlap);
      at::Tensor expected = at::full(wanted.local_shape(), -1.0, at::kDouble);
      core::copy_overlap(stored, cut(global, stored), wanted, expected);
      EXPECT_TRUE(at::equal(out, expected)) << stored.to_string() << " / " << wanted.to_string();
      if (::testing::Test::HasFailure()) return;
    }
  }
}

TEST(TensorPiece, ScalarsCastsStridedTargetsAndMismatches) {
  at::Tensor out = at::zeros({}, at::kFloat);
  EXPECT_EQ(core::copy_overlap(TensorPiece::flat_range({}, 0, 1), at::full({1}, 3.0, at::kDouble),
                               TensorPiece::whole({}), out),
            1);
  EXPECT_EQ(out.item<float>(), 3.0f);
  // A box target may be a strided view: the columns 1..2 of a larger tensor are written in place.
  at::Tensor big = at::zeros({4, 5});
  at::Tensor view = big.narrow(1, 1, 2);
  core::copy_overlap(TensorPiece::whole({4, 5}), at::arange(20, at::kFloat).view({4, 5}),
                     TensorPiece::box({4, 5}, {0, 1}, {4, 2}), view);
  EXPECT_TRUE(at::equal(big.narrow(1, 1, 2), at::arange(20, at::kFloat).view({4, 5}).narrow(1, 1, 2)));
  EXPECT_EQ(big.narrow(1, 0, 1).abs().sum().item<float>(), 0.0f);
  EXPECT_NE(error_of([] {
              core::copy_overlap(TensorPiece::whole({4, 6}), at::zeros({4, 6}), TensorPiece::whole({6, 4}),
                                 at::zeros({6, 4}));
            }).find("pieces of different tensors (box [0:4, 0:6] of [4, 6] and box [0:6, 0:4] of [6, 4])"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              core::copy_overlap(TensorPiece::flat_range({4, 6}, 0, 5), at::zeros({4}), TensorPiece::whole({4, 6}),
                                 at::zeros({4, 6}));
            }).find("the source tensor has 4 elements but its piece flat [0, 5) of [4, 6] has 5"),
            std::string::npos);
}

// A tensor-parallel piece of a fused [6, 2] weight (3 parts of 2 rows; tp rank 1 holds row 1 of
// each part), sharded on dim 0: this rank's rows 1-2 of the piece are rows 3 and 5 of the full
// weight, two boxes stacked along dim 0.
TEST(TensorPiece, StackedPiecesRoundTripAndSplitTheLocalTensor) {
  const core::StackedPieces stack{TensorPiece::box({6, 2}, {3, 0}, {1, 2}), TensorPiece::box({6, 2}, {5, 0}, {1, 2})};
  std::map<std::string, core::StackedPieces> pieces{{"qkv", stack}, {"b", {TensorPiece::flat_range({4}, 0, 2)}}};
  EXPECT_EQ(core::stacked_pieces_from_ivalue(core::pieces_to_ivalue(pieces), "test"), pieces);
  EXPECT_EQ(core::numel(stack), 4);
  const at::Tensor local = at::arange(4, at::kFloat);
  auto parts = core::split_stacked(local, stack);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_TRUE(at::equal(parts[1], at::tensor({2.0f, 3.0f}).view({1, 2})));
  at::Tensor full = at::zeros({6, 2});
  for (std::size_t k = 0; k < stack.size(); ++k) core::copy_overlap(stack[k], parts[k], TensorPiece::whole({6, 2}), full);
  EXPECT_TRUE(at::equal(full.select(0, 5), at::tensor({2.0f, 3.0f})));
  // Readers of one piece per tensor refuse them by name.
  EXPECT_NE(error_of([&] { core::pieces_from_ivalue(core::pieces_to_ivalue(pieces), "p"); }).find("p['qkv'] is 2 stacked"),
            std::string::npos);
}

TEST(TensorPiece, CheckpointFormatRoundTripsAndReadsTheLegacyFsdpFormat) {
  std::map<std::string, TensorPiece> pieces{{"a", TensorPiece::flat_range({4, 6}, 12, 12)},
                                            {"b", TensorPiece::box({8, 3}, {4, 0}, {4, 3})},
                                            {"s", TensorPiece::whole({})}};
  EXPECT_EQ(core::pieces_from_ivalue(core::pieces_to_ivalue(pieces), "test"), pieces);

  // fsdp_shard_metadata as the fsdp strategy wrote it: {name: [start, ndim, dims...]}; the
  // lengths are the stored tensors' sizes.
  c10::impl::GenericDict legacy(c10::StringType::get(), c10::ListType::ofInts());
  legacy.insert("w", c10::List<std::int64_t>({12, 2, 4, 6}));
  legacy.insert("bias", c10::List<std::int64_t>({0, 1, 6}));
  sdk::StateDict stored;
  stored.insert("w", at::zeros({12}));
  stored.insert("bias", at::zeros({6}));
  auto read = core::pieces_from_ivalue(legacy, "shard 1 [fsdp_shard_metadata]", &stored);
  EXPECT_EQ(read.at("w"), TensorPiece::flat_range({4, 6}, 12, 12));
  EXPECT_EQ(read.at("bias"), TensorPiece::flat_range({6}, 0, 6));
  EXPECT_NE(error_of([&] { core::pieces_from_ivalue(legacy, "m"); }).find("needs the stored tensors"), std::string::npos);

  c10::impl::GenericDict bad(c10::StringType::get(), c10::AnyType::get());
  c10::impl::GenericDict entry(c10::StringType::get(), c10::AnyType::get());
  entry.insert("kind", "slab");
  bad.insert("x", entry);
  EXPECT_NE(error_of([&] { core::pieces_from_ivalue(bad, "shard 0 [tensor_pieces]"); })
                .find("shard 0 [tensor_pieces]['x'] has no 'global_shape'"),
            std::string::npos);
  entry.insert("global_shape", c10::List<std::int64_t>({4}));
  entry.insert("offsets", c10::List<std::int64_t>({0}));
  entry.insert("lengths", c10::List<std::int64_t>({4}));
  EXPECT_NE(error_of([&] { core::pieces_from_ivalue(bad, "p"); }).find("p['x']['kind'] must be \"flat\" or \"box\""),
            std::string::npos);
  entry.insert_or_assign("kind", "box");
  entry.insert_or_assign("lengths", c10::List<std::int64_t>({5}));
  EXPECT_NE(error_of([&] { core::pieces_from_ivalue(bad, "p"); }).find("p['x']: box offsets [0] lengths [5] fall "
                                                                       "outside a tensor of shape [4]"),
            std::string::npos);
}

}  // namespace
