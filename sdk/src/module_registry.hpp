#pragma once
// What the SDK attaches to a module without changing torch::nn::Module: an object per module
// address (a unit's runner, a network's sharded model), installed once at setup and looked up
// on every call (a hash lookup, well under a microsecond).
#include <memory>
#include <mutex>
#include <unordered_map>

#include <torch/nn/module.h>

namespace tessera::sdk::detail {

template <typename T>
class ModuleRegistry {
 public:
  /// Attaches `value` to `module`; a null `value` detaches what was there.
  void set(const torch::nn::Module& module, std::shared_ptr<T> value) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (value) entries_[&module] = std::move(value);
    else entries_.erase(&module);
  }
  /// What is attached to `module`, or nullptr.
  T* find(const torch::nn::Module& module) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = entries_.find(&module);
    return it == entries_.end() ? nullptr : it->second.get();
  }

 private:
  std::mutex mutex_;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<T>> entries_;
};

}  // namespace tessera::sdk::detail
