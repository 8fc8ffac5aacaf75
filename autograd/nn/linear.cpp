#include "tandem/autograd/nn/linear.h"

#include <cmath>

#include "tandem/autograd/init.h"
#include "tandem/autograd/ops.h"
#include "tandem/runtime/error.h"

namespace tandem::nn {

Linear::Linear(const LinearOptions& options, Generator& gen)
    : Module("Linear"), in_features_(options.in_features), out_features_(options.out_features) {
  const int64_t in_features = options.in_features, out_features = options.out_features;
  // Zero sizes are allowed, as in torch.nn.Linear: with in == 0 the output is
  // the bias alone (zeros without one), and the weight is empty.
  TANDEM_CHECK(in_features >= 0 && out_features >= 0,
               "[nn::Linear] expected non-negative sizes, got in={}, out={}", in_features,
               out_features);
  weight_ = init::kaiming_uniform(Shape{out_features, in_features}, gen);
  register_parameter("weight", &weight_);
  if (options.bias) {
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

Embedding::Embedding(const EmbeddingOptions& options, Generator& gen)
    : Module("Embedding"), num_embeddings_(options.num_embeddings), dim_(options.dim) {
  TANDEM_CHECK(num_embeddings_ >= 0 && dim_ >= 0,
               "[nn::Embedding] expected non-negative sizes, got V={}, D={}", num_embeddings_,
               dim_);
  weight_ = init::normal(Shape{num_embeddings_, dim_}, 0.0, options.init_std, gen);
  register_parameter("weight", &weight_);
}

std::vector<Tensor> Embedding::forward(Args& args) {
  const Tensor& indices = single_input(args, "Embedding");
  TANDEM_CHECK(!is_floating(indices.dtype()) && indices.dtype() != DType::Bool,
               "[nn::Embedding] expected integer indices, got {}", dtype_name(indices.dtype()));
  return {embedding(weight_, indices)};
}

SwiGLU::SwiGLU(const SwiGLUOptions& options, Generator& gen) : Module("SwiGLU") {
  const int64_t d_model = options.d_model, hidden = options.hidden;
  w1_ = register_module(
      "w1",
      nn::make<nn::Linear>({.in_features = d_model, .out_features = hidden, .bias = false}, gen));
  w2_ = register_module(
      "w2",
      nn::make<nn::Linear>({.in_features = hidden, .out_features = d_model, .bias = false}, gen));
  w3_ = register_module(
      "w3",
      nn::make<nn::Linear>({.in_features = d_model, .out_features = hidden, .bias = false}, gen));
}

std::vector<Tensor> SwiGLU::forward(Args& args) {
  const Tensor& x = single_input(args, "SwiGLU");
  return {(*w2_)(swiglu((*w1_)(x), (*w3_)(x)))};  // silu(w1 x) * w3 x, fused
}

}  // namespace tandem::nn
