// Dropout as a module: zeroes each element with probability p while the
// module is training (Module::train / eval) and scales the others by
// 1 / (1 - p); the identity in eval mode, as torch.nn.Dropout.
//
// The module owns its random stream: a seed taken from the Generator it is
// constructed with (so a model built from one seed drops the same elements on
// every run and device) and its own counter. Under checkpoint the re-run
// reuses the forward's mask (Note [Random draws under checkpoint]).
#pragma once

#include <cstdint>
#include <mutex>

#include "tandem/autograd/module.h"
#include "tandem/autograd/nn/container.h"
#include "tandem/tensor/random.h"

namespace tandem::nn {

struct DropoutOptions {
  double p = 0.5;  // torch's default
};

class Dropout final : public Module {
 public:
  using Options = DropoutOptions;
  Dropout(const DropoutOptions& options, Generator& gen);

  double p() const { return p_; }
  // The module's own generator state (seed, next counter).
  uint64_t seed() const;
  uint64_t offset() const;

 protected:
  std::vector<Tensor> forward(Args& args) override;

 private:
  double p_;
  // The forward worker draws while a checkpoint re-run may read the module
  // on the backward worker; the counter is reserved under this lock.
  mutable std::mutex mutex_;
  Generator gen_;
};

}  // namespace tandem::nn
