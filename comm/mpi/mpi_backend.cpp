// MpiProcessGroup, mpi_world and mpi_finalize (mpi_backend.h). The tasks a
// launch becomes are in mpi_tasks.cpp; the executor that runs them in
// mpi_executor.cpp.
#include "tandem/comm/mpi/mpi_backend.h"

#include <cstdlib>
#include <numeric>

#include "tandem/comm/mpi/mpi_check.h"
#include "tandem/comm/mpi/mpi_group.h"
#include "tandem/runtime/config.h"
#include "tandem/runtime/logging.h"

namespace tandem {
namespace mpi {
namespace {

using Clock = std::chrono::steady_clock;

// Extra time a caller waits for a setup task beyond the task's own bound
// (the task may sit behind earlier, themselves bounded, tasks).
constexpr std::chrono::seconds kSetupMargin{5};

void check_cpu(const Tensor& t, const ProcessGroup& group, const char* op) {
  TANDEM_CHECK(!t.defined() || t.device().is_cpu(),
               "[comm::{}] expected CPU tensors for the mpi backend, got a tensor on {} ({})", op,
               t.device().str(), group.where());
}

// Waits for a setup task's result (bounded) and rethrows its error.
MPI_Comm take(std::future<MPI_Comm>& result, const std::string& what) {
  auto bound = wait_timeout() + kSetupMargin;
  if (result.wait_for(bound) != std::future_status::ready) {
    throw TimeoutError(fmt::format(
        "[comm::mpi] expected {} to complete within {} ms, got no result (the MPI executor is "
        "stalled behind earlier collectives)",
        what, std::chrono::duration_cast<std::chrono::milliseconds>(bound).count()));
  }
  return result.get();
}

// MPI_Comm_idup of MPI_COMM_WORLD on the executor's world channel, bounded
// (mpi_world).
class DupWorldTask final : public Task {
 public:
  DupWorldTask(Executor& executor, std::chrono::milliseconds timeout, std::promise<MPI_Comm> result)
      : executor_(executor),
        timeout_(timeout),
        result_(std::move(result)),
        comm_(std::make_shared<MPI_Comm>(MPI_COMM_NULL)) {}

  std::string label() const override {
    return fmt::format("rank={}/{} mpi_world", executor_.world_rank(), executor_.world_size());
  }

  bool advance() override {
    if (!posted_) {
      TANDEM_MPI_CHECK(MPI_Comm_idup(MPI_COMM_WORLD, comm_.get(), &request_));
      posted_ = true;
      deadline_ = Clock::now() + timeout_;
    }
    int flag = 0;
    TANDEM_MPI_CHECK(MPI_Test(&request_, &flag, MPI_STATUS_IGNORE));
    if (flag != 0) {
      TANDEM_MPI_CHECK(MPI_Comm_set_errhandler(*comm_, MPI_ERRORS_RETURN));
      result_.set_value(*comm_);
      delivered_ = true;
      return true;
    }
    if (Clock::now() > deadline_) {
      std::string report = fmt::format(
          "[comm::watchdog] {} waited {} ms for every process of MPI_COMM_WORLD to call "
          "mpi_world (MPI_Comm_idup); a collective cannot be cancelled, so the MPI backend "
          "cannot create world groups in this process any more",
          label(), timeout_.count());
      executor_.adopt(Orphan{{request_}, comm_});
      executor_.world_channel()->mark_unusable(report);
      log_error("{}", report);
      throw TimeoutError(report);
    }
    return false;
  }

  void fail(std::exception_ptr error) noexcept override {
    if (!delivered_) result_.set_exception(error);
    delivered_ = true;
  }

 private:
  Executor& executor_;  // the process's executor, which runs this task
  std::chrono::milliseconds timeout_;
  std::promise<MPI_Comm> result_;
  std::shared_ptr<MPI_Comm> comm_;  // written by MPI when the idup completes
  MPI_Request request_ = MPI_REQUEST_NULL;
  bool posted_ = false;
  bool delivered_ = false;
  Clock::time_point deadline_;
};

// The Work of a collective of this backend: a thread that waits on it runs
// the executor's passes itself (Note [MPI progress]).
class MpiWork final : public Work {
 public:
  MpiWork(std::string description, std::shared_ptr<Executor> executor)
      : Work(std::move(description)),
        executor_(std::move(executor)),
        launched_(std::chrono::steady_clock::now()) {}

  void synchronize() override {
    if (!executor_->on_executor_thread()) {
      if (!waited_.exchange(true)) executor_->waited(launched_);
      // Bounded like Work::synchronize(), which reports the timeout.
      if (!Work::is_completed()) {
        CommWaitScope waiting;
        executor_->drive([this] { return Work::is_completed(); },
                         std::chrono::steady_clock::now() + wait_timeout());
      }
    }
    Work::synchronize();
  }

  bool is_completed() override {
    if (!Work::is_completed() && !executor_->on_executor_thread()) executor_->try_pass();
    return Work::is_completed();
  }

 private:
  std::shared_ptr<Executor> executor_;
  std::chrono::steady_clock::time_point launched_;  // about when the task was submitted
  std::atomic<bool> waited_{false};
};

}  // namespace

MpiProcessGroup::MpiProcessGroup(std::shared_ptr<Executor> executor, MPI_Comm comm, int rank,
                                 std::vector<int> world_ranks, ProcessGroupOptions options)
    : ProcessGroup(rank, static_cast<int>(world_ranks.size()), world_ranks, std::move(options)),
      executor_(std::move(executor)),
      channel_(std::make_shared<Channel>(comm)) {}

// Runs once no task holds the group any more (tasks keep it alive), so the
// communicator has nothing queued; orphans keep their own buffers.
MpiProcessGroup::~MpiProcessGroup() {
  executor_->release(channel_->comm());
}

std::shared_ptr<MpiProcessGroup> MpiProcessGroup::self() {
  return std::static_pointer_cast<MpiProcessGroup>(shared_from_this());
}

void MpiProcessGroup::launch(Collective& c) {
  const char* name = collective_name(c.kind);
  check_cpu(c.input, *this, name);
  check_cpu(c.output, *this, name);
  for (const P2POp& op : c.p2p)
    check_cpu(op.tensor, *this, name);
  if (std::optional<std::string> reason = channel_->unusable_reason()) {
    c.work->finish(std::make_exception_ptr(CommAbortedError(fmt::format(
        "[comm::mpi] {} #{} {} failed at once: expected a usable communicator, got one made "
        "unusable earlier: {}",
        where(), c.entry.seq, name, *reason))));
    return;
  }
  // The front end no longer uses `c` once launch() returns. An MpiWork's
  // waiter drives the task (a wrapper's Work has no such waiter).
  const bool driven = dynamic_cast<MpiWork*>(c.work.get()) != nullptr;
  executor_->submit(channel_, collective_task(self(), std::move(c)), driven);
}

void MpiProcessGroup::set_up_board() {
  if (!options().checked || size() == 1) return;
  if (const char* env = std::getenv("TANDEM_MPI_BOARD"); env != nullptr && std::string(env) == "0")
    return;
  executor_->submit(channel_, board_task(self()));
}

WorkPtr MpiProcessGroup::make_work(std::string description) {
  return std::make_shared<MpiWork>(std::move(description), executor_);
}

WorkPtr MpiProcessGroup::check_entry(const LedgerEntry& entry) {
  auto work =
      std::make_shared<Work>(fmt::format("checked exchange of {} ({})", entry.str(), where()));
  executor_->submit(channel_, check_task(self(), entry, work));
  return work;
}

std::shared_ptr<ProcessGroup> MpiProcessGroup::make_subgroup(const std::vector<int>& ranks,
                                                             int new_rank,
                                                             const std::string& name) {
  LedgerEntry entry;
  entry.op = "split";
  entry.counts.assign(ranks.begin(), ranks.end());
  entry.thread = thread_name();
  entry.tag = name;
  std::promise<MPI_Comm> promise;
  std::future<MPI_Comm> result = promise.get_future();
  {
    // Same lock as the front end's launches: the split takes its place in
    // the parent's launch order (Note [Issue lock]).
    std::lock_guard<std::mutex> lock(comm_issue_mutex());
    entry = ledger().append(entry);
    executor_->submit(channel_, split_task(self(), entry, new_rank, std::move(promise)));
  }
  MPI_Comm comm = take(result, fmt::format("split #{} of {}", entry.seq, where()));
  if (new_rank < 0) return nullptr;
  std::vector<int> members;
  members.reserve(ranks.size());
  for (int r : ranks)
    members.push_back(world_ranks()[r]);
  ProcessGroupOptions sub = options();
  sub.name = name;
  auto group =
      std::make_shared<MpiProcessGroup>(executor_, comm, new_rank, std::move(members), sub);
  group->set_up_board();
  return group;
}

}  // namespace mpi

ProcessGroupPtr mpi_world(ProcessGroupOptions options) {
  std::shared_ptr<mpi::Executor> ex = mpi::executor();
  std::promise<MPI_Comm> promise;
  std::future<MPI_Comm> result = promise.get_future();
  // A world group is setup, not a training collective: it waits for the
  // slowest process up to wait_timeout(), not the group's (maybe tiny) timeout.
  ex->submit(ex->world_channel(),
             std::make_unique<mpi::DupWorldTask>(*ex, wait_timeout(), std::move(promise)));
  MPI_Comm comm = mpi::take(result, "mpi_world");
  std::vector<int> ranks(static_cast<size_t>(ex->world_size()));
  std::iota(ranks.begin(), ranks.end(), 0);
  auto group = std::make_shared<mpi::MpiProcessGroup>(ex, comm, ex->world_rank(), std::move(ranks),
                                                      std::move(options));
  group->set_up_board();
  return group;
}

void mpi_finalize() {
  mpi::finalize();
}

bool mpi_built() {
  return true;
}

WorkPtr mpi_check_entry(ProcessGroup& group, const LedgerEntry& entry) {
  auto* mpi_group = dynamic_cast<mpi::MpiProcessGroup*>(&group);
  TANDEM_CHECK(mpi_group != nullptr,
               "[comm::mpi_check_entry] expected a group of the mpi backend, got backend {} ({})",
               group.backend_name(), group.where());
  return mpi_group->check_entry(entry);
}

}  // namespace tandem
