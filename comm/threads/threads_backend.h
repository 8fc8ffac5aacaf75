// The threads backend: N ranks as threads of one process, moving real data
// through shared memory (DESIGN §5). The default for the Catch2 suites and for
// the single-machine demo.
//
// Each rank's group has its own comm executor (a TaskQueue thread: the "comm
// stream"), so launches never block the caller. A collective posts the rank's
// input in the group's shared slots, meets the other ranks at a barrier, reads
// what it needs directly from the peers' inputs into its output, and meets
// them again so no input is released or reused while a peer still reads it.
// Reductions add in rank order on every rank, so results are bit-identical
// across ranks. Every barrier and mailbox wait is bounded by the group's
// timeout; on expiry (or when a rank fails) the group is aborted and every
// member's pending and future collectives fail with a message naming the rank
// and the call (Note [Bounded waits]).
#pragma once

#include <functional>
#include <memory>

#include "comm/process_group.h"

namespace tandem {

class ThreadsWorld;

// Starts `world_size` rank threads, gives each its world group (threads
// backend), runs fn on each, joins them all and rethrows the first failure
// (the root cause: a rank's own error rather than the "aborted by rank r"
// errors it induced in its peers). A rank that throws aborts the world so
// its peers fail promptly instead of waiting for the timeout.
void run_ranks(int world_size, const std::function<void(ProcessGroupPtr world)>& fn,
               ProcessGroupOptions options = {});

}  // namespace tandem
