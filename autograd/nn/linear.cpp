#include "autograd/nn/linear.h"

#include <cmath>

#include "autograd/init.h"
#include "autograd/ops.h"
#include "runtime/error.h"

namespace tandem::nn {

Linear::Linear(int64_t in_features, int64_t out_features, Generator& gen, bool bias)
    : Module("Linear"), in_features_(in_features), out_features_(out_features) {
  // Zero sizes are allowed, as in torch.nn.Linear: with in == 0 the output is
  // the bias alone (zeros without one), and the weight is empty.
  TANDEM_CHECK(in_features >= 0 && out_features >= 0,
               "[nn::Linear] expected non-negative sizes, got in={}, out={}", in_features,
               out_features);
  weight_ = init::kaiming_uniform(Shape{out_features, in_features}, gen);
  register_parameter("weight", &weight_);
  if (bias) {
    const double bound = in_features > 0 ? 1.0 / std::sqrt(static_cast<double>(in_features)) : 0.0;
    bias_ = init::uniform(Shape{out_features}, -bound, bound, gen);
    register_parameter("bias", &bias_);
  }
}

std::vector<Tensor> Linear::forward(Args& args) {
  const Tensor& x = single_input(args, "Linear");
  // The weight's own extent: a tensor-parallel shard may hold fewer features.
  const int64_t in = weight_.shape()[1];
  TANDEM_CHECK(x.dim() >= 1 && x.shape().back() == in,
               "[nn::Linear] expected an input of shape (…, {}), got {}", in, x.shape());
  return {linear(x, weight_, bias_deferred_ ? Tensor() : bias_)};
}

Embedding::Embedding(int64_t num_embeddings, int64_t dim, Generator& gen, double init_std)
    : Module("Embedding"), num_embeddings_(num_embeddings), dim_(dim) {
  TANDEM_CHECK(num_embeddings >= 0 && dim >= 0,
               "[nn::Embedding] expected non-negative sizes, got V={}, D={}", num_embeddings, dim);
  weight_ = init::normal(Shape{num_embeddings, dim}, 0.0, init_std, gen);
  register_parameter("weight", &weight_);
}

std::vector<Tensor> Embedding::forward(Args& args) {
  const Tensor& indices = single_input(args, "Embedding");
  TANDEM_CHECK(!is_floating(indices.dtype()) && indices.dtype() != DType::Bool,
               "[nn::Embedding] expected integer indices, got {}", dtype_name(indices.dtype()));
  return {embedding(weight_, indices)};
}

SwiGLU::SwiGLU(int64_t d_model, int64_t hidden, Generator& gen) : Module("SwiGLU") {
  w1_ = register_module("w1", std::make_shared<Linear>(d_model, hidden, gen, false));
  w2_ = register_module("w2", std::make_shared<Linear>(hidden, d_model, gen, false));
  w3_ = register_module("w3", std::make_shared<Linear>(d_model, hidden, gen, false));
}

std::vector<Tensor> SwiGLU::forward(Args& args) {
  const Tensor& x = single_input(args, "SwiGLU");
  return {(*w2_)(swiglu((*w1_)(x), (*w3_)(x)))};  // silu(w1 x) * w3 x, fused
}

}  // namespace tandem::nn
