// The MPI executor thread and the process-wide MPI state (Note [One MPI executor]).
#include "tandem/comm/mpi/mpi_executor.h"

#include <algorithm>

#include "tandem/comm/mpi/mpi_check.h"
#include "tandem/comm/work.h"
#include "tandem/runtime/error.h"
#include "tandem/runtime/logging.h"

namespace tandem::mpi {
namespace {

// Idle passes of the executor thread (Note [MPI progress]): when a pass
// moved nothing, it sleeps, doubling the pause up to kMaxIdle, so a long
// collective overlapped with compute costs little CPU on oversubscribed
// machines. A waiting thread never sleeps between its passes.
constexpr std::chrono::microseconds kMinIdle{5};
constexpr std::chrono::microseconds kMaxIdle{50};
constexpr std::chrono::milliseconds kOrphanPoll{5};
// Note [Lazy executor wake-ups] (mpi_executor.h).
constexpr std::chrono::microseconds kSyncWindow{200};
constexpr std::chrono::milliseconds kLazyCheck{1};
constexpr std::chrono::milliseconds kLazyWindow{100};

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

void Executor::submit(std::shared_ptr<Channel> channel, std::unique_ptr<Task> task,
                      bool waited_soon) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!stopping_) {
      enqueue(Item{std::move(channel), std::move(task), MPI_COMM_NULL}, waited_soon);
      return;
    }
  }
  task->fail(std::make_exception_ptr(CommAbortedError(fmt::format(
      "[comm::mpi] {} failed at once: expected a running MPI backend, got one stopped by "
      "mpi_finalize()",
      task->label()))));
}

void Executor::enqueue(Item item, bool waited_soon) {
  const auto now = std::chrono::steady_clock::now();
  if (inbox_.empty()) inbox_since_ = now;
  inbox_.push_back(std::move(item));
  if (!waited_soon) ++eager_items_;
  last_submit_ = now;
  // A driver takes it in its next pass; the executor thread sleeps while one
  // drives, and is not woken for a launch expected to be waited right away
  // unless it sleeps until woken (Note [Lazy executor wake-ups]).
  if (drivers_ == 0 && (!waited_soon || !lazy_ || deep_idle_)) cv_.notify_one();
}

void Executor::release(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;  // MPI_Finalize reclaims it
  enqueue(Item{nullptr, nullptr, comm}, false);
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
  // A driver may be in a pass: no MPI call starts after this.
  std::lock_guard<std::mutex> progress(progress_mu_);
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

bool Executor::in_pass() const {
  return pass_thread_.load() == std::this_thread::get_id();
}

bool Executor::pass() {
  pass_thread_.store(std::this_thread::get_id());
  struct Leave {
    std::atomic<std::thread::id>& owner;
    ~Leave() { owner.store(std::thread::id()); }
  } leave{pass_thread_};
  bool arrived = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return false;
    taken_.swap(inbox_);
    eager_items_ = 0;
    arrived = !taken_.empty();
  }
  take(taken_);
  bool moved = progress_channels();
  progress_orphans();
  std::lock_guard<std::mutex> lock(mu_);
  has_tasks_ = !active_.empty();
  has_orphans_ = !orphans_.empty();
  return moved || arrived;
}

void Executor::try_pass() {
  if (in_pass()) return;
  std::unique_lock<std::mutex> progress(progress_mu_, std::try_to_lock);
  if (progress.owns_lock()) pass();
}

void Executor::waited(std::chrono::steady_clock::time_point launched) {
  const bool soon = std::chrono::steady_clock::now() - launched < kSyncWindow;
  std::lock_guard<std::mutex> lock(mu_);
  lazy_ = soon;
}

void Executor::drive(const std::function<bool()>& done,
                     std::chrono::steady_clock::time_point deadline) {
  if (in_pass()) return;  // a callback inside a pass: the caller waits instead
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;  // the executor thread drains what is queued
    ++drivers_;
  }
  while (!done() && std::chrono::steady_clock::now() < deadline) {
    // Another driver, or the executor thread finishing its pass, may hold
    // the lock: then this thread yields. A pass needs no yield of its own:
    // when nothing moved, MPI's progress engine yields (Open MPI does when
    // the node is oversubscribed), as in MPI_Wait.
    std::unique_lock<std::mutex> progress(progress_mu_, std::try_to_lock);
    if (progress.owns_lock()) {
      pass();
    } else {
      std::this_thread::yield();
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (--drivers_ == 0 && (has_tasks_ || !inbox_.empty()))
    cv_.notify_one();  // the executor thread takes over
}

void Executor::loop() {
  set_thread_name("comm mpi");
  set_log_context(LogContext{world_rank_, world_size_});
  auto idle = kMinIdle;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Sleeps while a waiting thread runs the passes (Note [MPI progress])
      // or there is nothing to do (Note [Lazy executor wake-ups]).
      auto ready = [&] {
        return stopping_ ||
               (drivers_ == 0 && (has_tasks_ || (!inbox_.empty() && (!lazy_ || eager_items_ > 0))));
      };
      while (!ready()) {
        idle = kMinIdle;
        const auto now = std::chrono::steady_clock::now();
        if (!inbox_.empty() && drivers_ == 0) {
          // Launches expected to be waited right away: their waiters take them.
          if (now - inbox_since_ >= kLazyCheck) {
            lazy_ = false;  // one was not: launches wake this thread again
            break;
          }
          cv_.wait_until(lock, inbox_since_ + kLazyCheck, ready);
        } else if (has_orphans_) {
          if (!cv_.wait_for(lock, kOrphanPoll, ready)) break;  // poll them
        } else if (drivers_ > 0 || (lazy_ && now - last_submit_ < kLazyWindow)) {
          // Drivers take new tasks, and lazy launches do not wake this
          // thread: it looks now and then.
          cv_.wait_for(lock, kLazyCheck,
                       [&] { return ready() || (!inbox_.empty() && drivers_ == 0); });
        } else {
          deep_idle_ = true;  // every launch wakes this thread
          cv_.wait(lock, [&] { return ready() || !inbox_.empty(); });
          deep_idle_ = false;
        }
      }
      if (stopping_ && inbox_.empty() && !has_tasks_) break;
      if (!stopping_ && drivers_ > 0) continue;
    }
    bool moved = false, busy = false;
    {
      std::lock_guard<std::mutex> progress(progress_mu_);
      moved = pass();
      std::lock_guard<std::mutex> lock(mu_);
      busy = has_tasks_;
    }
    if (moved) {
      idle = kMinIdle;
    } else if (busy) {
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
