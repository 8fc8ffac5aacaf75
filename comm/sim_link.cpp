// The simulated-link wrapper and its timer thread (Note [Simulated link
// timing] in comm/sim_link.h).
#include "tandem/comm/sim_link.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"
#include "tandem/runtime/trace.h"

namespace tandem {

LinkCost LinkModel::cost(CollectiveKind kind) const {
  auto it = overrides.find(kind);
  return it != overrides.end() ? it->second : LinkCost{latency_us, bandwidth_gbps};
}

double LinkModel::transfer_us(CollectiveKind kind, double bytes) const {
  LinkCost c = cost(kind);
  // bytes / (GB/s · 10^9) seconds = bytes / (GB/s · 10^3) microseconds.
  return c.latency_us + bytes / (c.bandwidth_gbps * 1e3);
}

LinkModel LinkModel::nvlink() {
  return LinkModel{2.0, 450.0, {}};
}

LinkModel LinkModel::infiniband() {
  return LinkModel{5.0, 50.0, {}};
}

namespace {

using Clock = std::chrono::steady_clock;

// The process's one timer thread: runs each scheduled callback once its
// deadline has passed, sleeping in between (no polling). It is the one
// process-wide object of the simulated links, holding nothing but pending
// deadlines; started on first use, joined at exit (pending callbacks are then
// dropped: the process is ending).
class LinkTimer {
 public:
  static LinkTimer& get() {
    static LinkTimer timer;
    return timer;
  }

  void at(Clock::time_point deadline, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(Entry{deadline, next_seq_++, std::move(fn)});
      std::push_heap(queue_.begin(), queue_.end(), Later{});
    }
    cv_.notify_one();
  }

 private:
  struct Entry {
    Clock::time_point deadline;
    uint64_t seq;  // FIFO among equal deadlines
    std::function<void()> fn;
  };
  // Orders the heap so that front() is the earliest deadline.
  struct Later {
    bool operator()(const Entry& a, const Entry& b) const {
      return a.deadline != b.deadline ? a.deadline > b.deadline : a.seq > b.seq;
    }
  };

  LinkTimer() : thread_([this] { loop(); }) {}
  ~LinkTimer() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_one();
    thread_.join();
  }

  void loop() {
    set_thread_name("sim link timer");
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (queue_.empty()) {
        cv_.wait(lock);
        continue;
      }
      Clock::time_point deadline = queue_.front().deadline;
      if (Clock::now() < deadline) {
        cv_.wait_until(lock, deadline);  // an earlier deadline may arrive meanwhile
        continue;
      }
      std::pop_heap(queue_.begin(), queue_.end(), Later{});
      std::function<void()> fn = std::move(queue_.back().fn);
      queue_.pop_back();
      lock.unlock();
      fn();  // Work::finish never throws
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Entry> queue_;  // a heap under Later
  uint64_t next_seq_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

// Bytes of one row (dim 0 slice) of `t`.
double row_bytes(const Tensor& t) {
  double n = static_cast<double>(t.element_size());
  for (int d = 1; d < t.dim(); ++d)
    n *= static_cast<double>(t.shape()[d]);
  return n;
}

// What each rank sends over the link (Note [Simulated link timing]).
double link_bytes(const Collective& c, int rank, int size) {
  const double fraction = static_cast<double>(size - 1) / size;
  switch (c.kind) {
    case CollectiveKind::AllReduce:
      return 2.0 * fraction * static_cast<double>(c.input.nbytes());
    case CollectiveKind::Broadcast:
      return static_cast<double>(c.input.nbytes());
    case CollectiveKind::AllGather:
      return fraction * static_cast<double>(c.output.nbytes());
    case CollectiveKind::ReduceScatter:
      return fraction * static_cast<double>(c.input.nbytes());
    case CollectiveKind::AllToAll: {
      int64_t sent = 0, received = 0;
      for (int r = 0; r < size; ++r) {
        if (r == rank) continue;
        sent += c.input_splits[r];
        received += c.output_splits[r];
      }
      return static_cast<double>(std::max(sent, received)) * row_bytes(c.input);
    }
    case CollectiveKind::Send:
    case CollectiveKind::Recv:
    case CollectiveKind::BatchP2P: {
      double sent = 0, received = 0;
      for (const P2POp& op : c.p2p) {
        (op.kind == P2POp::Kind::Send ? sent : received) += static_cast<double>(op.tensor.nbytes());
      }
      return std::max(sent, received);
    }
    case CollectiveKind::Barrier:
      return 0;
  }
  return 0;
}

// The kind whose cost applies: a batch of one send or one recv is that op.
CollectiveKind cost_kind(const Collective& c) {
  if (c.kind == CollectiveKind::BatchP2P && c.p2p.size() == 1) {
    return c.p2p[0].kind == P2POp::Kind::Send ? CollectiveKind::Send : CollectiveKind::Recv;
  }
  return c.kind;
}

// Hands a collective to another group's launch(). ProcessGroup::launch is
// protected, and a derived class may reach a protected member of another
// object only through a pointer to member formed with its own name.
struct LaunchAccess : ProcessGroup {
  static void forward(ProcessGroup& group, Collective& c) {
    void (ProcessGroup::*launch_fn)(Collective&) = &LaunchAccess::launch;
    (group.*launch_fn)(c);
  }
  static std::mutex& issue_mutex_of(const ProcessGroup& group) {
    std::mutex& (ProcessGroup::*fn)() const = &LaunchAccess::issue_mutex;
    return (group.*fn)();
  }
};

class SimLinkProcessGroup final : public ProcessGroup {
 public:
  SimLinkProcessGroup(ProcessGroupPtr inner, LinkModel model)
      : ProcessGroup(inner->rank(), inner->size(), inner->world_ranks(), inner->options()),
        inner_(std::move(inner)),
        model_(std::move(model)),
        lane_(fmt::format("link r{} {}", rank(), options().name)) {}

  std::string backend_name() const override { return "sim(" + inner_->backend_name() + ")"; }

 protected:
  // The inner group's: launches through this wrapper and straight on the
  // inner group are one sequence (Note [Issue lock]).
  std::mutex& issue_mutex() const override { return LaunchAccess::issue_mutex_of(*inner_); }

  // Runs under the issue lock (Note [Issue lock]), which is why the inner
  // group's front end (inner_->all_reduce(...)) cannot be called here: it
  // takes that lock again. The collective is already validated, contiguous
  // and along dim 0, so it goes to the inner backend as it is, writing
  // straight into this call's outputs, and the inner ledger records it at the
  // same point of the launch order as ours.
  void launch(Collective& c) override {
    const Clock::time_point now = Clock::now();
    Collective forwarded = c;
    forwarded.entry = inner_->ledger().append(c.entry);
    forwarded.work =
        std::make_shared<Work>(fmt::format("{} ({})", collective_name(c.kind), inner_->where()));
    forwarded.work->set_outputs(c.work->results());
    WorkPtr inner_work = forwarded.work;
    LaunchAccess::forward(*inner_, forwarded);

    WorkPtr outer = c.work;
    // The callback runs inside inner_work->finish(), which keeps it alive.
    Work* inner_raw = inner_work.get();
    if (size() == 1) {
      inner_work->on_completion([outer, inner_raw] { outer->finish(inner_raw->error()); });
      return;
    }
    const double bytes = link_bytes(c, rank(), size());
    const double us = model_.transfer_us(cost_kind(c), bytes);
    const Clock::time_point start = std::max(now, link_free_);
    const Clock::time_point deadline = start + std::chrono::duration_cast<Clock::duration>(
                                                   std::chrono::duration<double, std::micro>(us));
    link_free_ = deadline;
    if (trace_enabled()) {
      int64_t start_us = trace_now_us() +
                         std::chrono::duration_cast<std::chrono::microseconds>(start - now).count();
      trace_complete("link", fmt::format("{} #{}", collective_name(c.kind), c.entry.seq), start_us,
                     std::llround(us),
                     fmt::format("\"seq\":{},\"group\":\"{}\",\"bytes\":{:.0f}", c.entry.seq,
                                 options().name, bytes),
                     lane_);
    }
    inner_work->on_completion([outer, inner_raw, deadline] {
      std::exception_ptr error = inner_raw->error();
      if (error || Clock::now() >= deadline) {
        outer->finish(error);
        return;
      }
      LinkTimer::get().at(deadline, [outer] { outer->finish(); });
    });
  }

  std::shared_ptr<ProcessGroup> make_subgroup(const std::vector<int>& ranks, int /*new_rank*/,
                                              const std::string& name) override {
    // Every member splits the inner group too, so its split order stays ours.
    ProcessGroupPtr sub = inner_->split(ranks, name);
    if (!sub) return nullptr;
    return std::make_shared<SimLinkProcessGroup>(std::move(sub), model_);
  }

 private:
  ProcessGroupPtr inner_;
  LinkModel model_;
  std::string lane_;
  // When the last collective issued on this group leaves the link. Only
  // launch() touches it, under the issue lock.
  Clock::time_point link_free_{};
};

void check_cost(const LinkCost& cost, const char* what) {
  TANDEM_CHECK(cost.latency_us >= 0 && cost.bandwidth_gbps > 0,
               "[comm::simulate_link] expected {} latency >= 0 and bandwidth > 0, got latency={} "
               "us bandwidth={} GB/s",
               what, cost.latency_us, cost.bandwidth_gbps);
}

}  // namespace

ProcessGroupPtr simulate_link(ProcessGroupPtr inner, LinkModel model) {
  TANDEM_CHECK(inner != nullptr, "[comm::simulate_link] expected an inner group, got nullptr");
  check_cost(LinkCost{model.latency_us, model.bandwidth_gbps}, "the model's");
  for (const auto& [kind, cost] : model.overrides)
    check_cost(cost, collective_name(kind));
  return std::make_shared<SimLinkProcessGroup>(std::move(inner), std::move(model));
}

}  // namespace tandem
