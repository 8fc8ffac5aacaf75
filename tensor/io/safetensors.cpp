// safetensors reader and writer (tensor/io/safetensors.h). Validation follows the reference Rust
// implementation and adds what it leaves to serde (exact fields, duplicate keys) plus the checksum
// of Note [Safetensors checksum].
#include "tandem/tensor/io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <limits>
#include <optional>
#include <system_error>
#include <tuple>

#include <nlohmann/json.hpp>

#include "tandem/tensor/ops.h"

// The data section is little-endian and read by memcpy into tensors.
static_assert(std::endian::native == std::endian::little,
              "tandem's safetensors code assumes a little-endian host");

namespace tandem {
namespace {

using Json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // as the reference implementation
constexpr const char* kChecksumKey = "tandem.crc32c";
constexpr const char* kMetadataKey = "__metadata__";

}  // namespace

// ---- dtypes ----

namespace {

struct DTypeName {
  DType dtype;
  const char* name;
};
constexpr DTypeName kDTypeNames[] = {
    {DType::F32, "F32"}, {DType::F64, "F64"}, {DType::BF16, "BF16"}, {DType::F16, "F16"},
    {DType::I32, "I32"}, {DType::I64, "I64"}, {DType::Bool, "BOOL"},
};
static_assert(std::size(kDTypeNames) == kDTypeCount, "one safetensors name per DType");
// safetensors dtypes tandem has no dtype for (so their error says "unsupported",
// not "unknown").
constexpr const char* kForeignDTypes[] = {"U8",      "I8",      "U16",     "I16",        "U32",
                                          "U64",     "F8_E4M3", "F8_E5M2", "F8_E8M0",    "F6_E2M3",
                                          "F6_E3M2", "F4",      "C64",     "F8_E4M3FNUZ"};

std::optional<DType> lookup_dtype(const std::string& name) {
  for (const auto& d : kDTypeNames) {
    if (name == d.name) return d.dtype;
  }
  return std::nullopt;
}

std::string dtype_error(const std::string& name) {
  bool foreign = std::find_if(std::begin(kForeignDTypes), std::end(kForeignDTypes),
                              [&](const char* f) { return name == f; }) != std::end(kForeignDTypes);
  return fmt::format(
      "expected one of the dtypes tandem supports (F32, F64, F16, BF16, I64, I32, BOOL), got {} "
      "'{}'",
      foreign ? "the safetensors dtype tandem has no dtype for" : "the unknown dtype", name);
}

}  // namespace

const char* safetensors_dtype_name(DType dtype) {
  for (const auto& d : kDTypeNames) {
    if (d.dtype == dtype) return d.name;
  }
  TANDEM_FAIL("[tensor::safetensors] expected a valid dtype, got {}", static_cast<int>(dtype));
}

DType safetensors_dtype(const std::string& name) {
  std::optional<DType> d = lookup_dtype(name);
  TANDEM_CHECK(d.has_value(), "[tensor::safetensors] {}", dtype_error(name));
  return *d;
}

// ---- SafetensorsFile ----

SafetensorsFile::SafetensorsFile(std::vector<std::pair<std::string, Tensor>> tensors,
                                 std::map<std::string, std::string> metadata,
                                 bool checksum_verified)
    : tensors_(std::move(tensors)),
      metadata_(std::move(metadata)),
      checksum_verified_(checksum_verified) {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    bool inserted = index_.emplace(tensors_[i].first, i).second;
    TANDEM_CHECK(inserted, "[tensor::SafetensorsFile] expected unique tensor names, got '{}' twice",
                 tensors_[i].first);
  }
}

const Tensor& SafetensorsFile::at(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    std::string some;
    for (size_t i = 0; i < tensors_.size() && i < 8; ++i)
      some += fmt::format("{}'{}'", i ? ", " : "", tensors_[i].first);
    if (tensors_.size() > 8) some += ", ...";
    TANDEM_FAIL(
        "[tensor::SafetensorsFile::at] expected one of the {} tensors of the file ({}), got '{}'",
        tensors_.size(), some, name);
  }
  return tensors_[it->second].second;
}

// ---- the checksum's canonical table ----

namespace {
void put_u64(std::vector<uint8_t>& out, uint64_t v) {
  for (int i = 0; i < 8; ++i)
    out.push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_string(std::vector<uint8_t>& out, const std::string& s) {
  put_u64(out, s.size());
  out.insert(out.end(), s.begin(), s.end());
}
}  // namespace

std::vector<uint8_t> safetensors_canonical_table(
    const std::vector<SafetensorsEntry>& entries,
    const std::map<std::string, std::string>& metadata) {
  std::vector<uint8_t> out;
  put_u64(out, entries.size());
  for (const SafetensorsEntry& e : entries) {
    put_string(out, e.name);
    put_string(out, e.dtype);
    put_u64(out, e.shape.size());
    for (int64_t extent : e.shape)
      put_u64(out, static_cast<uint64_t>(extent));
    put_u64(out, e.begin);
    put_u64(out, e.end);
  }
  put_u64(out, metadata.size());
  for (const auto& [key, value] : metadata) {
    put_string(out, key);
    put_string(out, value);
  }
  return out;
}

// ---- reading ----

namespace {

bool entry_less(const SafetensorsEntry& a, const SafetensorsEntry& b) {
  return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
}

// What a header says, validated against the size of the whole file.
struct Layout {
  std::vector<SafetensorsEntry> entries;  // header order
  std::vector<DType> dtypes;              // per entry
  std::map<std::string, std::string> metadata;
  std::optional<uint32_t> stored_crc;
  uint64_t data_start = 0;  // 8 + header length
};

// The JSON, with duplicate keys at any level rejected (nlohmann keeps the last
// one silently) and the top-level keys in file order.
Json parse_json(const char* text, size_t size, const std::string& source,
                std::vector<std::string>& top_keys) {
  // One frame per open object (its keys) or array (nullopt).
  std::vector<std::optional<std::vector<std::string>>> frames;
  auto callback = [&](int /*depth*/, nlohmann::json::parse_event_t event, Json& parsed) {
    using E = nlohmann::json::parse_event_t;
    switch (event) {
      case E::object_start:
      case E::array_start:
        // {name: {"shape": [..]}} is three levels; anything deeper is malformed,
        // and stopping early bounds the work on hostile input.
        TANDEM_CHECK(frames.size() < 3,
                     "[tensor::load_safetensors] {}: expected at most 3 levels of JSON nesting "
                     "(object of objects of arrays), got deeper",
                     source);
        if (event == E::object_start) {
          frames.emplace_back(std::vector<std::string>{});
        } else {
          frames.emplace_back(std::nullopt);
        }
        break;
      case E::object_end:
      case E::array_end:
        if (!frames.empty()) {
          if (frames.back().has_value()) {  // the top level is checked below, naming the tensor
            std::vector<std::string>& keys = *frames.back();
            std::sort(keys.begin(), keys.end());
            auto dup = std::adjacent_find(keys.begin(), keys.end());
            TANDEM_CHECK(dup == keys.end(),
                         "[tensor::load_safetensors] {}: expected unique JSON keys, got '{}' twice",
                         source, *dup);
          }
          frames.pop_back();
        }
        break;
      case E::key: {
        TANDEM_INTERNAL_ASSERT(!frames.empty() && frames.back().has_value(),
                               "key outside an object");
        const std::string& key = parsed.get_ref<const std::string&>();
        (frames.size() == 1 ? top_keys : *frames.back()).push_back(key);
        break;
      }
      case E::value:
        break;
    }
    return true;
  };
  Json json;
  try {
    json = Json::parse(text, text + size, callback);
  } catch (const nlohmann::json::exception& e) {
    TANDEM_FAIL("[tensor::load_safetensors] {}: expected a JSON header, got invalid JSON ({})",
                source, e.what());
  }
  std::vector<std::string> sorted = top_keys;
  std::sort(sorted.begin(), sorted.end());
  auto dup = std::adjacent_find(sorted.begin(), sorted.end());
  TANDEM_CHECK(dup == sorted.end(),
               "[tensor::load_safetensors] {}: expected unique tensor names, got '{}' twice",
               source, dup == sorted.end() ? "" : *dup);
  return json;
}

// A non-negative JSON integer that fits int64_t.
uint64_t json_size(const Json& v, const std::string& source, const std::string& name,
                   const char* field) {
  TANDEM_CHECK(!v.is_number_integer() || v.is_number_unsigned(),
               "[tensor::load_safetensors] {}: tensor '{}': expected non-negative integers in "
               "\"{}\", got {}",
               source, name, field, v.dump());
  TANDEM_CHECK(v.is_number_unsigned(),
               "[tensor::load_safetensors] {}: tensor '{}': expected integers in \"{}\", got {} {}",
               source, name, field, v.type_name(), v.dump());
  uint64_t u = v.get<uint64_t>();
  TANDEM_CHECK(u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
               "[tensor::load_safetensors] {}: tensor '{}': expected \"{}\" values below 2^63, got "
               "{}",
               source, name, field, u);
  return u;
}

// An entry is an object with exactly the fields "dtype", "shape" and
// "data_offsets".
void check_entry_fields(const std::string& name, const Json& v, const std::string& source) {
  TANDEM_CHECK(v.is_object(),
               "[tensor::load_safetensors] {}: tensor '{}': expected an object with \"dtype\", "
               "\"shape\" and \"data_offsets\", got {}",
               source, name, v.type_name());
  for (const auto& [key, unused] : v.items()) {
    TANDEM_CHECK(key == "dtype" || key == "shape" || key == "data_offsets",
                 "[tensor::load_safetensors] {}: tensor '{}': expected only the fields \"dtype\", "
                 "\"shape\" and \"data_offsets\", got \"{}\"",
                 source, name, key);
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    TANDEM_CHECK(v.contains(field),
                 "[tensor::load_safetensors] {}: tensor '{}': expected the field \"{}\", got an "
                 "entry without it",
                 source, name, field);
  }
}

// The "dtype" of entry e, stored in e.dtype; returns tandem's dtype for it.
DType parse_entry_dtype(const Json& jdtype, const std::string& source, SafetensorsEntry& e) {
  const std::string& name = e.name;
  TANDEM_CHECK(jdtype.is_string(),
               "[tensor::load_safetensors] {}: tensor '{}': expected \"dtype\" to be a string, got "
               "{}",
               source, name, jdtype.type_name());
  e.dtype = jdtype.get<std::string>();
  std::optional<DType> d = lookup_dtype(e.dtype);
  TANDEM_CHECK(d.has_value(), "[tensor::load_safetensors] {}: tensor '{}': {}", source, name,
               dtype_error(e.dtype));
  return *d;
}

// The "shape" of entry e, stored in e.shape; returns its element count.
uint64_t parse_entry_shape(const Json& jshape, const std::string& source, SafetensorsEntry& e) {
  const std::string& name = e.name;
  TANDEM_CHECK(jshape.is_array(),
               "[tensor::load_safetensors] {}: tensor '{}': expected \"shape\" to be an array, got "
               "{}",
               source, name, jshape.type_name());
  TANDEM_CHECK(jshape.size() <= static_cast<size_t>(kMaxDims),
               "[tensor::load_safetensors] {}: tensor '{}': expected at most {} dims, got {}",
               source, name, kMaxDims, jshape.size());
  // Elements: the product of the non-zero extents must fit int64_t, so no
  // product of any subset of the extents (numel, strides) overflows later.
  uint64_t nonzero_product = 1;
  bool has_zero = false;
  for (const Json& x : jshape) {
    uint64_t extent = json_size(x, source, name, "shape");
    e.shape.push_back(static_cast<int64_t>(extent));
    if (extent == 0) {
      has_zero = true;
      continue;
    }
    bool overflow = __builtin_mul_overflow(nonzero_product, extent, &nonzero_product);
    TANDEM_CHECK(
        !overflow && nonzero_product <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()),
        "[tensor::load_safetensors] {}: tensor '{}': expected a shape whose element "
        "count fits 64 bits, got {} (overflows)",
        source, name, jshape.dump());
  }
  return has_zero ? 0 : nonzero_product;
}

// The "data_offsets" [begin, end] of entry e, stored in e.begin and e.end.
void parse_data_offsets(const Json& joff, const std::string& source, SafetensorsEntry& e) {
  const std::string& name = e.name;
  TANDEM_CHECK(joff.is_array() && joff.size() == 2,
               "[tensor::load_safetensors] {}: tensor '{}': expected \"data_offsets\" to be an "
               "array [begin, end], got {}",
               source, name, joff.is_array() ? joff.dump() : joff.type_name());
  e.begin = json_size(joff[0], source, name, "data_offsets");
  e.end = json_size(joff[1], source, name, "data_offsets");
  TANDEM_CHECK(e.begin <= e.end,
               "[tensor::load_safetensors] {}: tensor '{}': expected data_offsets begin <= end, "
               "got [{}, {}]",
               source, name, e.begin, e.end);
}

SafetensorsEntry parse_entry(const std::string& name, const Json& v, const std::string& source,
                             DType& dtype) {
  check_entry_fields(name, v, source);
  SafetensorsEntry e;
  e.name = name;
  dtype = parse_entry_dtype(v["dtype"], source, e);
  const Json& jshape = v["shape"];
  const uint64_t numel = parse_entry_shape(jshape, source, e);
  uint64_t nbytes = 0;
  TANDEM_CHECK(!__builtin_mul_overflow(numel, dtype_size(dtype), &nbytes),
               "[tensor::load_safetensors] {}: tensor '{}': expected a byte size that fits 64 "
               "bits, got {} elements of {}",
               source, name, numel, e.dtype);
  parse_data_offsets(v["data_offsets"], source, e);
  TANDEM_CHECK(e.end - e.begin == nbytes,
               "[tensor::load_safetensors] {}: tensor '{}': expected data_offsets to span {} bytes "
               "({} elements of shape {} x {} bytes), got [{}, {}] ({} bytes)",
               source, name, nbytes, numel, jshape.dump(), dtype_size(dtype), e.begin, e.end,
               e.end - e.begin);
  return e;
}

void parse_metadata(const Json& v, const std::string& source, Layout& layout) {
  if (v.is_null()) return;  // the reference implementation writes null for "no metadata"
  TANDEM_CHECK(v.is_object(),
               "[tensor::load_safetensors] {}: expected \"__metadata__\" to be an object of "
               "strings, got {}",
               source, v.type_name());
  for (const auto& [key, value] : v.items()) {
    TANDEM_CHECK(value.is_string(),
                 "[tensor::load_safetensors] {}: expected \"__metadata__\" values to be strings, "
                 "got {} for key '{}'",
                 source, value.type_name(), key);
    const std::string& s = value.get_ref<const std::string&>();
    if (key != kChecksumKey) {
      layout.metadata.emplace(key, s);
      continue;
    }
    bool hex = s.size() == 8 && std::all_of(s.begin(), s.end(), [](char c) {
                 return std::isxdigit(static_cast<unsigned char>(c)) != 0;
               });
    TANDEM_CHECK(hex,
                 "[tensor::load_safetensors] {}: expected \"{}\" to be 8 hex digits, got '{}' "
                 "(the file is corrupt)",
                 source, kChecksumKey, s);
    layout.stored_crc = static_cast<uint32_t>(std::stoul(s, nullptr, 16));
  }
}

// The header length in the first 8 bytes of a file of `file_size` bytes.
uint64_t decode_header_length(const uint8_t* length_bytes, uint64_t file_size,
                              const std::string& source) {
  TANDEM_CHECK(file_size >= 8,
               "[tensor::load_safetensors] {}: expected at least 8 bytes (the header length), got "
               "{} (the file is truncated)",
               source, file_size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | length_bytes[i];
  TANDEM_CHECK(
      n <= kMaxHeaderBytes,
      "[tensor::load_safetensors] {}: expected a header length of at most {} bytes, got {}", source,
      kMaxHeaderBytes, n);
  TANDEM_CHECK(n <= file_size - 8,
               "[tensor::load_safetensors] {}: expected a header length within the file ({} bytes "
               "after the length), got {} (the file is truncated or not safetensors)",
               source, file_size - 8, n);
  return n;
}

// The n bytes of the header, through `read_header`, checked to be text that
// can hold a JSON object.
std::string read_header_text(uint64_t n, const std::function<std::string(uint64_t)>& read_header,
                             const std::string& source) {
  std::string text = read_header(n);
  TANDEM_CHECK(!text.empty() && text[0] == '{',
               "[tensor::load_safetensors] {}: expected the header to start with '{{', got {}",
               source,
               text.empty() ? std::string("an empty header")
                            : fmt::format("byte 0x{:02x}", static_cast<uint8_t>(text[0])));

  // JSON never holds a raw NUL, and nlohmann would take one for the end of the
  // input, accepting whatever follows it.
  size_t nul = text.find('\0');
  TANDEM_CHECK(nul == std::string::npos,
               "[tensor::load_safetensors] {}: expected a JSON header without NUL bytes, got one "
               "at header byte {}",
               source, nul);
  return text;
}

// The tensors must tile the data section: sorted by offset, each begins where
// the previous ended, and the last ends at the end of the file.
void check_tiling(const Layout& layout, uint64_t file_size, const std::string& source) {
  std::vector<const SafetensorsEntry*> sorted;
  for (const SafetensorsEntry& e : layout.entries)
    sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
    return entry_less(*a, *b);
  });
  uint64_t expected = 0;
  const SafetensorsEntry* prev = nullptr;
  for (const SafetensorsEntry* e : sorted) {
    TANDEM_CHECK(e->begin >= expected,
                 "[tensor::load_safetensors] {}: tensor '{}': expected data_offsets to begin at {} "
                 "(where '{}' ends), got [{}, {}] (the tensors overlap)",
                 source, e->name, expected, prev ? prev->name : "", e->begin, e->end);
    TANDEM_CHECK(e->begin == expected,
                 "[tensor::load_safetensors] {}: tensor '{}': expected data_offsets to begin at {} "
                 "({}), got [{}, {}] (a hole in the data section)",
                 source, e->name, expected,
                 prev ? fmt::format("where '{}' ends", prev->name) : "the first tensor", e->begin,
                 e->end);
    expected = e->end;
    prev = e;
  }
  uint64_t data_size = file_size - layout.data_start;
  TANDEM_CHECK(expected <= data_size,
               "[tensor::load_safetensors] {}: expected a data section of {} bytes (the tensors' "
               "data_offsets), got {} (the file is truncated)",
               source, expected, data_size);
  TANDEM_CHECK(expected == data_size,
               "[tensor::load_safetensors] {}: expected a data section of {} bytes (the tensors' "
               "data_offsets), got {} ({} bytes no tensor covers at the end)",
               source, expected, data_size, data_size - expected);
}

// Validates the header at `bytes` (the first min(size, 8 + header length)
// bytes of a file of `file_size` bytes); `read_header` fetches the header.
Layout parse_layout(const uint8_t* length_bytes, uint64_t file_size,
                    const std::function<std::string(uint64_t)>& read_header,
                    const std::string& source) {
  const uint64_t n = decode_header_length(length_bytes, file_size, source);
  std::string text = read_header_text(n, read_header, source);

  Layout layout;
  layout.data_start = 8 + n;
  std::vector<std::string> top_keys;
  Json json = parse_json(text.data(), text.size(), source, top_keys);
  TANDEM_CHECK(json.is_object(), "[tensor::load_safetensors] {}: expected a JSON object, got {}",
               source, json.type_name());
  for (const std::string& key : top_keys) {
    const Json& v = json[key];
    if (key == kMetadataKey) {
      parse_metadata(v, source, layout);
    } else {
      DType dtype = DType::F32;
      layout.entries.push_back(parse_entry(key, v, source, dtype));
      layout.dtypes.push_back(dtype);
    }
  }
  check_tiling(layout, file_size, source);
  return layout;
}

// Builds the tensors: `read_data(offset, dst, n)` copies bytes of the data
// section (offsets relative to it, all within it).
SafetensorsFile load_layout(const Layout& layout,
                            const std::function<void(uint64_t, void*, size_t)>& read_data,
                            const std::string& source) {
  std::vector<size_t> order(layout.entries.size());
  for (size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return entry_less(layout.entries[a], layout.entries[b]); });
  uint32_t crc = 0;
  if (layout.stored_crc) {
    std::vector<SafetensorsEntry> sorted;
    for (size_t i : order)
      sorted.push_back(layout.entries[i]);
    std::vector<uint8_t> table = safetensors_canonical_table(sorted, layout.metadata);
    crc = crc32c(table.data(), table.size());
  }
  std::vector<Tensor> tensors(layout.entries.size());
  for (size_t i : order) {  // file order: the checksum runs over the data section
    const SafetensorsEntry& e = layout.entries[i];
    Tensor t = empty(Shape(e.shape), layout.dtypes[i], Device::cpu());
    size_t nbytes = static_cast<size_t>(e.end - e.begin);
    if (nbytes > 0) {
      read_data(e.begin, t.raw_data(), nbytes);
      if (layout.stored_crc) crc = crc32c(t.raw_data(), nbytes, crc);
    }
    tensors[i] = std::move(t);
  }
  if (layout.stored_crc) {
    TANDEM_CHECK(crc == *layout.stored_crc,
                 "[tensor::load_safetensors] {}: checksum mismatch: the file is corrupt (stored "
                 "{:08x}, computed {:08x})",
                 source, *layout.stored_crc, crc);
  }
  // A byte other than 0 or 1 read as a C++ bool is undefined behaviour.
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (layout.dtypes[i] != DType::Bool) continue;
    const auto* p = static_cast<const uint8_t*>(tensors[i].raw_data());
    const size_t n = static_cast<size_t>(tensors[i].numel());
    const uint8_t* bad = std::find_if(p, p + n, [](uint8_t b) { return b > 1; });
    TANDEM_CHECK(bad == p + n,
                 "[tensor::load_safetensors] {}: tensor '{}': expected BOOL bytes 0 or 1, got "
                 "0x{:02x} at element {}",
                 source, layout.entries[i].name, *bad, bad - p);
  }
  std::vector<std::pair<std::string, Tensor>> named;
  named.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i)
    named.emplace_back(layout.entries[i].name, std::move(tensors[i]));
  return SafetensorsFile(std::move(named), layout.metadata, layout.stored_crc.has_value());
}

}  // namespace

SafetensorsFile parse_safetensors(const uint8_t* data, size_t size, const std::string& source) {
  Layout layout = parse_layout(
      data, size,
      [&](uint64_t n) { return std::string(reinterpret_cast<const char*>(data) + 8, n); }, source);
  const uint8_t* section = data + layout.data_start;
  return load_layout(
      layout, [&](uint64_t offset, void* dst, size_t n) { std::memcpy(dst, section + offset, n); },
      source);
}

SafetensorsFile load_safetensors(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  TANDEM_CHECK(fd.get() >= 0, "[tensor::load_safetensors] expected to open {}, got {}", path,
               errno_text(errno));
  struct stat st {};
  TANDEM_CHECK(::fstat(fd.get(), &st) == 0,
               "[tensor::load_safetensors] expected to stat {}, got {}", path, errno_text(errno));
  TANDEM_CHECK(S_ISREG(st.st_mode), "[tensor::load_safetensors] expected {} to be a regular file",
               path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  uint8_t length[8] = {};
  if (size >= 8) pread_exact(fd.get(), path, 0, length, 8);
  Layout layout = parse_layout(
      length, size,
      [&](uint64_t n) {
        std::string text(n, '\0');
        pread_exact(fd.get(), path, 8, text.data(), n);
        return text;
      },
      path);
  return load_layout(
      layout,
      [&](uint64_t offset, void* dst, size_t n) {
        pread_exact(fd.get(), path, layout.data_start + offset, dst, n);
      },
      path);
}

// ---- writing ----

namespace {

// The bytes of serialize_safetensors.
class VectorSink {
 public:
  void write(const void* data, size_t nbytes) {
    const auto* p = static_cast<const uint8_t*>(data);
    bytes.insert(bytes.end(), p, p + nbytes);
  }
  void write_at(uint64_t offset, const void* data, size_t nbytes) {
    std::memcpy(bytes.data() + offset, data, nbytes);
  }
  std::vector<uint8_t> bytes;
};

// Names unique and other than the metadata key, tensors defined, and no
// checksum key in the caller's metadata.
void check_save_inputs(const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::unordered_map<std::string, size_t> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, t] = tensors[i];
    TANDEM_CHECK(name != kMetadataKey,
                 "[tensor::save_safetensors] expected tensor names other than \"{}\" (reserved), "
                 "got it for tensor {}",
                 kMetadataKey, i);
    auto [it, inserted] = seen.emplace(name, i);
    TANDEM_CHECK(inserted,
                 "[tensor::save_safetensors] expected unique tensor names, got '{}' at positions "
                 "{} and {}",
                 name, it->second, i);
    TANDEM_CHECK(t.defined(),
                 "[tensor::save_safetensors] expected defined tensors, got an empty "
                 "handle for '{}'",
                 name);
  }
  TANDEM_CHECK(metadata.count(kChecksumKey) == 0,
               "[tensor::save_safetensors] expected metadata without the reserved key \"{}\" "
               "(tandem writes it), got it",
               kChecksumKey);
}

// Data order: decreasing element size, so every tensor is aligned to its own.
std::vector<size_t> order_by_alignment(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return tensors[a].second.element_size() > tensors[b].second.element_size();
  });
  return order;
}

// The entries in the caller's order, their data laid out in `order`.
std::vector<SafetensorsEntry> plan_entries(
    const std::vector<std::pair<std::string, Tensor>>& tensors, const std::vector<size_t>& order) {
  std::vector<SafetensorsEntry> entries(tensors.size());
  uint64_t offset = 0;
  for (size_t i : order) {
    const Tensor& t = tensors[i].second;
    SafetensorsEntry& e = entries[i];
    e.name = tensors[i].first;
    e.dtype = safetensors_dtype_name(t.dtype());
    e.shape = t.shape().vec();
    e.begin = offset;
    e.end = offset + t.nbytes();
    offset = e.end;
  }
  return entries;
}

// The header up to the checksum's digits.
std::string format_checksum_prefix() {
  return fmt::format("{{\"{}\":{{\"{}\":\"", kMetadataKey, kChecksumKey);
}

// The header's JSON text, padded to a multiple of 8 bytes, with a placeholder
// for the checksum right after format_checksum_prefix().
std::string format_header(const std::vector<SafetensorsEntry>& entries,
                          const std::map<std::string, std::string>& metadata) {
  // Header: metadata first with the checksum first, so the placeholder sits at
  // a known position; then the tensors in the caller's order.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  auto& meta = header[kMetadataKey] = nlohmann::ordered_json::object();
  meta[kChecksumKey] = "00000000";
  for (const auto& [key, value] : metadata)
    meta[key] = value;
  for (const SafetensorsEntry& e : entries) {
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& ex) {
    TANDEM_FAIL("[tensor::save_safetensors] expected tensor names and metadata in UTF-8, got {}",
                ex.what());
  }
  const std::string prefix = format_checksum_prefix();
  TANDEM_INTERNAL_ASSERT(text.compare(0, prefix.size(), prefix) == 0, "header starts with {}",
                         prefix);
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

// Writes the file to `sink` (FileWriter or VectorSink). Note [Safetensors checksum]:
// the checksum precedes the data it covers, so the header is written with a
// placeholder, the data streamed through the CRC one tensor at a time (no
// second host copy of the model), and the eight digits patched in at the end.
template <class Sink>
void write_safetensors(Sink& sink, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  check_save_inputs(tensors, metadata);
  const std::vector<size_t> order = order_by_alignment(tensors);
  const std::vector<SafetensorsEntry> entries = plan_entries(tensors, order);
  const std::string text = format_header(entries, metadata);
  uint8_t length[8];
  for (int i = 0; i < 8; ++i)
    length[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  sink.write(length, 8);
  sink.write(text.data(), text.size());

  std::vector<SafetensorsEntry> sorted = entries;
  std::sort(sorted.begin(), sorted.end(), entry_less);
  std::vector<uint8_t> table = safetensors_canonical_table(sorted, metadata);
  uint32_t crc = crc32c(table.data(), table.size());
  for (size_t i : order) {
    const Tensor& t = tensors[i].second;
    if (t.numel() == 0) continue;
    Tensor host = ops::contiguous(t.device().is_cpu() ? t : ops::to(t, Device::cpu()));
    current_stream(Device::cpu()).synchronize();
    sink.write(host.raw_data(), host.nbytes());
    crc = crc32c(host.raw_data(), host.nbytes(), crc);
  }
  std::string digits = fmt::format("{:08x}", crc);
  sink.write_at(8 + format_checksum_prefix().size(), digits.data(), digits.size());
}

}  // namespace

std::vector<uint8_t> serialize_safetensors(
    const std::vector<std::pair<std::string, Tensor>>& tensors,
    const std::map<std::string, std::string>& metadata) {
  VectorSink sink;
  write_safetensors(sink, tensors, metadata);
  return std::move(sink.bytes);
}

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  write_file_atomically(path, [&](FileWriter& out) { write_safetensors(out, tensors, metadata); });
}

}  // namespace tandem
