// Tensors to the launchers of fused_kernels.h: dtypes, row strides, outputs and scratch
// allocated through ATen's caching allocator, launches on the current stream (no host sync).
#include "fused_ops_cuda.hpp"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "fused_kernels.h"
#include "tessera/sdk/error.hpp"

namespace tessera::toolkit::cuda {

namespace {

Dtype dtype(const at::Tensor& t) {
  if (t.scalar_type() == at::kFloat) return Dtype::kFloat32;
  TESSERA_CHECK(t.scalar_type() == at::kBFloat16, "toolkit CUDA kernels: fp32 or bf16 expected, found ", t.scalar_type());
  return Dtype::kBFloat16;
}

void check(cudaError_t error, const char* kernel) {
  TESSERA_CHECK(error == cudaSuccess, "toolkit CUDA kernel ", kernel, ": ", cudaGetErrorString(error));
}

cudaStream_t stream(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

/// t as [rows, width] rows with a unit stride in width: a view where t's strides allow it
/// (a slice of rows, the halves of one projection), a contiguous copy otherwise.
at::Tensor rows_of(const at::Tensor& t, std::int64_t width) {
  at::Tensor rows = t.reshape({-1, width});
  return rows.stride(1) == 1 || width == 1 ? rows : rows.contiguous();
}
std::int64_t row_stride(const at::Tensor& rows) { return rows.size(0) > 1 ? rows.stride(0) : rows.size(1); }

}  // namespace

RmsNormTensors rms_norm_forward(const at::Tensor& x_in, const at::Tensor& delta_in, const at::Tensor& weight,
                                double eps) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor x = x_in, delta = delta_in;
  if (delta.defined() && delta.sizes() != x.sizes()) {  // broadcast: the add on its own
    x = at::add(x, delta);
    delta = at::Tensor();
  } else if (delta.defined()) {
    const at::ScalarType h_type = at::promote_types(x.scalar_type(), delta.scalar_type());
    x = x.to(h_type);
    delta = delta.to(h_type);
  }
  const std::int64_t D = x.size(-1);
  const at::Tensor x_rows = rows_of(x, D), w = weight.contiguous();
  const at::Tensor delta_rows = delta.defined() ? rows_of(delta, D) : at::Tensor();
  RmsNormTensors out;
  out.h = delta.defined() ? at::empty(x.sizes(), x.options()) : x;
  out.y = at::empty(x.sizes(), x.options().dtype(at::promote_types(x.scalar_type(), w.scalar_type())));
  out.rstd = at::empty({x_rows.size(0)}, x.options().dtype(at::kFloat));
  RmsNormForward a;
  a.x = x_rows.data_ptr();
  a.x_row_stride = row_stride(x_rows);
  if (delta.defined()) {
    a.delta = delta_rows.data_ptr();
    a.delta_row_stride = row_stride(delta_rows);
    a.h_out = out.h.data_ptr();
  }
  a.x_dtype = dtype(x);
  a.weight = w.data_ptr();
  a.weight_dtype = dtype(w);
  a.y = out.y.data_ptr();
  a.rstd = out.rstd.data_ptr<float>();
  a.rows = x_rows.size(0);
  a.D = D;
  a.eps = static_cast<float>(eps);
  check(cuda::rms_norm_forward(a, stream(x)), "rms_norm_forward");
  return out;
}

std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& dy_in, const at::Tensor& h,
                                                    const at::Tensor& weight, const at::Tensor& rstd,
                                                    const at::Tensor& dh_extra_in) {
  const c10::cuda::CUDAGuard guard(h.device());
  const std::int64_t D = h.size(-1);
  const at::Tensor h_rows = rows_of(h, D), w = weight.contiguous();
  const at::Tensor dy = dy_in.to(at::promote_types(h.scalar_type(), w.scalar_type())).contiguous();
  const at::Tensor dh_extra = dh_extra_in.defined() ? dh_extra_in.to(h.scalar_type()).contiguous() : at::Tensor();
  at::Tensor dh = at::empty(h.sizes(), h.options());
  at::Tensor dw = at::empty({D}, w.options());
  const std::int64_t rows = h_rows.size(0);
  const std::size_t workspace_bytes = rms_norm_backward_workspace_bytes(rows, D);
  TESSERA_CHECK(workspace_bytes > 0 || rows == 0, "toolkit CUDA kernel rms_norm_backward: no device to size it for");
  at::Tensor workspace = at::empty({static_cast<std::int64_t>(workspace_bytes / sizeof(float))}, h.options().dtype(at::kFloat));
  RmsNormBackward a;
  a.dy = dy.data_ptr();
  a.h = h_rows.data_ptr();
  a.h_row_stride = row_stride(h_rows);
  a.h_dtype = dtype(h);
  a.weight = w.data_ptr();
  a.weight_dtype = dtype(w);
  a.rstd = rstd.data_ptr<float>();
  a.dh_extra = dh_extra.defined() ? dh_extra.data_ptr() : nullptr;
  a.dh = dh.data_ptr();
  a.dweight = dw.data_ptr();
  a.workspace = workspace.data_ptr();
  a.rows = rows;
  a.D = D;
  check(cuda::rms_norm_backward(a, stream(h)), "rms_norm_backward");
  return {dh, dw};
}

std::pair<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& cos_in,
                                                   const at::Tensor& sin_in, at::ScalarType q_out, at::ScalarType k_out,
                                                   bool backward) {
  const at::Tensor& any = q_in.defined() ? q_in : k_in;
  if (!any.defined()) return {};
  const c10::cuda::CUDAGuard guard(any.device());
  // cos and sin share one layout; the kernel reads their rows with a unit stride in D.
  const bool shared_layout = cos_in.stride(1) == 1 && sin_in.strides() == cos_in.strides();
  const at::Tensor cos = shared_layout ? cos_in : cos_in.contiguous();
  const at::Tensor sin = shared_layout ? sin_in.to(cos.scalar_type()) : sin_in.to(cos.scalar_type()).contiguous();
  Rotary a;
  a.B = any.size(0);
  a.T = any.size(2);
  a.D = any.size(3);
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.cs_row_stride = cos.size(0) > 1 ? cos.stride(0) : a.D;
  a.cs_dtype = dtype(cos);
  a.backward = backward;
  // Heads are read with a unit stride in D; the results are new contiguous tensors.
  at::Tensor q = q_in.defined() && q_in.stride(3) != 1 ? q_in.contiguous() : q_in;
  at::Tensor k = k_in.defined() && k_in.stride(3) != 1 ? k_in.contiguous() : k_in;
  auto describe = [](const at::Tensor& x, at::ScalarType out_type, RotaryOperand& side) {
    at::Tensor result;
    if (!x.defined()) return result;
    result = at::empty(x.sizes(), x.options().dtype(out_type));
    side.x = x.data_ptr();
    side.out = result.data_ptr();
    for (int d = 0; d < 3; ++d) {
      side.x_strides[d] = x.stride(d);
      side.out_strides[d] = result.stride(d);
    }
    side.x_dtype = dtype(x);
    side.out_dtype = dtype(result);
    side.heads = x.size(1);
    return result;
  };
  std::pair<at::Tensor, at::Tensor> out{describe(q, q_out, a.q), describe(k, k_out, a.k)};
  check(cuda::rotary_embedding(a, stream(any)), "rotary_embedding");
  return out;
}

namespace {

/// gate's and up's rows (and their row strides) for the SwiGLU launchers; `keep` holds them.
SwiGLU swiglu_inputs(const at::Tensor& gate, const at::Tensor& up, std::pair<at::Tensor, at::Tensor>& keep) {
  const std::int64_t width = gate.dim() > 0 ? gate.size(-1) : 1;
  keep = {rows_of(gate, width), rows_of(up, width)};
  SwiGLU a;
  a.gate = keep.first.data_ptr();
  a.gate_row_stride = row_stride(keep.first);
  a.gate_dtype = dtype(gate);
  a.up = keep.second.data_ptr();
  a.up_row_stride = row_stride(keep.second);
  a.up_dtype = dtype(up);
  a.rows = keep.first.size(0);
  a.width = width;
  return a;
}

}  // namespace

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  const c10::cuda::CUDAGuard guard(gate.device());
  std::pair<at::Tensor, at::Tensor> rows;
  SwiGLU a = swiglu_inputs(gate, up, rows);
  at::Tensor y = at::empty(gate.sizes(), gate.options().dtype(at::promote_types(gate.scalar_type(), up.scalar_type())));
  a.y = y.data_ptr();
  check(cuda::swiglu_forward(a, stream(gate)), "swiglu_forward");
  return y;
}

std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& dy_in, const at::Tensor& gate, const at::Tensor& up) {
  const c10::cuda::CUDAGuard guard(gate.device());
  std::pair<at::Tensor, at::Tensor> rows;
  SwiGLU a = swiglu_inputs(gate, up, rows);
  const at::Tensor dy = dy_in.to(at::promote_types(gate.scalar_type(), up.scalar_type())).contiguous();
  at::Tensor dgate = at::empty(gate.sizes(), gate.options()), dup = at::empty(up.sizes(), up.options());
  a.dy = dy.data_ptr();
  a.dgate = dgate.data_ptr();
  a.dup = dup.data_ptr();
  check(cuda::swiglu_backward(a, stream(gate)), "swiglu_backward");
  return {dgate, dup};
}

void cross_entropy_rows(const at::Tensor& logits, const at::Tensor& target, std::int64_t ignore_index,
                        const at::Tensor& grad_scale, const at::Tensor& row_loss) {
  const c10::cuda::CUDAGuard guard(logits.device());
  TESSERA_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && target.scalar_type() == at::kLong &&
                    target.is_contiguous() && target.numel() == logits.size(0) && row_loss.is_contiguous() &&
                    row_loss.scalar_type() == at::kFloat && row_loss.numel() == logits.size(0) &&
                    (!grad_scale.defined() || grad_scale.scalar_type() == at::kFloat),
                "toolkit CUDA kernel cross_entropy_rows: logits [rows, vocab] with unit stride in vocab, int64 "
                "targets and fp32 row losses expected");
  CrossEntropyRows a;
  a.logits = logits.data_ptr();
  a.row_stride = logits.size(0) > 1 ? logits.stride(0) : logits.size(1);
  a.dtype = dtype(logits);
  a.target = target.data_ptr<std::int64_t>();
  a.ignore_index = ignore_index;
  a.grad_scale = grad_scale.defined() ? grad_scale.data_ptr<float>() : nullptr;
  a.row_loss = row_loss.data_ptr<float>();
  a.rows = logits.size(0);
  a.vocab = logits.size(1);
  check(cuda::cross_entropy_rows(a, stream(logits)), "cross_entropy_rows");
}

}  // namespace tessera::toolkit::cuda
