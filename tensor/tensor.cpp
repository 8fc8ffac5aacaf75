#include "tandem/tensor/tensor.h"

#include <cstring>
#include <utility>

#include "tandem/runtime/cuda/cuda_api.h"
#include "tandem/tensor/dispatch.h"
#include "tandem/tensor/kernels.h"
#include "tandem/tensor/ops.h"
#include "tandem/tensor/storage.h"

namespace tandem {

StorageImpl::StorageImpl(size_t n, Device d, const Stream& stream)
    : nbytes(n), device(d), allocator(&allocator_for(d)), alloc_stream_id(stream.id()) {
  data = allocator->allocate(n, stream);
}

StorageImpl::StorageImpl(void* d, size_t n, Device dev, std::function<void()> r)
    : data(d), nbytes(n), device(dev), allocator(nullptr), release(std::move(r)) {}

// Note [Released storage] (tensor/storage.h).
void release_storage(const Tensor& t) {
  StorageImpl* s = t.storage().get();
  TANDEM_CHECK(s != nullptr && s->allocator != nullptr,
               "[tensor::release_storage] expected a tensor whose memory tandem allocated, got {}",
               s == nullptr ? "an undefined tensor" : "foreign memory");
  if (s->data == nullptr) return;
  void* block = std::exchange(s->data, nullptr);
  Allocator* allocator = s->allocator;
  const Stream& stream = current_stream(s->device);
  if (s->device.is_cpu() && !stream.is_inline()) {
    stream.enqueue_async([allocator, block] { allocator->deallocate(block); }, true);
  } else {
    allocator->deallocate(block);
  }
}

void restore_storage(const Tensor& t) {
  StorageImpl* s = t.storage().get();
  TANDEM_CHECK(s != nullptr && s->allocator != nullptr,
               "[tensor::restore_storage] expected a tensor whose memory tandem allocated, got {}",
               s == nullptr ? "an undefined tensor" : "foreign memory");
  if (s->data != nullptr) return;
  const Stream& stream = current_stream(s->device);
  s->data = s->allocator->allocate(s->nbytes, stream);
  s->alloc_stream_id = stream.id();
}

bool storage_released(const Tensor& t) {
  return t.defined() && t.storage()->data == nullptr && t.storage()->allocator != nullptr;
}

StorageImpl::~StorageImpl() {
  if (allocator != nullptr) {
    allocator->deallocate(data);
  } else if (release) {
    try {
      release();
    } catch (...) {  // destructors never throw (STYLE); a foreign deleter has no way to report
    }
  }
}

Tensor::Tensor(std::shared_ptr<StorageImpl> storage, Shape shape, Dims strides, int64_t offset,
               DType dtype)
    : storage_(std::move(storage)),
      shape_(shape),
      strides_(strides),
      offset_(offset),
      dtype_(dtype) {}

int64_t Tensor::size(int64_t d) const {
  return shape_[wrap_dim(d, dim(), "size")];
}
int64_t Tensor::stride(int64_t d) const {
  return strides_[wrap_dim(d, dim(), "stride")];
}

bool Tensor::is_contiguous() const {
  if (numel() == 0) return true;  // no element to be out of place (as in PyTorch)
  int64_t expected = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (shape_[i] == 1) continue;
    if (strides_[i] != expected) return false;
    expected *= shape_[i];
  }
  return true;
}

Tensor empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t extent : shape) {
    TANDEM_CHECK(extent >= 0, "[tensor::empty] expected non-negative extents, got {}", shape);
  }
  size_t nbytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  auto storage = std::make_shared<StorageImpl>(nbytes, device, current_stream(device));
  return Tensor(std::move(storage), shape, contiguous_strides(shape), 0, dtype);
}

namespace {

// Contiguous host copy of `t` (synchronises).
Tensor host_contiguous(const Tensor& t) {
  Tensor c = ops::contiguous(t.device().is_cpu() ? t : ops::to(t, Device::cpu()));
  current_stream(Device::cpu()).synchronize();
  return c;
}

}  // namespace

template <class T>
std::vector<T> Tensor::to_vector() const {
  TANDEM_CHECK(defined(), "[tensor::to_vector] expected a defined tensor, got an empty handle");
  TANDEM_CHECK(dtype_of<T>::value == dtype_, "[tensor::to_vector] expected dtype {}, got {}",
               dtype_name(dtype_of<T>::value), dtype_name(dtype_));
  Tensor c = host_contiguous(*this);
  std::vector<T> out(static_cast<size_t>(numel()));
  if (!out.empty()) std::memcpy(out.data(), c.raw_data(), out.size() * sizeof(T));
  return out;
}

// std::vector<bool> is bit-packed: specialise through uint8_t.
template <>
std::vector<bool> Tensor::to_vector<bool>() const {
  TANDEM_CHECK(dtype_ == DType::Bool, "[tensor::to_vector] expected dtype bool, got {}",
               dtype_name(dtype_));
  Tensor c = host_contiguous(*this);
  const auto* p = static_cast<const uint8_t*>(c.raw_data());
  return std::vector<bool>(p, p + numel());
}

template <class T>
T Tensor::item() const {
  TANDEM_CHECK(numel() == 1, "[tensor::item] expected exactly one element, got shape {}", shape_);
  return to_vector<T>()[0];
}

double Tensor::item_double() const {
  TANDEM_CHECK(numel() == 1, "[tensor::item] expected exactly one element, got shape {}", shape_);
  return dispatch_dtype(dtype_, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, bool>) {
      return to_vector<bool>()[0] ? 1.0 : 0.0;
    } else {
      return static_cast<double>(static_cast<acc_t<T>>(to_vector<T>()[0]));
    }
  });
}

template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<BFloat16> Tensor::to_vector<BFloat16>() const;
template std::vector<Half> Tensor::to_vector<Half>() const;
template std::vector<int32_t> Tensor::to_vector<int32_t>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;
template float Tensor::item<float>() const;
template double Tensor::item<double>() const;
template int32_t Tensor::item<int32_t>() const;
template int64_t Tensor::item<int64_t>() const;
template bool Tensor::item<bool>() const;

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  std::string s = fmt::format("Tensor(shape={}, dtype={}, device={}", shape_, dtype_name(dtype_),
                              device().str());
  if (numel() <= 64) {
    Tensor d = ops::to(*this, DType::F64);
    std::vector<double> v = d.to_vector<double>();
    s += ", values=[";
    for (size_t i = 0; i < v.size(); ++i)
      s += fmt::format("{}{:.6g}", i ? ", " : "", v[i]);
    s += "]";
  }
  return s + ")";
}

namespace {
// Note [Released storage]: an op on a released tensor is an error, not a read
// through a null pointer.
void check_not_released(const Tensor& t) {
  TANDEM_CHECK(!t.defined() || t.storage()->data != nullptr || t.storage()->nbytes == 0 ||
                   t.storage()->allocator == nullptr,
               "[tensor] expected a tensor with memory, got one of shape {} whose storage was "
               "released (Note [Released storage]: FSDP restores it before the backward reads "
               "it)",
               t.shape());
}
}  // namespace

TensorArg arg_of(const Tensor& t) {
  check_not_released(t);
  TensorArg a;
  a.data = t.raw_data();
  a.dtype = t.dtype();
  a.ndim = t.dim();
  for (int i = 0; i < t.dim(); ++i) {
    a.shape[i] = t.shape()[i];
    a.strides[i] = t.strides()[i];
  }
  a.numel = t.numel();
  a.contiguous = t.is_contiguous();
  return a;
}

TensorArg broadcast_arg(const Tensor& t, const Shape& shape) {
  check_not_released(t);
  TensorArg a;
  a.data = t.raw_data();
  a.dtype = t.dtype();
  a.ndim = shape.size();
  int lead = shape.size() - t.dim();
  bool same = lead == 0;
  for (int i = 0; i < shape.size(); ++i) {
    a.shape[i] = shape[i];
    int j = i - lead;
    if (j < 0 || t.shape()[j] != shape[i]) {
      a.strides[i] = 0;
      same = false;
    } else {
      a.strides[i] = t.strides()[j];
    }
  }
  a.numel = shape.numel();
  a.contiguous = same && t.is_contiguous();
  return a;
}

namespace detail {
void record_streams_for(const Stream& stream, std::initializer_list<const Tensor*> tensors) {
  for (const Tensor* t : tensors) {
    // Foreign storage (no allocator) is kept alive by its owner, not by us.
    if (t->defined() && t->storage()->allocator != nullptr &&
        t->storage()->alloc_stream_id != stream.id()) {
      t->storage()->allocator->record_stream(t->storage()->data, stream);
    }
  }
}
}  // namespace detail

}  // namespace tandem
