#include "tandem/tensor/cpu/copy_bytes.h"

#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

namespace tandem::cpu {

// Note [Large copies]
// ~~~~~~~~~~~~~~~~~~~
// glibc's memcpy picks its loop by size from cache sizes it reads at start-up.
// On AMD it stops using `rep movsb` above the core's L2 size and copies with
// a loop of vector moves until its non-temporal threshold (glibc 2.33-2.39,
// Debian 12's 2.36 included). On AMD Zen CPUs that loop is the slower one
// for pieces of about a megabyte and more, in cache and out of it, while
// below that memcpy is faster (the measurements are in the README's
// benchmark section, "Measurements behind design choices"). So from kRepMovsbFrom bytes
// up, on AMD Zen CPUs (family 19h and later) with ERMS, copy_bytes() issues
// `rep movsb` itself; elsewhere and below that it is std::memcpy. Used where
// tandem copies large blocks: contiguous tensor copies and the pieces and
// chunks of the threads backend's collectives (Note [Threads jobs]).

// Sanitizers see the bytes std::memcpy touches (an interceptor), not those
// of an asm statement: their builds copy with memcpy only.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define TANDEM_COPY_BYTES_ASM 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define TANDEM_COPY_BYTES_ASM 0
#endif
#endif
#if !defined(TANDEM_COPY_BYTES_ASM)
#if defined(__x86_64__)
#define TANDEM_COPY_BYTES_ASM 1
#else
#define TANDEM_COPY_BYTES_ASM 0
#endif
#endif

namespace {

bool detect_rep_movsb() {
#if TANDEM_COPY_BYTES_ASM
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return false;
  // "AuthenticAMD"
  const bool amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;
  if (!amd || eax < 7) return false;
  __get_cpuid(1, &eax, &ebx, &ecx, &edx);
  const unsigned family = ((eax >> 8) & 0xf) + (((eax >> 8) & 0xf) == 0xf ? (eax >> 20) & 0xff : 0);
  __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx);
  const bool erms = (ebx >> 9) & 1u;
  return family >= 0x19 && erms;
#else
  return false;
#endif
}

const bool g_rep_movsb = detect_rep_movsb();

}  // namespace

bool copy_bytes_uses_rep_movsb() {
  return g_rep_movsb;
}

void copy_bytes(void* dst, const void* src, size_t n) {
#if TANDEM_COPY_BYTES_ASM
  if (n >= kRepMovsbFrom && g_rep_movsb) {
    asm volatile("rep movsb" : "+D"(dst), "+S"(src), "+c"(n) : : "memory");
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace tandem::cpu
