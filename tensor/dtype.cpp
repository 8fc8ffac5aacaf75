#include "tandem/tensor/dtype.h"

namespace tandem {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "f32";
    case DType::F64:
      return "f64";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "f16";
    case DType::I32:
      return "i32";
    case DType::I64:
      return "i64";
    case DType::Bool:
      return "bool";
  }
  return "?";
}

DType parse_dtype(const std::string& name) {
  for (DType t :
       {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64, DType::Bool}) {
    if (name == dtype_name(t)) return t;
  }
  TANDEM_FAIL(
      "[tensor::parse_dtype] expected one of f32, f64, bf16, f16, i32, i64, bool, got \"{}\"",
      name);
}

DType promote(DType a, DType b) {
  if (a == b) return a;
  auto rank = [](DType t) {
    switch (t) {
      case DType::Bool:
        return 0;
      case DType::I32:
        return 1;
      case DType::I64:
        return 2;
      case DType::F16:
        return 3;
      case DType::BF16:
        return 3;
      case DType::F32:
        return 4;
      case DType::F64:
        return 5;
    }
    return 0;
  };
  // bf16 with f16 has no exact common 16-bit type: f32, like PyTorch.
  if ((a == DType::BF16 && b == DType::F16) || (a == DType::F16 && b == DType::BF16))
    return DType::F32;
  return rank(a) >= rank(b) ? a : b;
}

}  // namespace tandem
