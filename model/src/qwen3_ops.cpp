// Stateless Qwen3 building blocks, written to match HF transformers' Qwen3 modules op for op:
// RMSNorm (fp32 normalize, cast, times weight), rotate-half RoPE, and attention (SDPA where
// LibTorch has it, else the eager path: scaled scores, fp32 softmax, cast, times V). Masks are
// built on the device from padding/segment ids without host synchronization.
#include <ATen/ATen.h>

#include <cmath>

#include "q4/quant/torch_compat.h"
#include "qwen3_impl.h"

namespace q4::model {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool fused) {
  if (fused && fused_rms_norm_applies(x, weight)) return fused_rms_norm(x, weight, eps);
  return rms_norm_reference(x, weight, eps);
}

at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto input_dtype = x.scalar_type();
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  xf = xf * at::rsqrt(var + eps);
  return weight * xf.to(input_dtype);
}

namespace {
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}
}  // namespace

at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope) {
  at::Tensor cos = rope.cos.unsqueeze(1);  // (B, 1, T, D)
  at::Tensor sin = rope.sin.unsqueeze(1);
  return x * cos + rotate_half(x) * sin;
}

at::Tensor apply_rope_bthd(const at::Tensor& x, const RopeTables& rope, bool fused) {
  if (fused && x.dim() == 4) {
    const int64_t B = x.size(0), T = x.size(1), NH = x.size(2), D = x.size(3);
    const at::Tensor cos = rope.cos.reshape({B * T, D});
    const at::Tensor xf = x.reshape({B * T, NH, D});
    if (fused_rope_applies(xf, cos)) {
      return fused_rope(xf, cos, rope.sin.reshape({B * T, D})).view({B, T, NH, D});
    }
  }
  at::Tensor cos = rope.cos.unsqueeze(2);  // (B, T, 1, D)
  at::Tensor sin = rope.sin.unsqueeze(2);
  return x * cos + rotate_half(x) * sin;
}

bool varlen_attention_available(const at::Device& device, at::ScalarType compute_dtype,
                                int64_t head_dim) {
  return Q4_HAS_FLASH_VARLEN && device.is_cuda() &&
         (compute_dtype == at::kBFloat16 || compute_dtype == at::kHalf) && head_dim % 8 == 0 &&
         head_dim <= 256;
}

at::Tensor attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens, int64_t max_seqlen) {
#if Q4_HAS_FLASH_VARLEN
  TORCH_INTERNAL_ASSERT(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && q.is_cuda() &&
                        cu_seqlens.scalar_type() == at::kInt && cu_seqlens.is_cuda());
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  // GQA: the kernel reads each KV head for its group of query heads (no repeat_interleave).
  auto out = at::_flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                          /*dropout_p=*/0.0, /*is_causal=*/true,
                                          /*return_debug_mask=*/false, scale);
  return std::get<0>(out);
#else
  TORCH_CHECK(false, "variable-length attention needs LibTorch >= 2.4 with CUDA");
  return {};
#endif
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttnMask& mask) {
  TORCH_INTERNAL_ASSERT(mask.kind != AttnMask::Kind::kVarlen, "varlen mask in attention()");
  const int64_t nh = q.size(1);
  const int64_t kvh = k.size(1);
  // One query position (a decode step) with grouped key/value heads: the query heads that share
  // a key/value head become its query rows, (B, KVH, NH/KVH, D), so the cache is read as it is
  // instead of repeated NH/KVH times (a mask of one row per batch broadcasts over those rows).
  const bool one_row_mask =
      mask.kind == AttnMask::Kind::kNone ||
      (mask.kind == AttnMask::Kind::kExplicit && mask.allowed.size(-2) == 1 &&
       (mask.allowed.dim() < 4 || mask.allowed.size(1) == 1));
  if (kvh != nh && q.size(2) == 1 && one_row_mask) {
    const int64_t B = q.size(0), D = q.size(3);
    return attention(q.reshape({B, kvh, nh / kvh, D}), k, v, mask).reshape({B, nh, 1, D});
  }
  at::Tensor kk = k;
  at::Tensor vv = v;
  if (kvh != nh) {
    kk = k.repeat_interleave(nh / kvh, 1);
    vv = v.repeat_interleave(nh / kvh, 1);
  }
#if Q4_HAS_SDPA
  switch (mask.kind) {
    case AttnMask::Kind::kNone:
      return at::scaled_dot_product_attention(q, kk, vv, {}, 0.0, false);
    case AttnMask::Kind::kCausal:
      return at::scaled_dot_product_attention(q, kk, vv, {}, 0.0, true);
    case AttnMask::Kind::kExplicit:
      return at::scaled_dot_product_attention(q, kk, vv, mask.allowed, 0.0, false);
    case AttnMask::Kind::kVarlen:
      break;  // layer_forward calls attention_varlen
  }
  TORCH_INTERNAL_ASSERT(false, "unreachable");
#else
  const double scaling = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q, kk.transpose(-2, -1)) * scaling;  // (B, NH, T, S)
  at::Tensor scores32 = scores.to(at::kFloat);
  if (mask.kind == AttnMask::Kind::kCausal) {
    const int64_t T = q.size(2);
    const int64_t S = kk.size(2);
    at::Tensor future = at::ones({T, S}, q.options().dtype(at::kBool)).triu(S - T + 1);
    scores32 = scores32.masked_fill(future, -std::numeric_limits<float>::infinity());
  } else if (mask.kind == AttnMask::Kind::kExplicit) {
    scores32 =
        scores32.masked_fill(mask.allowed.logical_not(), -std::numeric_limits<float>::infinity());
  }
  at::Tensor probs = at::softmax(scores32, -1).to(q.scalar_type());
  return at::matmul(probs, vv);
#endif
}

AttnMask build_attention_mask(const ModelInputs& in, int64_t past, int64_t T,
                              const at::Device& device) {
  const bool has_pad = in.attention_mask.defined();
  const bool has_seg = in.segment_ids.defined();
  AttnMask m;
  if (!has_pad && !has_seg) {
    if (T == 1) {
      m.kind = AttnMask::Kind::kNone;
    } else if (past == 0) {
      m.kind = AttnMask::Kind::kCausal;
    } else {
      // Prefill on top of a non-empty cache: query i sits at absolute position past + i.
      const int64_t S = past + T;
      at::Tensor allowed =
          at::ones({T, S}, at::TensorOptions().dtype(at::kBool).device(device)).tril(past);
      m.kind = AttnMask::Kind::kExplicit;
      m.allowed = allowed.view({1, 1, T, S});
    }
    return m;
  }
  TORCH_CHECK(past == 0,
              "attention_mask/segment_ids are not supported together with a KV cache "
              "(cache holds ",
              past, " tokens)");
  const auto bopt = at::TensorOptions().dtype(at::kBool).device(device);
  at::Tensor causal = at::ones({T, T}, bopt).tril().view({1, 1, T, T});
  at::Tensor allowed = causal;
  if (has_pad) {
    at::Tensor key_ok = in.attention_mask.to(device).ne(0).view({-1, 1, 1, T});  // (B,1,1,T)
    allowed = allowed.logical_and(key_ok);
  }
  if (has_seg) {
    at::Tensor seg = in.segment_ids.to(device);
    at::Tensor same = seg.unsqueeze(2).eq(seg.unsqueeze(1)).unsqueeze(1);  // (B,1,T,T)
    at::Tensor key_real = seg.ne(0).view({-1, 1, 1, T});
    allowed = allowed.logical_and(same).logical_and(key_real);
  }
  // Every query keeps itself so padded query rows stay finite (their outputs are unsupervised).
  at::Tensor diag = at::eye(T, bopt).view({1, 1, T, T});
  m.kind = AttnMask::Kind::kExplicit;
  m.allowed = allowed.logical_or(diag).contiguous();
  return m;
}

KeyRef classify_key(const std::string& key) {
  static const std::string kQ = ".qdata";
  static const std::string kS = ".scale";
  auto ends_with = [&](const std::string& suf) {
    return key.size() > suf.size() && key.compare(key.size() - suf.size(), suf.size(), suf) == 0;
  };
  KeyRef r;
  if (ends_with(kQ)) {
    r.part = KeyRef::Part::kQData;
    r.name = key.substr(0, key.size() - kQ.size());
  } else if (ends_with(kS)) {
    r.part = KeyRef::Part::kScale;
    r.name = key.substr(0, key.size() - kS.size());
  } else {
    r.name = key;
  }
  return r;
}

}  // namespace q4::model
