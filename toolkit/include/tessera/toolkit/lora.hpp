#pragma once
/// LoRA (Hu et al. 2021) as Hugging Face PEFT computes and names it: a Linear layer's weight W
/// stays frozen and two small matrices are trained beside it, lora_A [r, in] and lora_B [out, r],
/// so that y = x W^T + b + (alpha / r) * B(A(dropout(x))). The layer keeps the base Linear's
/// parameter names ("weight", "bias") and names its adapters "lora_A.weight" and "lora_B.weight",
/// which are PEFT's state-dict names once PEFT's "base_model.model." prefix is put in front: a
/// Hugging Face folder loads into the base unchanged and an adapter exports with no mapping table.
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "tessera/sdk/layer.hpp"
#include "tessera/sdk/options.hpp"

namespace tessera::toolkit {

/// PEFT's LoraConfig fields that change what is computed (PEFT's defaults).
struct LoraOptions {
  std::int64_t r = 8;         ///< the adapters' rank (PEFT's r)
  double alpha = 8.0;         ///< PEFT's lora_alpha; the update is scaled by alpha / r
  double dropout = 0.0;       ///< PEFT's lora_dropout, on the adapter's input only, while training
  std::vector<std::string> target_modules;  ///< module names (the last part of a path) to adapt
  double scaling() const { return alpha / static_cast<double>(r); }
};

/// The [model.lora] table of a model plugin: nullopt when the model's table has no `lora`
/// sub-table. `valid_targets` are the model's Linear names LoRA can adapt (refused otherwise,
/// naming them; "all-linear", PEFT's shorthand, takes them all), `default_targets` PEFT's
/// default for the architecture (target_modules absent). Keys are read even when the table is
/// absent, so that `tessera config` lists them.
std::optional<LoraOptions> read_lora_options(const sdk::Options& model, const std::vector<std::string>& valid_targets,
                                             const std::vector<std::string>& default_targets);

/// Throws, naming [model.lora] target_modules and the valid names, for a target no module of
/// the network matched (`matched`: the targets applied at least once).
void check_lora_targets_matched(const LoraOptions& options, const std::vector<std::string>& matched,
                                const std::vector<std::string>& valid_targets);

/// PEFT's initialisation of lora_A in place: kaiming_uniform_(a = sqrt(5)), i.e. U(-1/sqrt(in),
/// 1/sqrt(in)) for A [r, in], drawn from `generator` (the global CPU generator when undefined).
void init_lora_A(at::Tensor& weight, c10::optional<at::Generator> generator = c10::nullopt);

/// One adapter matrix (lora_A or lora_B) as a module holding `weight`, so that it is named
/// "<layer>.lora_A.weight" as PEFT's nn.Linear adapters are. reset_parameters draws it as PEFT
/// does (A: kaiming uniform, B: zeros), also under deferred init without a model initialiser.
class LoraMatrixImpl : public torch::nn::Module, public sdk::ResettableLayer {
 public:
  LoraMatrixImpl(std::int64_t out, std::int64_t in, bool is_A);
  void reset_parameters() override;
  void pretty_print(std::ostream& stream) const override;
  at::Tensor weight;  ///< A: [r, in]; B: [out, r]

 private:
  bool is_A_;
};
TORCH_MODULE(LoraMatrix);

/// A Linear with a LoRA adapter (PEFT's lora.Linear, merged = false). The base's weight and bias
/// are this layer's own "weight" and "bias", frozen (requires_grad false); only lora_A and lora_B
/// train. The adapter is computed in the base's dtype (the activations'), as PEFT does under
/// autocast.
class LoraLinearImpl : public torch::nn::Module, public sdk::ResettableLayer {
 public:
  /// Adapts `base`: this layer takes its weight and bias tensors (the same tensors, frozen) and
  /// draws lora_A as PEFT (kaiming uniform from the global generator), lora_B zeros.
  LoraLinearImpl(const torch::nn::LinearImpl& base, const LoraOptions& options);

  at::Tensor forward(const at::Tensor& input);
  /// W + (alpha / r) B A, in fp32: the weight PEFT's merge_and_unload leaves (a copy).
  at::Tensor merged_weight() const;
  /// The base's weight and bias as torch::nn::Linear initialises them (lora_A and lora_B are
  /// modules of their own, reset by theirs).
  void reset_parameters() override;
  void pretty_print(std::ostream& stream) const override;

  LoraOptions options;
  at::Tensor weight;  ///< the base's [out, in], frozen
  at::Tensor bias;    ///< the base's [out], frozen; undefined without bias
  LoraMatrix lora_A{nullptr}, lora_B{nullptr};
};
TORCH_MODULE(LoraLinear);

/// Whether a parameter name is a LoRA adapter's ("...lora_A.weight" / "...lora_B.weight").
bool is_lora_parameter(const std::string& name);

/// PEFT's mark_only_lora_as_trainable (bias = "none"): every parameter of `network` but the
/// adapters frozen (requires_grad false): embeddings, norms and the output head too.
void mark_only_lora_as_trainable(torch::nn::Module& network);

/// A model's initialiser for an adapter by its name (eager and deferred builds alike): lora_A
/// from a generator seeded by (`seed`, `name`) as PEFT draws it, lora_B zeros. False for a name
/// that is not an adapter's (the model initialises it).
bool init_lora_parameter(const std::string& name, at::Tensor& parameter, std::uint64_t seed);

}  // namespace tessera::toolkit
