// Deterministic parameter initialisation. Every helper draws from the
// Generator it is given (tensor/random.h), never from global state, so a model
// built from Generator(seed) has the same parameters on every run, device and
// rank. Results are f32 CPU tensors that do not require grad; modules register
// them as parameters and Module::to() moves or casts them.
//
// Fans follow torch.nn.init: for a weight of shape (out, in, *k),
// fan_in = in * prod(k) and fan_out = out * prod(k); a 1-D shape has
// fan_in = fan_out = its length. As in torch.nn.init, a shape with no
// elements is a no-op: the fan-based helpers return it empty, draw nothing
// and check no fans.
#pragma once

#include <cstdint>

#include "tandem/tensor/random.h"
#include "tandem/tensor/tensor.h"

namespace tandem::init {

struct Fans {
  int64_t fan_in = 0;
  int64_t fan_out = 0;
};
Fans fans(const Shape& shape);

// U(low, high).
Tensor uniform(const Shape& shape, double low, double high, Generator& gen);
// N(mean, stddev^2).
Tensor normal(const Shape& shape, double mean, double stddev, Generator& gen);
// He uniform: U(-b, b) with b = gain * sqrt(3 / fan_in), gain = sqrt(2 / (1 + a^2)).
// The default a = sqrt(5) is torch.nn.Linear's weight init: b = 1 / sqrt(fan_in).
Tensor kaiming_uniform(const Shape& shape, Generator& gen, double a = 2.23606797749979);
// He normal: N(0, (gain / sqrt(fan_in))^2) with the same gain.
Tensor kaiming_normal(const Shape& shape, Generator& gen, double a = 0.0);
// Glorot: U(-b, b) with b = gain * sqrt(6 / (fan_in + fan_out)).
Tensor xavier_uniform(const Shape& shape, Generator& gen, double gain = 1.0);
// Glorot: N(0, (gain * sqrt(2 / (fan_in + fan_out)))^2).
Tensor xavier_normal(const Shape& shape, Generator& gen, double gain = 1.0);

}  // namespace tandem::init
