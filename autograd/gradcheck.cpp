#include "tandem/autograd/gradcheck.h"

#include <algorithm>
#include <cmath>

#include "tandem/autograd/ops.h"

namespace tandem {

GradcheckResult gradcheck(const std::function<std::vector<Tensor>(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& options,
                          const std::vector<size_t>& no_grad_inputs) {
  auto is_const = [&](size_t i) {
    return std::find(no_grad_inputs.begin(), no_grad_inputs.end(), i) != no_grad_inputs.end();
  };
  std::vector<Tensor> x(inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (is_const(i)) {
      x[i] = inputs[i];
    } else {
      x[i] = ops::contiguous(ops::clone(ops::to(ops::to(inputs[i], Device::cpu()), DType::F64)));
      set_requires_grad(x[i]);
    }
  }
  // Fixed random projection of every output.
  std::vector<Tensor> outs = fn(x);
  Generator gen(options.seed);
  std::vector<Tensor> dirs;
  for (const Tensor& o : outs)
    dirs.push_back(ops::randn(o.shape(), gen, DType::F64));
  auto project = [&](const std::vector<Tensor>& ys) {
    double total = 0;
    for (size_t j = 0; j < ys.size(); ++j) {
      total += ops::sum(ops::mul(ops::to(ys[j], DType::F64), dirs[j])).item<double>();
    }
    return total;
  };
  Tensor loss;
  for (size_t j = 0; j < outs.size(); ++j) {
    Tensor term = sum(mul(to(outs[j], DType::F64), dirs[j]));
    loss = loss.defined() ? add(loss, term) : term;
  }
  std::vector<Tensor> wrt;
  std::vector<size_t> wrt_index;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!is_const(i)) {
      wrt.push_back(x[i]);
      wrt_index.push_back(i);
    }
  }
  std::vector<Tensor> analytic = gradients({loss}, wrt);

  GradcheckResult result;
  double worst_excess = 0;
  NoGradGuard no_grad;
  for (size_t w = 0; w < wrt.size(); ++w) {
    Tensor xi = wrt[w];
    std::vector<double> a = analytic[w].defined()
                                ? ops::to(analytic[w], DType::F64).to_vector<double>()
                                : std::vector<double>(static_cast<size_t>(xi.numel()), 0.0);
    auto* data = static_cast<double*>(xi.raw_data());
    for (int64_t e = 0; e < xi.numel(); ++e) {
      const double saved = data[e];
      data[e] = saved + options.eps;
      double plus = project(fn(x));
      data[e] = saved - options.eps;
      double minus = project(fn(x));
      data[e] = saved;
      double numeric = (plus - minus) / (2 * options.eps);
      double err = std::abs(numeric - a[e]);
      double allowed = options.atol + options.rtol * std::abs(numeric);
      result.max_abs_error = std::max(result.max_abs_error, err);
      if (err > allowed && err - allowed > worst_excess) {
        worst_excess = err - allowed;
        result.ok = false;
        result.message = fmt::format(
            "[autograd::gradcheck] expected analytic == numeric gradient, got input {} element {} "
            "(shape {}): analytic {:.8g}, numeric {:.8g}, |diff| {:.3g} > {:.3g}",
            wrt_index[w], e, xi.shape(), a[e], numeric, err, allowed);
      }
    }
  }
  return result;
}

}  // namespace tandem
