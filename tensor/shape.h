// Dims: a fixed-capacity list of up to kMaxDims extents or strides. Shapes are
// built and copied on every op, so they live inline (no heap).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "tandem/runtime/error.h"

namespace tandem {

constexpr int kMaxDims = 8;

class Dims {
 public:
  Dims() = default;
  Dims(std::initializer_list<int64_t> values) { assign(values.begin(), values.end()); }
  explicit Dims(const std::vector<int64_t>& values) { assign(values.begin(), values.end()); }
  static Dims filled(int n, int64_t value) {
    Dims d;
    d.resize(n, value);
    return d;
  }

  int size() const { return size_; }
  bool empty() const { return size_ == 0; }
  int64_t& operator[](int i) { return data_[i]; }
  int64_t operator[](int i) const { return data_[i]; }
  int64_t* begin() { return data_; }
  int64_t* end() { return data_ + size_; }
  const int64_t* begin() const { return data_; }
  const int64_t* end() const { return data_ + size_; }
  const int64_t* data() const { return data_; }
  int64_t back() const { return data_[size_ - 1]; }

  void push_back(int64_t v) {
    TANDEM_CHECK(size_ < kMaxDims, "[tensor::Dims] expected at most {} dims, got more", kMaxDims);
    data_[size_++] = v;
  }
  void insert(int pos, int64_t v) {
    push_back(0);
    for (int i = size_ - 1; i > pos; --i)
      data_[i] = data_[i - 1];
    data_[pos] = v;
  }
  void erase(int pos) {
    for (int i = pos; i + 1 < size_; ++i)
      data_[i] = data_[i + 1];
    --size_;
  }
  void resize(int n, int64_t fill = 0) {
    TANDEM_CHECK(n >= 0 && n <= kMaxDims, "[tensor::Dims] expected at most {} dims, got {}",
                 kMaxDims, n);
    for (int i = size_; i < n; ++i)
      data_[i] = fill;
    size_ = n;
  }
  std::vector<int64_t> vec() const { return std::vector<int64_t>(begin(), end()); }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < size_; ++i)
      n *= data_[i];
    return n;
  }
  std::string str() const;

  friend bool operator==(const Dims& a, const Dims& b) {
    if (a.size_ != b.size_) return false;
    for (int i = 0; i < a.size_; ++i) {
      if (a.data_[i] != b.data_[i]) return false;
    }
    return true;
  }

 private:
  template <class It>
  void assign(It first, It last) {
    size_ = 0;
    for (; first != last; ++first)
      push_back(*first);
  }
  int64_t data_[kMaxDims] = {};
  int size_ = 0;
};

using Shape = Dims;

// Row-major contiguous strides of a shape.
Dims contiguous_strides(const Dims& shape);
// Wraps a possibly negative dim index; names the op in the error.
int wrap_dim(int64_t dim, int ndim, const char* op);
// Broadcast two shapes (numpy rules); error names the op and both shapes.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

}  // namespace tandem

template <>
struct fmt::formatter<tandem::Dims> : fmt::formatter<std::string> {
  auto format(const tandem::Dims& d, format_context& ctx) const {
    return fmt::formatter<std::string>::format(d.str(), ctx);
  }
};
