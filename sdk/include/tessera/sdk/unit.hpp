#pragma once
/// The FSDP seam. LibTorch modules have no forward hooks, so a model runs each FSDP unit
/// (e.g. a transformer block) through tessera::sdk::invoke(). Without a strategy hook this
/// is exactly `unit->forward(args...)`; under FSDP the strategy's UnitRunner gathers the
/// unit's parameters before, frees them after, and arranges the backward-pass work.
///
/// A unit's forward may take any arguments (tensors among them get gradients; the others are
/// kept by value in case the unit is recomputed in backward) and return a tensor, a
/// std::tuple / std::pair of tensors, or a std::vector of tensors.
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "tessera/sdk/export.hpp"

namespace tessera::sdk {

/// A unit's forward as a function of the tensors among its arguments, returning its outputs.
using UnitFunction = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

/// Installed by a strategy on each unit module it manages.
class TESSERA_SDK_API UnitRunner {
 public:
  virtual ~UnitRunner();
  /// Runs `forward(inputs)` for `unit` with the strategy's pre/post-forward work around it;
  /// may keep `forward` to re-run it in backward (activation checkpointing).
  virtual std::vector<at::Tensor> run(torch::nn::Module& unit, UnitFunction forward,
                                      const std::vector<at::Tensor>& inputs) = 0;
};

/// Install (or, with null, remove) the runner for `unit`. Called by strategies on setup.
TESSERA_SDK_API void set_unit_runner(const torch::nn::Module& unit, std::shared_ptr<UnitRunner> runner);
/// The runner installed for `unit`, or null.
TESSERA_SDK_API UnitRunner* unit_runner(const torch::nn::Module& unit);

namespace detail {

template <typename T>
inline constexpr bool is_tensor_v = std::is_same_v<std::decay_t<T>, at::Tensor>;

/// How many of the first I arguments are tensors: argument I's index among the inputs.
template <std::size_t I, typename... Args>
constexpr std::size_t tensors_before() {
  constexpr bool flags[] = {is_tensor_v<Args>..., false};
  std::size_t n = 0;
  for (std::size_t k = 0; k < I; ++k) n += flags[k] ? 1 : 0;
  return n;
}

template <std::size_t I, typename... Args>
decltype(auto) argument(const std::tuple<Args...>& bound, const std::vector<at::Tensor>& inputs) {
  if constexpr (is_tensor_v<std::tuple_element_t<I, std::tuple<Args...>>>)
    return at::Tensor(inputs[tensors_before<I, Args...>()]);
  else
    return (std::get<I>(bound));
}

template <typename T>
struct UnitOutputs;  // a forward's result <-> a list of tensors
template <>
struct UnitOutputs<at::Tensor> {
  static std::vector<at::Tensor> to_list(at::Tensor t) { return {std::move(t)}; }
  static at::Tensor from_list(std::vector<at::Tensor> v) { return std::move(v.at(0)); }
};
template <>
struct UnitOutputs<std::vector<at::Tensor>> {
  static std::vector<at::Tensor> to_list(std::vector<at::Tensor> v) { return v; }
  static std::vector<at::Tensor> from_list(std::vector<at::Tensor> v) { return v; }
};
template <typename... T>
struct UnitOutputs<std::tuple<T...>> {
  static_assert((is_tensor_v<T> && ...), "a unit's forward returns tensors only");
  static std::vector<at::Tensor> to_list(std::tuple<T...> t) {
    return std::apply([](auto&... x) { return std::vector<at::Tensor>{x...}; }, t);
  }
  static std::tuple<T...> from_list(std::vector<at::Tensor> v) {
    return from_list(v, std::index_sequence_for<T...>{});
  }
  template <std::size_t... I>
  static std::tuple<T...> from_list(std::vector<at::Tensor>& v, std::index_sequence<I...>) {
    return std::tuple<T...>(v.at(I)...);
  }
};
template <typename A, typename B>
struct UnitOutputs<std::pair<A, B>> {
  static std::vector<at::Tensor> to_list(std::pair<A, B> p) { return {p.first, p.second}; }
  static std::pair<A, B> from_list(std::vector<at::Tensor> v) { return {v.at(0), v.at(1)}; }
};

template <typename Result, typename Holder, typename... Args, std::size_t... I>
std::vector<at::Tensor> call_unit(Holder& holder, const std::tuple<Args...>& bound, const std::vector<at::Tensor>& tensors,
                                  std::index_sequence<I...>) {
  return UnitOutputs<Result>::to_list(holder->forward(argument<I>(bound, tensors)...));
}

}  // namespace detail

/// Run one FSDP unit: `holder` is a torch::nn::ModuleHolder (e.g. a TORCH_MODULE type), and
/// `args` the arguments of its forward.
template <typename ModuleHolder, typename... Args>
auto invoke(ModuleHolder& holder, Args&&... args) {
  using Result = std::decay_t<decltype(holder->forward(std::forward<Args>(args)...))>;
  UnitRunner* runner = unit_runner(*holder);
  if (runner == nullptr) return Result(holder->forward(std::forward<Args>(args)...));
  std::vector<at::Tensor> inputs;
  (
      [&](const auto& a) {
        if constexpr (detail::is_tensor_v<decltype(a)>) inputs.push_back(a);
      }(args),
      ...);
  using Bound = std::tuple<std::decay_t<Args>...>;
  UnitFunction forward = [&holder, bound = Bound(args...)](const std::vector<at::Tensor>& tensors) {
    return detail::call_unit<Result>(holder, bound, tensors, std::index_sequence_for<Args...>{});
  };
  return detail::UnitOutputs<Result>::from_list(runner->run(*holder, std::move(forward), inputs));
}

}  // namespace tessera::sdk
