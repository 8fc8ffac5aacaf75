// fuzz-safetensors: arbitrary bytes into parse_safetensors (tensor/io/safetensors.h).
//
// The reader must reject what is malformed with a tandem::Error and never read
// outside the buffer (AddressSanitizer watches). What it accepts must survive
// a round trip: written again by tandem and read back, the same names in the
// same order, the same dtypes, shapes and bytes, the same metadata, and now a
// verified checksum. An internal assert, any other exception, a crash or a
// round-trip difference is a finding.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tandem/runtime/error.h"
#include "tandem/tensor/io/safetensors.h"

namespace tandem {
namespace {

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "fuzz-safetensors: FINDING: %s\n", what.c_str());
  std::abort();  // a crash is how a libFuzzer target reports
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  // Loaded tensors are contiguous CPU tensors with their own storage.
  return a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0);
}

void check_round_trip(const SafetensorsFile& file, size_t input_size) {
  size_t total = 0;
  for (const auto& [name, t] : file.tensors())
    total += t.nbytes();
  if (total > input_size) finding("the tensors hold more bytes than the input");

  std::vector<uint8_t> again;
  try {
    again = serialize_safetensors(file.tensors(), file.metadata());
  } catch (const Error& e) {
    finding(std::string("writing back an accepted file failed: ") + e.what());
  }
  SafetensorsFile back = parse_safetensors(again.data(), again.size(), "<round trip>");
  if (!back.checksum_verified()) finding("the round trip has no verified checksum");
  if (back.metadata() != file.metadata()) finding("the round trip changed the metadata");
  if (back.size() != file.size()) finding("the round trip changed the number of tensors");
  for (size_t i = 0; i < file.size(); ++i) {
    const auto& [name, t] = file.tensors()[i];
    const auto& [name2, t2] = back.tensors()[i];
    if (name != name2 || t.dtype() != t2.dtype() || !(t.shape() == t2.shape()) ||
        !same_bytes(t, t2)) {
      finding("the round trip changed tensor '" + name + "'");
    }
  }
}

void run(const uint8_t* data, size_t size) {
  try {
    SafetensorsFile file = parse_safetensors(data, size, "<fuzz>");
    check_round_trip(file, size);
  } catch (const Error& e) {
    if (std::strncmp(e.what(), "[internal]", 10) == 0) finding(e.what());
  }
}

}  // namespace
}  // namespace tandem

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tandem::run(data, size);
  return 0;
}
