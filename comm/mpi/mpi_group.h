// MpiProcessGroup and the tasks its launches become (internal to comm/mpi/).
#pragma once

#include <mpi.h>

#include <atomic>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "tandem/comm/mpi/mpi_board.h"
#include "tandem/comm/mpi/mpi_executor.h"
#include "tandem/comm/process_group.h"

namespace tandem::mpi {

class MpiProcessGroup final : public ProcessGroup {
 public:
  // Takes ownership of `comm` (freed on the executor when the group goes).
  MpiProcessGroup(std::shared_ptr<Executor> executor, MPI_Comm comm, int rank,
                  std::vector<int> world_ranks, ProcessGroupOptions options);
  ~MpiProcessGroup() override;

  std::string backend_name() const override { return "mpi"; }
  Executor& executor() const { return *executor_; }
  const std::shared_ptr<Channel>& channel() const { return channel_; }
  MPI_Comm comm() const { return channel_->comm(); }

  // mpi_check_entry() (mpi_backend.h).
  WorkPtr check_entry(const LedgerEntry& entry);

  // Note [MPI fingerprint board]. set_up_board() queues the set-up as the
  // group's first task (right after construction; checked mode only). The
  // rest runs in passes, under the executor's progress lock.
  void set_up_board();
  Board* board() const { return board_.get(); }
  void set_board(std::unique_ptr<Board> board) {
    board_ = std::move(board);
    has_board_.store(board_ != nullptr);
  }
  uint64_t next_handshake() { return handshakes_++; }
  // Whether the set-up has ended with a board in use (tests; any thread).
  bool uses_board() const { return has_board_.load(); }
  [[noreturn]] void unsupported_kind(CollectiveKind kind) const {
    unsupported(collective_name(kind));
  }

 protected:
  void launch(Collective& c) override;
  // A Work whose waiters run the executor's passes (Note [MPI progress]).
  WorkPtr make_work(std::string description) override;
  std::shared_ptr<ProcessGroup> make_subgroup(const std::vector<int>& ranks, int new_rank,
                                              const std::string& name) override;

 private:
  std::shared_ptr<MpiProcessGroup> self();

  std::shared_ptr<Executor> executor_;
  std::shared_ptr<Channel> channel_;
  std::unique_ptr<Board> board_;
  uint64_t handshakes_ = 0;
  std::atomic<bool> has_board_{false};
};

// The tasks of mpi_tasks.cpp. Each keeps its group alive until it finishes.
std::unique_ptr<Task> collective_task(std::shared_ptr<MpiProcessGroup> group, Collective c);
// The checked-mode exchange alone; finishes `work`.
std::unique_ptr<Task> check_task(std::shared_ptr<MpiProcessGroup> group, LedgerEntry entry,
                                 WorkPtr work);
// MPI_Comm_split of the group's communicator after a bounded handshake on
// `entry` (op "split", counts = the group ranks); MPI_COMM_NULL for
// non-members (new_rank < 0).
std::unique_ptr<Task> split_task(std::shared_ptr<MpiProcessGroup> group, LedgerEntry entry,
                                 int new_rank, std::promise<MPI_Comm> result);
// Note [MPI fingerprint board]: maps the group's board, or decides it has none.
std::unique_ptr<Task> board_task(std::shared_ptr<MpiProcessGroup> group);

}  // namespace tandem::mpi
