// The threads backend: N ranks as threads of one process, moving real data
// through shared memory (DESIGN §5). The default for the Catch2 suites and for
// the single-machine demo.
//
// A collective is a round of its group (Note [Threads rounds] in
// threads_backend.cpp): launch() posts the rank's input and output without
// waiting, and once every rank has posted, each rank's output is written
// from the peers' inputs by whichever thread drives the round first, usually
// the rank's own thread waiting on its Work, so a synchronous collective
// costs no hand-off to another thread. Each rank's group keeps a comm thread
// for launches that must wait before posting (an input on an asynchronous
// stream) and for point-to-point batches. Reductions add in rank order on
// every rank, so results are bit-identical across ranks. Every wait is
// bounded by the group's timeout; on expiry (or when a rank fails) the group
// is aborted and every member's pending and future collectives fail with a
// message naming the rank and the call (Note [Bounded waits]).
#pragma once

#include <functional>
#include <memory>

#include "tandem/comm/process_group.h"

namespace tandem {

class ThreadsWorld;

// Starts `world_size` rank threads, gives each its world group (threads
// backend), runs fn on each (after the caller's stream, and synchronising the
// rank's stream at its end: Note [Thread hand-off]) and joins them all. A
// rank that throws aborts the world so its peers fail promptly instead of
// waiting for the timeout. After the join, failures are reported the same way
// whatever their timing (Note [Rank failure report] in threads_backend.cpp): a
// single failing rank's exception is rethrown as is; with several, one
// exception names every failing rank and its message, root causes (a rank's
// own error) first, then the ranks aborted by a peer's failure, each group in
// rank order.
void run_ranks(int world_size, const std::function<void(ProcessGroupPtr world)>& fn,
               ProcessGroupOptions options = {});

}  // namespace tandem
