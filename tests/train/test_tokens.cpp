// Token files (Note [Token files] in tools/train/data.h): the llm.c format
// with uint16 and uint32 ids and nanoGPT's bare uint16 arrays read back as
// written; batches are windows of the file, a pure function of their
// coordinates; malformed files and ids outside the vocab are refused with the
// numbers.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tandem/tensor/ops.h"
#include "tools/train/data.h"

using namespace tandem;
using namespace tandem::train;
using Catch::Matchers::Contains;

namespace {

std::string temp_file(const std::string& what) {
  return (std::filesystem::temp_directory_path() /
          ("tandem-tokens-" + what + "-" + std::to_string(::getpid()) + ".bin"))
      .string();
}

std::vector<int64_t> ramp(int64_t n, int64_t mul, int64_t mod) {
  std::vector<int64_t> v;
  for (int64_t i = 0; i < n; ++i)
    v.push_back((i * mul + 7) % mod);
  return v;
}

}  // namespace

TEST_CASE("token files read back what was written, in every width", "[tokens]") {
  for (int64_t mod : {int64_t{50000}, int64_t{200000}}) {  // uint16, then uint32 ids
    const std::string path = temp_file("rt");
    const std::vector<int64_t> ids = ramp(1000, 7919, mod);
    write_token_file(path, ids);
    TokenFile f(path);
    CHECK(f.has_header());
    CHECK(f.bytes_per_token() == (mod > 65536 ? 4 : 2));
    REQUIRE(f.size() == 1000);
    bool same = true;
    for (int64_t i = 0; i < f.size(); ++i)
      same = same && f[i] == ids[static_cast<size_t>(i)];
    CHECK(same);
    std::filesystem::remove(path);
  }
  // nanoGPT's bare uint16 array.
  const std::string raw = temp_file("raw");
  {
    std::ofstream out(raw, std::ios::binary);
    for (uint16_t v : {uint16_t{5}, uint16_t{65535}, uint16_t{0}, uint16_t{300}})
      out.write(reinterpret_cast<const char*>(&v), 2);
  }
  TokenFile f(raw);
  CHECK_FALSE(f.has_header());
  CHECK(f.size() == 4);
  CHECK((f[0] == 5 && f[1] == 65535 && f[2] == 0 && f[3] == 300));
  std::filesystem::remove(raw);
}

TEST_CASE("token batches are windows of the file drawn from their coordinates", "[tokens]") {
  const std::string path = temp_file("batch");
  const std::vector<int64_t> ids = ramp(5000, 31, 997);  // distinct windows of 9 tokens
  write_token_file(path, ids);
  TokenTask task(path, 8, 1000);
  const Batch a = task.sample(1, 5, 0, 0, 3);
  const Batch again = task.sample(1, 5, 0, 0, 3);
  const Batch other_rank = task.sample(1, 5, 0, 1, 3);
  CHECK(ops::equal(a.tokens, again.tokens));
  CHECK_FALSE(ops::equal(a.tokens, other_rank.tokens));
  // A global batch of 6 is the same windows on one data rank as on two.
  const Batch whole = task.sample(1, 5, 0, 0, 6);
  CHECK(ops::equal(whole.tokens, ops::cat({a.tokens, other_rank.tokens}, 0)));
  CHECK(ops::equal(whole.targets, ops::cat({a.targets, other_rank.targets}, 0)));
  const std::vector<int64_t> t = a.tokens.to_vector<int64_t>(), y = a.targets.to_vector<int64_t>();
  for (int64_t b = 0; b < 3; ++b) {
    // The window's place in the file, from its first two tokens.
    int64_t start = -1;
    for (int64_t s = 0; s + 8 < 5000 && start < 0; ++s) {
      if (ids[s] == t[b * 8] && ids[s + 1] == t[b * 8 + 1]) start = s;
    }
    REQUIRE(start >= 0);
    for (int64_t i = 0; i < 8; ++i) {
      CHECK(t[b * 8 + i] == ids[start + i]);
      CHECK(y[b * 8 + i] == ids[start + i + 1]);  // every position scored
    }
  }
  std::filesystem::remove(path);
}

TEST_CASE("malformed token files and ids outside the vocab are refused", "[tokens]") {
  CHECK_THROWS_WITH(TokenFile("/nonexistent/tokens.bin"), Contains("cannot open"));
  const std::string path = temp_file("bad");
  write_token_file(path, ramp(100, 3, 500));
  std::filesystem::resize_file(path, std::filesystem::file_size(path) - 2);  // one token short
  CHECK_THROWS_WITH(TokenFile(path), Contains("announces 100 tokens of 2 bytes"));
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write("abc", 3);
  }
  CHECK_THROWS_WITH(TokenFile(path), Contains("an even byte count), got 3 bytes"));
  write_token_file(path, ramp(100, 3, 500));
  CHECK_THROWS_WITH(TokenTask(path, 100, 500), Contains("holds 100 tokens"));
  TokenTask small_vocab(path, 8, 10);
  CHECK_THROWS_WITH(small_vocab.sample(1, 0, 0, 0, 4), Contains("outside the model's vocab of 10"));
  std::filesystem::remove(path);
}
