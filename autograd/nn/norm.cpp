#include "autograd/nn/norm.h"

#include "autograd/nn/container.h"
#include "autograd/ops.h"
#include "runtime/error.h"

namespace tandem::nn {
namespace {

void check_last_dim(const Tensor& x, int64_t dim, const char* module) {
  TANDEM_CHECK(x.dim() >= 1 && x.shape().back() == dim,
               "[nn::{}] expected an input of shape (…, {}), got {}", module, dim, x.shape());
}

}  // namespace

LayerNorm::LayerNorm(int64_t dim, double eps) : Module("LayerNorm"), dim_(dim), eps_(eps) {
  TANDEM_CHECK(dim >= 0, "[nn::LayerNorm] expected a non-negative dim, got {}", dim);
  weight_ = ops::ones(Shape{dim});
  bias_ = ops::zeros(Shape{dim});
  register_parameter("weight", &weight_);
  register_parameter("bias", &bias_);
}

std::vector<Tensor> LayerNorm::forward(Args& args) {
  const Tensor& x = single_input(args, "LayerNorm");
  check_last_dim(x, dim_, "LayerNorm");
  return {layer_norm(x, weight_, bias_, eps_)};
}

RMSNorm::RMSNorm(int64_t dim, double eps) : Module("RMSNorm"), dim_(dim), eps_(eps) {
  TANDEM_CHECK(dim >= 0, "[nn::RMSNorm] expected a non-negative dim, got {}", dim);
  weight_ = ops::ones(Shape{dim});
  register_parameter("weight", &weight_);
}

std::vector<Tensor> RMSNorm::forward(Args& args) {
  const Tensor& x = single_input(args, "RMSNorm");
  check_last_dim(x, dim_, "RMSNorm");
  return {rms_norm(x, weight_, eps_)};
}

std::shared_ptr<Module> make_norm(NormKind kind, int64_t dim, double eps) {
  if (kind == NormKind::Layer) return std::make_shared<LayerNorm>(dim, eps);
  return std::make_shared<RMSNorm>(dim, eps);
}

}  // namespace tandem::nn
