// Dense layers: Linear, Embedding and the SwiGLU MLP. Each is a Module whose
// parameters are initialised from the Generator it is constructed with
// (autograd/init.h), so a model built from one seed is identical everywhere.
#pragma once

#include <cstdint>
#include <memory>

#include "tandem/autograd/nn/container.h"
#include "tandem/tensor/random.h"

namespace tandem::nn {

struct LinearOptions {
  int64_t in_features = 0;
  int64_t out_features = 0;
  bool bias = true;
};

// y = x W^T (+ b), W of shape (out, in) as in torch.nn.Linear, initialised
// like torch: W and b ~ U(-1/sqrt(in), 1/sqrt(in)). Input (…, in), output (…, out).
class Linear final : public Module {
 public:
  using Options = LinearOptions;
  Linear(const LinearOptions& options, Generator& gen);

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }  // undefined without bias
  // Row-parallel layers add the bias after the reduction themselves.
  void set_bias_deferred(bool deferred) { bias_deferred_ = deferred; }
  bool bias_deferred() const { return bias_deferred_; }

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  int64_t in_features_;
  int64_t out_features_;
  Tensor weight_;
  Tensor bias_;
  bool bias_deferred_ = false;
};

struct EmbeddingOptions {
  int64_t num_embeddings = 0;  // V
  int64_t dim = 0;             // D
  double init_std = 1.0;       // torch's default
};

// Lookup table (V, D): integer indices of any shape → (*indices, D).
// Initialised N(0, init_std^2).
class Embedding final : public Module {
 public:
  using Options = EmbeddingOptions;
  Embedding(const EmbeddingOptions& options, Generator& gen);

  int64_t num_embeddings() const { return num_embeddings_; }
  int64_t dim() const { return dim_; }
  const Tensor& weight() const { return weight_; }

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  int64_t num_embeddings_;
  int64_t dim_;
  Tensor weight_;
};

// The gated MLP of LLaMA-style blocks: w2(silu(w1 x) * w3 x), three
// bias-free Linears (w1, w3: d → hidden; w2: hidden → d). Input and output
// (…, d). MoE experts are SwiGLUs.
struct SwiGLUOptions {
  int64_t d_model = 0;
  int64_t hidden = 0;
};

class SwiGLU final : public Module {
 public:
  using Options = SwiGLUOptions;
  SwiGLU(const SwiGLUOptions& options, Generator& gen);

  const std::shared_ptr<Linear>& w1() const { return w1_; }
  const std::shared_ptr<Linear>& w2() const { return w2_; }
  const std::shared_ptr<Linear>& w3() const { return w3_; }

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  std::shared_ptr<Linear> w1_;
  std::shared_ptr<Linear> w2_;
  std::shared_ptr<Linear> w3_;
};

}  // namespace tandem::nn
