// copy_bytes(): memcpy for the large contiguous copies of tensor copies and
// the threads comm backend (Note [Large copies] in copy_bytes.cpp).
#pragma once

#include <cstddef>

namespace tandem::cpu {

// Copies `n` bytes from `src` to `dst` (no overlap), as std::memcpy does.
void copy_bytes(void* dst, const void* src, size_t n);

// Whether copy_bytes() uses `rep movsb` from kRepMovsbFrom bytes up on this
// CPU (for the benchmark and tests).
bool copy_bytes_uses_rep_movsb();
constexpr size_t kRepMovsbFrom = size_t{1} << 20;

}  // namespace tandem::cpu
