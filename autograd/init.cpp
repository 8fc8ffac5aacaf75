#include "tandem/autograd/init.h"

#include <cmath>

#include "tandem/tensor/ops.h"

namespace tandem::init {
namespace {

Fans checked_fans(const Shape& shape, const char* op) {
  Fans f = fans(shape);
  TANDEM_CHECK(f.fan_in > 0 && f.fan_out > 0,
               "[init::{}] expected a shape with nonzero fans, got {}", op, shape);
  return f;
}

double leaky_relu_gain(double a) {
  return std::sqrt(2.0 / (1.0 + a * a));
}

}  // namespace

Fans fans(const Shape& shape) {
  TANDEM_CHECK(shape.size() >= 1, "[init::fans] expected a shape with at least 1 dim, got {}",
               shape);
  if (shape.size() == 1) return {shape[0], shape[0]};
  int64_t receptive = 1;
  for (int i = 2; i < shape.size(); ++i)
    receptive *= shape[i];
  return {shape[1] * receptive, shape[0] * receptive};
}

Tensor uniform(const Shape& shape, double low, double high, Generator& gen) {
  TANDEM_CHECK(low <= high, "[init::uniform] expected low <= high, got {} > {}", low, high);
  return ops::uniform(shape, low, high, gen, DType::F32);
}

Tensor normal(const Shape& shape, double mean, double stddev, Generator& gen) {
  TANDEM_CHECK(stddev >= 0, "[init::normal] expected stddev >= 0, got {}", stddev);
  return ops::normal(shape, mean, stddev, gen, DType::F32);
}

Tensor kaiming_uniform(const Shape& shape, Generator& gen, double a) {
  if (shape.numel() == 0) return ops::zeros(shape);  // nothing to draw
  const Fans f = checked_fans(shape, "kaiming_uniform");
  const double bound = leaky_relu_gain(a) * std::sqrt(3.0 / static_cast<double>(f.fan_in));
  return uniform(shape, -bound, bound, gen);
}

Tensor kaiming_normal(const Shape& shape, Generator& gen, double a) {
  if (shape.numel() == 0) return ops::zeros(shape);  // nothing to draw
  const Fans f = checked_fans(shape, "kaiming_normal");
  return normal(shape, 0.0, leaky_relu_gain(a) / std::sqrt(static_cast<double>(f.fan_in)), gen);
}

Tensor xavier_uniform(const Shape& shape, Generator& gen, double gain) {
  if (shape.numel() == 0) return ops::zeros(shape);  // nothing to draw
  const Fans f = checked_fans(shape, "xavier_uniform");
  const double bound = gain * std::sqrt(6.0 / static_cast<double>(f.fan_in + f.fan_out));
  return uniform(shape, -bound, bound, gen);
}

Tensor xavier_normal(const Shape& shape, Generator& gen, double gain) {
  if (shape.numel() == 0) return ops::zeros(shape);  // nothing to draw
  const Fans f = checked_fans(shape, "xavier_normal");
  return normal(shape, 0.0, gain * std::sqrt(2.0 / static_cast<double>(f.fan_in + f.fan_out)), gen);
}

}  // namespace tandem::init
