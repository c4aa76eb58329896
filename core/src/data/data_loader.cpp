#include "tessera/core/data_loader.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "tessera/sdk/error.hpp"

namespace tessera::core {

DataLoader::DataLoader(std::shared_ptr<sdk::Dataset> dataset, const sdk::DataLoaderSpec& spec)
    : dataset_(std::move(dataset)), spec_(spec) {
  TESSERA_CHECK(dataset_ != nullptr, "the data plugin provides no dataset for this stage");
  TESSERA_CHECK(spec_.batch_size > 0 && spec_.num_replicas > 0 && spec_.rank >= 0 && spec_.rank < spec_.num_replicas,
                "invalid data loader settings: batch_size ", spec_.batch_size, ", rank ", spec_.rank, " of ",
                spec_.num_replicas);
  set_epoch(0);
}

void DataLoader::set_epoch(std::int64_t epoch) {
  const std::int64_t n = dataset_->size();
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
  indices_.clear();
  for (std::int64_t i = spec_.rank; i < total; i += replicas) indices_.push_back(order[i]);
}

std::int64_t DataLoader::num_batches() const {
  const auto n = static_cast<std::int64_t>(indices_.size());
  return spec_.drop_last ? n / spec_.batch_size : (n + spec_.batch_size - 1) / spec_.batch_size;
}

sdk::Batch DataLoader::batch(std::int64_t i) const {
  TESSERA_CHECK(i >= 0 && i < num_batches(), "batch ", i, " is out of range (", num_batches(), " batches)");
  const auto begin = indices_.begin() + i * spec_.batch_size;
  const auto end = std::min(begin + spec_.batch_size, indices_.end());
  return dataset_->get_batch(std::vector<std::int64_t>(begin, end));
}

}  // namespace tessera::core
