// Helpers of the MPI suite (defined in mpi_main.cpp, next to the runner).
#pragma once

namespace tandem::test {

// Call on every rank at the end of a test case: rank 0 fails the test case
// when another rank failed an assertion in it, so the one report the CI reads
// (rank 0's) counts failures on every rank.
void check_all_ranks_passed();

}  // namespace tandem::test
