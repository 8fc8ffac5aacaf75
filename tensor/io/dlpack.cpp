// DLPack export and import (tensor/io/dlpack.h, Note [DLPack ownership]).
#include "tandem/tensor/io/dlpack.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>

#include "tandem/runtime/stream.h"

namespace tandem {
namespace {

// kDLBool of DLPack >= 0.8; the 0.6 header has no bool type code.
constexpr uint8_t kDLBoolCode = 6;

// Everything a DLManagedTensor of to_dlpack points at, in one allocation that
// its deleter frees.
struct ExportContext {
  Tensor tensor;  // keeps the storage alive
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
  DLManagedTensor managed{};
};

void delete_export(DLManagedTensor* self) {
  // Takes back the ownership to_dlpack released to the consumer.
  std::unique_ptr<ExportContext> ctx(static_cast<ExportContext*>(self->manager_ctx));
}

DLDataType dl_dtype(DType t) {
  switch (t) {
    case DType::F32:
      return {kDLFloat, 32, 1};
    case DType::F64:
      return {kDLFloat, 64, 1};
    case DType::BF16:
      return {kDLBfloat, 16, 1};
    case DType::F16:
      return {kDLFloat, 16, 1};
    case DType::I32:
      return {kDLInt, 32, 1};
    case DType::I64:
      return {kDLInt, 64, 1};
    case DType::Bool:
      return {kDLBoolCode, 8, 1};
  }
  TANDEM_FAIL("[tensor::to_dlpack] expected a valid dtype, got {}", static_cast<int>(t));
}

std::optional<DType> tandem_dtype(DLDataType d) {
  if (d.lanes != 1) return std::nullopt;
  switch (d.code) {
    case kDLFloat:
      if (d.bits == 16) return DType::F16;
      if (d.bits == 32) return DType::F32;
      if (d.bits == 64) return DType::F64;
      break;
    case kDLBfloat:
      if (d.bits == 16) return DType::BF16;
      break;
    case kDLInt:
      if (d.bits == 32) return DType::I32;
      if (d.bits == 64) return DType::I64;
      break;
    case kDLBoolCode:
      if (d.bits == 8) return DType::Bool;
      break;
    default:
      break;
  }
  return std::nullopt;
}

// "int8", "uint8", "float32x4", "complex64", "code 9 bits 8".
std::string dl_dtype_str(DLDataType d) {
  const char* base = nullptr;
  switch (d.code) {
    case kDLInt:
      base = "int";
      break;
    case kDLUInt:
      base = "uint";
      break;
    case kDLFloat:
      base = "float";
      break;
    case kDLBfloat:
      base = "bfloat";
      break;
    case kDLComplex:
      base = "complex";
      break;
    case kDLOpaqueHandle:
      base = "opaque";
      break;
    case kDLBoolCode:
      base = "bool";
      break;
    default:
      break;
  }
  std::string s = base ? fmt::format("{}{}", base, d.bits)
                       : fmt::format("type code {} bits {}", d.code, d.bits);
  if (d.lanes != 1) s += fmt::format("x{}", d.lanes);
  return s;
}

Device import_device(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU:
    case kDLCUDAHost:  // pinned host memory: ordinary CPU memory to tandem
      return Device::cpu();
    case kDLCUDA: {
      int count = cuda_device_count();
      TANDEM_CHECK(d.device_id >= 0 && d.device_id < count,
                   "[tensor::from_dlpack] expected a CUDA device index in [0, {}), got {}{}", count,
                   d.device_id, count == 0 ? " (no usable GPU in this process)" : "");
      return Device::cuda(d.device_id);
    }
    default:
      break;
  }
  TANDEM_FAIL(
      "[tensor::from_dlpack] expected device type kDLCPU (1), kDLCUDA (2) or kDLCUDAHost (3), "
      "got {}",
      static_cast<int>(d.device_type));
}

// The shape of an imported tensor, its extents non-negative and the product
// of the non-zero ones within 64 bits.
Shape import_shape(const DLTensor& dl) {
  Shape shape;
  int64_t nonzero = 1;
  bool overflow = false;
  for (int i = 0; i < dl.ndim; ++i) {
    TANDEM_CHECK(dl.shape[i] >= 0,
                 "[tensor::from_dlpack] expected non-negative extents, got {} in dim {}",
                 dl.shape[i], i);
    shape.push_back(dl.shape[i]);
    if (dl.shape[i] != 0) overflow |= __builtin_mul_overflow(nonzero, dl.shape[i], &nonzero);
  }
  TANDEM_CHECK(!overflow,
               "[tensor::from_dlpack] expected an element count that fits 64 bits, got "
               "shape {}",
               shape);
  return shape;
}

// The strides of an imported tensor: its own, or contiguous when it has none.
Dims import_strides(const DLTensor& dl, const Shape& shape) {
  Dims strides = contiguous_strides(shape);
  if (dl.strides != nullptr) {
    for (int i = 0; i < dl.ndim; ++i) {
      TANDEM_CHECK(dl.strides[i] >= 0,
                   "[tensor::from_dlpack] expected non-negative strides, got {} in dim {} (shape "
                   "{})",
                   dl.strides[i], i, shape);
      strides[i] = dl.strides[i];
    }
  }
  return strides;
}

// Bytes from element 0 to one past the furthest element.
int64_t measure_extent_bytes(const Shape& shape, const Dims& strides, int64_t elem,
                             bool empty_tensor) {
  bool overflow = false;
  int64_t last = 0, nbytes = 0;
  for (int i = 0; i < shape.size() && !empty_tensor; ++i) {
    int64_t reach = 0;
    overflow |= __builtin_mul_overflow(shape[i] - 1, strides[i], &reach);
    overflow |= __builtin_add_overflow(last, reach, &last);
  }
  if (!empty_tensor) overflow |= __builtin_mul_overflow(last + 1, elem, &nbytes);
  TANDEM_CHECK(!overflow,
               "[tensor::from_dlpack] expected shape and strides whose extent in bytes fits 64 "
               "bits, got shape {} strides {}",
               shape, strides);
  return nbytes;
}

}  // namespace

DLManagedTensor* to_dlpack(const Tensor& t) {
  TANDEM_CHECK(t.defined(), "[tensor::to_dlpack] expected a defined tensor, got an empty handle");
  // The consumer reads the memory directly: finish what was queued on it.
  current_stream(t.device()).synchronize();

  auto ctx = std::make_unique<ExportContext>();
  // A plain handle: the export must not keep an autograd graph alive.
  ctx->tensor = Tensor(t.storage(), t.shape(), t.strides(), t.storage_offset(), t.dtype());
  for (int i = 0; i < t.dim(); ++i) {
    ctx->shape[i] = t.shape()[i];
    ctx->strides[i] = t.strides()[i];
  }
  DLTensor& dl = ctx->managed.dl_tensor;
  dl.data = t.raw_data();
  dl.device = t.device().is_cpu() ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, t.device().index()};
  dl.ndim = t.dim();
  dl.dtype = dl_dtype(t.dtype());
  dl.shape = ctx->shape;
  dl.strides = ctx->strides;
  dl.byte_offset = 0;
  ctx->managed.manager_ctx = ctx.get();
  ctx->managed.deleter = &delete_export;
  // Ownership passes to the consumer, who gives it back through the deleter.
  return &ctx.release()->managed;
}

Tensor from_dlpack(DLManagedTensor* src) {
  TANDEM_CHECK(src != nullptr, "[tensor::from_dlpack] expected a DLManagedTensor, got null");
  if (src->deleter == &delete_export) {
    // One of ours: the original storage, still tracked by its allocator.
    Tensor t = static_cast<ExportContext*>(src->manager_ctx)->tensor;
    src->deleter(src);
    return t;
  }
  const DLTensor& dl = src->dl_tensor;
  TANDEM_CHECK(dl.ndim >= 0 && dl.ndim <= kMaxDims,
               "[tensor::from_dlpack] expected 0 to {} dims, got {}", kMaxDims, dl.ndim);
  std::optional<DType> dtype = tandem_dtype(dl.dtype);
  TANDEM_CHECK(dtype.has_value(),
               "[tensor::from_dlpack] expected dtype float16/32/64, bfloat16, int32/64 or bool "
               "(one lane), got {}",
               dl_dtype_str(dl.dtype));
  Device device = import_device(dl.device);
  TANDEM_CHECK(dl.ndim == 0 || dl.shape != nullptr,
               "[tensor::from_dlpack] expected a shape array for {} dims, got null", dl.ndim);

  // Every product below is checked, so a hostile shape cannot overflow numel,
  // the strides or the extent later. The product of the non-zero extents
  // bounds every partial product numel() and contiguous_strides() form.
  const Shape shape = import_shape(dl);
  const bool empty_tensor = std::find(shape.begin(), shape.end(), 0) != shape.end();
  const Dims strides = import_strides(dl, shape);
  const auto elem = static_cast<int64_t>(dtype_size(*dtype));
  const int64_t nbytes = measure_extent_bytes(shape, strides, elem, empty_tensor);
  TANDEM_CHECK(empty_tensor || dl.data != nullptr,
               "[tensor::from_dlpack] expected a data pointer for shape {}, got null", shape);
  // Integer arithmetic: an empty tensor may come with a null data pointer.
  auto* base = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(dl.data) + dl.byte_offset);
  TANDEM_CHECK(reinterpret_cast<uintptr_t>(base) % static_cast<uintptr_t>(elem) == 0,
               "[tensor::from_dlpack] expected element 0 aligned to {} bytes for {}, got address "
               "{} (data {} + byte_offset {})",
               elem, dtype_name(*dtype), static_cast<const void*>(base), dl.data, dl.byte_offset);

  // From here on nothing throws but the allocation of the storage, before
  // which `src` is still the caller's.
  auto storage = std::make_shared<StorageImpl>(base, static_cast<size_t>(nbytes), device, [src] {
    if (src->deleter != nullptr) src->deleter(src);
  });
  return Tensor(std::move(storage), shape, strides, 0, *dtype);
}

}  // namespace tandem
