// core::DataLoader: the rank slices equal PyTorch's DistributedSampler (outputs recorded
// from torch 1.13's torch.utils.data.distributed.DistributedSampler), batches, drop_last,
// random access, and the parity property N ranks x B == one device x B*N.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include <ATen/ATen.h>

#include "data/data_loader.hpp"
#include "tessera/sdk/error.hpp"

namespace {

using tessera::core::DataLoader;
using tessera::sdk::DataLoaderSpec;
using Indices = std::vector<std::int64_t>;

/// Sample i is the scalar i, so a batch shows which indices it holds.
class Range : public tessera::sdk::Dataset {
 public:
  explicit Range(std::int64_t n) : n_(n) {}
  std::int64_t size() const override { return n_; }
  tessera::sdk::Batch get_batch(const std::vector<std::int64_t>& indices) const override {
    ++reads;
    return {at::tensor(indices, at::kLong), at::Tensor()};
  }
  mutable int reads = 0;

 private:
  std::int64_t n_;
};

DataLoaderSpec spec(std::int64_t batch_size, std::int64_t replicas, std::int64_t rank, bool shuffle, bool drop_last,
                    std::int64_t seed) {
  DataLoaderSpec s;
  s.batch_size = batch_size;
  s.num_replicas = replicas;
  s.rank = rank;
  s.shuffle = shuffle;
  s.drop_last = drop_last;
  s.seed = seed;
  return s;
}

Indices as_indices(const tessera::sdk::Batch& batch) {
  at::Tensor t = batch.input.contiguous();
  return Indices(t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + t.numel());
}

struct Reference {
  std::int64_t n, replicas;
  bool shuffle, drop_last;
  std::int64_t seed, epoch;
  std::vector<Indices> per_rank;  // list(DistributedSampler(range(n), ...)) after set_epoch(epoch)
};

TEST(DataLoader, RankSlicesEqualPyTorchDistributedSampler) {
  const std::vector<Reference> references = {
      {10, 3, true, false, 7, 0, {{5, 4, 9, 2}, {0, 1, 6, 5}, {3, 7, 8, 0}}},
      {10, 3, true, false, 7, 1, {{3, 1, 4, 9}, {5, 2, 7, 3}, {0, 6, 8, 5}}},
      {10, 3, true, true, 7, 0, {{5, 4, 9}, {0, 1, 6}, {3, 7, 8}}},
      {10, 3, false, false, 0, 0, {{0, 3, 6, 9}, {1, 4, 7, 0}, {2, 5, 8, 1}}},
      {11, 4, true, false, 42, 2, {{2, 5, 0}, {4, 3, 10}, {9, 7, 1}, {8, 6, 2}}},
      {5, 3, false, false, 0, 0, {{0, 3}, {1, 4}, {2, 0}}},
      {2, 5, true, false, 3, 0, {{0}, {1}, {0}, {1}, {0}}},  // padding longer than the dataset
      {30, 4, true, true, 9, 3,
       {{3, 13, 20, 5, 26, 22, 14}, {29, 16, 7, 1, 10, 2, 18}, {8, 9, 6, 27, 28, 11, 17}, {15, 24, 0, 21, 12, 4, 23}}},
  };
  for (const auto& r : references) {
    auto dataset = std::make_shared<Range>(r.n);
    for (std::int64_t rank = 0; rank < r.replicas; ++rank) {
      DataLoader loader(dataset, spec(1, r.replicas, rank, r.shuffle, r.drop_last, r.seed));
      loader.set_epoch(r.epoch);
      EXPECT_EQ(loader.indices(), r.per_rank[rank])
          << "n " << r.n << " replicas " << r.replicas << " rank " << rank << " seed " << r.seed << " epoch " << r.epoch;
    }
  }
}

TEST(DataLoader, ShuffleIsTorchRandpermSeededWithSeedPlusEpoch) {
  // torch.Generator().manual_seed(5); torch.randperm(40, generator=g)
  const Indices expected = {11, 16, 37, 25, 30, 20, 6,  33, 1,  29, 9,  13, 23, 21, 5,  28, 31, 27, 39, 38,
                            10, 19, 15, 17, 36, 32, 12, 8,  18, 2,  34, 24, 14, 26, 0,  35, 3,  22, 7,  4};
  DataLoader loader(std::make_shared<Range>(40), spec(4, 1, 0, true, false, 2));
  loader.set_epoch(3);
  EXPECT_EQ(loader.indices(), expected);
  EXPECT_EQ(as_indices(loader.batch(1)), (Indices{30, 20, 6, 33}));
  loader.set_epoch(0);
  EXPECT_NE(loader.indices(), expected);
}

TEST(DataLoader, BatchesAndDropLast) {
  auto dataset = std::make_shared<Range>(10);
  DataLoader keep(dataset, spec(4, 1, 0, false, false, 0));
  ASSERT_EQ(keep.num_batches(), 3);
  EXPECT_EQ(as_indices(keep.batch(2)), (Indices{8, 9}));  // the partial last batch
  DataLoader drop(dataset, spec(4, 1, 0, false, true, 0));
  EXPECT_EQ(drop.num_batches(), 2);
  EXPECT_EQ(as_indices(drop.batch(1)), (Indices{4, 5, 6, 7}));
  EXPECT_THROW(drop.batch(2), tessera::sdk::Error);
  EXPECT_THROW(drop.batch(-1), tessera::sdk::Error);
}

TEST(DataLoader, RandomAccessReadsOnlyTheRequestedBatch) {
  auto dataset = std::make_shared<Range>(1000);
  DataLoader loader(dataset, spec(8, 2, 1, true, true, 11));
  Indices expected(loader.indices().begin() + 40 * 8, loader.indices().begin() + 41 * 8);
  EXPECT_EQ(as_indices(loader.batch(40)), expected);
  EXPECT_EQ(dataset->reads, 1);
}

TEST(DataLoader, EachEpochCoversEverySampleOnce) {
  auto dataset = std::make_shared<Range>(24);
  for (std::int64_t epoch : {0, 1, 2}) {
    std::multiset<std::int64_t> seen;
    for (std::int64_t rank = 0; rank < 3; ++rank) {
      DataLoader loader(dataset, spec(4, 3, rank, true, true, 5));
      loader.set_epoch(epoch);
      for (std::int64_t i = 0; i < loader.num_batches(); ++i)
        for (auto index : as_indices(loader.batch(i))) seen.insert(index);
    }
    ASSERT_EQ(seen.size(), 24u);
    for (std::int64_t i = 0; i < 24; ++i) EXPECT_EQ(seen.count(i), 1u) << "epoch " << epoch << " sample " << i;
  }
}

/// What parity tests rely on: batch i of N ranks with batch size B together hold exactly the
/// samples of batch i of one device with batch size B * N (same seed and epoch).
TEST(DataLoader, NRanksSeeTheGlobalBatchOfOneDevice) {
  for (bool drop_last : {true, false}) {
    for (std::int64_t replicas : {2, 3, 4}) {
      const std::int64_t b = 3, n = 101;
      auto dataset = std::make_shared<Range>(n);
      DataLoader single(dataset, spec(b * replicas, 1, 0, true, drop_last, 17));
      single.set_epoch(1);
      std::vector<DataLoader> ranks;
      for (std::int64_t r = 0; r < replicas; ++r) {
        ranks.emplace_back(dataset, spec(b, replicas, r, true, drop_last, 17));
        ranks.back().set_epoch(1);
        if (drop_last) EXPECT_EQ(ranks.back().num_batches(), single.num_batches());
      }
      const std::int64_t full_batches = n / (b * replicas);  // without padding at the end
      for (std::int64_t i = 0; i < full_batches; ++i) {
        std::multiset<std::int64_t> global, split;
        for (auto index : as_indices(single.batch(i))) global.insert(index);
        for (auto& loader : ranks)
          for (auto index : as_indices(loader.batch(i))) split.insert(index);
        EXPECT_EQ(global, split) << "batch " << i << " with " << replicas << " ranks, drop_last " << drop_last;
      }
    }
  }
}

TEST(DataLoader, InvalidSettingsAreErrors) {
  auto dataset = std::make_shared<Range>(4);
  EXPECT_THROW(DataLoader(nullptr, spec(1, 1, 0, false, false, 0)), tessera::sdk::Error);
  EXPECT_THROW(DataLoader(dataset, spec(0, 1, 0, false, false, 0)), tessera::sdk::Error);
  EXPECT_THROW(DataLoader(dataset, spec(1, 2, 2, false, false, 0)), tessera::sdk::Error);
  DataLoader empty(std::make_shared<Range>(0), spec(2, 1, 0, true, false, 0));
  EXPECT_EQ(empty.num_batches(), 0);
}

}  // namespace
