// Hugging Face safetensors files: read and write (the atomic file write and
// CRC-32C they use are in tensor/io/file_io.h).
//
// Format: an 8-byte little-endian header length N, N bytes of a UTF-8 JSON
// object {name: {"dtype", "shape", "data_offsets": [begin, end]}, optional
// "__metadata__": {string: string}}, then the data section: every tensor
// row-major and C-contiguous, little-endian, at [begin, end) relative to the
// section's start, the tensors covering it without holes or overlaps.
//
// Note [Safetensors checksum]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The format has no checksum, so tandem's writer stores one in the metadata:
// __metadata__["tandem.crc32c"] = 8 lowercase hex digits of the CRC-32C of
// safetensors_canonical_table() (count, then per entry in data order name,
// dtype, shape and offsets; then the other metadata pairs in key order; every
// integer as u64 little-endian, every string length-prefixed) followed by the
// whole data section. The reader verifies it when present, so a truncated or
// bit-flipped tandem file is detected rather than loaded; files written by
// other frameworks have no such key and load unverified (every structural
// check still applies). The key is reserved: save_safetensors rejects it in
// user metadata, and load_safetensors removes it from the metadata it returns.
// Left undetected: a flip inside the key "tandem.crc32c" itself, which turns
// the file into an unverified one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tandem/tensor/io/file_io.h"
#include "tandem/tensor/tensor.h"

namespace tandem {

// ---- safetensors ----

// The safetensors name of a dtype ("F32", "BF16", "BOOL", ...) and back.
// safetensors_dtype throws for a name tandem has no dtype for (U8, I8, F8_E4M3,
// ...) or that safetensors does not define, naming it and the supported set.
const char* safetensors_dtype_name(DType dtype);
DType safetensors_dtype(const std::string& name);

// The tensors of a file (CPU, contiguous, each with its own storage) in the
// order of the header's JSON object, which for files tandem writes is the order
// they were given to save_safetensors; the metadata without "tandem.crc32c".
class SafetensorsFile {
 public:
  SafetensorsFile() = default;
  SafetensorsFile(std::vector<std::pair<std::string, Tensor>> tensors,
                  std::map<std::string, std::string> metadata, bool checksum_verified);

  const std::vector<std::pair<std::string, Tensor>>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  size_t size() const { return tensors_.size(); }
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  // Throws, listing a few names the file does have, when `name` is absent.
  const Tensor& at(const std::string& name) const;
  // True when the file carried a tandem checksum (Note [Safetensors checksum]),
  // which then matched; false for files of other writers.
  bool checksum_verified() const { return checksum_verified_; }

 private:
  std::vector<std::pair<std::string, Tensor>> tensors_;
  std::map<std::string, std::string> metadata_;
  std::unordered_map<std::string, size_t> index_;
  bool checksum_verified_ = false;
};

// Writes `tensors` (any device, any strides: copied to the host contiguous one
// at a time; synchronises) with `metadata` and the checksum, atomically
// (write_file_atomically). Names must be unique and not "__metadata__"; the
// metadata key "tandem.crc32c" is reserved. The data section holds the tensors
// in order of decreasing element size (stable), the header is padded with
// spaces to a multiple of 8 bytes, so every tensor starts at a file offset that
// is a multiple of its element size, as in the reference writer.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {});

// The same bytes save_safetensors writes, in memory (tests, fuzz seeds).
std::vector<uint8_t> serialize_safetensors(
    const std::vector<std::pair<std::string, Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata = {});

// Reads and validates a whole file: header length at most 100 MB and within the
// file, a UTF-8 JSON object whose entries have exactly the fields above with
// the right types, known dtypes, at most kMaxDims non-negative extents whose
// byte size does not overflow and equals end - begin, offsets that tile the
// data section exactly, no duplicate keys, string metadata, BOOL bytes 0 or 1,
// and the checksum when present. Every failure is a tandem::Error naming the
// file, the tensor and what was expected and found.
SafetensorsFile load_safetensors(const std::string& path);

// The same on a buffer; `source` names it in errors. Never reads outside
// [data, data + size).
SafetensorsFile parse_safetensors(const uint8_t* data, size_t size,
                                  const std::string& source = "<memory>");

// The canonical description the checksum covers (Note [Safetensors checksum]).
struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // safetensors name
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // relative to the data section
};
// `entries` sorted by (begin, end, name); `metadata` without the checksum key.
std::vector<uint8_t> safetensors_canonical_table(
    const std::vector<SafetensorsEntry>& entries,
    const std::map<std::string, std::string>& metadata);

}  // namespace tandem
