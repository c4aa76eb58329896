#include "tessera/toolkit/batched_matmul.hpp"

#include <mutex>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "tessera/sdk/autocast.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/openblas.hpp"

namespace tessera::toolkit {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// Whether the matrices go to the threads one by one rather than to at::baddbmm.
bool split_by_matrix(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias) {
  const c10::ScalarType dtype = a.scalar_type();
  return a.device().is_cpu() && b.device().is_cpu() && (dtype == at::kFloat || dtype == at::kDouble) &&
         b.scalar_type() == dtype && (!bias.defined() || (bias.device().is_cpu() && bias.scalar_type() == dtype)) &&
         a.size(0) > 1 && at::get_num_threads() > 1 && !at::in_parallel_region() &&
         !sdk::autocast_enabled(/*cuda=*/false) && !sdk::autocast_enabled(/*cuda=*/true) && openblas::loaded();
}

/// Holds OpenBLAS's own pool (its pthreads build) at one thread while it lives, one holder at a
/// time: the count is global, and the pool's threads must not split each matrix again.
class OneBlasThreadEach {
 public:
  OneBlasThreadEach() : lock_(mutex()), before_(openblas::has_own_threads() ? openblas::num_threads() : 1) {
    if (before_ > 1) openblas::set_num_threads(1);
  }
  ~OneBlasThreadEach() {
    if (before_ > 1) openblas::set_num_threads(before_);
  }
  OneBlasThreadEach(const OneBlasThreadEach&) = delete;
  OneBlasThreadEach& operator=(const OneBlasThreadEach&) = delete;

 private:
  static std::mutex& mutex() {
    static std::mutex one_holder;
    return one_holder;
  }
  std::lock_guard<std::mutex> lock_;
  int before_;
};

/// The forward's and backward's product: out[i] = bias[i] + alpha * a[i] @ b[i], each matrix
/// one BLAS call on the thread that owns it. Detached: the pool's threads run with autograd on
/// (their own thread-local default), and an out= product refuses inputs that need gradients.
at::Tensor multiply_by_matrix(const at::Tensor& a_in, const at::Tensor& b_in, const at::Tensor& bias, double alpha) {
  const at::Tensor a = a_in.detach(), b = b_in.detach();
  at::Tensor out = at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
  const at::Tensor addend = bias.defined() ? bias.detach().expand_as(out) : bias;
  OneBlasThreadEach one_blas_thread;
  at::parallel_for(0, a.size(0), 1, [&](std::int64_t begin, std::int64_t end) {
    for (std::int64_t i = begin; i < end; ++i) {
      at::Tensor out_i = out.select(0, i);
      if (addend.defined())
        at::addmm_out(out_i, addend.select(0, i), a.select(0, i), b.select(0, i), /*beta=*/1, alpha);
      else if (alpha == 1.0)
        at::mm_out(out_i, a.select(0, i), b.select(0, i));
      else
        at::addmm_out(out_i, out_i, a.select(0, i), b.select(0, i), /*beta=*/0, alpha);
    }
  });
  return out;
}

/// at::bmm's alpha * (a @ b), as a graph autograd records.
at::Tensor recorded_product(const at::Tensor& a, const at::Tensor& b, double alpha) {
  return alpha == 1.0 ? at::bmm(a, b) : at::bmm(a, b) * alpha;
}

/// The gradients of alpha * (a @ b) with respect to a and b, those that autograd asks for.
std::pair<at::Tensor, at::Tensor> product_gradients(AutogradContext* ctx, const at::Tensor& grad) {
  const variable_list saved = ctx->get_saved_variables();
  const double alpha = ctx->saved_data["alpha"].toDouble();
  // A differentiable backward (create_graph) takes LibTorch's own products.
  const bool recorded = at::GradMode::is_enabled();
  auto product = [&](const at::Tensor& x, const at::Tensor& y) {
    return recorded ? recorded_product(x, y, alpha) : multiply_by_matrix(x, y, {}, alpha);
  };
  at::Tensor grad_a, grad_b;
  if (ctx->needs_input_grad(0)) grad_a = product(grad, saved[1].transpose(1, 2));
  if (ctx->needs_input_grad(1)) grad_b = product(saved[0].transpose(1, 2), grad);
  return {grad_a, grad_b};
}

// Two functions, with a bias and without: LibTorch 1.13's autograd functions take no undefined tensor.
struct Product : public torch::autograd::Function<Product> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, double alpha) {
    ctx->save_for_backward({a, b});
    ctx->saved_data["alpha"] = alpha;
    return multiply_by_matrix(a, b, {}, alpha);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto [grad_a, grad_b] = product_gradients(ctx, grads[0]);
    return {grad_a, grad_b, at::Tensor()};
  }
};

struct ProductPlusBias : public torch::autograd::Function<ProductPlusBias> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias,
                            double alpha) {
    ctx->save_for_backward({a, b});
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["bias_sizes"] = bias.sizes();
    return multiply_by_matrix(a, b, bias, alpha);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto [grad_a, grad_b] = product_gradients(ctx, grads[0]);
    at::Tensor grad_bias;
    if (ctx->needs_input_grad(2)) grad_bias = at::sum_to(grads[0], ctx->saved_data["bias_sizes"].toIntVector());
    return {grad_a, grad_b, grad_bias, at::Tensor()};
  }
};

}  // namespace

at::Tensor batched_matmul(const at::Tensor& a, const at::Tensor& b, const at::Tensor& bias, double alpha) {
  TESSERA_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1),
                "batched_matmul: a [n, p, q] and b [n, q, r], got ", a.sizes(), " and ", b.sizes());
  if (!split_by_matrix(a, b, bias))
    return bias.defined() ? at::baddbmm(bias, a, b, /*beta=*/1, alpha) : recorded_product(a, b, alpha);
  return bias.defined() ? ProductPlusBias::apply(a, b, bias, alpha) : Product::apply(a, b, alpha);
}

}  // namespace tessera::toolkit
