// Stream and Event semantics on CPU (Note [Stream ordering]): async streams are
// FIFO executors, events order one stream after another, errors are sticky
// until synchronize(), and every host wait is bounded (Note [Bounded waits]).
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "tandem/runtime/error.h"
#include "tandem/runtime/stream.h"
#include "tests/support/test_util.h"

using namespace tandem;
using Catch::Matchers::Contains;
using tandem::test::Gate;
using tandem::test::ScopedWaitTimeout;
using tandem::test::sleep_ms;

TEST_CASE("async CPU stream runs tasks in FIFO order on its own thread", "[stream]") {
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Async, "fifo");
  REQUIRE_FALSE(s.is_inline());
  REQUIRE(s.device() == Device::cpu());
  REQUIRE(s.name() == "fifo");
  REQUIRE(s.native_handle() == nullptr);

  std::vector<int> order;  // touched only by the stream thread until synchronize()
  std::thread::id stream_thread;
  constexpr int kTasks = 1000;
  for (int i = 0; i < kTasks; ++i) {
    s.enqueue([&order, &stream_thread, i] {
      if (i % 97 == 0) sleep_ms(1);  // uneven task lengths must not reorder
      order.push_back(i);
      stream_thread = std::this_thread::get_id();
    });
  }
  s.synchronize();
  REQUIRE(s.query());
  REQUIRE(order.size() == static_cast<size_t>(kTasks));
  for (int i = 0; i < kTasks; ++i)
    REQUIRE(order[i] == i);
  REQUIRE(stream_thread != std::this_thread::get_id());
}

TEST_CASE("stream ids are unique and names default to device/stream<id>", "[stream]") {
  Stream a = Stream::create(Device::cpu(), CpuStreamMode::Async);
  Stream b = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  REQUIRE(a.id() != b.id());
  REQUIRE(a.id() != 0);
  REQUIRE_FALSE(a == b);
  Stream a2 = a;
  REQUIRE(a2 == a);
  REQUIRE(a.name() == "cpu/stream" + std::to_string(a.id()));
  REQUIRE_FALSE(Stream().defined());
  REQUIRE(Stream().id() == 0);
}

TEST_CASE("query reports pending work on an async stream", "[stream]") {
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Async);
  Gate gate;
  s.enqueue(gate.waiter());
  Event e;
  e.record(s);
  REQUIRE(e.recorded());
  REQUIRE_FALSE(s.query());
  REQUIRE_FALSE(e.query());
  gate.open();
  e.synchronize();
  REQUIRE(e.query());
  s.synchronize();
  REQUIRE(s.query());
}

TEST_CASE("event record/wait orders a consumer stream after a producer", "[stream]") {
  Stream producer = Stream::create(Device::cpu(), CpuStreamMode::Async, "producer");
  Stream consumer = Stream::create(Device::cpu(), CpuStreamMode::Async, "consumer");
  // Plain ints: the event is the only thing ordering the write before the read.
  int value = 0;
  int seen = -1;
  producer.enqueue([&value] {
    sleep_ms(100);
    value = 42;
  });
  Event e;
  e.record(producer);
  e.wait(consumer);
  consumer.enqueue([&value, &seen] { seen = value; });
  consumer.synchronize();
  REQUIRE(seen == 42);
  producer.synchronize();
}

TEST_CASE("an event recorded again is waited at the generation current at wait()", "[stream]") {
  Stream producer = Stream::create(Device::cpu(), CpuStreamMode::Async);
  Stream consumer = Stream::create(Device::cpu(), CpuStreamMode::Async);
  Gate second;
  std::atomic<int> stage{0};
  int seen = -1;
  Event e;
  producer.enqueue([&stage] { stage = 1; });
  e.record(producer);
  e.wait(consumer);  // waits for record #1 only
  producer.enqueue(second.waiter());
  producer.enqueue([&stage] { stage = 2; });
  e.record(producer);  // record #2 stays pending until the gate opens
  consumer.enqueue([&stage, &seen] { seen = stage.load(); });
  consumer.synchronize();  // would time out if it waited for record #2
  REQUIRE(seen == 1);
  REQUIRE_FALSE(e.query());
  second.open();
  e.synchronize();
  REQUIRE(stage == 2);
  REQUIRE(e.query());
}

TEST_CASE("Event::synchronize blocks the host until the record completes", "[stream]") {
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Async);
  std::atomic<bool> done{false};
  s.enqueue([&done] {
    sleep_ms(50);
    done = true;
  });
  Event e;
  e.record(s);
  e.synchronize();
  REQUIRE(done);
  REQUIRE(e.query());
}

TEST_CASE("elapsed_ms measures at least the time slept between two records", "[stream]") {
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Async);
  Event start, end;
  start.record(s);
  s.enqueue([] { sleep_ms(60); });
  end.record(s);
  float ms = start.elapsed_ms(end);
  REQUIRE(ms >= 59.0f);
  REQUIRE(ms < 10000.0f);
  // Reversed order gives a negative duration.
  REQUIRE(end.elapsed_ms(start) <= -59.0f);
}

TEST_CASE("elapsed_ms needs both events recorded", "[stream]") {
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  Event start, end;
  start.record(s);
  REQUIRE_THROWS_WITH(start.elapsed_ms(end), Contains("expected both events recorded"));
}

TEST_CASE("waiting on a never-recorded event is a no-op", "[stream]") {
  Event e;
  REQUIRE_FALSE(e.recorded());
  REQUIRE(e.query());
  e.synchronize();  // returns at once

  Stream async = Stream::create(Device::cpu(), CpuStreamMode::Async);
  Stream inl = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  bool ran_async = false;
  e.wait(async);
  async.enqueue([&ran_async] { ran_async = true; });
  async.synchronize();
  REQUIRE(ran_async);

  bool ran_inline = false;
  e.wait(inl);
  inl.enqueue([&ran_inline] { ran_inline = true; });
  REQUIRE(ran_inline);
}

TEST_CASE("an error in an async stream task surfaces at synchronize()", "[stream]") {
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Async, "failing");
  Stream waiter = Stream::create(Device::cpu(), CpuStreamMode::Async, "waiter");
  bool before = false, after = false, released = false;
  s.enqueue([&before] { before = true; });
  s.enqueue([] { throw Error("[test::task] expected success, got boom"); });
  s.enqueue([&after] { after = true; });  // skipped: the stream holds an error
  Event e;
  e.record(s);  // event completions always run
  e.wait(waiter);
  waiter.enqueue([&released] { released = true; });

  waiter.synchronize();  // would time out if the record had been skipped
  REQUIRE(released);
  REQUIRE(e.query());

  REQUIRE_THROWS_WITH(s.synchronize(), Contains("got boom"));
  REQUIRE(before);
  REQUIRE_FALSE(after);

  // The error is taken by synchronize(): the stream works again.
  bool later = false;
  s.enqueue([&later] { later = true; });
  REQUIRE_NOTHROW(s.synchronize());
  REQUIRE(later);
}

TEST_CASE("only the first error of an async stream is reported", "[stream]") {
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Async);
  s.enqueue([] { throw Error("first failure"); });
  s.enqueue([] { throw Error("second failure"); });
  REQUIRE_THROWS_WITH(s.synchronize(), Contains("first failure"));
  REQUIRE_NOTHROW(s.synchronize());
}

TEST_CASE("waits on a stalled stream time out with TimeoutError", "[stream]") {
  Stream stalled = Stream::create(Device::cpu(), CpuStreamMode::Async, "stalled-stream");
  Gate gate;  // declared after the stream: opened before the stream is joined
  stalled.enqueue(gate.waiter());
  Event e;
  e.record(stalled);
  const auto original = wait_timeout();
  {
    ScopedWaitTimeout timeout(std::chrono::milliseconds(200));
    REQUIRE(wait_timeout() == std::chrono::milliseconds(200));

    SECTION("Event::synchronize") {
      auto t0 = std::chrono::steady_clock::now();
      try {
        e.synchronize();
        FAIL("Event::synchronize on a stalled stream returned");
      } catch (const TimeoutError& err) {
        std::string msg = err.what();
        REQUIRE_THAT(msg, Contains("Event::synchronize"));
        REQUIRE_THAT(msg, Contains("200 ms"));
        REQUIRE_THAT(msg, Contains("record #1"));
      }
      auto waited = std::chrono::steady_clock::now() - t0;
      REQUIRE(waited >= std::chrono::milliseconds(190));
      REQUIRE(waited < std::chrono::seconds(30));
    }
    SECTION("Stream::synchronize names the stream") {
      try {
        stalled.synchronize();
        FAIL("Stream::synchronize on a stalled stream returned");
      } catch (const TimeoutError& err) {
        REQUIRE_THAT(std::string(err.what()), Contains("stalled-stream"));
      }
    }
    SECTION("an inline stream waiting on the event") {
      Stream inl = Stream::create(Device::cpu(), CpuStreamMode::Inline);
      REQUIRE_THROWS_AS(e.wait(inl), TimeoutError);
      REQUIRE_THROWS_WITH(e.wait(inl), Contains("inline stream wait"));
    }
    // A TimeoutError is a tandem::Error (and a std::runtime_error).
    REQUIRE_THROWS_AS(e.synchronize(), Error);
  }
  REQUIRE(wait_timeout() == original);
  gate.open();
  e.synchronize();
  stalled.synchronize();
  REQUIRE(e.query());
}

TEST_CASE("set_wait_timeout rejects a non-positive timeout", "[stream]") {
  const auto original = wait_timeout();
  REQUIRE_THROWS_AS(set_wait_timeout(std::chrono::milliseconds(0)), Error);
  REQUIRE(wait_timeout() == original);
}

TEST_CASE("StreamGuard sets and restores the thread's current stream", "[stream]") {
  const Stream before = current_stream(Device::cpu());
  REQUIRE(before.defined());
  REQUIRE(current_stream(Device::cpu()) == before);  // stable across calls
  Stream a = Stream::create(Device::cpu(), CpuStreamMode::Async);
  Stream b = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  {
    StreamGuard ga(a);
    REQUIRE(current_stream(Device::cpu()) == a);
    {
      StreamGuard gb(b);
      REQUIRE(current_stream(Device::cpu()) == b);
      // Another thread keeps its own current stream.
      Stream other;
      std::thread t([&other] { other = current_stream(Device::cpu()); });
      t.join();
      REQUIRE(other.defined());
      REQUIRE_FALSE(other == b);
      REQUIRE_FALSE(other == a);
      REQUIRE_FALSE(other == before);
    }
    REQUIRE(current_stream(Device::cpu()) == a);
  }
  REQUIRE(current_stream(Device::cpu()) == before);

  set_current_stream(a);
  REQUIRE(current_stream(Device::cpu()) == a);
  set_current_stream(before);
  REQUIRE(current_stream(Device::cpu()) == before);
  REQUIRE_THROWS_AS(set_current_stream(Stream()), Error);
}

TEST_CASE("the default CPU stream follows default_cpu_stream_mode", "[stream]") {
  const CpuStreamMode original = default_cpu_stream_mode();
  for (CpuStreamMode mode : {CpuStreamMode::Inline, CpuStreamMode::Async}) {
    set_default_cpu_stream_mode(mode);
    bool is_inline = false;
    std::string name;
    std::thread t([&] {
      is_inline = current_stream(Device::cpu()).is_inline();
      name = current_stream(Device::cpu()).name();
    });
    t.join();
    REQUIRE(is_inline == (mode == CpuStreamMode::Inline));
    REQUIRE(name == "cpu/default");
  }
  set_default_cpu_stream_mode(original);
}

TEST_CASE("inline streams run work immediately on the caller", "[stream]") {
  Stream s = Stream::create(Device::cpu(), CpuStreamMode::Inline);
  REQUIRE(s.is_inline());
  bool ran = false;
  std::thread::id where;
  s.enqueue([&] {
    ran = true;
    where = std::this_thread::get_id();
  });
  REQUIRE(ran);  // before any synchronize
  REQUIRE(where == std::this_thread::get_id());
  REQUIRE(s.query());

  bool ran_async_api = false;
  s.enqueue_async([&ran_async_api] { ran_async_api = true; }, false);
  REQUIRE(ran_async_api);

  // Errors propagate directly instead of being deferred.
  REQUIRE_THROWS_WITH(s.enqueue([] { throw Error("inline failure"); }), Contains("inline failure"));
  REQUIRE_NOTHROW(s.synchronize());

  Event e;
  e.record(s);
  REQUIRE(e.query());  // an inline record completes at once
  e.synchronize();
}
