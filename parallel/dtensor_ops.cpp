// Sharding rules of the DTensor elementwise, unary, reduction, norm and shape
// ops (the table is in dtensor_ops.h), and the helpers every rule shares
// (dtensor_rules.h). dtensor_matmul.cpp has matmul, linear and embedding.
#include "tandem/parallel/dtensor_ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tandem/autograd/function.h"
#include "tandem/autograd/ops.h"
#include "tandem/parallel/dtensor_rules.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"

namespace tandem {
namespace dtensor_detail {

void check_same_mesh(const DTensor& a, const DTensor& b, const char* op) {
  TANDEM_CHECK(a.mesh() == b.mesh(), "[parallel::{}] expected operands on one mesh, got {} and {}",
               op, a.mesh().str(), b.mesh().str());
}

DTensor move(const DTensor& x, int m, const Placement& p, const char* op) {
  if (x.placements()[m] == p) return x;
  Placements target = x.placements();
  log_debug("[parallel::{}] no rule for {} on mesh dim {}: redistributing to {}", op,
            x.placements()[m].str(), m, p.str());
  target[m] = p;
  return x.redistribute(target);
}

Tensor with_f(const DTensor& in, const Placements& out) {
  Tensor local = in.to_local();
  for (int m = 0; m < in.mesh().ndim(); ++m) {
    if (in.placements()[m].is_replicate() && !out[m].is_replicate()) {
      local = all_reduce_grad(local, in.mesh().get_group(m));
    }
  }
  return local;
}

}  // namespace dtensor_detail

using dtensor_detail::check_same_mesh;
using dtensor_detail::move;
using dtensor_detail::out_dim;
using dtensor_detail::with_f;

namespace {

// Megatron's "f": identity forward, all-reduce of the gradient.
struct AllReduceGrad final : Function {
  ProcessGroupPtr group;
  const char* name() const override { return "AllReduceGradBackward"; }
  std::vector<Tensor> forward(FunctionCtx&, const std::vector<Tensor>& in) override {
    return {in[0]};
  }
  std::vector<Tensor> backward(FunctionCtx&, const std::vector<Tensor>& g) override {
    WorkPtr w = group->all_reduce(g[0], {RedOp::Sum, "f-grad"});
    w->wait();
    return {w->result()};
  }
};

enum class Kind { Add, Sub, Mul, Div };

DTensor elementwise(const DTensor& a0, const DTensor& b0, Kind kind, const char* op) {
  check_same_mesh(a0, b0, op);
  DTensor a = a0, b = b0;
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), op);
  const int n = shape.size();
  Placements out(static_cast<size_t>(a.mesh().ndim()), Replicate());
  for (int m = 0; m < a.mesh().ndim(); ++m) {
    for (int attempt = 0; attempt < 3; ++attempt) {
      const Placement pa = a.placements()[m], pb = b.placements()[m];
      auto broadcast_along = [&](const DTensor& t, int64_t od) {
        int64_t d = od - (n - t.shape().size());
        return d < 0 || t.shape()[d] == 1;
      };
      if (pa.is_replicate() && pb.is_replicate()) {
        out[m] = Replicate();
      } else if (pa.is_shard() && pb.is_shard()) {
        int64_t da = out_dim(pa.dim, a.shape().size(), n),
                db = out_dim(pb.dim, b.shape().size(), n);
        if (da == db) {
          out[m] = Shard(da);
        } else {
          b = move(b, m, Replicate(), op);
          continue;
        }
      } else if (pa.is_shard() || pb.is_shard()) {
        bool a_sharded = pa.is_shard();
        const DTensor& s = a_sharded ? a : b;
        DTensor& r = a_sharded ? b : a;
        int64_t od = out_dim(s.placements()[m].dim, s.shape().size(), n);
        if (r.placements()[m].is_partial()) {
          r = move(r, m, Replicate(), op);
          continue;
        }
        if (!broadcast_along(r, od)) {  // the replicated side is full along od: chunk it
          r = move(r, m, Shard(od - (n - r.shape().size())), op);
          continue;
        }
        out[m] = Shard(od);
      } else if (pa.is_partial() && pb.is_partial() && pa == pb &&
                 (kind == Kind::Add || kind == Kind::Sub) && pa.op == RedOp::Sum) {
        out[m] = pa;
      } else if (pa.is_partial() && pb.is_replicate() && (kind == Kind::Mul || kind == Kind::Div) &&
                 pa.op == RedOp::Sum) {
        out[m] = pa;
      } else if (pb.is_partial() && pa.is_replicate() && kind == Kind::Mul && pb.op == RedOp::Sum) {
        out[m] = pb;
      } else {
        if (pa.is_partial()) a = move(a, m, Replicate(), op);
        if (pb.is_partial()) b = move(b, m, Replicate(), op);
        continue;
      }
      break;
    }
  }
  Tensor la = with_f(a, out), lb = with_f(b, out);
  Tensor local = kind == Kind::Add   ? tandem::add(la, lb)
                 : kind == Kind::Sub ? tandem::sub(la, lb)
                 : kind == Kind::Mul ? tandem::mul(la, lb)
                                     : tandem::div(la, lb);
  return DTensor::make(local, a.mesh(), out, shape);
}

// Unary ops: Partial is resolved first unless the op is linear.
template <class F>
DTensor unary(const DTensor& x0, bool linear, const char* op, F f) {
  DTensor x = x0;
  for (int m = 0; m < x.mesh().ndim(); ++m) {
    if (x.placements()[m].is_partial() && (!linear || x.placements()[m].op != RedOp::Sum)) {
      x = move(x, m, Replicate(), op);
    }
  }
  return DTensor::make(f(x.to_local()), x.mesh(), x.placements(), x.shape());
}

Dims sorted_dims(const Dims& dims, int ndim, const char* op) {
  Dims out;
  if (dims.empty()) {
    for (int i = 0; i < ndim; ++i)
      out.push_back(i);
  } else {
    for (int64_t d : dims)
      out.push_back(wrap_dim(d, ndim, op));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

Tensor all_reduce_grad(const Tensor& x, const ProcessGroupPtr& group) {
  if (group->size() == 1) return x;
  auto f = std::make_shared<AllReduceGrad>();
  f->group = group;
  return Function::apply(f, {x})[0];
}

DTensor add(const DTensor& a, const DTensor& b) {
  return elementwise(a, b, Kind::Add, "add");
}
DTensor sub(const DTensor& a, const DTensor& b) {
  return elementwise(a, b, Kind::Sub, "sub");
}
DTensor mul(const DTensor& a, const DTensor& b) {
  return elementwise(a, b, Kind::Mul, "mul");
}
DTensor div(const DTensor& a, const DTensor& b) {
  return elementwise(a, b, Kind::Div, "div");
}
DTensor mul(const DTensor& a, double s) {
  return unary(a, true, "mul", [s](const Tensor& t) { return tandem::mul(t, s); });
}
#define TANDEM_UNARY_DEFINE(E, name, linear)                                         \
  DTensor name(const DTensor& a) {                                                   \
    return unary(a, linear, #name, [](const Tensor& t) { return tandem::name(t); }); \
  }
TANDEM_UNARY_OPS(TANDEM_UNARY_DEFINE)
#undef TANDEM_UNARY_DEFINE
DTensor gelu(const DTensor& a) {
  return unary(a, false, "gelu", [](const Tensor& t) { return tandem::gelu(t); });
}

DTensor sum(const DTensor& t, const Dims& dims, bool keepdim) {
  const int n = t.shape().size();
  Dims reduced = sorted_dims(dims, n, "sum");
  auto is_reduced = [&](int64_t d) {
    return std::find(reduced.begin(), reduced.end(), d) != reduced.end();
  };
  Placements out = t.placements();
  for (Placement& p : out) {
    if (!p.is_shard()) continue;
    if (is_reduced(p.dim)) {
      p = Partial();
    } else if (!keepdim) {
      int64_t shift = 0;
      for (int64_t d : reduced)
        shift += d < p.dim ? 1 : 0;
      p = Shard(p.dim - shift);
    }
  }
  DTensor x = t;
  for (int m = 0; m < x.mesh().ndim(); ++m) {
    if (x.placements()[m].is_partial() && x.placements()[m].op != RedOp::Sum) {
      x = move(x, m, Replicate(), "sum");
      out[m] = Replicate();
    }
  }
  Shape shape;
  for (int i = 0; i < n; ++i) {
    if (!is_reduced(i)) {
      shape.push_back(t.shape()[i]);
    } else if (keepdim) {
      shape.push_back(1);
    }
  }
  Tensor local = tandem::sum(with_f(x, out), reduced, keepdim);
  return DTensor::make(local, x.mesh(), out, shape);
}

DTensor mean(const DTensor& t, const Dims& dims, bool keepdim) {
  Dims reduced = sorted_dims(dims, t.shape().size(), "mean");
  int64_t count = 1;
  for (int64_t d : reduced)
    count *= t.shape()[d];
  // Over nothing, 0 / 0: NaN, as the local mean and PyTorch.
  return mul(sum(t, dims, keepdim), count > 0 ? 1.0 / static_cast<double>(count) : std::nan(""));
}

namespace {
// Redistributes so that `dim` is whole on every rank and nothing is Partial.
DTensor whole_along(const DTensor& t, int64_t dim, const char* op) {
  DTensor x = t;
  for (int m = 0; m < x.mesh().ndim(); ++m) {
    const Placement p = x.placements()[m];
    if (p.is_partial() || p.is_shard(dim)) x = move(x, m, Replicate(), op);
  }
  return x;
}

DTensor replicated(const DTensor& t, const char* op) {
  DTensor x = t;
  for (int m = 0; m < x.mesh().ndim(); ++m)
    x = move(x, m, Replicate(), op);
  return x;
}
}  // namespace

DTensor softmax(const DTensor& t, int64_t dim) {
  int d = wrap_dim(dim, t.shape().size(), "softmax");
  DTensor x = whole_along(t, d, "softmax");
  return DTensor::make(tandem::softmax(x.to_local(), d), x.mesh(), x.placements(), x.shape());
}

DTensor layer_norm(const DTensor& x0, const DTensor& weight, const DTensor& bias, double eps) {
  DTensor x = whole_along(x0, static_cast<int64_t>(x0.shape().size()) - 1, "layer_norm");
  Tensor w = weight.defined() ? with_f(replicated(weight, "layer_norm"), x.placements()) : Tensor();
  Tensor b = bias.defined() ? with_f(replicated(bias, "layer_norm"), x.placements()) : Tensor();
  return DTensor::make(tandem::layer_norm(x.to_local(), w, b, eps), x.mesh(), x.placements(),
                       x.shape());
}

DTensor rms_norm(const DTensor& x0, const DTensor& weight, double eps) {
  DTensor x = whole_along(x0, static_cast<int64_t>(x0.shape().size()) - 1, "rms_norm");
  Tensor w = weight.defined() ? with_f(replicated(weight, "rms_norm"), x.placements()) : Tensor();
  return DTensor::make(tandem::rms_norm(x.to_local(), w, eps), x.mesh(), x.placements(), x.shape());
}

DTensor reshape(const DTensor& t0, const Shape& shape_in) {
  DTensor t = t0;
  const Shape& in = t.shape();
  // Resolve a -1 against the global element count.
  Shape shape = shape_in;
  int64_t known = 1, infer = -1;
  for (int i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      infer = i;
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) shape[infer] = known == 0 ? 0 : in.numel() / known;
  TANDEM_CHECK(shape.numel() == in.numel(),
               "[parallel::reshape] expected a shape of {} elements, got {}", in.numel(), shape);
  auto prefix = [](const Shape& s, int d) {
    int64_t p = 1;
    for (int i = 0; i < d; ++i)
      p *= s[i];
    return p;
  };
  Placements out = t.placements();
  for (int m = 0; m < t.mesh().ndim(); ++m) {
    const Placement p = t.placements()[m];
    if (!p.is_shard()) continue;
    int found = -1;
    for (int j = 0; j < shape.size(); ++j) {
      if (shape[j] == in[p.dim] && prefix(shape, j) == prefix(in, static_cast<int>(p.dim)))
        found = j;
    }
    if (found < 0) {
      t = move(t, m, Replicate(), "reshape");
      out[m] = Replicate();
    } else {
      out[m] = Shard(found);
    }
  }
  Shape local_shape = DTensor::local_shape_for(shape, out, t.mesh());
  return DTensor::make(tandem::reshape(t.to_local(), local_shape), t.mesh(), out, shape);
}

DTensor view(const DTensor& t, const Shape& shape) {
  return reshape(t, shape);
}

DTensor permute(const DTensor& t, const Dims& dims) {
  const int n = t.shape().size();
  TANDEM_CHECK(dims.size() == n, "[parallel::permute] expected {} dims, got {}", n, dims.size());
  Shape shape;
  Dims inverse = Dims::filled(n, 0);
  for (int i = 0; i < n; ++i) {
    int d = wrap_dim(dims[i], n, "permute");
    shape.push_back(t.shape()[d]);
    inverse[d] = i;
  }
  Placements out = t.placements();
  for (Placement& p : out) {
    if (p.is_shard()) p = Shard(inverse[static_cast<int>(p.dim)]);
  }
  return DTensor::make(tandem::permute(t.to_local(), dims), t.mesh(), out, shape);
}

DTensor transpose(const DTensor& t, int64_t dim0, int64_t dim1) {
  const int n = t.shape().size();
  Dims order = Dims::filled(n, 0);
  for (int i = 0; i < n; ++i)
    order[i] = i;
  std::swap(order[wrap_dim(dim0, n, "transpose")], order[wrap_dim(dim1, n, "transpose")]);
  return permute(t, order);
}

}  // namespace tandem
