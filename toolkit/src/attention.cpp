// Causal attention: LibTorch's SDPA where it exists, a query-blocked kernel with
// recomputation in backward where it does not (LibTorch 1.13), and the math path.
#include "tessera/toolkit/attention.hpp"

#include <cmath>
#include <limits>
#include <sstream>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/version.h>

#include "tessera/sdk/autocast.hpp"
#include "tessera/sdk/error.hpp"
#include "tessera/toolkit/batched_matmul.hpp"

namespace tessera::toolkit {

namespace {

constexpr bool kHasSdpa = TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1);

double resolved_scale(const at::Tensor& q, double scale) {
  return scale != 0.0 ? scale : 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
}

/// The dtype the kernels compute in. q, k and v may differ: under autocast a model's rotary
/// embedding (fp32 cos and sin) promotes q and k to fp32 while v stays the Linear's bf16 output.
/// Autocast's own products would run in its dtype, so the kernels do (the math path's matmuls
/// through autocast, the blocked kernel explicitly: its backward runs outside autocast); without
/// autocast, the promoted type of the three, as LibTorch's arithmetic would give.
at::ScalarType compute_dtype(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const bool cuda = q.is_cuda();
  if (at::isFloatingType(q.scalar_type()) && sdk::autocast_enabled(cuda)) return sdk::autocast_dtype(cuda);
  return at::promote_types(at::promote_types(q.scalar_type(), k.scalar_type()), v.scalar_type());
}

std::string describe_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  std::ostringstream out;
  out << "q " << q.scalar_type() << " " << q.sizes() << ", k " << k.scalar_type() << " " << k.sizes() << ", v "
      << v.scalar_type() << " " << v.sizes();
  return out.str();
}

/// LibTorch's errors inside a kernel, with the kernel and its inputs named: a dtype or shape
/// error in attention is otherwise reported as the bare op's, with no hint of where it came from.
template <typename F>
auto naming_the_kernel(const char* kernel, const char* pass, const at::Tensor& q, const at::Tensor& k,
                       const at::Tensor& v, F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    TESSERA_FAIL("causal attention, the \"", kernel, "\" kernel's ", pass, " (", describe_inputs(q, k, v),
                 "): ", message.substr(0, message.find('\n')), ". The model's [model] attention key chooses the ",
                 "kernel: \"math\" takes the reference path (autograd through LibTorch's own ops), \"blocked\" ",
                 "this kernel; please report the failure with the inputs above");
  }
}

/// -inf where key j is in the future of query row r (j > offset + r), 0 elsewhere: [rows, keys].
at::Tensor causal_bias(std::int64_t rows, std::int64_t keys, std::int64_t offset, const at::TensorOptions& options) {
  at::Tensor r = at::arange(rows, options.dtype(at::kLong)).add_(offset).unsqueeze(1);
  at::Tensor j = at::arange(keys, options.dtype(at::kLong)).unsqueeze(0);
  return at::zeros({rows, keys}, options).masked_fill_(j > r, -std::numeric_limits<double>::infinity());
}

/// -inf where key j belongs to another sample than query row r, 0 elsewhere: [B, rows, keys] for
/// queries of segments `rows` [B, rows] and keys of segments `keys` [B, keys].
at::Tensor segment_bias(const at::Tensor& rows, const at::Tensor& keys, const at::TensorOptions& options) {
  return at::zeros({rows.size(0), rows.size(1), keys.size(1)}, options)
      .masked_fill_(rows.unsqueeze(2) != keys.unsqueeze(1), -std::numeric_limits<double>::infinity());
}

/// Hugging Face's repeat_kv: [B, Hkv, T, D] -> [B, Hkv * groups, T, D], head h reading h / groups.
at::Tensor repeat_kv(const at::Tensor& x, std::int64_t groups) {
  if (groups == 1) return x;
  const auto B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  return x.unsqueeze(2).expand({B, H, groups, T, D}).reshape({B, H * groups, T, D});
}

at::Tensor math_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                          const CausalAttentionOptions& options, const at::Tensor& segments) {
  // Outside autocast, inputs of mixed dtypes meet in their promoted type (a GEMM takes one).
  const at::ScalarType dtype = compute_dtype(q_in, k_in, v_in);
  const bool autocast = sdk::autocast_enabled(q_in.is_cuda());
  const at::Tensor q = autocast ? q_in : q_in.to(dtype), k = autocast ? k_in : k_in.to(dtype),
                   v = autocast ? v_in : v_in.to(dtype);
  const std::int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3), Tk = k.size(2);
  const std::int64_t groups = H / k.size(1);
  at::Tensor kk = repeat_kv(k, groups).reshape({B * H, Tk, D}), vv = repeat_kv(v, groups).reshape({B * H, Tk, D});
  // mask + scale q k^T in one batched GEMM (the values of scaling and masking after it).
  at::Tensor bias = Tq > 1 ? causal_bias(Tq, Tk, Tk - Tq, q.options()) : at::Tensor();
  if (segments.defined())  // [B, Tq, Tk] per row, the same for each of its heads
    bias = (bias.defined() ? segment_bias(segments, segments, q.options()).add_(bias)
                           : segment_bias(segments, segments, q.options()))
               .unsqueeze(1).expand({B, H, Tq, Tk}).reshape({B * H, Tq, Tk});
  at::Tensor scores = batched_matmul(q.reshape({B * H, Tq, D}), kk.transpose(1, 2), bias, resolved_scale(q, options.scale));
  // Softmax in fp32 for low-precision inputs (Hugging Face's eager attention).
  at::Tensor probs = scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kDouble
                         ? at::softmax(scores, -1)
                         : at::softmax(scores, -1, at::kFloat).to(scores.scalar_type());
  probs = probs.view({B, H, Tq, Tk});
  if (options.dropout) probs = options.dropout(probs);
  return batched_matmul(probs.reshape({B * H, Tq, Tk}), vv).view({B, H, Tq, D});
}

/// The query-blocked kernel (see AttentionKernel::blocked). Works on [B Hkv, groups, T, D]: a
/// block's rows are the groups' query heads of each key/value head, so one product per block
/// reads each key/value head once and the key/value gradients sum over the group in the GEMM.
class BlockedCausalAttention : public torch::autograd::Function<BlockedCausalAttention> {
 public:
  struct Shape {
    std::int64_t B, H, Hkv, groups, Tq, Tk, D, block;
    double scale;
  };

  /// One block's probabilities [B Hkv, groups n, keys - k0] (float) and its inputs: queries
  /// [B Hkv, groups n, D], keys and values [B Hkv, keys, D], of which the block reads [k0, keys):
  /// k0 > 0 where packed samples start after it (see key_starts). `lse` given: exp(s - lse)
  /// (backward), else computed and returned through it (forward).
  static at::Tensor probabilities(const Shape& s, const at::Tensor& qg, const at::Tensor& kk, std::int64_t t0,
                                  std::int64_t n, std::int64_t k0, at::Tensor& qb, at::Tensor& lse, bool have_lse,
                                  const at::Tensor& segments) {
    const std::int64_t BH = s.B * s.Hkv, keys = s.Tk - s.Tq + t0 + n, width = keys - k0;
    qb = qg.narrow(2, t0, n).reshape({BH, s.groups * n, s.D});
    at::Tensor bias;
    if (n > 1) bias = causal_bias(n, width, s.Tk - s.Tq + t0 - k0, qg.options()).repeat({s.groups, 1});
    if (segments.numel() > 0) {  // a block's rows are (group, query): each row's sample mask, per head
      at::Tensor other =
          segment_bias(segments.narrow(1, s.Tk - s.Tq + t0, n), segments.narrow(1, k0, width), qg.options());
      other = other.view({s.B, 1, 1, n, width}).expand({s.B, s.Hkv, s.groups, n, width}).reshape({BH, s.groups * n, width});
      bias = bias.defined() ? other.add_(bias) : other;
    }
    at::Tensor scores = batched_matmul(qb, kk.narrow(1, k0, width).transpose(1, 2), bias, s.scale).to(at::kFloat);
    if (!have_lse) lse = at::logsumexp(scores, -1, /*keepdim=*/true);
    return scores.sub_(lse).exp_();
  }

  /// The first key each query block can see (varlen attention without padding): the start of
  /// the sample of its first query, the earliest over the batch's rows; 0 for every block of
  /// unpacked rows. Read on the host once per call (packed batches come from the host).
  static std::vector<std::int64_t> key_starts(const Shape& s, const at::Tensor& segments) {
    const std::int64_t offset = s.Tk - s.Tq;  // the keys before the first query (0 when packed)
    std::vector<std::int64_t> starts;
    for (std::int64_t t0 = 0; t0 < s.Tq; t0 += s.block) starts.push_back(segments.numel() > 0 ? offset + t0 : 0);
    if (segments.numel() == 0) return starts;
    const at::Tensor segs = segments.to(at::kCPU, at::kLong).contiguous();
    std::vector<std::int64_t> start(static_cast<std::size_t>(s.Tk));  // where each key's sample starts
    for (std::int64_t b = 0; b < s.B; ++b) {
      const std::int64_t* row = segs[b].data_ptr<std::int64_t>();
      for (std::int64_t t = 0; t < s.Tk; ++t)
        start[static_cast<std::size_t>(t)] = t > 0 && row[t] == row[t - 1] ? start[static_cast<std::size_t>(t - 1)] : t;
      for (std::size_t i = 0; i < starts.size(); ++i)
        starts[i] = std::min(starts[i], start[static_cast<std::size_t>(offset) + i * static_cast<std::size_t>(s.block)]);
    }
    return starts;
  }

  /// Packed rows' segments ([B, T], or empty): a plain argument, not an input autograd tracks.
  struct Segments {
    at::Tensor ids;
  };

  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, Segments packed, double scale, std::int64_t block) {
    const at::Tensor& segments = packed.ids;
    return naming_the_kernel("blocked", "forward", q, k, v, [&] {
      // Every product in one dtype (compute_dtype); the gradients go back in each input's own.
      const at::ScalarType dtype = compute_dtype(q, k, v);
      Shape s{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), k.size(2), q.size(3), block, scale};
      const std::int64_t BH = s.B * s.Hkv;
      at::Tensor qg = q.to(dtype).contiguous().view({BH, s.groups, s.Tq, s.D});
      at::Tensor kk = k.to(dtype).contiguous().view({BH, s.Tk, s.D}), vv = v.to(dtype).contiguous().view({BH, s.Tk, s.D});
      at::Tensor out = at::empty_like(qg);
      at::Tensor lse_all = at::empty({BH, s.groups, s.Tq}, q.options().dtype(at::kFloat));
      const std::vector<std::int64_t> starts = key_starts(s, segments);
      for (std::int64_t t0 = 0, i = 0; t0 < s.Tq; t0 += s.block, ++i) {
        const std::int64_t n = std::min(s.block, s.Tq - t0), keys = s.Tk - s.Tq + t0 + n, k0 = starts[i];
        at::Tensor qb, lse;
        at::Tensor p = probabilities(s, qg, kk, t0, n, k0, qb, lse, /*have_lse=*/false, segments).to(dtype);
        out.narrow(2, t0, n).copy_(batched_matmul(p, vv.narrow(1, k0, keys - k0)).view({BH, s.groups, n, s.D}));
        lse_all.narrow(2, t0, n).copy_(lse.view({BH, s.groups, n}));
      }
      ctx->save_for_backward({qg, kk, vv, out, lse_all});
      ctx->saved_data["segments"] = segments;
      ctx->saved_data["key_starts"] = starts;
      ctx->saved_data["shape"] = std::vector<std::int64_t>{s.B, s.H, s.Hkv, s.groups, s.Tq, s.Tk, s.D, s.block};
      ctx->saved_data["scale"] = scale;
      ctx->saved_data["input_dtypes"] = std::vector<std::int64_t>{static_cast<std::int64_t>(q.scalar_type()),
                                                                  static_cast<std::int64_t>(k.scalar_type()),
                                                                  static_cast<std::int64_t>(v.scalar_type())};
      return out.view({s.B, s.H, s.Tq, s.D});
    });
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &qg = saved[0], &kk = saved[1], &vv = saved[2], &out = saved[3], &lse_all = saved[4];
    const at::Tensor segments = ctx->saved_data["segments"].toTensor();
    return naming_the_kernel("blocked", "backward", qg, kk, vv, [&] {
      const auto d = ctx->saved_data["shape"].toIntVector();
      const auto input_dtypes = ctx->saved_data["input_dtypes"].toIntVector();
      Shape s{d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], ctx->saved_data["scale"].toDouble()};
      const std::int64_t BH = s.B * s.Hkv;
      // The dtype forward computed in (its saved tensors'), whatever autocast says now: backward
      // runs outside the forward's autocast region.
      const auto dtype = qg.scalar_type();
      at::Tensor dout = grads[0].to(dtype).contiguous().view({BH, s.groups, s.Tq, s.D});
      // D_i = rowsum(dO * O): the softmax backward's correction term (flash attention's D).
      at::Tensor delta = (dout.to(at::kFloat) * out.to(at::kFloat)).sum(-1);
      at::Tensor dq = at::empty_like(qg), dk = at::zeros_like(kk), dv = at::zeros_like(vv);
      const auto starts = ctx->saved_data["key_starts"].toIntVector();
      for (std::int64_t t0 = 0, i = 0; t0 < s.Tq; t0 += s.block, ++i) {
        const std::int64_t n = std::min(s.block, s.Tq - t0), k0 = starts[static_cast<std::size_t>(i)],
                           width = s.Tk - s.Tq + t0 + n - k0;
        at::Tensor qb, lse = lse_all.narrow(2, t0, n).reshape({BH, s.groups * n, 1});
        at::Tensor p = probabilities(s, qg, kk, t0, n, k0, qb, lse, /*have_lse=*/true, segments);
        at::Tensor dob = dout.narrow(2, t0, n).reshape({BH, s.groups * n, s.D});
        at::Tensor kb = kk.narrow(1, k0, width), vb = vv.narrow(1, k0, width);
        dv.narrow(1, k0, width).add_(batched_matmul(p.to(dtype).transpose(1, 2), dob));
        at::Tensor dp = batched_matmul(dob, vb.transpose(1, 2)).to(at::kFloat);
        at::Tensor ds =
            p.mul_(dp.sub_(delta.narrow(2, t0, n).reshape({BH, s.groups * n, 1}))).mul_(s.scale).to(dtype);
        dq.narrow(2, t0, n).copy_(batched_matmul(ds, kb).view({BH, s.groups, n, s.D}));
        dk.narrow(1, k0, width).add_(batched_matmul(ds.transpose(1, 2), qb));
      }
      auto as_input = [&](const at::Tensor& g, std::size_t i) {
        return g.to(static_cast<at::ScalarType>(input_dtypes[i]));
      };
      return torch::autograd::variable_list{as_input(dq.view({s.B, s.H, s.Tq, s.D}), 0),
                                            as_input(dk.view({s.B, s.Hkv, s.Tk, s.D}), 1),
                                            as_input(dv.view({s.B, s.Hkv, s.Tk, s.D}), 2), at::Tensor(), at::Tensor(),
                                            at::Tensor()};
    });
  }
};

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
at::Tensor sdpa_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, double scale,
                          const at::Tensor& segments) {
  // SDPA takes one dtype: outside autocast (which casts for it) the promoted type of the three.
  const bool autocast = sdk::autocast_enabled(q_in.is_cuda());
  const at::ScalarType dtype = compute_dtype(q_in, k_in, v_in);
  const at::Tensor q = autocast ? q_in : q_in.to(dtype), k = autocast ? k_in : k_in.to(dtype),
                   v = autocast ? v_in : v_in.to(dtype);
  const std::int64_t Tq = q.size(2), Tk = k.size(2), groups = q.size(1) / k.size(1);
  // SDPA's is_causal aligns the mask top-left; a KV cache needs it bottom-right. One query sees
  // every key (no mask); a square one is is_causal; otherwise an explicit boolean mask.
  bool causal = Tq == Tk && Tq > 1;
  c10::optional<at::Tensor> mask;  // true: the query may attend to the key
  if (Tq != Tk && Tq > 1) mask = at::ones({Tq, Tk}, q.options().dtype(at::kBool)).tril(Tk - Tq);
  if (segments.defined()) {  // block-diagonal causal: [B, 1, T, T]
    mask = (segments.unsqueeze(2) == segments.unsqueeze(1)).logical_and_(at::ones({Tq, Tk}, q.options().dtype(at::kBool)).tril())
               .unsqueeze(1);
    causal = false;
  }
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 5
  // CUDA's flash kernel reads each key/value head for its group of query heads (enable_gqa). The
  // CPU's flash kernel takes no GQA: asked for it, SDPA falls back to the math path and its
  // [B, H, T, T] probabilities (measured on LibTorch 2.6: the math path's peak). There the keys and
  // values are repeated instead (T x D per query head, not T x T).
  if (q.is_cuda()) return at::scaled_dot_product_attention(q, k, v, mask, 0.0, causal, scale, /*enable_gqa=*/groups > 1);
#endif
  return at::scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups), mask, 0.0, causal, scale);
}
#endif

}  // namespace

AttentionKernel causal_attention_kernel(const at::Tensor& q, const at::Tensor& k, const CausalAttentionOptions& options) {
  if (options.dropout) return AttentionKernel::math;
  AttentionKernel kernel = options.kernel;
  if (kernel == AttentionKernel::automatic) kernel = kHasSdpa ? AttentionKernel::sdpa : AttentionKernel::blocked;
  // One block is the math path with nothing saved in its place.
  if (kernel == AttentionKernel::blocked && q.size(2) <= options.query_block) return AttentionKernel::math;
  (void)k;
  return kernel;
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const CausalAttentionOptions& options, const at::Tensor& segments) {
  TESSERA_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "causal_attention: q, k and v must be [B, H, T, D], found ",
                q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TESSERA_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(3) == k.size(3) && k.size(1) > 0 &&
                    q.size(1) % k.size(1) == 0 && k.size(2) >= q.size(2),
                "causal_attention: q ", q.sizes(), " with k ", k.sizes(), " and v ", v.sizes(),
                ": k and v must be alike, with as many batch rows and head dims as q, a number of heads dividing q's "
                "and at least q's positions");
  TESSERA_CHECK(options.query_block > 0, "causal_attention: query_block must be positive, found ", options.query_block);
  const bool packed = segments.defined() && segments.numel() > 0;  // an empty tensor: none
  TESSERA_CHECK(!packed || (segments.dim() == 2 && segments.size(0) == q.size(0) &&
                                        segments.size(1) == q.size(2) && q.size(2) == k.size(2)),
                "causal_attention: segments ", segments.defined() ? segments.sizes() : at::IntArrayRef{},
                " must be [B, T] for q ", q.sizes(), " and k ", k.sizes(), " of as many positions (packed rows take no KV cache)");
  const at::Tensor segs = packed ? segments.to(q.device(), at::kLong) : at::Tensor();
  const double scale = resolved_scale(q, options.scale);
  AttentionKernel kernel = causal_attention_kernel(q, k, options);
  if (packed && options.kernel == AttentionKernel::automatic && !q.is_cuda() && kernel == AttentionKernel::sdpa)
    kernel = q.size(2) <= options.query_block ? AttentionKernel::math : AttentionKernel::blocked;
  switch (kernel) {
    case AttentionKernel::sdpa:
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
      return sdpa_attention(q, k, v, scale, segs);
#else
      TESSERA_FAIL("causal_attention: the sdpa kernel needs LibTorch 2.1 or later (this is ", TORCH_VERSION,
                   "); use \"automatic\" (the blocked kernel here) or \"blocked\"");
#endif
    case AttentionKernel::blocked:
      // An IValue holds no undefined tensor: no segments is an empty one.
      return BlockedCausalAttention::apply(
          q, k, v, BlockedCausalAttention::Segments{segs.defined() ? segs : at::empty({0}, at::kLong)}, scale,
          options.query_block);
    default: {
      CausalAttentionOptions math = options;
      math.scale = scale;
      return math_attention(q, k, v, math, segs);
    }
  }
}

at::Tensor segments_from_positions(const at::Tensor& position_ids) {
  TESSERA_CHECK(position_ids.dim() == 2, "position_ids must be [B, T], found ", position_ids.sizes());
  return position_ids.eq(0).cumsum(1);
}

AttentionKernel parse_attention_kernel(const std::string& name, const std::string& what) {
  for (AttentionKernel kernel :
       {AttentionKernel::automatic, AttentionKernel::sdpa, AttentionKernel::blocked, AttentionKernel::math})
    if (name == to_string(kernel)) {
      TESSERA_CHECK(kernel != AttentionKernel::sdpa || kHasSdpa, what, " = \"sdpa\" needs LibTorch 2.1 or later (this is ",
                    TORCH_VERSION, "); valid here: \"automatic\" (the blocked kernel), \"blocked\", \"math\"");
      return kernel;
    }
  TESSERA_FAIL(what, " = \"", name, "\" is not an attention kernel; valid: \"automatic\", \"sdpa\", \"blocked\", \"math\"");
}

std::string to_string(AttentionKernel kernel) {
  switch (kernel) {
    case AttentionKernel::sdpa: return "sdpa";
    case AttentionKernel::blocked: return "blocked";
    case AttentionKernel::math: return "math";
    default: return "automatic";
  }
}

}  // namespace tessera::toolkit
