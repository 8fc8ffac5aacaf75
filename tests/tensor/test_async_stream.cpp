// Tensor ops on async CPU streams (Note [Stream ordering], Note [Kernel
// closures keep storage alive]): results equal the inline stream's once
// synchronised, events order consumers after producers, temporaries survive
// until their kernels ran, and kernel errors surface at the next
// synchronisation.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tandem/runtime/stream.h"
#include "tandem/tensor/ops.h"
#include "tests/support/test_util.h"

using namespace tandem;
using namespace tandem::test;
using Catch::Matchers::Contains;

namespace {

struct ChainResult {
  std::vector<double> probs;  // softmax(matmul(a + b, w)), (8, 12)
  std::vector<double> sums;   // sum(probs * logits, dim 1), (8)
};

// Inputs are created inside, so they too are made on the current stream.
ChainResult run_chain(const std::vector<double>& av, const std::vector<double>& bv,
                      const std::vector<double>& wv) {
  Tensor a = tensor_of(av, {8, 16}), b = tensor_of(bv, {8, 16}), w = tensor_of(wv, {16, 12});
  Tensor logits = ops::matmul(ops::add(a, b), w);
  Tensor probs = ops::softmax(logits, -1);
  Tensor sums = ops::sum(ops::mul(probs, logits), {1});
  return {values_of(probs), values_of(sums)};
}

}  // namespace

TEST_CASE("a chain of ops on an async stream equals the inline result", "[async]") {
  std::vector<double> av = random_stored(128, 1, DType::F32),
                      bv = random_stored(128, 2, DType::F32);
  std::vector<double> wv = random_stored(192, 3, DType::F32);
  Stream inl = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  Stream async = Stream::create(Device::cpu(), CpuStreamMode::Async, "async-chain");

  ChainResult ref;
  {
    StreamGuard guard(inl);
    ref = run_chain(av, bv, wv);
  }
  ChainResult got;
  {
    StreamGuard guard(async);
    // Hold the stream back so that a read that forgot to synchronise would see
    // unwritten memory.
    async.enqueue([] { sleep_ms(50); });
    got = run_chain(av, bv, wv);
  }
  REQUIRE(async.query());
  REQUIRE(got.probs == ref.probs);  // same kernels: bit-identical
  REQUIRE(got.sums == ref.sums);

  // And both agree with a naive reference.
  std::vector<double> probs, sums;
  for (int64_t i = 0; i < 8; ++i) {
    std::vector<double> logits(12, 0.0);
    for (int64_t n = 0; n < 12; ++n) {
      for (int64_t k = 0; k < 16; ++k)
        logits[n] += (av[i * 16 + k] + bv[i * 16 + k]) * wv[k * 12 + n];
    }
    double m = *std::max_element(logits.begin(), logits.end()), z = 0, s = 0;
    for (double l : logits)
      z += std::exp(l - m);
    for (double l : logits) {
      probs.push_back(std::exp(l - m) / z);
      s += probs.back() * l;
    }
    sums.push_back(s);
  }
  TANDEM_REQUIRE_CLOSE(got.probs, probs, 1e-5, 1e-6);
  TANDEM_REQUIRE_CLOSE(got.sums, sums, 1e-5, 1e-5);
}

TEST_CASE("a consumer stream that waits on an event sees the producer's result", "[async]") {
  std::vector<double> av = random_stored(4096, 10, DType::F32),
                      bv = random_stored(4096, 11, DType::F32);
  Stream producer = Stream::create(Device::cpu(), CpuStreamMode::Async, "producer");
  Stream consumer = Stream::create(Device::cpu(), CpuStreamMode::Async, "consumer");
  Tensor x;
  Event produced;
  {
    StreamGuard guard(producer);
    producer.enqueue([] { sleep_ms(100); });  // a slow producer
    x = ops::add(tensor_of(av, {64, 64}), tensor_of(bv, {64, 64}));
    produced.record(producer);
  }
  std::vector<double> got;
  {
    StreamGuard guard(consumer);
    produced.wait(consumer);
    Tensor y = ops::mul(x, 2.0);
    got = values_of(y);  // synchronises the consumer only
  }
  std::vector<double> expected;
  for (size_t i = 0; i < av.size(); ++i) {
    expected.push_back(2.0 * stored_value(DType::F32, av[i] + bv[i]));
  }
  REQUIRE(got == expected);

  // Chained the other way: the producer consumes the consumer's output.
  Tensor z;
  Event consumed;
  {
    StreamGuard guard(consumer);
    consumer.enqueue([] { sleep_ms(50); });
    z = ops::neg(x);
    consumed.record(consumer);
  }
  {
    StreamGuard guard(producer);
    consumed.wait(producer);
    std::vector<double> back = values_of(ops::add(z, x));
    REQUIRE(back == std::vector<double>(av.size(), 0.0));
  }
}

// The README's promise, shown on purpose: a consumer stream that leaves out
// the Event::wait reads its input before the producer wrote it, and that is
// caught, as a wrong result or as an error. The producer is held by a gate
// that opens only after the consumer has been read back, so the producer
// cannot have run whatever the scheduling: the outcome is deterministic.
TEST_CASE("a consumer that leaves out the event wait is caught", "[async]") {
  Stream producer = Stream::create(Device::cpu(), CpuStreamMode::Async, "gated-producer");
  Stream consumer = Stream::create(Device::cpu(), CpuStreamMode::Async, "consumer");
  Gate gate;  // after the streams: opened before they are joined
  const int64_t n = 64;

  SECTION("a wrong result") {
    Tensor x;
    Event produced;
    {
      StreamGuard guard(producer);
      x = ops::full({n}, 1.0);
      producer.synchronize();  // x holds 1 before the producer is held
      producer.enqueue(gate.waiter());
      ops::fill_(x, 7.0);  // the producer's write, held behind the gate
      produced.record(producer);
    }
    std::vector<double> without_wait, with_wait;
    {
      StreamGuard guard(consumer);
      // Missing: produced.wait(consumer).
      without_wait = values_of(ops::mul(x, 2.0));  // synchronises the consumer only
      REQUIRE_FALSE(produced.query());             // the write has not run
      produced.wait(consumer);
      Tensor y = ops::mul(x, 2.0);
      gate.open();
      with_wait = values_of(y);
    }
    CHECK(without_wait == std::vector<double>(n, 2.0));  // read before the write: wrong
    CHECK(with_wait == std::vector<double>(n, 14.0));
  }

  SECTION("an error") {
    // An index tensor that a producer rewrites from an out-of-range filler to
    // valid rows; a consumer that reads it too early fails in index_select,
    // as tandem-train once did with routing indices read before they were
    // written.
    Tensor table = ops::full({4, 3}, 5.0);
    Tensor index;
    Event produced;
    {
      StreamGuard guard(producer);
      index = ops::full({n}, -1.0, DType::I64);
      producer.synchronize();
      producer.enqueue(gate.waiter());
      ops::fill_(index, 2.0);
      produced.record(producer);
    }
    StreamGuard guard(consumer);
    Tensor early = ops::index_select(table, 0, index);  // missing: produced.wait(consumer)
    REQUIRE_THROWS_WITH(consumer.synchronize(),
                        Contains("[tensor::index_select] expected index in [0, 4), got -1"));
    produced.wait(consumer);
    Tensor rows = ops::index_select(table, 0, index);
    gate.open();
    REQUIRE(values_of(rows) == std::vector<double>(n * 3, 5.0));
  }
}

TEST_CASE("temporaries dropped on the host before the stream ran stay alive", "[async]") {
  std::vector<double> xv = random_stored(256 * 64, 20, DType::F32);
  Stream async = Stream::create(Device::cpu(), CpuStreamMode::Async, "stalled");
  Stream inl = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  Gate gate;  // after the streams: opened before they are joined
  Tensor result;
  {
    StreamGuard guard(async);
    async.enqueue(gate.waiter());
    Tensor t1 = tensor_of(xv, {256, 64});
    Tensor t2 = ops::add(t1, t1);
    result = ops::mul(t2, 3.0);
  }  // t1 and t2 are gone on the host; only queued closures hold them
  REQUIRE_FALSE(async.query());

  // If their blocks had gone back to the allocator, these same-size tensors
  // would get them and overwrite them before the stream runs.
  std::vector<Tensor> scratch;
  {
    StreamGuard guard(inl);
    for (int i = 0; i < 4; ++i)
      scratch.push_back(ops::full({256, 64}, 999.0));
  }
  gate.open();
  std::vector<double> got;
  {
    StreamGuard guard(async);
    got = values_of(result);
  }
  std::vector<double> expected;
  for (double x : xv)
    expected.push_back(stored_value(DType::F32, 6.0 * x));
  REQUIRE(got == expected);
  for (const Tensor& s : scratch)
    REQUIRE(values_of(s) == std::vector<double>(256 * 64, 999.0));
}

TEST_CASE("an error inside an async kernel surfaces at the next synchronisation", "[async]") {
  Stream async = Stream::create(Device::cpu(), CpuStreamMode::Async, "failing-ops");
  StreamGuard guard(async);
  std::vector<double> wv = random_stored(15, 30, DType::F32);
  Tensor w = tensor_of(wv, {5, 3});

  SECTION("index_select, read with to_vector") {
    Tensor out;
    // The index values are data: only the kernel sees them, later.
    REQUIRE_NOTHROW(out = ops::index_select(w, 0, tensor_of({0, 7}, {2}, DType::I64)));
    try {
      out.to_vector<float>();
      FAIL("to_vector of a failed index_select returned");
    } catch (const Error& e) {
      std::string msg = e.what();
      REQUIRE_THAT(msg, Contains("[tensor::index_select]"));
      REQUIRE_THAT(msg, Contains("got 7"));
    }
  }
  SECTION("embedding, read with synchronize") {
    Tensor out;
    REQUIRE_NOTHROW(out = ops::embedding(w, tensor_of({1, -1, 2}, {3}, DType::I64)));
    REQUIRE_THROWS_WITH(async.synchronize(), Contains("got -1"));
  }
  // The error was taken: the stream computes correctly again.
  Tensor ok = ops::index_select(w, 0, tensor_of({4, 0}, {2}, DType::I64));
  std::vector<double> expected{wv[12], wv[13], wv[14], wv[0], wv[1], wv[2]};
  REQUIRE(values_of(ok) == expected);
}

TEST_CASE("threads whose default stream is async compute correctly", "[async]") {
  std::vector<double> av = random_stored(128, 40, DType::F32),
                      bv = random_stored(128, 41, DType::F32);
  std::vector<double> wv = random_stored(192, 42, DType::F32);
  ChainResult ref;
  {
    Stream inl = Stream::create(Device::cpu(), CpuStreamMode::Inline);
    StreamGuard guard(inl);
    ref = run_chain(av, bv, wv);
  }
  const CpuStreamMode saved = default_cpu_stream_mode();
  set_default_cpu_stream_mode(CpuStreamMode::Async);
  ChainResult got[2];
  bool async_default[2] = {false, false};
  std::string failure[2];
  auto body = [&](int i) {
    try {
      async_default[i] = !current_stream(Device::cpu()).is_inline();
      got[i] = run_chain(av, bv, wv);
    } catch (const std::exception& e) {
      failure[i] = e.what();
    }
  };
  std::thread t0(body, 0), t1(body, 1);
  t0.join();
  t1.join();
  set_default_cpu_stream_mode(saved);
  for (int i = 0; i < 2; ++i) {
    INFO("thread " << i);
    REQUIRE(failure[i].empty());
    REQUIRE(async_default[i]);
    REQUIRE(got[i].probs == ref.probs);
    REQUIRE(got[i].sums == ref.sums);
  }
}
