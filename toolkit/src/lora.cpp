#include "tessera/toolkit/lora.hpp"

#include <algorithm>
#include <cmath>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/nn/init.h>
#include <xxhash.h>

#include "tessera/sdk/error.hpp"

namespace tessera::toolkit {

std::optional<LoraOptions> read_lora_options(const sdk::Options& model, const std::vector<std::string>& valid_targets,
                                             const std::vector<std::string>& default_targets) {
  // r turns LoRA on, not the table's presence: `tessera config` lists [model.lora] with its
  // defaults, and a listing taken as a config (or with every default written out) must train as
  // the config it lists.
  const sdk::Options t = model.sub_table("lora");
  LoraOptions o;
  o.r = t.get_int({"r", "LoRA: the adapters' rank (PEFT's r; 8 is PEFT's default); 0: no LoRA"}, 0, 0);
  const bool present = o.r > 0;
  o.alpha = t.get_double({"alpha", "LoRA: PEFT's lora_alpha; the adapter's output is scaled by alpha / r"}, 8.0, 0.0);
  o.dropout = t.get_double({"dropout", "LoRA: PEFT's lora_dropout on the adapter's input, while training"}, 0.0, 0.0,
                           1.0);
  TESSERA_CHECK(o.dropout < 1.0, t.locate("dropout"), " = 1 would drop every input of the adapters: valid: [0, 1)");
  const std::string valid = sdk::join(valid_targets);
  const std::vector<std::string> targets =
      t.get_string_list({"target_modules", "LoRA: the Linear modules adapted, by name (PEFT's target_modules: " + valid +
                                               "; \"all-linear\": all of them)"},
                        default_targets);
  for (const std::string& name : targets) {
    if (name == "all-linear") {
      o.target_modules = valid_targets;
      break;
    }
    TESSERA_CHECK(std::find(valid_targets.begin(), valid_targets.end(), name) != valid_targets.end(),
                  t.locate("target_modules"), ": \"", name, "\" names no Linear module of this model",
                  sdk::did_you_mean(name, valid_targets), "; valid: ", valid, " or \"all-linear\"");
    if (std::find(o.target_modules.begin(), o.target_modules.end(), name) == o.target_modules.end())
      o.target_modules.push_back(name);
  }
  TESSERA_CHECK(!present || !o.target_modules.empty(), t.locate("target_modules"),
                " is empty: LoRA would train nothing; valid: ", valid, " or \"all-linear\"");
  const bool defaults = o.alpha == 8.0 && o.dropout == 0.0 && targets == default_targets;
  TESSERA_CHECK(present || defaults, t.locate("r"), " = 0 leaves LoRA off, but [model.lora] sets ",
                o.alpha != 8.0 ? "alpha" : o.dropout != 0.0 ? "dropout" : "target_modules",
                ": set r (PEFT's default is 8) to train adapters, or remove the key");
  t.check_all_used();
  if (!present) return std::nullopt;
  return o;
}

void check_lora_targets_matched(const LoraOptions& options, const std::vector<std::string>& matched,
                                const std::vector<std::string>& valid_targets) {
  for (const std::string& name : options.target_modules)
    TESSERA_CHECK(std::find(matched.begin(), matched.end(), name) != matched.end(), "[model.lora] target_modules: \"",
                  name, "\" matches no module of this model as configured; modules LoRA can adapt here: ",
                  sdk::join(matched.empty() ? valid_targets : matched));
}

void init_lora_A(at::Tensor& weight, c10::optional<at::Generator> generator) {
  torch::NoGradGuard no_grad;
  // kaiming_uniform_(a = sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in) = 1 / sqrt(fan_in).
  const double bound = 1.0 / std::sqrt(static_cast<double>(weight.size(1)));
  weight.uniform_(-bound, bound, generator);
}

LoraMatrixImpl::LoraMatrixImpl(std::int64_t out, std::int64_t in, bool is_A)
    : torch::nn::Module(is_A ? "LoraA" : "LoraB"), is_A_(is_A) {
  weight = register_parameter("weight", at::empty({out, in}));
  reset_parameters();
}

void LoraMatrixImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  if (is_A_) init_lora_A(weight);
  else weight.zero_();
}

void LoraMatrixImpl::pretty_print(std::ostream& stream) const {
  stream << (is_A_ ? "lora_A" : "lora_B") << "(" << weight.size(1) << " -> " << weight.size(0) << ")";
}

LoraLinearImpl::LoraLinearImpl(const torch::nn::LinearImpl& base, const LoraOptions& o)
    : torch::nn::Module("LoraLinear"), options(o) {
  TESSERA_CHECK(o.r > 0, "LoRA: r = ", o.r, " must be at least 1");
  weight = register_parameter("weight", base.weight, /*requires_grad=*/false);
  if (base.bias.defined()) bias = register_parameter("bias", base.bias, /*requires_grad=*/false);
  const std::int64_t out = weight.size(0), in = weight.size(1);
  lora_A = register_module("lora_A", LoraMatrix(o.r, in, /*is_A=*/true));
  lora_B = register_module("lora_B", LoraMatrix(out, o.r, /*is_A=*/false));
  torch::NoGradGuard no_grad;
  lora_A->weight.set_data(lora_A->weight.to(weight.options()));
  lora_B->weight.set_data(lora_B->weight.to(weight.options()));
}

at::Tensor LoraLinearImpl::forward(const at::Tensor& input) {
  at::Tensor y = at::linear(input, weight, bias);
  const at::Tensor x = options.dropout > 0.0 ? at::dropout(input, options.dropout, is_training()) : input;
  // PEFT: result + lora_B(lora_A(dropout(x))) * scaling, the adapter in the input's dtype.
  return y + at::linear(at::linear(x, lora_A->weight), lora_B->weight) * options.scaling();
}

at::Tensor LoraLinearImpl::merged_weight() const {
  torch::NoGradGuard no_grad;
  return weight.to(at::kFloat) +
         at::matmul(lora_B->weight.to(at::kFloat), lora_A->weight.to(at::kFloat)) * options.scaling();
}

void LoraLinearImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  // torch::nn::Linear's reset_parameters (kaiming_uniform a = sqrt(5), the bias U(-1/sqrt(in), 1/sqrt(in))).
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
  if (bias.defined()) bias.uniform_(-1.0 / std::sqrt(static_cast<double>(weight.size(1))),
                                    1.0 / std::sqrt(static_cast<double>(weight.size(1))));
}

void LoraLinearImpl::pretty_print(std::ostream& stream) const {
  stream << "LoraLinear(in_features=" << weight.size(1) << ", out_features=" << weight.size(0)
         << ", bias=" << (bias.defined() ? "true" : "false") << ", r=" << options.r << ", alpha=" << options.alpha
         << ", dropout=" << options.dropout << ")";
}

bool is_lora_parameter(const std::string& name) {
  auto ends_with = [&](const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  return ends_with("lora_A.weight") || ends_with("lora_B.weight");
}

void mark_only_lora_as_trainable(torch::nn::Module& network) {
  for (auto& item : network.named_parameters()) item.value().requires_grad_(is_lora_parameter(item.key()));
}

bool init_lora_parameter(const std::string& name, at::Tensor& p, std::uint64_t seed) {
  if (!is_lora_parameter(name)) return false;
  torch::NoGradGuard no_grad;
  if (name.compare(name.size() - 13, 13, "lora_B.weight") == 0) {
    p.zero_();
    return true;
  }
  // Drawn on the CPU whatever the device, as the models draw their matrices.
  at::Generator generator = at::detail::createCPUGenerator(XXH64(name.data(), name.size(), seed));
  at::Tensor values = p.device().is_cpu() ? p : at::empty(p.sizes(), p.options().device(at::kCPU));
  init_lora_A(values, generator);
  if (!values.is_same(p)) p.copy_(values);
  return true;
}

}  // namespace tessera::toolkit
