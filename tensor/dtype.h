// Element types and the one dtype dispatcher (STYLE: a function taking a
// templated lambda, not macros).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

#include "tandem/runtime/error.h"
#include "tandem/tensor/half.h"

namespace tandem {

enum class DType : uint8_t { F32, F64, BF16, F16, I32, I64, Bool };
// The number of dtypes, for tables with one entry per dtype (each
// static_asserts its size against it): the last value + 1, so a new dtype goes
// last or moves the count with it. Not an enumerator, so that switches stay
// exhaustive without a default.
constexpr int kDTypeCount = static_cast<int>(DType::Bool) + 1;

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
      return 4;
    case DType::F64:
      return 8;
    case DType::BF16:
      return 2;
    case DType::F16:
      return 2;
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
    case DType::Bool:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType t);
DType parse_dtype(const std::string& name);

constexpr bool is_floating(DType t) {
  return t == DType::F32 || t == DType::F64 || t == DType::BF16 || t == DType::F16;
}
constexpr bool is_integral(DType t) {
  return t == DType::I32 || t == DType::I64;
}

// The C++ type of each dtype and back.
template <class T>
struct dtype_of;
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::F32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::F64;
};
template <>
struct dtype_of<BFloat16> {
  static constexpr DType value = DType::BF16;
};
template <>
struct dtype_of<Half> {
  static constexpr DType value = DType::F16;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::I32;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::I64;
};
template <>
struct dtype_of<bool> {
  static constexpr DType value = DType::Bool;
};

template <class T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<T>{}) for the C++ type of `t`.
template <class F>
decltype(auto) dispatch_dtype(DType t, F&& fn) {
  switch (t) {
    case DType::F32:
      return fn(TypeTag<float>{});
    case DType::F64:
      return fn(TypeTag<double>{});
    case DType::BF16:
      return fn(TypeTag<BFloat16>{});
    case DType::F16:
      return fn(TypeTag<Half>{});
    case DType::I32:
      return fn(TypeTag<int32_t>{});
    case DType::I64:
      return fn(TypeTag<int64_t>{});
    case DType::Bool:
      return fn(TypeTag<bool>{});
  }
  TANDEM_FAIL("[tensor::dispatch_dtype] expected a valid dtype, got {}", static_cast<int>(t));
}

// Float types only (f32, f64, bf16, f16).
template <class F>
decltype(auto) dispatch_floating(DType t, const char* op, F&& fn) {
  switch (t) {
    case DType::F32:
      return fn(TypeTag<float>{});
    case DType::F64:
      return fn(TypeTag<double>{});
    case DType::BF16:
      return fn(TypeTag<BFloat16>{});
    case DType::F16:
      return fn(TypeTag<Half>{});
    default:
      break;
  }
  TANDEM_FAIL("[tensor::{}] expected a floating dtype (f32, f64, bf16, f16), got {}", op,
              dtype_name(t));
}

// The type arithmetic is done in: float for the 16-bit types, else T itself.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>, float, T>;

// Result dtype of a binary op (PyTorch-like promotion over this dtype set).
DType promote(DType a, DType b);

}  // namespace tandem
