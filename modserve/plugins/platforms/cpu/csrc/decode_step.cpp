// A decode step of a pre-norm Llama decoder as one C++ call, on the CPU.
//
// A step of a few decodes reads every weight once, which the few-row kernels do near this
// machine's memory bandwidth; what they waited for was the rest: ~50 compiled and eager
// regions a step, each with its guards, its wrapper and its Python, 4-5 ms of a ~10 ms
// step. Here the whole decoder runs in one call, for any number of decodes: the linears
// and the attention are the same registered ops the eager path calls (each linear's
// quantizer and the attention backend name theirs), called through the dispatcher with no
// Python between them; the elementwise work between them (RMSNorm, RoPE, SiLU-and-mul,
// residual adds) is a few thousand floats a row, in vector loops on the calling thread
// for a few rows and split over the threads from kParallelRows on.
//
// Registered as torch.classes.modserve_decode.DecodeStep (built by
// modserve/plugins/platforms/cpu/native_decode.py).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "claims.h"  // parallel_claims: modserve/api/csrc/, on every kernel's include path
#include "vec8.h"    // v8, load8, store8, hsum, exp8

namespace {

using modserve::exp8;
using modserve::load8;
using modserve::store8;
using modserve::v8;

c10::OperatorHandle find_op(const std::string& qualified) {
  // "ns::name" or "ns::name.overload"
  const auto dot = qualified.find('.');
  const std::string name = qualified.substr(0, dot);
  const std::string overload = dot == std::string::npos ? "" : qualified.substr(dot + 1);
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
}

// One linear as its quantizer runs it: op(x [T, in], args...) -> [T, out].
struct NativeLinear {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;

  at::Tensor operator()(const at::Tensor& x) const {
    torch::jit::Stack stack;
    stack.reserve(args.size() + 1);
    stack.emplace_back(x);
    stack.insert(stack.end(), args.begin(), args.end());
    op.callBoxed(stack);
    return stack.back().toTensor();
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;  // [hidden] float32
  std::vector<NativeLinear> linears;  // qkv, o, gate_up, down
};

// y = w * (x * rsqrt(mean(x^2) + eps)), transformers' op order; n floats, a multiple of 8.
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps) {
  v8 sums = {};
  for (int64_t i = 0; i < n; i += 8) sums += load8(x + i) * load8(x + i);
  const float r = 1.f / std::sqrt(modserve::hsum(sums) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; i += 8) store8(y + i, load8(w + i) * (load8(x + i) * r));
}

// out = silu(gate) * up = gate / (1 + e^-gate) * up; n floats, a multiple of 8.
void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    const v8 g = load8(gate + i);
    store8(out + i, g / (1.f + exp8(-g)) * load8(up + i));
  }
}

// out = x * cos + rotate_half(x) * sin for one head of D floats (rotate_half: [-x2, x1]).
void rope(const float* x, const float* cos, const float* sin, float* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < D; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// The attention backend's native decode op: (q, k, v, kv_cache, slot_mapping, block_tables,
// seq_lens, scale) -> [T, H, D] (AttentionBackend.native_decode).
using AttentionSignature = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const at::Tensor&, const at::Tensor&, const at::Tensor&, double);
using AttentionOp = c10::TypedOperatorHandle<AttentionSignature>;

class DecodeStep : public torch::CustomClassHolder {
 public:
  // embedding [V, hidden]; final_norm [hidden]; cos, sin [max_positions, D] float32.
  DecodeStep(at::Tensor embedding, at::Tensor final_norm, at::Tensor cos, at::Tensor sin, int64_t heads,
             int64_t kv_heads, int64_t head_dim, double eps, double scale, std::string attention_op)
      : embedding_(embedding.contiguous()), final_norm_(final_norm.contiguous()), cos_(cos.contiguous()),
        sin_(sin.contiguous()), H_(heads), Hkv_(kv_heads), D_(head_dim), eps_(static_cast<float>(eps)),
        scale_(scale),
        attention_(find_op(attention_op).typed<AttentionSignature>()) {
    TORCH_CHECK(embedding_.scalar_type() == at::kFloat && final_norm_.scalar_type() == at::kFloat &&
                    cos_.scalar_type() == at::kFloat && sin_.scalar_type() == at::kFloat,
                "DecodeStep: float32 embedding, norm and rotary tables");
    TORCH_CHECK(cos_.size(1) == D_ && D_ % 2 == 0 && H_ % Hkv_ == 0, "DecodeStep: head shapes disagree");
    TORCH_CHECK(embedding_.size(1) % 8 == 0, "DecodeStep: hidden size a multiple of 8");
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm) {
    TORCH_CHECK(input_norm.scalar_type() == at::kFloat && post_norm.scalar_type() == at::kFloat,
                "DecodeStep: float32 norm weights");
    layers_.push_back(Layer{input_norm.contiguous(), post_norm.contiguous(), {}});
  }

  // The last added layer's next linear (qkv, o, gate_up, down, in that order).
  void add_linear(std::string op, c10::List<c10::optional<at::Tensor>> args) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "DecodeStep: four linears per layer");
    NativeLinear linear{find_op(op), {}};
    for (const c10::optional<at::Tensor>& a : args) linear.args.emplace_back(a);
    layers_.back().linears.push_back(std::move(linear));
  }

  void set_kv_caches(std::vector<at::Tensor> kv_caches) {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodeStep: one KV cache per layer");
    kv_caches_ = std::move(kv_caches);
  }

  // input_ids, positions, slot_mapping [T]; block_tables [T, max_blocks]; seq_lens [T]:
  // T sequences of one new token each -> their normed hidden states [T, hidden].
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& positions, const at::Tensor& slot_mapping,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens) {
    TORCH_CHECK(kv_caches_.size() == layers_.size(), "DecodeStep: set_kv_caches first");
    const int64_t T = input_ids.size(0), hidden = embedding_.size(1), D = D_;
    const int64_t q_size = H_ * D, kv_size = Hkv_ * D;
    const auto ids = input_ids.to(at::kLong).contiguous();
    const auto pos = positions.to(at::kLong).contiguous();
    const int64_t* idp = ids.data_ptr<int64_t>();
    const int64_t* pp = pos.data_ptr<int64_t>();
    const int64_t V = embedding_.size(0), P = cos_.size(0);

    at::Tensor x = at::empty({T, hidden}, embedding_.options());  // the residual stream
    at::Tensor h = at::empty({T, hidden}, embedding_.options());  // normed, a linear's input
    at::Tensor q = at::empty({T, H_, D}, embedding_.options());
    at::Tensor k = at::empty({T, Hkv_, D}, embedding_.options());
    at::Tensor v = at::empty({T, Hkv_, D}, embedding_.options());
    float* xp = x.data_ptr<float>();
    float* hp = h.data_ptr<float>();
    for (int64_t t = 0; t < T; ++t) {
      TORCH_CHECK(idp[t] >= 0 && idp[t] < V && pp[t] >= 0 && pp[t] < P,
                  "DecodeStep: token id or position out of range");
      std::memcpy(xp + t * hidden, embedding_.data_ptr<float>() + idp[t] * hidden, hidden * sizeof(float));
    }
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& layer = layers_[l];
      norm_rows(xp, layer.input_norm, hp, T, hidden);
      const at::Tensor qkv = layer.linears[0](h);  // [T, q + 2 kv]
      TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size && qkv.is_contiguous(), "DecodeStep: qkv has the wrong shape");
      const float* qkvp = qkv.data_ptr<float>();
      float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
      rows(T, [&](int64_t t) {
        const float* row = qkvp + t * (q_size + 2 * kv_size);
        const float* c = cos_.data_ptr<float>() + pp[t] * D;
        const float* s = sin_.data_ptr<float>() + pp[t] * D;
        for (int64_t i = 0; i < H_; ++i) rope(row + i * D, c, s, qp + (t * H_ + i) * D, D);
        for (int64_t i = 0; i < Hkv_; ++i) rope(row + q_size + i * D, c, s, kp + (t * Hkv_ + i) * D, D);
        std::memcpy(vp + t * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
      });
      const at::Tensor attn = attention_.call(q, k, v, kv_caches_[l], slot_mapping, block_tables, seq_lens, scale_);
      add_rows(xp, layer.linears[1](attn.view({T, q_size})), T, hidden);
      norm_rows(xp, layer.post_norm, hp, T, hidden);
      const at::Tensor gate_up = layer.linears[2](h);  // [T, 2 I]
      const int64_t I = gate_up.size(1) / 2;
      TORCH_CHECK(I % 8 == 0 && gate_up.is_contiguous(), "DecodeStep: gate_up has the wrong shape");
      at::Tensor act = at::empty({T, I}, embedding_.options());
      const float* gp = gate_up.data_ptr<float>();
      float* ap = act.data_ptr<float>();
      rows(T, [&](int64_t t) { silu_mul(gp + t * 2 * I, gp + t * 2 * I + I, ap + t * I, I); });
      add_rows(xp, layer.linears[3](act), T, hidden);
    }
    norm_rows(xp, final_norm_, hp, T, hidden);
    return h;
  }

 private:
  // f(t) for every row t: on this thread for a few rows (a thread wake-up costs more than
  // their work), claimed by the threads for many.
  template <class F>
  static void rows(int64_t T, const F& f) {
    if (T < kParallelRows) {
      for (int64_t t = 0; t < T; ++t) f(t);
      return;
    }
    modserve::parallel_claims(T, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) f(t);
    });
  }

  void norm_rows(const float* x, const at::Tensor& w, float* y, int64_t T, int64_t n) const {
    const float* wp = w.data_ptr<float>();
    rows(T, [&](int64_t t) { rms_norm(x + t * n, wp, y + t * n, n, eps_); });
  }

  static void add_rows(float* x, const at::Tensor& y, int64_t T, int64_t n) {  // x [T, n] += y
    TORCH_CHECK(y.numel() == T * n && y.is_contiguous() && y.scalar_type() == at::kFloat,
                "DecodeStep: a linear's output has the wrong shape");
    const float* yp = y.data_ptr<float>();
    rows(T, [&](int64_t t) {
      for (int64_t i = t * n; i < (t + 1) * n; i += 8) store8(x + i, load8(x + i) + load8(yp + i));
    });
  }

  static constexpr int64_t kParallelRows = 8;

  at::Tensor embedding_, final_norm_, cos_, sin_;
  int64_t H_, Hkv_, D_;
  float eps_;
  double scale_;
  AttentionOp attention_;
  std::vector<Layer> layers_;
  std::vector<at::Tensor> kv_caches_;
};

}  // namespace

TORCH_LIBRARY(modserve_decode, m) {
  m.class_<DecodeStep>("DecodeStep")
      .def(torch::init<at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t, int64_t, int64_t, double, double,
                       std::string>())
      .def("add_layer", &DecodeStep::add_layer)
      .def("add_linear", &DecodeStep::add_linear)
      .def("set_kv_caches", &DecodeStep::set_kv_caches)
      .def("forward", &DecodeStep::forward);
}
