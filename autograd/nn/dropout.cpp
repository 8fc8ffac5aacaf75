#include "tandem/autograd/nn/dropout.h"

#include "tandem/autograd/nn/container.h"
#include "tandem/autograd/ops.h"
#include "tandem/runtime/error.h"

namespace tandem::nn {
namespace {

// A 64-bit seed from the next counter of gen: distinct per module.
uint64_t derive_seed(Generator& gen) {
  const Philox4 r = philox4x32(gen.advance(1), gen.seed());
  return (static_cast<uint64_t>(r.x[1]) << 32) | r.x[0];
}

}  // namespace

Dropout::Dropout(const DropoutOptions& options, Generator& gen)
    : Module("Dropout"), p_(options.p), gen_(derive_seed(gen)) {
  const double p = options.p;
  TANDEM_CHECK(p >= 0.0 && p <= 1.0, "[nn::Dropout] expected p in [0, 1], got {}", p);
}

uint64_t Dropout::seed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gen_.seed();
}

uint64_t Dropout::offset() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return gen_.offset();
}

std::vector<Tensor> Dropout::forward(Args& args) {
  const Tensor& x = single_input(args, "Dropout");
  std::lock_guard<std::mutex> lock(mutex_);
  return {dropout(x, p_, is_training(), gen_)};
}

}  // namespace tandem::nn
