#include "tessera/sdk/autograd_graph.hpp"

#include <unordered_set>
#include <vector>

namespace tessera::sdk {

void for_each_autograd_node(const at::Tensor& output, const std::function<void(torch::autograd::Node&)>& visit) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> pending;
  if (output.defined() && output.grad_fn()) pending.push_back(output.grad_fn().get());
  while (!pending.empty()) {
    torch::autograd::Node* node = pending.back();
    pending.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    visit(*node);
    for (const auto& edge : node->next_edges()) pending.push_back(edge.function.get());
  }
}

}  // namespace tessera::sdk
