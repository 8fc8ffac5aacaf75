// Normalisation layers over the last dim: LayerNorm (weight 1, bias 0) and
// RMSNorm (weight 1). Deterministic constants, so no Generator.
#pragma once

#include <cstdint>
#include <memory>

#include "tandem/autograd/module.h"
#include "tandem/autograd/nn/container.h"

namespace tandem::nn {

enum class NormKind { Layer, Rms };

struct LayerNormOptions {
  int64_t dim = 0;
  double eps = 1e-5;
};

class LayerNorm final : public Module {
 public:
  using Options = LayerNormOptions;
  explicit LayerNorm(const LayerNormOptions& options);

  double eps() const { return eps_; }
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  int64_t dim_;
  double eps_;
  Tensor weight_;
  Tensor bias_;
};

struct RMSNormOptions {
  int64_t dim = 0;
  double eps = 1e-6;
};

// y = x / sqrt(mean(x^2) + eps) * weight.
class RMSNorm final : public Module {
 public:
  using Options = RMSNormOptions;
  explicit RMSNorm(const RMSNormOptions& options);

  double eps() const { return eps_; }
  const Tensor& weight() const { return weight_; }

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  int64_t dim_;
  double eps_;
  Tensor weight_;
};

// A LayerNorm or an RMSNorm of `dim`.
std::shared_ptr<Module> make_norm(NormKind kind, int64_t dim, double eps);

}  // namespace tandem::nn
