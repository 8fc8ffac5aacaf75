#include "tandem/autograd/nn/norm.h"

#include "tandem/autograd/nn/container.h"
#include "tandem/autograd/ops.h"
#include "tandem/runtime/error.h"

namespace tandem::nn {
namespace {

void check_last_dim(const Tensor& x, int64_t dim, const char* module) {
  TANDEM_CHECK(x.dim() >= 1 && x.shape().back() == dim,
               "[nn::{}] expected an input of shape (…, {}), got {}", module, dim, x.shape());
}

}  // namespace

LayerNorm::LayerNorm(const LayerNormOptions& options)
    : Module("LayerNorm"), dim_(options.dim), eps_(options.eps) {
  TANDEM_CHECK(dim_ >= 0, "[nn::LayerNorm] expected a non-negative dim, got {}", dim_);
  weight_ = ops::ones(Shape{dim_});
  bias_ = ops::zeros(Shape{dim_});
  register_parameter("weight", &weight_);
  register_parameter("bias", &bias_);
}

std::vector<Tensor> LayerNorm::forward(Args& args) {
  const Tensor& x = single_input(args, "LayerNorm");
  check_last_dim(x, dim_, "LayerNorm");
  return {layer_norm(x, weight_, bias_, eps_)};
}

RMSNorm::RMSNorm(const RMSNormOptions& options)
    : Module("RMSNorm"), dim_(options.dim), eps_(options.eps) {
  TANDEM_CHECK(dim_ >= 0, "[nn::RMSNorm] expected a non-negative dim, got {}", dim_);
  weight_ = ops::ones(Shape{dim_});
  register_parameter("weight", &weight_);
}

std::vector<Tensor> RMSNorm::forward(Args& args) {
  const Tensor& x = single_input(args, "RMSNorm");
  check_last_dim(x, dim_, "RMSNorm");
  return {rms_norm(x, weight_, eps_)};
}

std::shared_ptr<Module> make_norm(NormKind kind, int64_t dim, double eps) {
  if (kind == NormKind::Layer) return nn::make<nn::LayerNorm>({.dim = dim, .eps = eps});
  return nn::make<nn::RMSNorm>({.dim = dim, .eps = eps});
}

}  // namespace tandem::nn
