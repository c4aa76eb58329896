#include "data/data_loader.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "tessera/sdk/error.hpp"
#include "tessera/sdk/token_data.hpp"

namespace tessera::core {

namespace {

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace

std::uint64_t feistel_key(std::int64_t seed, std::int64_t epoch) {
  return splitmix64(splitmix64(static_cast<std::uint64_t>(seed)) ^ static_cast<std::uint64_t>(epoch));
}

std::int64_t feistel_permute(std::int64_t position, std::int64_t n, std::uint64_t key) {
  if (n <= 1) return position;
  // A balanced Feistel network on 2 * half bits (the smallest even width covering n, so at most
  // 4n values) is a bijection; walking the cycle until the value falls below n restricts it to a
  // bijection of [0, n) (Black & Rogaway's cycle walking), on average under 4 rounds of it.
  int bits = 0;
  while ((std::uint64_t{1} << bits) < static_cast<std::uint64_t>(n)) ++bits;
  const int half = (bits + 1) / 2;
  const std::uint64_t mask = (std::uint64_t{1} << half) - 1;
  auto x = static_cast<std::uint64_t>(position);
  do {
    std::uint64_t left = x >> half, right = x & mask;
    for (std::uint64_t round = 0; round < 6; ++round) {
      const std::uint64_t next = left ^ (splitmix64(key ^ (round << 56) ^ right) & mask);
      left = right;
      right = next;
    }
    x = (left << half) | right;
  } while (x >= static_cast<std::uint64_t>(n));
  return static_cast<std::int64_t>(x);
}

DataLoader::DataLoader(std::shared_ptr<sdk::Dataset> dataset, const sdk::DataLoaderSpec& spec)
    : dataset_(std::move(dataset)), spec_(spec) {
  TESSERA_CHECK(dataset_ != nullptr, "the data plugin provides no dataset for this stage");
  TESSERA_CHECK(spec_.batch_size > 0 && spec_.num_replicas > 0 && spec_.rank >= 0 && spec_.rank < spec_.num_replicas,
                "invalid data loader settings: batch_size ", spec_.batch_size, ", rank ", spec_.rank, " of ",
                spec_.num_replicas);
  large_ = dynamic_cast<const sdk::LargeDataset*>(dataset_.get()) != nullptr;
  size_ = dataset_->size();
  set_epoch(0);
}

DataLoader::~DataLoader() { drain(); }

void DataLoader::drain() {
  if (!ahead_.valid()) return;
  ahead_.wait();  // its result or error belongs to a batch nobody asked for any more
  ahead_ = {};
  ahead_index_ = -1;
}

void DataLoader::set_epoch(std::int64_t epoch) {
  drain();
  epoch_ = epoch;
  key_ = feistel_key(spec_.seed, epoch);
  indices_.clear();
  if (large_) return;  // computed per position
  const std::int64_t n = size_;
  std::vector<std::int64_t> order(static_cast<std::size_t>(n));
  if (spec_.shuffle) {
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<std::uint64_t>(spec_.seed + epoch));
    at::Tensor permutation = at::randperm(n, generator, at::kLong);
    std::copy(permutation.data_ptr<std::int64_t>(), permutation.data_ptr<std::int64_t>() + n, order.begin());
  } else {
    for (std::int64_t i = 0; i < n; ++i) order[i] = i;
  }
  const std::int64_t replicas = spec_.num_replicas;
  std::int64_t total = spec_.drop_last ? n / replicas * replicas : (n + replicas - 1) / replicas * replicas;
  for (std::int64_t i = n; i < total; ++i) order.push_back(order[(i - n) % n]);  // pad with the head
  for (std::int64_t i = spec_.rank; i < total; i += replicas) indices_.push_back(order[i]);
}

std::int64_t DataLoader::per_rank() const {
  if (!large_) return static_cast<std::int64_t>(indices_.size());
  const std::int64_t replicas = spec_.num_replicas;
  return spec_.drop_last ? size_ / replicas : (size_ + replicas - 1) / replicas;
}

std::int64_t DataLoader::index(std::int64_t k) const {
  if (!large_) return indices_.at(static_cast<std::size_t>(k));
  std::int64_t position = spec_.rank + spec_.num_replicas * k;
  if (position >= size_) position = (position - size_) % size_;  // padding repeats the head, as above
  return spec_.shuffle ? feistel_permute(position, size_, key_) : position;
}

const std::vector<std::int64_t>& DataLoader::indices() const {
  if (large_ && indices_.empty())
    for (std::int64_t k = 0, n = per_rank(); k < n; ++k) indices_.push_back(index(k));
  return indices_;
}

std::int64_t DataLoader::num_batches() const {
  const std::int64_t n = per_rank();
  return spec_.drop_last ? n / spec_.batch_size : (n + spec_.batch_size - 1) / spec_.batch_size;
}

std::vector<std::int64_t> DataLoader::batch_indices(std::int64_t i) const {
  const std::int64_t begin = i * spec_.batch_size, end = std::min(begin + spec_.batch_size, per_rank());
  std::vector<std::int64_t> batch;
  batch.reserve(static_cast<std::size_t>(end - begin));
  for (std::int64_t k = begin; k < end; ++k) batch.push_back(index(k));
  return batch;
}

sdk::Batch DataLoader::batch(std::int64_t i) {
  TESSERA_CHECK(i >= 0 && i < num_batches(), "batch ", i, " is out of range (", num_batches(), " batches)");
  if (!large_) return dataset_->get_batch(batch_indices(i));
  sdk::Batch result;
  if (ahead_.valid() && ahead_index_ == i) {
    ahead_index_ = -1;
    result = ahead_.get();  // rethrows what the read raised, at the step that needs the batch
  } else {
    drain();
    result = dataset_->get_batch(batch_indices(i));
  }
  if (i + 1 < num_batches()) {  // the thread holds what it reads from, not this loader (which may move)
    ahead_index_ = i + 1;
    ahead_ = std::async(std::launch::async,
                        [dataset = dataset_, indices = batch_indices(i + 1)] { return dataset->get_batch(indices); });
  }
  return result;
}

}  // namespace tessera::core
