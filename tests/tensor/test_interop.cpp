// Interop (issue 8): safetensors files (tensor/io/safetensors.h) and DLPack
// (tensor/io/dlpack.h).
//
// The oracles are independent of the code under test: files assembled here
// byte by byte (a hand-written JSON header plus little-endian raw bytes) must
// load with the right values, and the bytes tandem writes are taken apart
// here with nlohmann and raw reads. CRC-32C is checked against the published
// check values; every malformed input must raise tandem::Error with a message
// that says what was wrong.
#include <unistd.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cctype>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/ranges.h>

#include "tandem/runtime/error.h"
#include "tandem/tensor/io/dlpack.h"
#include "tandem/tensor/io/safetensors.h"
#include "tandem/tensor/ops.h"
#include "tests/support/skip_cuda.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace fs = std::filesystem;

namespace {

const DType kAllDTypes[] = {DType::F32, DType::F64, DType::BF16, DType::F16,
                            DType::I32, DType::I64, DType::Bool};
static_assert(std::size(kAllDTypes) == kDTypeCount, "every DType");

using Bytes = std::vector<uint8_t>;

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}
void write_file(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

// The raw bytes of a tensor's elements in row-major order (bitwise compare, NaN-safe).
Bytes bytes_of(const Tensor& t) {
  Tensor c = ops::contiguous(t);
  current_stream(Device::cpu()).synchronize();
  const auto* p = static_cast<const uint8_t*>(c.raw_data());
  return Bytes(p, p + c.nbytes());
}

// Little-endian bytes of integers of `width` bytes.
Bytes le(const std::vector<uint64_t>& values, int width) {
  Bytes out;
  for (uint64_t v : values) {
    for (int i = 0; i < width; ++i)
      out.push_back(static_cast<uint8_t>(v >> (8 * i)));
  }
  return out;
}
Bytes le_f32(const std::vector<float>& values) {
  std::vector<uint64_t> bits;
  for (float f : values) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits.push_back(u);
  }
  return le(bits, 4);
}

// An independent writer: 8-byte little-endian length, the header as given, the data.
Bytes assemble(const std::string& header, const Bytes& data = {}) {
  Bytes out = le({header.size()}, 8);
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

void require_parse_error(const Bytes& file, const std::string& expected) {
  CAPTURE(std::string(file.begin(), file.end()));
  REQUIRE_THROWS_AS(parse_safetensors(file.data(), file.size()), Error);
  REQUIRE_THROWS_WITH(parse_safetensors(file.data(), file.size()), Contains(expected));
}

// `"name":body`, and a JSON object of such entries.
std::string entry(const std::string& name, const std::string& body) {
  return fmt::format("\"{}\":{}", name, body);
}
std::string object(const std::vector<std::string>& entries) {
  return fmt::format("{{{}}}", fmt::join(entries, ","));
}
// One f32 tensor of two elements, as other frameworks write it.
const std::string kX = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";

}  // namespace

// ---- CRC-32C ----

TEST_CASE("crc32c matches the published check values on both paths", "[interop][crc32c]") {
  const std::string digits = "123456789";
  REQUIRE(crc32c(digits.data(), digits.size()) == 0xE3069283u);
  REQUIRE(detail::crc32c_portable(digits.data(), digits.size(), 0) == 0xE3069283u);
  REQUIRE(crc32c(nullptr, 0) == 0u);
  // RFC 3720 (iSCSI) B.4: 32 bytes of zeros, of ones, ascending.
  Bytes zeros(32, 0), ones(32, 0xff), ascending(32);
  for (int i = 0; i < 32; ++i)
    ascending[i] = static_cast<uint8_t>(i);
  REQUIRE(crc32c(zeros.data(), 32) == 0x8A9136AAu);
  REQUIRE(crc32c(ones.data(), 32) == 0x62A8AB43u);
  REQUIRE(crc32c(ascending.data(), 32) == 0x46DD794Eu);

  // Every length and alignment: the fast path equals the table, and a CRC
  // extends over a split buffer.
  std::mt19937 gen(7);
  Bytes data(300);
  for (uint8_t& b : data)
    b = static_cast<uint8_t>(gen());
  for (size_t start = 0; start < 9; ++start) {
    for (size_t n = 0; start + n <= data.size(); n += 7) {
      uint32_t fast = crc32c(data.data() + start, n);
      REQUIRE(fast == detail::crc32c_portable(data.data() + start, n, 0));
      size_t half = n / 3;
      REQUIRE(crc32c(data.data() + start + half, n - half, crc32c(data.data() + start, half)) ==
              fast);
    }
  }
}

// ---- safetensors: round trips ----

TEST_CASE("safetensors round trip of every dtype, 0-dim and empty tensors",
          "[interop][safetensors]") {
  TempDir dir("interop");
  std::vector<std::pair<std::string, Tensor>> tensors;
  uint32_t seed = 1;
  for (DType dtype : kAllDTypes) {
    for (const Shape& shape : {Shape{}, Shape{0}, Shape{3, 0, 2}, Shape{5}, Shape{2, 3, 4}}) {
      std::string name = fmt::format("{}/{}", dtype_name(dtype), shape);
      tensors.emplace_back(name, random_tensor(shape, dtype, seed++, -100, 100));
    }
  }
  std::map<std::string, std::string> metadata = {{"format", "pt"},
                                                 {"empty", ""},
                                                 {"unicode", "h\xc3\xa9llo \xe2\x9c\x93"},
                                                 {"quote", "a\"b\\c\n"}};
  const std::string path = dir.file("model.safetensors");
  save_safetensors(path, tensors, metadata);

  SafetensorsFile file = load_safetensors(path);
  REQUIRE(file.checksum_verified());
  REQUIRE(file.metadata() == metadata);
  REQUIRE(file.size() == tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, expected] = tensors[i];
    CAPTURE(name);
    REQUIRE(file.tensors()[i].first == name);  // the caller's order survives
    const Tensor& got = file.at(name);
    REQUIRE(got.dtype() == expected.dtype());
    REQUIRE(got.shape() == expected.shape());
    // (Not is_contiguous(): it says false for some empty shapes such as [3, 0, 2].)
    REQUIRE(got.strides() == contiguous_strides(got.shape()));
    REQUIRE(bytes_of(got) == bytes_of(expected));
  }
  // The in-memory form is the same bytes.
  REQUIRE(serialize_safetensors(tensors, metadata) == read_file(path));
  REQUIRE(dir.entries() == std::vector<std::string>{"model.safetensors"});
}

TEST_CASE("safetensors saves non-contiguous views by value", "[interop][safetensors]") {
  Tensor base = iota_tensor({4, 6}, DType::F32);
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"transposed", ops::transpose(base, 0, 1)},
      {"narrowed", ops::narrow(base, 1, 2, 3)},
      {"selected", ops::select(base, 0, 2)},
      {"expanded", ops::expand(ops::narrow(base, 0, 1, 1), {3, 6})},
      {"stepped", ops::slice(base, 1, 0, 6, 2)},
  };
  Bytes bytes = serialize_safetensors(tensors);
  SafetensorsFile file = parse_safetensors(bytes.data(), bytes.size());
  for (const auto& [name, view] : tensors) {
    CAPTURE(name);
    REQUIRE(file.at(name).shape() == view.shape());
    REQUIRE(values_of(file.at(name)) == values_of(view));
  }
}

TEST_CASE("a safetensors file assembled by hand loads with the right values",
          "[interop][safetensors]") {
  // Deliberately not tandem's layout: header keys out of data order, metadata
  // last, no checksum, no padding.
  Bytes data = le_f32({1.5f, -2.0f});                        // a: [0, 8)
  Bytes b = le({7, static_cast<uint64_t>(-9)}, 8);           // b: [8, 24)
  Bytes h = le({0x3FC0, 0xC000}, 2);                         // h (bf16 1.5, -2): [24, 28)
  Bytes f = le({0x3E00, 0xBC00}, 2);                         // f (f16 1.5, -1): [28, 32)
  Bytes m = {1, 0, 0, 1};                                    // m: [32, 36)
  Bytes i = le({static_cast<uint64_t>(-3), 2147483647}, 4);  // i: [36, 44)
  Bytes d = le({0x400C000000000000ull}, 8);                  // d (3.5): [44, 52)
  for (const Bytes* part : {&b, &h, &f, &m, &i, &d})
    data.insert(data.end(), part->begin(), part->end());
  const std::string header = R"({"b":{"dtype":"I64","shape":[2],"data_offsets":[8,24]},)"
                             R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                             R"("h":{"shape":[2],"dtype":"BF16","data_offsets":[24,28]},)"
                             R"("f":{"dtype":"F16","shape":[1,2],"data_offsets":[28,32]},)"
                             R"("m":{"dtype":"BOOL","shape":[2,2],"data_offsets":[32,36]},)"
                             R"("i":{"dtype":"I32","shape":[2],"data_offsets":[36,44]},)"
                             R"("d":{"dtype":"F64","shape":[],"data_offsets":[44,52]},)"
                             R"("e":{"dtype":"F32","shape":[0,3],"data_offsets":[52,52]},)"
                             R"("__metadata__":{"format":"pt"}})";
  Bytes bytes = assemble(header, data);

  TempDir dir("interop");
  write_file(dir.file("hand.safetensors"), bytes);
  for (const SafetensorsFile& file : {parse_safetensors(bytes.data(), bytes.size()),
                                      load_safetensors(dir.file("hand.safetensors"))}) {
    REQUIRE_FALSE(file.checksum_verified());
    REQUIRE(file.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
    std::vector<std::string> names;
    for (const auto& [name, t] : file.tensors())
      names.push_back(name);
    REQUIRE(names == std::vector<std::string>{"b", "a", "h", "f", "m", "i", "d", "e"});
    REQUIRE(values_of(file.at("a")) == std::vector<double>{1.5, -2.0});
    REQUIRE(file.at("b").to_vector<int64_t>() == std::vector<int64_t>{7, -9});
    REQUIRE(values_of(file.at("h")) == std::vector<double>{1.5, -2.0});
    REQUIRE(file.at("f").shape() == Shape{1, 2});
    REQUIRE(values_of(file.at("f")) == std::vector<double>{1.5, -1.0});
    REQUIRE(file.at("m").dtype() == DType::Bool);
    REQUIRE(values_of(file.at("m")) == std::vector<double>{1, 0, 0, 1});
    REQUIRE(file.at("i").to_vector<int32_t>() == std::vector<int32_t>{-3, 2147483647});
    REQUIRE(file.at("d").dim() == 0);
    REQUIRE(file.at("d").item<double>() == 3.5);
    REQUIRE(file.at("e").shape() == Shape{0, 3});
  }
}

TEST_CASE("the bytes tandem writes follow the format, read independently",
          "[interop][safetensors]") {
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"mask", tensor_of({1, 0, 1}, {3}, DType::Bool)},
      {"w", tensor_of({0.5, -1.25, 3.0, 8.0}, {2, 2}, DType::F32)},
      {"ids", tensor_of({-5.0, 1099511627776.0}, {2}, DType::I64)},
      {"h", tensor_of({1.5}, {1}, DType::BF16)},
  };
  Bytes bytes = serialize_safetensors(tensors, {{"step", "12"}});

  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | bytes[i];
  REQUIRE(n % 8 == 0);  // padded, so the data section starts 8-aligned
  REQUIRE(8 + n <= bytes.size());
  nlohmann::ordered_json header =
      nlohmann::ordered_json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<long>(n));
  const uint8_t* section = bytes.data() + 8 + n;
  const uint64_t section_size = bytes.size() - 8 - n;

  // The caller's order in the header; the metadata with the checksum.
  std::vector<std::string> keys;
  for (const auto& [key, value] : header.items())
    keys.push_back(key);
  REQUIRE(keys == std::vector<std::string>{"__metadata__", "mask", "w", "ids", "h"});
  REQUIRE(header["__metadata__"]["step"] == "12");
  std::string crc = header["__metadata__"]["tandem.crc32c"];
  REQUIRE(crc.size() == 8);

  struct Expect {
    const char* name;
    const char* dtype;
    std::vector<int64_t> shape;
    Bytes raw;
  };
  const std::vector<Expect> expect = {
      {"mask", "BOOL", {3}, {1, 0, 1}},
      {"w", "F32", {2, 2}, le_f32({0.5f, -1.25f, 3.0f, 8.0f})},
      {"ids", "I64", {2}, le({static_cast<uint64_t>(-5), 1ull << 40}, 8)},
      {"h", "BF16", {1}, le({0x3FC0}, 2)},
  };
  uint64_t covered = 0;
  for (const Expect& e : expect) {
    CAPTURE(e.name);
    const auto& j = header[e.name];
    REQUIRE(j.size() == 3);
    REQUIRE(j["dtype"] == e.dtype);
    REQUIRE(j["shape"].get<std::vector<int64_t>>() == e.shape);
    uint64_t begin = j["data_offsets"][0], end = j["data_offsets"][1];
    REQUIRE(end - begin == e.raw.size());
    REQUIRE(end <= section_size);
    REQUIRE(Bytes(section + begin, section + end) == e.raw);
    covered += end - begin;
  }
  REQUIRE(covered == section_size);
  // Alignment: every tensor starts at a file offset that is a multiple of its element size.
  REQUIRE((8 + n + header["w"]["data_offsets"][0].get<uint64_t>()) % 4 == 0);
  REQUIRE((8 + n + header["ids"]["data_offsets"][0].get<uint64_t>()) % 8 == 0);
  REQUIRE((8 + n + header["h"]["data_offsets"][0].get<uint64_t>()) % 2 == 0);

  // The checksum, recomputed from Note [Safetensors checksum] by hand for a one-tensor file.
  Bytes one = serialize_safetensors({{"x", tensor_of({2.0}, {1}, DType::F32)}});
  Bytes canonical = le({1, 1}, 8);
  canonical.push_back('x');
  canonical.insert(canonical.end(), {3, 0, 0, 0, 0, 0, 0, 0, 'F', '3', '2'});
  for (uint64_t v : {1, 1, 0, 4, 0})  // ndim, shape[0], begin, end, metadata count
    for (uint8_t b : le({v}, 8))
      canonical.push_back(b);
  Bytes two = le_f32({2.0f});
  uint32_t expected_crc = crc32c(two.data(), 4, crc32c(canonical.data(), canonical.size()));
  REQUIRE(std::string(one.begin(), one.end())
              .find(fmt::format("\"tandem.crc32c\":\"{:08x}\"", expected_crc)) !=
          std::string::npos);
}

// ---- safetensors: malformed input ----

TEST_CASE("malformed safetensors headers are errors that say what is wrong",
          "[interop][safetensors]") {
  const Bytes two = le_f32({1, 2});
  auto with = [&](const std::string& body, const Bytes& data) {
    return assemble(object({entry("x", body)}), data);
  };
  SECTION("too short") {
    require_parse_error({}, "expected at least 8 bytes (the header length), got 0");
    require_parse_error(Bytes(7, 0), "got 7 (the file is truncated)");
  }
  SECTION("header length") {
    Bytes huge = le({100'000'001}, 8);
    require_parse_error(huge, "expected a header length of at most 100000000 bytes, got 100000001");
    Bytes longer = assemble("{}");
    longer[0] = 3;
    require_parse_error(
        longer, "expected a header length within the file (2 bytes after the length), got 3");
  }
  SECTION("not JSON") {
    require_parse_error(assemble(" {}"), "expected the header to start with '{', got byte 0x20");
    require_parse_error(assemble("[1]"), "expected the header to start with '{', got byte 0x5b");
    require_parse_error(assemble(R"({"x":)"), "expected a JSON header, got invalid JSON");
    require_parse_error(assemble(R"({"x":{}} trailing)"), "got invalid JSON");
    require_parse_error(assemble("{\"\xff\":1}"), "got invalid JSON");
    require_parse_error(assemble(std::string("{}\0 junk", 7)),
                        "expected a JSON header without NUL bytes, got one at header byte 2");
    require_parse_error(assemble(R"({"x":[[[[1]]]]})"),
                        "expected at most 3 levels of JSON nesting");
  }
  SECTION("entries") {
    require_parse_error(
        assemble(R"({"x":[1]})"),
        "tensor 'x': expected an object with \"dtype\", \"shape\" and \"data_offsets\", got array");
    require_parse_error(with(R"({"shape":[2],"data_offsets":[0,8]})", two),
                        "tensor 'x': expected the field \"dtype\", got an entry without it");
    require_parse_error(with(R"({"dtype":"F32","data_offsets":[0,8]})", two),
                        "expected the field \"shape\"");
    require_parse_error(with(R"({"dtype":"F32","shape":[2]})", two),
                        "expected the field \"data_offsets\"");
    require_parse_error(
        with(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1})", two),
        "expected only the fields \"dtype\", \"shape\" and \"data_offsets\", got \"x\"");
    require_parse_error(
        with(R"({"dtype":"F32","shape":[2],"dtype":"F32","data_offsets":[0,8]})", two),
        "expected unique JSON keys, got 'dtype' twice");
    require_parse_error(assemble(object({entry("x", kX), entry("x", kX)}), two),
                        "expected unique tensor names, got 'x' twice");
  }
  SECTION("types") {
    require_parse_error(with(R"({"dtype":32,"shape":[2],"data_offsets":[0,8]})", two),
                        "expected \"dtype\" to be a string, got number");
    require_parse_error(with(R"({"dtype":"F32","shape":"2","data_offsets":[0,8]})", two),
                        "expected \"shape\" to be an array, got string");
    require_parse_error(with(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})", two),
                        "expected integers in \"shape\", got number 2.0");
    require_parse_error(with(R"({"dtype":"F32","shape":["2"],"data_offsets":[0,8]})", two),
                        "expected integers in \"shape\", got string");
    require_parse_error(with(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8,8]})", two),
                        "expected \"data_offsets\" to be an array [begin, end], got [0,8,8]");
    require_parse_error(with(R"({"dtype":"F32","shape":[2],"data_offsets":{"a":0}})", two),
                        "expected \"data_offsets\" to be an array [begin, end], got object");
    require_parse_error(with(R"({"dtype":"F32","shape":[2],"data_offsets":[0,-8]})", two),
                        "expected non-negative integers in \"data_offsets\", got -8");
  }
  SECTION("dtypes") {
    require_parse_error(with(R"({"dtype":"U8","shape":[2],"data_offsets":[0,2]})", {1, 2}),
                        "got the safetensors dtype tandem has no dtype for 'U8'");
    require_parse_error(with(R"({"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]})", {1, 2}),
                        "tandem has no dtype for 'F8_E4M3'");
    require_parse_error(with(R"({"dtype":"Q7","shape":[2],"data_offsets":[0,2]})", {1, 2}),
                        "got the unknown dtype 'Q7'");
  }
  SECTION("shapes") {
    require_parse_error(with(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})", two),
                        "expected non-negative integers in \"shape\", got -2");
    require_parse_error(
        with(R"({"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]})", two),
        "expected a shape whose element count fits 64 bits, got [4294967296,4294967296]");
    require_parse_error(
        with(R"({"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8]})", two),
        "expected \"shape\" values below 2^63, got 9223372036854775808");
    require_parse_error(
        with(R"({"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]})", two),
        "expected integers in \"shape\", got number");
    require_parse_error(
        with(R"({"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,8]})", two),
        "expected a byte size that fits 64 bits, got 4611686018427387904 elements of F32");
    require_parse_error(
        with(R"({"dtype":"F32","shape":[1,1,1,1,1,1,1,1,2],"data_offsets":[0,8]})", two),
        "expected at most 8 dims, got 9");
    require_parse_error(with(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})", two),
                        "expected data_offsets to span 12 bytes (3 elements of shape [3] x 4 "
                        "bytes), got [0, 8] (8 bytes)");
  }
  SECTION("offsets") {
    require_parse_error(with(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})", two),
                        "expected data_offsets begin <= end, got [8, 0]");
    require_parse_error(
        with(R"({"dtype":"F32","shape":[2],"data_offsets":[8,16]})", two),
        "tensor 'x': expected data_offsets to begin at 0 (the first tensor), got [8, 16] (a hole");
    require_parse_error(with(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", le_f32({1})),
                        "expected a data section of 8 bytes (the tensors' data_offsets), got 4 "
                        "(the file is truncated)");
    require_parse_error(
        with(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", le_f32({1, 2, 3})),
        "got 12 (4 bytes no tensor covers at the end)");
    std::string y = R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})";
    std::string z = R"({"dtype":"F32","shape":[1],"data_offsets":[12,16]})";
    require_parse_error(assemble(object({entry("x", kX), entry("y", y)}), two),
                        "tensor 'y': expected data_offsets to begin at 8 (where 'x' ends), got [4, "
                        "8] (the tensors overlap)");
    require_parse_error(
        assemble(object({entry("x", kX), entry("z", z)}), le_f32({1, 2, 3, 4})),
        "tensor 'z': expected data_offsets to begin at 8 (where 'x' ends), got [12, 16] (a hole");
  }
  SECTION("metadata") {
    require_parse_error(assemble(R"({"__metadata__":{"a":1}})"),
                        "expected \"__metadata__\" values to be strings, got number for key 'a'");
    require_parse_error(assemble(R"({"__metadata__":["a"]})"),
                        "expected \"__metadata__\" to be an object of strings, got array");
    require_parse_error(assemble(R"({"__metadata__":{"tandem.crc32c":"xyz"}})"),
                        "expected \"tandem.crc32c\" to be 8 hex digits, got 'xyz'");
    Bytes null_meta = assemble(R"({"__metadata__":null})");
    REQUIRE(parse_safetensors(null_meta.data(), null_meta.size()).metadata().empty());
    Bytes empty = assemble("{}");
    REQUIRE(parse_safetensors(empty.data(), empty.size()).size() == 0);
  }
  SECTION("bool bytes") {
    require_parse_error(with(R"({"dtype":"BOOL","shape":[3],"data_offsets":[0,3]})", {1, 0, 2}),
                        "tensor 'x': expected BOOL bytes 0 or 1, got 0x02 at element 2");
  }
}

TEST_CASE("every truncation and every bit flip of a tandem file is detected",
          "[interop][safetensors]") {
  std::vector<std::pair<std::string, Tensor>> tensors = {
      {"w", random_tensor({3, 2}, DType::F32, 11)},
      {"b", random_tensor({2}, DType::BF16, 12)},
      {"on", tensor_of({1, 0}, {2}, DType::Bool)},
  };
  const Bytes good = serialize_safetensors(tensors, {{"k", "v"}});
  const std::string text(good.begin(), good.end());
  const size_t key_at = text.find("\"tandem.crc32c\"");
  REQUIRE(key_at != std::string::npos);

  for (size_t size = 0; size < good.size(); ++size) {
    CAPTURE(size);
    REQUIRE_THROWS_AS(parse_safetensors(good.data(), size), Error);
  }
  SECTION("a flip in the data section") {
    Bytes bad = good;
    bad[bad.size() - 3] ^= 0x10;
    require_parse_error(bad, "checksum mismatch: the file is corrupt (stored ");
  }
  SECTION("every single-bit flip") {
    // Each flip throws, or (a flip that turns a hex digit's case, or one inside
    // the checksum's key, which makes the file look foreign) loads the very same tensors.
    for (size_t byte = 0; byte < good.size(); ++byte) {
      for (int bit = 0; bit < 8; ++bit) {
        Bytes bad = good;
        bad[byte] ^= static_cast<uint8_t>(1u << bit);
        CAPTURE(byte, bit);
        std::optional<SafetensorsFile> file;
        try {
          file = parse_safetensors(bad.data(), bad.size());
        } catch (const Error&) {
          continue;
        }
        REQUIRE((!file->checksum_verified()
                     ? byte > key_at && byte < key_at + 15
                     : std::isxdigit(good[byte]) && (good[byte] ^ bad[byte]) == 0x20));
        REQUIRE(file->size() == tensors.size());
        for (const auto& [name, t] : tensors)
          REQUIRE(bytes_of(file->at(name)) == bytes_of(t));
      }
    }
  }
}

TEST_CASE("load_safetensors reads files and names them in errors", "[interop][safetensors]") {
  TempDir dir("interop");
  REQUIRE_THROWS_WITH(
      load_safetensors(dir.file("missing.safetensors")),
      Contains("expected to open " + dir.file("missing.safetensors")) && Contains("No such file"));
  REQUIRE_THROWS_WITH(load_safetensors(dir.file("")), Contains("to be a regular file"));
  const std::string path = dir.file("t.safetensors");
  save_safetensors(path, {{"a", iota_tensor({4}, DType::I64)}});
  Bytes bytes = read_file(path);
  write_file(path, Bytes(bytes.begin(), bytes.end() - 1));
  REQUIRE_THROWS_WITH(load_safetensors(path),
                      Contains(path + ": expected a data section of 32 bytes") &&
                          Contains("the file is truncated"));
  bytes[bytes.size() - 8] ^= 1;
  write_file(path, bytes);
  REQUIRE_THROWS_WITH(load_safetensors(path), Contains(path + ": checksum mismatch"));

  SafetensorsFile file;
  REQUIRE_THROWS_WITH(file.at("nope"),
                      Contains("expected one of the 0 tensors of the file (), got 'nope'"));
}

TEST_CASE("save_safetensors rejects what the format cannot hold", "[interop][safetensors]") {
  Tensor t = iota_tensor({2});
  REQUIRE_THROWS_WITH(serialize_safetensors({{"a", t}, {"a", t}}),
                      Contains("expected unique tensor names, got 'a' at positions 0 and 1"));
  REQUIRE_THROWS_WITH(serialize_safetensors({{"__metadata__", t}}),
                      Contains("expected tensor names other than \"__metadata__\""));
  REQUIRE_THROWS_WITH(serialize_safetensors({{"a", Tensor()}}),
                      Contains("expected defined tensors, got an empty handle for 'a'"));
  REQUIRE_THROWS_WITH(serialize_safetensors({{"a", t}}, {{"tandem.crc32c", "0"}}),
                      Contains("without the reserved key \"tandem.crc32c\""));
  REQUIRE_THROWS_WITH(serialize_safetensors({{"bad\xff", t}}), Contains("in UTF-8"));
  REQUIRE_THROWS_WITH(safetensors_dtype("I8"), Contains("tandem has no dtype for 'I8'"));
  for (DType d : kAllDTypes)
    REQUIRE(safetensors_dtype(safetensors_dtype_name(d)) == d);
}

TEST_CASE("an atomic write that fails leaves the previous file and no temporary",
          "[interop][safetensors]") {
  TempDir dir("interop");
  const std::string path = dir.file("ckpt.safetensors");
  save_safetensors(path, {{"v", tensor_of({1, 2, 3}, {3})}});
  const Bytes before = read_file(path);

  auto fail_midway = [](FileWriter& out) {
    out.write("partial", 7);
    REQUIRE(out.size() == 7);
    throw std::runtime_error("disk on fire");
  };
  REQUIRE_THROWS_WITH(write_file_atomically(path, fail_midway), "disk on fire");
  REQUIRE(read_file(path) == before);
  REQUIRE(dir.entries() == std::vector<std::string>{"ckpt.safetensors"});

  // A failing save (invalid input found after the temporary exists) likewise.
  REQUIRE_THROWS_AS(save_safetensors(path, {{"v", Tensor()}}), Error);
  REQUIRE(read_file(path) == before);
  REQUIRE(dir.entries() == std::vector<std::string>{"ckpt.safetensors"});

  auto patch_nothing = [](FileWriter& out) { out.write_at(0, "x", 1); };
  REQUIRE_THROWS_WITH(write_file_atomically(path, patch_nothing),
                      Contains("expected write_at inside the 0 bytes written"));
  REQUIRE(read_file(path) == before);

  // A successful write replaces the file whole; write_at patches earlier bytes.
  write_file_atomically(path, [](FileWriter& out) {
    out.write("hello world", 11);
    out.write_at(0, "J", 1);
  });
  REQUIRE(read_file(path) == Bytes{'J', 'e', 'l', 'l', 'o', ' ', 'w', 'o', 'r', 'l', 'd'});
  REQUIRE(dir.entries() == std::vector<std::string>{"ckpt.safetensors"});

  REQUIRE_THROWS_WITH(
      save_safetensors(dir.file("no/such/dir/x.safetensors"), {}),
      Contains("expected to create the temporary file") && Contains("No such file"));
}

// ---- DLPack ----

namespace {

// A foreign producer: owns a buffer, counts deleter calls.
struct Foreign {
  static inline int deleted = 0;
  std::vector<uint8_t> buffer;
  std::vector<int64_t> shape, strides;
  DLManagedTensor managed{};
};

DLManagedTensor* make_foreign(Bytes buffer, std::vector<int64_t> shape,
                              std::vector<int64_t> strides, DLDataType dtype,
                              uint64_t byte_offset = 0) {
  auto f = std::make_unique<Foreign>();
  f->buffer = std::move(buffer);
  f->shape = std::move(shape);
  f->strides = std::move(strides);
  DLTensor& dl = f->managed.dl_tensor;
  dl.data = f->buffer.data();
  dl.device = {kDLCPU, 0};
  dl.ndim = static_cast<int>(f->shape.size());
  dl.dtype = dtype;
  dl.shape = f->shape.data();
  dl.strides = f->strides.empty() ? nullptr : f->strides.data();
  dl.byte_offset = byte_offset;
  f->managed.manager_ctx = f.get();
  f->managed.deleter = [](DLManagedTensor* self) {
    ++Foreign::deleted;
    std::unique_ptr<Foreign>(static_cast<Foreign*>(self->manager_ctx));
  };
  return &f.release()->managed;
}

}  // namespace

TEST_CASE("to_dlpack shares the storage and describes the view", "[interop][dlpack]") {
  Tensor base = iota_tensor({4, 6}, DType::F32);
  Tensor view =
      ops::narrow(ops::transpose(base, 0, 1), 0, 1, 3);  // (3, 4), strides (1, 6), offset 1
  DLManagedTensor* m = to_dlpack(view);
  const DLTensor& dl = m->dl_tensor;
  REQUIRE(dl.data == view.raw_data());
  REQUIRE(dl.byte_offset == 0);
  REQUIRE(dl.device.device_type == kDLCPU);
  REQUIRE(dl.ndim == 2);
  REQUIRE((dl.shape[0] == 3 && dl.shape[1] == 4));
  REQUIRE((dl.strides[0] == 1 && dl.strides[1] == 6));
  REQUIRE((dl.dtype.code == kDLFloat && dl.dtype.bits == 32 && dl.dtype.lanes == 1));

  // The export keeps the storage alive after every tandem handle is gone.
  const float* data = static_cast<const float*>(dl.data);
  base = Tensor();
  view = Tensor();
  REQUIRE(data[0] == 1.0f);               // element (0, 0) of the view: base (0, 1)
  REQUIRE(data[1 * 1 + 2 * 6] == 14.0f);  // element (1, 2): base (2, 2)
  m->deleter(m);

  // Round trip: zero copy, strides and offset intact, the original storage.
  Tensor b = iota_tensor({4, 6}, DType::F32);
  Tensor v = ops::narrow(ops::transpose(b, 0, 1), 0, 1, 3);
  Tensor back = from_dlpack(to_dlpack(v));
  REQUIRE(back.raw_data() == v.raw_data());
  REQUIRE(back.is_alias_of(b));
  REQUIRE(back.strides() == v.strides());
  REQUIRE(back.storage_offset() == v.storage_offset());
  REQUIRE(values_of(back) == values_of(v));

  for (DType d : kAllDTypes) {
    DLManagedTensor* e = to_dlpack(iota_tensor({}, d));
    DLDataType t = e->dl_tensor.dtype;
    CAPTURE(dtype_name(d));
    REQUIRE(e->dl_tensor.ndim == 0);
    REQUIRE(t.bits == 8 * dtype_size(d));
    int code = d == DType::BF16   ? kDLBfloat
               : d == DType::Bool ? 6
               : is_integral(d)   ? kDLInt
                                  : kDLFloat;
    REQUIRE(t.code == code);
    e->deleter(e);
  }
  REQUIRE_THROWS_WITH(to_dlpack(Tensor()), Contains("expected a defined tensor"));
}

TEST_CASE("from_dlpack wraps foreign memory and calls its deleter exactly once",
          "[interop][dlpack]") {
  Foreign::deleted = 0;
  SECTION("i64 with strides and byte_offset") {
    // Buffer: a padding int64 then the (2, 3) matrix [[0, 1, 2], [3, 4, 5]] column-major.
    Bytes buffer = le({99, 0, 3, 1, 4, 2, 5}, 8);
    DLManagedTensor* m = make_foreign(buffer, {2, 3}, {1, 2}, {kDLInt, 64, 1}, 8);
    const void* element0 = static_cast<uint8_t*>(m->dl_tensor.data) + 8;
    Tensor t = from_dlpack(m);
    REQUIRE(t.raw_data() == element0);  // zero copy
    REQUIRE(t.strides() == Dims{1, 2});
    REQUIRE(t.to_vector<int64_t>() == std::vector<int64_t>{0, 1, 2, 3, 4, 5});
    Tensor row = ops::select(t, 0, 1);
    t = Tensor();
    REQUIRE(Foreign::deleted == 0);  // a view still holds it
    REQUIRE(row.to_vector<int64_t>() == std::vector<int64_t>{3, 4, 5});
    Tensor copy = row;
    row = Tensor();
    REQUIRE(Foreign::deleted == 0);
    copy = Tensor();
    REQUIRE(Foreign::deleted == 1);
  }
  SECTION("bf16, contiguous (null strides)") {
    {
      Tensor t =
          from_dlpack(make_foreign(le({0x3FC0, 0xC000, 0x0000}, 2), {3}, {}, {kDLBfloat, 16, 1}));
      REQUIRE(t.dtype() == DType::BF16);
      REQUIRE(t.is_contiguous());
      REQUIRE(values_of(t) == std::vector<double>{1.5, -2.0, 0.0});
      REQUIRE(values_of(ops::mul(t, t)) == std::vector<double>{2.25, 4.0, 0.0});
    }
    REQUIRE(Foreign::deleted == 1);
  }
  SECTION("bool, 0-dim and empty") {
    {
      Tensor b = from_dlpack(make_foreign({1, 0}, {2}, {}, {6, 8, 1}));
      Tensor s = from_dlpack(make_foreign(le({7}, 4), {}, {}, {kDLInt, 32, 1}));
      Tensor e = from_dlpack(make_foreign({}, {0, 5}, {}, {kDLFloat, 32, 1}));
      REQUIRE(values_of(b) == std::vector<double>{1, 0});
      REQUIRE(s.item<int32_t>() == 7);
      REQUIRE(e.shape() == Shape{0, 5});
    }
    REQUIRE(Foreign::deleted == 3);
  }
}

TEST_CASE("from_dlpack rejects what tandem cannot hold and leaves ownership with the caller",
          "[interop][dlpack]") {
  Foreign::deleted = 0;
  auto reject = [](DLManagedTensor* m, const std::string& expected) {
    REQUIRE_THROWS_WITH(from_dlpack(m), Contains(expected));
    REQUIRE(Foreign::deleted == 0);  // not taken
    m->deleter(m);
    Foreign::deleted = 0;
  };
  Bytes eight(8, 0);
  reject(make_foreign(eight, {8}, {}, {kDLUInt, 8, 1}),
         "float16/32/64, bfloat16, int32/64 or bool (one lane), got uint8");
  reject(make_foreign(eight, {8}, {}, {kDLInt, 8, 1}), "got int8");
  reject(make_foreign(eight, {1}, {}, {kDLComplex, 64, 1}), "got complex64");
  reject(make_foreign(eight, {2}, {}, {kDLFloat, 32, 2}), "got float32x2");
  reject(make_foreign(eight, {9}, {}, {6, 1, 1}), "got bool1");
  reject(make_foreign(eight, {2}, {-1}, {kDLFloat, 32, 1}),
         "expected non-negative strides, got -1 in dim 0");
  reject(make_foreign(eight, {-2}, {}, {kDLFloat, 32, 1}),
         "expected non-negative extents, got -2 in dim 0");
  reject(make_foreign(eight, std::vector<int64_t>(9, 1), {}, {kDLFloat, 32, 1}),
         "expected 0 to 8 dims, got 9");
  reject(make_foreign(eight, {1}, {}, {kDLFloat, 32, 1}, 2),
         "expected element 0 aligned to 4 bytes for f32");
  reject(make_foreign(eight, {1LL << 62, 4, 0}, {}, {kDLFloat, 32, 1}),
         "expected an element count that fits 64 bits, got shape [4611686018427387904,4,0]");
  reject(make_foreign(eight, {1LL << 61, 2}, {4, 1}, {kDLFloat, 32, 1}),
         "expected shape and strides whose extent in bytes fits 64 bits");
  DLManagedTensor* opencl = make_foreign(eight, {2}, {}, {kDLFloat, 32, 1});
  opencl->dl_tensor.device = {kDLOpenCL, 0};
  reject(opencl, "expected device type kDLCPU (1), kDLCUDA (2) or kDLCUDAHost (3), got 4");
  DLManagedTensor* null_data = make_foreign(eight, {2}, {}, {kDLFloat, 32, 1});
  null_data->dl_tensor.data = nullptr;
  reject(null_data, "expected a data pointer for shape [2], got null");
  if (!cuda_available()) {
    DLManagedTensor* gpu = make_foreign(eight, {2}, {}, {kDLFloat, 32, 1});
    gpu->dl_tensor.device = {kDLCUDA, 0};
    reject(gpu, "expected a CUDA device index in [0, 0), got 0 (no usable GPU in this process)");
  }
  REQUIRE_THROWS_WITH(from_dlpack(nullptr), Contains("got null"));
}

TEST_CASE("DLPack round trip of a CUDA tensor", "[interop][dlpack][cuda]") {
  TANDEM_SKIP_WITHOUT_CUDA();
  Tensor t = ops::to(iota_tensor({3, 4}, DType::F32), Device::cuda(0));
  Tensor v = ops::transpose(t, 0, 1);
  DLManagedTensor* m = to_dlpack(v);
  REQUIRE(m->dl_tensor.device.device_type == kDLCUDA);
  REQUIRE(m->dl_tensor.device.device_id == 0);
  REQUIRE(m->dl_tensor.data == v.raw_data());
  Tensor back = from_dlpack(m);
  REQUIRE(back.device() == Device::cuda(0));
  REQUIRE(values_of(back) == values_of(v));
  // Saving a CUDA tensor goes through the host.
  Bytes bytes = serialize_safetensors({{"v", v}});
  REQUIRE(values_of(parse_safetensors(bytes.data(), bytes.size()).at("v")) == values_of(v));
}
