// fuzz-views: random chains of view ops (tensor/ops_view.cpp) against a naive
// reference. The input bytes choose a small i64 tensor holding 0..n-1 and up
// to 12 ops with their arguments, mostly valid and sometimes not.
//
// The reference is independent of strides: it keeps, for every element of the
// current result in row-major order, the value it shows and its index in the
// current storage (index maps), and derives each op's maps from the op's
// meaning. view() is possible exactly when the storage map is an affine
// function of the multi-index (some strides and offset reproduce it);
// reshape() must alias then and copy otherwise. After every op the result must have the reference's
// shape, its contiguous copy the reference's values, and every element read through its own strides
// and offset must lie inside its storage and hold that value. An op the reference calls invalid
// must throw tandem::Error; a valid one must not; an internal assert, another exception or a crash
// is a finding.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "tandem/tensor/ops.h"

namespace tandem {
namespace {

using Vec = std::vector<int64_t>;

// The input, read front to back; zeros once it is used up.
class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool empty() const { return p_ == end_; }
  uint8_t next() { return p_ == end_ ? 0 : *p_++; }
  int64_t pick(int64_t n) { return n <= 0 ? 0 : next() % n; }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

[[noreturn]] void finding(const std::vector<std::string>& trace, const std::string& what) {
  std::fprintf(stderr, "fuzz-views: FINDING after %s\n  %s\n",
               fmt::format("{}", fmt::join(trace, " -> ")).c_str(), what.c_str());
  std::abort();  // a crash is how a libFuzzer target reports
}

int64_t numel_of(const Vec& shape) {
  int64_t n = 1;
  for (int64_t e : shape)
    n *= e;
  return n;
}

Vec unravel(int64_t flat, const Vec& shape) {
  Vec idx(shape.size(), 0);
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    idx[i] = flat % shape[i];
    flat /= shape[i];
  }
  return idx;
}

int64_t ravel(const Vec& idx, const Vec& shape) {
  int64_t flat = 0;
  for (size_t i = 0; i < shape.size(); ++i)
    flat = flat * shape[i] + idx[i];
  return flat;
}

// The reference: shape and, per element in row-major order, its value (its
// index in the starting tensor) and its index in the current storage.
struct Ref {
  Vec shape;
  Vec src;
  Vec pos;
};

// A result of shape `out` whose element o is the input's element in_index(o).
Ref gather(const Ref& in, const Vec& out, const std::function<Vec(const Vec&)>& in_index) {
  const size_t n = static_cast<size_t>(numel_of(out));
  Ref r{out, Vec(n), Vec(n)};
  for (int64_t i = 0; i < static_cast<int64_t>(n); ++i) {
    const int64_t j = ravel(in_index(unravel(i, out)), in.shape);
    r.src[i] = in.src[j];
    r.pos[i] = in.pos[j];
  }
  return r;
}

// Same elements in the same order, another shape (view, reshape, squeeze…).
Ref reshaped(const Ref& in, const Vec& shape) {
  return Ref{shape, in.src, in.pos};
}

// Whether some strides and offset reproduce the storage map (then view() works).
bool affine(const Ref& r) {
  if (r.pos.empty()) return true;
  const int n = static_cast<int>(r.shape.size());
  Vec stride(n, 0);
  for (int k = 0; k < n; ++k) {
    if (r.shape[k] < 2) continue;
    Vec unit(n, 0);
    unit[k] = 1;
    stride[k] = r.pos[ravel(unit, r.shape)] - r.pos[0];
  }
  for (int64_t i = 0; i < static_cast<int64_t>(r.pos.size()); ++i) {
    Vec idx = unravel(i, r.shape);
    int64_t at = r.pos[0];
    for (int k = 0; k < n; ++k)
      at += idx[k] * stride[k];
    if (at != r.pos[i]) return false;
  }
  return true;
}

// Dim wrapping as documented (wrap_dim): [-n, n) with n = max(ndim, 1).
std::optional<int> wrap(int64_t d, int ndim) {
  const int n = std::max(ndim, 1);
  if (d < -n || d >= n) return std::nullopt;
  return static_cast<int>(d < 0 ? d + n : d);
}

// ---- argument decoders: mostly valid, sometimes just outside ----

int64_t dim_arg(Bytes& in, int ndim) {
  const int n = std::max(ndim, 1);
  const uint8_t b = in.next();
  if (b < 240) return static_cast<int64_t>(b % (2 * n)) - n;
  return (b % 2) ? n + b % 3 : -n - 1 - b % 3;
}

// A value in [lo, hi] (which may be empty), sometimes just outside.
int64_t int_arg(Bytes& in, int64_t lo, int64_t hi) {
  const uint8_t b = in.next();
  if (b < 240 && hi >= lo) return lo + b % (hi - lo + 1);
  return (b % 2) ? hi + 1 + b % 4 : lo - 1 - b % 4;
}

// A shape for view/reshape: a factorisation of numel, maybe with -1, maybe wrong.
Vec shape_arg(Bytes& in, int64_t numel) {
  const int r = static_cast<int>(in.pick(5));
  Vec s(static_cast<size_t>(r), 1);
  if (numel == 0) {
    for (int64_t& e : s)
      e = in.pick(4);
    if (r > 0) s[in.pick(r)] = 0;
  } else if (r > 0) {
    int64_t rest = numel;
    for (int i = 0; i + 1 < r; ++i) {
      Vec divisors;
      for (int64_t d = 1; d <= rest; ++d) {
        if (rest % d == 0) divisors.push_back(d);
      }
      s[i] = divisors[in.pick(static_cast<int64_t>(divisors.size()))];
      rest /= s[i];
    }
    s[r - 1] = rest;
  }
  const uint8_t mode = in.next();
  if (r > 0 && mode % 4 == 0) {
    s[in.pick(r)] = -1;
  } else if (r > 0 && mode == 255) {
    s[in.pick(r)] += 1;
  } else if (r > 1 && mode == 253) {
    s[0] = s[1] = -1;
  } else if (r > 0 && mode == 251) {
    s[in.pick(r)] = -2;
  }
  return s;
}

// The reference of view/reshape's shape argument: the resolved shape, or
// nullopt when it is invalid (two -1, a negative extent, a wrong count).
std::optional<Vec> infer(const Vec& shape, int64_t numel) {
  Vec out = shape;
  int infer_at = -1;
  int64_t known = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer_at >= 0) return std::nullopt;
      infer_at = static_cast<int>(i);
    } else if (shape[i] < 0) {
      return std::nullopt;
    } else {
      known *= shape[i];
    }
  }
  if (infer_at >= 0) {
    if (known == 0 || numel % known != 0) return std::nullopt;
    out[infer_at] = numel / known;
  }
  if (numel_of(out) != numel) return std::nullopt;
  return out;
}

Vec permutation_arg(Bytes& in, int ndim) {
  Vec p(static_cast<size_t>(ndim));
  for (int i = 0; i < ndim; ++i)
    p[i] = i;
  for (int i = ndim - 1; i > 0; --i)
    std::swap(p[i], p[in.pick(i + 1)]);
  for (int64_t& d : p) {
    if (in.next() & 1) d -= ndim;
  }
  const uint8_t mode = in.next();
  if (mode == 255 && ndim >= 2) p[1] = p[0];
  if (mode == 254) p.push_back(0);
  if (mode == 253 && ndim >= 1) p.pop_back();
  if (mode == 252 && ndim >= 1) p[0] = ndim;
  return p;
}

Vec expand_arg(Bytes& in, const Vec& shape) {
  const int ndim = static_cast<int>(shape.size());
  const int lead = static_cast<int>(in.pick(std::min(3, 7 - ndim)));
  Vec s;
  for (int i = 0; i < lead; ++i)
    s.push_back(1 + in.pick(3));
  for (int64_t have : shape) {
    static const int64_t from_one[] = {1, 2, 3, -1, 0};
    s.push_back(have == 1 ? from_one[in.pick(5)] : (in.next() & 1 ? -1 : have));
  }
  const uint8_t mode = in.next();
  if (mode == 255 && !s.empty()) s[in.pick(static_cast<int64_t>(s.size()))] += 2;
  if (mode == 254 && lead > 0) s[0] = -1;
  if (mode == 253 && !s.empty()) s[in.pick(static_cast<int64_t>(s.size()))] = -2;
  if (mode == 252 && !s.empty()) s.erase(s.begin());
  return s;
}

// ---- the ops: each yields its text, its run and its reference ----

constexpr int64_t kMaxElements = 4096;

struct Op {
  std::string text;
  std::function<Tensor(const Tensor&)> run;
  std::optional<Ref> want;  // nullopt: the op must throw tandem::Error
  bool may_copy = false;    // reshape/flatten copy when no strides fit
};

Op decode_op(Bytes& in, const Ref& cur) {
  const int nd = static_cast<int>(cur.shape.size());
  const int64_t numel = numel_of(cur.shape);
  Op op;
  switch (in.pick(12)) {
    case 0:
    case 1: {
      const bool is_view = (in.next() & 1) == 0;
      Vec s = shape_arg(in, numel);
      op.text = fmt::format("{}([{}])", is_view ? "view" : "reshape", fmt::join(s, ","));
      op.run = [s, is_view](const Tensor& t) {
        return is_view ? ops::view(t, Shape{s}) : ops::reshape(t, Shape{s});
      };
      if (auto out = infer(s, numel)) {
        Ref r = reshaped(cur, *out);
        if (!is_view || affine(r)) op.want = r;
      }
      op.may_copy = !is_view;
      break;
    }
    case 2: {
      Vec p = permutation_arg(in, nd);
      op.text = fmt::format("permute([{}])", fmt::join(p, ","));
      op.run = [p](const Tensor& t) { return ops::permute(t, Dims{p}); };
      if (static_cast<int>(p.size()) != nd) break;  // (also: more dims than Dims holds)
      std::vector<int> wrapped;
      for (int64_t d : p) {
        auto w = wrap(d, nd);
        if (!w || std::count(wrapped.begin(), wrapped.end(), *w)) break;
        wrapped.push_back(*w);
      }
      if (static_cast<int>(wrapped.size()) != nd) break;
      Vec out;
      for (int d : wrapped)
        out.push_back(cur.shape[d]);
      op.want = gather(cur, out, [&](const Vec& o) {
        Vec i(static_cast<size_t>(nd));
        for (int k = 0; k < nd; ++k)
          i[wrapped[k]] = o[k];
        return i;
      });
      break;
    }
    case 3: {
      const int64_t d0 = dim_arg(in, nd), d1 = dim_arg(in, nd);
      op.text = fmt::format("transpose({}, {})", d0, d1);
      op.run = [=](const Tensor& t) { return ops::transpose(t, d0, d1); };
      auto a = wrap(d0, nd), b = wrap(d1, nd);
      if (!a || !b) break;
      if (nd == 0) {
        op.want = cur;
        break;
      }
      Vec out = cur.shape;
      std::swap(out[*a], out[*b]);
      op.want = gather(cur, out, [&](Vec o) {
        std::swap(o[*a], o[*b]);
        return o;
      });
      break;
    }
    case 4: {
      const int64_t dim = dim_arg(in, nd);
      auto d = wrap(dim, nd);
      const int64_t n = d && nd > 0 ? cur.shape[*d] : 1;
      const int64_t start = int_arg(in, -n, n), length = int_arg(in, 0, n);
      op.text = fmt::format("narrow({}, {}, {})", dim, start, length);
      op.run = [=](const Tensor& t) { return ops::narrow(t, dim, start, length); };
      if (!d || nd == 0) break;  // a 0-dim tensor has no dim to narrow
      const int64_t s = start < 0 ? start + n : start;
      if (s < 0 || length < 0 || s + length > n) break;
      Vec out = cur.shape;
      out[*d] = length;
      op.want = gather(cur, out, [&](Vec o) {
        o[*d] += s;
        return o;
      });
      break;
    }
    case 5: {
      const int64_t dim = dim_arg(in, nd);
      auto d = wrap(dim, nd);
      const int64_t n = d && nd > 0 ? cur.shape[*d] : 1;
      const int64_t start = int_arg(in, -n - 1, n + 1), end = int_arg(in, -n - 1, n + 1);
      const int64_t step = int_arg(in, 1, 3);
      op.text = fmt::format("slice({}, {}, {}, {})", dim, start, end, step);
      op.run = [=](const Tensor& t) { return ops::slice(t, dim, start, end, step); };
      if (!d || nd == 0 || step <= 0) break;
      // Python's rules: negative bounds count from the end, then clamp.
      auto clamp = [n](int64_t i) { return std::clamp<int64_t>(i < 0 ? i + n : i, 0, n); };
      const int64_t s = clamp(start), e = std::max(clamp(end), s);
      Vec out = cur.shape;
      out[*d] = (e - s + step - 1) / step;
      op.want = gather(cur, out, [&](Vec o) {
        o[*d] = s + o[*d] * step;
        return o;
      });
      break;
    }
    case 6: {
      const int64_t dim = dim_arg(in, nd);
      auto d = wrap(dim, nd);
      const int64_t n = d && nd > 0 ? cur.shape[*d] : 1;
      const int64_t index = int_arg(in, -n, n - 1);
      op.text = fmt::format("select({}, {})", dim, index);
      op.run = [=](const Tensor& t) { return ops::select(t, dim, index); };
      if (!d || nd == 0 || index < -n || index >= n) break;
      const int64_t i = index < 0 ? index + n : index;
      Vec out = cur.shape;
      out.erase(out.begin() + *d);
      op.want = gather(cur, out, [&](Vec o) {
        o.insert(o.begin() + *d, i);
        return o;
      });
      break;
    }
    case 7: {
      Vec s = expand_arg(in, cur.shape);
      op.text = fmt::format("expand([{}])", fmt::join(s, ","));
      op.run = [s](const Tensor& t) { return ops::expand(t, Shape{s}); };
      if (static_cast<int>(s.size()) < nd) break;
      const int lead = static_cast<int>(s.size()) - nd;
      Vec out = s;
      bool ok = true;
      for (int i = 0; i < static_cast<int>(s.size()); ++i) {
        if (i < lead) {
          ok = ok && s[i] >= 0;
          continue;
        }
        const int64_t have = cur.shape[i - lead];
        if (s[i] == -1) out[i] = have;
        ok = ok && out[i] >= 0 && (out[i] == have || have == 1);
      }
      if (!ok) break;
      if (numel_of(out) > kMaxElements) {
        op.run = nullptr;  // too big to check cheaply: skip
        break;
      }
      op.want = gather(cur, out, [&](const Vec& o) {
        Vec i(o.begin() + lead, o.end());
        for (int k = 0; k < nd; ++k) {
          if (cur.shape[k] == 1) i[k] = 0;
        }
        return i;
      });
      break;
    }
    case 8: {
      op.text = "squeeze()";
      op.run = [](const Tensor& t) { return ops::squeeze(t); };
      Vec out;
      for (int64_t e : cur.shape) {
        if (e != 1) out.push_back(e);
      }
      op.want = reshaped(cur, out);
      break;
    }
    case 9: {
      const int64_t dim = dim_arg(in, nd);
      op.text = fmt::format("squeeze({})", dim);
      op.run = [=](const Tensor& t) { return ops::squeeze(t, dim); };
      auto d = wrap(dim, nd);
      if (!d) break;
      Vec out = cur.shape;
      if (nd > 0 && out[*d] == 1) out.erase(out.begin() + *d);
      op.want = reshaped(cur, out);
      break;
    }
    case 10: {
      const int64_t dim = dim_arg(in, nd + 1);
      op.text = fmt::format("unsqueeze({})", dim);
      op.run = [=](const Tensor& t) { return ops::unsqueeze(t, dim); };
      auto d = wrap(dim, nd + 1);
      if (!d || nd >= kMaxDims) break;
      Vec out = cur.shape;
      out.insert(out.begin() + *d, 1);
      op.want = reshaped(cur, out);
      break;
    }
    default: {
      const int64_t a = dim_arg(in, nd), b = dim_arg(in, nd);
      op.text = fmt::format("flatten({}, {})", a, b);
      op.run = [=](const Tensor& t) { return ops::flatten(t, a, b); };
      op.may_copy = true;
      if (nd == 0) {  // any dims: a scalar flattens to [1]
        op.want = reshaped(cur, Vec{1});
        break;
      }
      auto s = wrap(a, nd), e = wrap(b, nd);
      if (!s || !e || *s > *e) break;
      Vec out(cur.shape.begin(), cur.shape.begin() + *s);
      out.push_back(numel_of(Vec(cur.shape.begin() + *s, cur.shape.begin() + *e + 1)));
      out.insert(out.end(), cur.shape.begin() + *e + 1, cur.shape.end());
      op.want = reshaped(cur, out);
      break;
    }
  }
  return op;
}

// Shape, values through a contiguous copy, and every element through the
// tensor's own strides and offset (where the reference puts it in storage).
void check(const Tensor& t, const Ref& want, const std::vector<std::string>& trace) {
  if (t.shape().vec() != want.shape) {
    finding(trace, fmt::format("shape {} (strides {}), expected [{}]", t.shape(), t.strides(),
                               fmt::join(want.shape, ",")));
  }
  const std::vector<int64_t> values = ops::contiguous(t).to_vector<int64_t>();
  if (values != want.src) {
    finding(trace, fmt::format("values [{}], expected [{}]", fmt::join(values, ","),
                               fmt::join(want.src, ",")));
  }
  const int64_t capacity = static_cast<int64_t>(t.storage()->nbytes / sizeof(int64_t));
  const auto* data = static_cast<const int64_t*>(t.storage()->data);
  for (int64_t i = 0; i < static_cast<int64_t>(want.src.size()); ++i) {
    const Vec idx = unravel(i, want.shape);
    int64_t at = t.storage_offset();
    for (size_t k = 0; k < idx.size(); ++k)
      at += idx[k] * t.strides()[static_cast<int>(k)];
    if (at < 0 || at >= capacity) {
      finding(trace, fmt::format("element [{}] at storage index {} outside [0, {}) (shape {} "
                                 "strides {} offset {})",
                                 fmt::join(idx, ","), at, capacity, t.shape(), t.strides(),
                                 t.storage_offset()));
    }
    if (at != want.pos[i] || data[at] != want.src[i]) {
      finding(trace,
              fmt::format("element [{}] is storage index {} holding {}, expected {} holding {}",
                          fmt::join(idx, ","), at, data[at], want.pos[i], want.src[i]));
    }
  }
}

void run(const uint8_t* data, size_t size) {
  Bytes in(data, size);
  static const int64_t extents[] = {1, 2, 3, 4, 2, 3, 1, 4, 2, 3, 1, 2, 3, 4, 5, 0};
  Vec shape(static_cast<size_t>(in.pick(5)));
  for (int64_t& e : shape)
    e = extents[in.pick(16)];
  const size_t n = static_cast<size_t>(numel_of(shape));
  Ref cur{shape, Vec(n), Vec(n)};
  for (size_t i = 0; i < n; ++i)
    cur.src[i] = cur.pos[i] = static_cast<int64_t>(i);
  Tensor t = ops::reshape(ops::arange(0, static_cast<double>(cur.src.size())), Shape{shape});
  std::vector<std::string> trace{
      fmt::format("arange({}).reshape([{}])", cur.src.size(), fmt::join(shape, ","))};
  for (int n = 0; n < 12 && !in.empty(); ++n) {
    Op op = decode_op(in, cur);
    if (!op.run) continue;
    trace.push_back(op.text);
    Tensor out;
    try {
      out = op.run(t);
    } catch (const Error& e) {
      const std::string what = e.what();
      if (what.find("[internal]") != std::string::npos) finding(trace, what);
      if (op.want) finding(trace, "unexpected error: " + what);
      trace.back() += " (error)";
      continue;  // the chain goes on from the unchanged tensor
    }
    if (!op.want) finding(trace, fmt::format("expected an error, got shape {}", out.shape()));
    Ref want = *op.want;
    const bool fits = affine(want);
    if (!op.may_copy && !out.is_alias_of(t)) finding(trace, "a view copied its input");
    if (op.may_copy && out.is_alias_of(t) != fits) {
      finding(trace,
              fmt::format("reshape {} although strides {} fit",
                          out.is_alias_of(t) ? "aliased" : "copied", fits ? "do" : "do not"));
    }
    if (op.may_copy && !fits) {  // a fresh contiguous copy
      for (size_t i = 0; i < want.pos.size(); ++i)
        want.pos[i] = static_cast<int64_t>(i);
    }
    check(out, want, trace);
    t = out;
    cur = std::move(want);
  }
}

}  // namespace
}  // namespace tandem

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::run(data, size);
  return 0;
}
