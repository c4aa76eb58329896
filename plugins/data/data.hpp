#pragma once
// The entries of the shipped data plugin (see data.cpp), and what its modules share.
#include <ATen/core/Tensor.h>

#include "tessera/sdk/data.hpp"
#include "tessera/sdk/plugin.hpp"

namespace tessera::data {
sdk::PluginEntry text_entry();
sdk::PluginEntry fashion_mnist_entry();
sdk::PluginEntry tokens_entry();

/// predict's dataset: one sample, the encoded prompt (`ids`, [1, n] int64).
class PromptDataset final : public sdk::Dataset {
 public:
  explicit PromptDataset(at::Tensor ids) : ids_(std::move(ids)) {}
  std::int64_t size() const override { return 1; }
  sdk::Batch get_batch(const std::vector<std::int64_t>&) const override { return sdk::Batch{ids_.clone(), {}}; }

 private:
  at::Tensor ids_;
};
}  // namespace tessera::data
