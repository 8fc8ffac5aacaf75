// The MPI executor thread and the process-wide MPI state (Note [One MPI executor]).
#include "comm/mpi/mpi_executor.h"

#include <algorithm>

#include "comm/mpi/mpi_check.h"
#include "comm/work.h"
#include "runtime/error.h"
#include "runtime/logging.h"

namespace tandem::mpi {
namespace {

// Polling: when a pass over the channels moved nothing, the executor sleeps,
// doubling the pause up to kMaxIdle (50 µs: at 1 ms the polling granularity
// alone cost 10× on a 1 MiB collective), so a long collective costs little CPU on
// oversubscribed machines while a quick one still completes in microseconds.
constexpr std::chrono::microseconds kMinIdle{5};
constexpr std::chrono::microseconds kMaxIdle{50};
constexpr std::chrono::milliseconds kOrphanPoll{5};

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
    default:
      return "an unknown thread level";
  }
}

}  // namespace

void Channel::mark_unusable(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!unusable_) unusable_ = reason;
}

std::optional<std::string> Channel::unusable_reason() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unusable_;
}

Executor::Executor(int world_rank, int world_size, bool thread_multiple)
    : world_rank_(world_rank),
      world_size_(world_size),
      thread_multiple_(thread_multiple),
      world_channel_(std::make_shared<Channel>(MPI_COMM_WORLD)),
      thread_([this] { loop(); }) {}

Executor::~Executor() {
  stop();
}

void Executor::submit(std::shared_ptr<Channel> channel, std::unique_ptr<Task> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      inbox_.push_back(Item{std::move(channel), std::move(task), MPI_COMM_NULL});
      cv_.notify_one();
      return;
    }
  }
  task->fail(std::make_exception_ptr(CommAbortedError(fmt::format(
      "[comm::mpi] {} failed at once: expected a running MPI backend, got one stopped by "
      "mpi_finalize()",
      task->label()))));
}

void Executor::release(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;  // MPI_Finalize reclaims it
  inbox_.push_back(Item{nullptr, nullptr, comm});
  cv_.notify_one();
}

void Executor::adopt(Orphan orphan) {
  orphans_.push_back(std::move(orphan));
}

void Executor::stop() noexcept {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopping_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable() && !on_executor_thread()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  stopped_ = true;
}

void Executor::take(std::vector<Item>& items) {
  for (Item& item : items) {
    if (!item.task) {  // a release()
      MPI_Comm comm = item.release;
      int rc = MPI_Comm_free(&comm);
      if (rc != MPI_SUCCESS) log_warn("[comm::mpi] MPI_Comm_free failed: {}", error_string(rc));
      continue;
    }
    Channel& channel = *item.channel;
    channel.queue_.push_back(std::move(item.task));
    if (!channel.active_) {
      channel.active_ = true;
      active_.push_back(item.channel);
    }
  }
  items.clear();
}

void Executor::loop() {
  set_thread_name("comm mpi");
  set_log_context(LogContext{world_rank_, world_size_});
  std::vector<Item> items;
  auto idle = kMinIdle;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (inbox_.empty() && active_.empty()) {
        if (stopping_) break;
        if (orphans_.empty()) {
          cv_.wait(lock, [&] { return stopping_ || !inbox_.empty(); });
        } else {
          cv_.wait_for(lock, kOrphanPoll, [&] { return stopping_ || !inbox_.empty(); });
        }
      }
      items.swap(inbox_);
    }
    take(items);
    bool moved = progress_channels();
    progress_orphans();
    if (moved) {
      idle = kMinIdle;
    } else if (!active_.empty()) {
      std::this_thread::sleep_for(idle);
      idle = std::min(idle * 2, kMaxIdle);
    }
  }
}

bool Executor::progress_channels() {
  bool moved = false;
  for (size_t i = 0; i < active_.size();) {
    Channel& channel = *active_[i];
    while (!channel.queue_.empty()) {
      Task& task = *channel.queue_.front();
      bool done = false;
      if (std::optional<std::string> reason = channel.unusable_reason()) {
        task.fail(std::make_exception_ptr(CommAbortedError(fmt::format(
            "[comm::mpi] {} failed at once: expected a usable communicator, got one made "
            "unusable earlier: {}",
            task.label(), *reason))));
        done = true;
      } else {
        try {
          done = task.advance();
        } catch (...) {
          task.fail(std::current_exception());
          done = true;
        }
      }
      if (!done) break;
      moved = true;
      // Destroying a task may drop the last reference to its group, whose
      // destructor only posts to the inbox (release()); mu_ is not held here.
      std::unique_ptr<Task> finished = std::move(channel.queue_.front());
      channel.queue_.pop_front();
      finished.reset();
    }
    if (channel.queue_.empty()) {
      channel.active_ = false;
      active_[i] = std::move(active_.back());
      active_.pop_back();
    } else {
      ++i;
    }
  }
  return moved;
}

void Executor::progress_orphans() {
  if (orphans_.empty()) return;
  auto now = std::chrono::steady_clock::now();
  if (now < next_orphan_poll_) return;
  next_orphan_poll_ = now + kOrphanPoll;
  std::erase_if(orphans_, [](Orphan& orphan) {
    int flag = 0;
    int rc = MPI_Testall(static_cast<int>(orphan.requests.size()), orphan.requests.data(), &flag,
                         MPI_STATUSES_IGNORE);
    return rc != MPI_SUCCESS || flag != 0;  // an error completes the requests too
  });
}

// ---- the process-wide state ----

namespace {
std::mutex g_mu;
std::shared_ptr<Executor> g_executor;  // kept after finalize() so late calls fail clearly
bool g_finalized = false;
}  // namespace

std::shared_ptr<Executor> executor() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (g_executor && !g_finalized) return g_executor;
  int finalized = 0;
  MPI_Finalized(&finalized);
  TANDEM_CHECK(!g_finalized && finalized == 0,
               "[comm::mpi] expected an MPI that is not finalized, got one finalized "
               "(mpi_finalize() ends MPI for the process; it cannot be initialised again)");
  int initialized = 0;
  TANDEM_MPI_CHECK(MPI_Initialized(&initialized));
  int provided = MPI_THREAD_SINGLE;
  if (initialized == 0) {
    TANDEM_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
  } else {
    TANDEM_MPI_CHECK(MPI_Query_thread(&provided));
  }
  TANDEM_CHECK(provided >= MPI_THREAD_SERIALIZED,
               "[comm::mpi] expected MPI initialised with at least MPI_THREAD_SERIALIZED (the "
               "backend calls MPI from its own executor thread), got {}",
               thread_level_name(provided));
  int rank = 0, size = 0;
  TANDEM_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank));
  TANDEM_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
  set_process_log_context(LogContext{rank, size});
  if (provided != MPI_THREAD_MULTIPLE) {
    log_debug("[comm::mpi] MPI granted {}; only the executor thread calls MPI",
              thread_level_name(provided));
  }
  g_executor = std::make_shared<Executor>(rank, size, provided == MPI_THREAD_MULTIPLE);
  return g_executor;
}

void finalize() {
  std::shared_ptr<Executor> ex;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_finalized) return;
    g_finalized = true;
    ex = g_executor;
  }
  if (ex) ex->stop();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized != 0 && finalized == 0) TANDEM_MPI_CHECK(MPI_Finalize());
}

}  // namespace tandem::mpi
