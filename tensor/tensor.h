// Tensor: a cheap value handle (shared storage + shape + strides + offset +
// dtype + device). Copies alias; ops::clone() copies data. DESIGN §3.
//
// The tensor layer's ops (tensor/ops.h) are free functions in tandem::ops and
// are not differentiable; autograd/ wraps them with the same names in
// namespace tandem. A Tensor carries an opaque autograd slot so that layer can
// attach gradients without the tensor layer knowing about it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/runtime/allocator.h"
#include "tandem/runtime/device.h"
#include "tandem/runtime/stream.h"
#include "tandem/tensor/dtype.h"
#include "tandem/tensor/shape.h"

namespace tandem {

// A block of device memory shared by every view: owned by an Allocator, or
// foreign memory (DLPack) that another framework owns.
struct StorageImpl {
  StorageImpl(size_t nbytes, Device device, const Stream& stream);
  // Wraps foreign memory: `release` runs exactly once, when the last view dies
  // (tensor/io/dlpack.h). Such a storage has no allocator, so no record_stream.
  StorageImpl(void* data, size_t nbytes, Device device, std::function<void()> release);
  ~StorageImpl();
  StorageImpl(const StorageImpl&) = delete;
  StorageImpl& operator=(const StorageImpl&) = delete;

  void* data = nullptr;
  size_t nbytes = 0;
  Device device;
  Allocator* allocator;           // process-lifetime (allocator_for); null for foreign memory
  uint64_t alloc_stream_id = 0;   // Note [Caching allocator]
  std::function<void()> release;  // foreign memory only
};

// Implemented by autograd/; the tensor layer only stores and copies the pointer.
class AutogradMetaBase {
 public:
  virtual ~AutogradMetaBase() = default;
};

class Tensor {
 public:
  Tensor() = default;
  // Wraps existing storage (views, DLPack, comm buffers).
  Tensor(std::shared_ptr<StorageImpl> storage, Shape shape, Dims strides, int64_t offset,
         DType dtype);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int dim() const { return shape_.size(); }
  int64_t size(int64_t d) const;
  const Dims& strides() const { return strides_; }
  int64_t stride(int64_t d) const;
  int64_t numel() const { return shape_.numel(); }
  DType dtype() const { return dtype_; }
  // Undefined handles report the CPU, so a check can name them instead of crashing.
  Device device() const { return storage_ ? storage_->device : Device::cpu(); }
  int64_t storage_offset() const { return offset_; }
  size_t element_size() const { return dtype_size(dtype_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }
  bool is_contiguous() const;

  // Address of element 0. No synchronisation: only for kernels and for code
  // that has synchronised the stream itself.
  void* raw_data() const {
    return static_cast<char*>(storage_->data) + offset_ * static_cast<int64_t>(element_size());
  }
  template <class T>
  T* data_ptr() const {
    TANDEM_CHECK(dtype_of<T>::value == dtype_,
                 "[tensor::data_ptr] expected a tensor of dtype {}, got {}",
                 dtype_name(dtype_of<T>::value), dtype_name(dtype_));
    return static_cast<T*>(raw_data());
  }
  const std::shared_ptr<StorageImpl>& storage() const { return storage_; }
  bool is_alias_of(const Tensor& other) const { return storage_ == other.storage_; }

  // Value reads synchronise the current stream of the tensor's device.
  template <class T>
  std::vector<T> to_vector() const;
  template <class T>
  T item() const;
  // The single element as double (any dtype).
  double item_double() const;

  std::string str() const;  // shape, dtype, device and (small) values

  AutogradMetaBase* autograd_meta() const { return autograd_.get(); }
  const std::shared_ptr<AutogradMetaBase>& autograd_meta_ptr() const { return autograd_; }
  void set_autograd_meta(std::shared_ptr<AutogradMetaBase> meta) { autograd_ = std::move(meta); }

 private:
  std::shared_ptr<StorageImpl> storage_;
  Shape shape_;
  Dims strides_;
  int64_t offset_ = 0;
  DType dtype_ = DType::F32;
  std::shared_ptr<AutogradMetaBase> autograd_;
};

template <>
std::vector<bool> Tensor::to_vector<bool>() const;

// Allocates an uninitialised contiguous tensor on `device`, on the current stream.
Tensor empty(const Shape& shape, DType dtype = DType::F32, Device device = Device::cpu());

}  // namespace tandem
