// Catch2 runner of the MPI suite, run as `mpirun -n N tandem-tests-mpi ...`.
//
// Every process runs the same test cases in the same order; collectives pair
// up across processes. Only rank 0 writes the report it was asked for (the
// JUnit file the CI reads); the other ranks print their failures in Catch's
// compact form. So that rank 0's report still counts a failure on rank 3,
// each test case ends with check_all_ranks_passed() (mpi_test_util.h), and the
// exit code is non-zero when any rank failed.
//
// Compiled once, unoptimised, into its own library: the Catch2 implementation
// costs 13 s at -O0 (TOOLCHAIN).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <mpi.h>

#include <cstdio>
#include <string>
#include <vector>

#include "tandem/comm/mpi/mpi_backend.h"
#include "tandem/runtime/config.h"
#include "tandem/tensor/ops.h"
#include "tests/comm/mpi/mpi_test_util.h"

namespace tandem::test {
namespace {

int failed_assertions = 0;      // on this rank, so far
int agreed_failures = 0;        // failed_assertions at the last check_all_ranks_passed()
ProcessGroupPtr verdict_group;  // reset before mpi_finalize()

class FailureCounter : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;
  bool assertionEnded(const Catch::AssertionStats& stats) override {
    if (!stats.assertionResult.isOk()) ++failed_assertions;
    return true;
  }
};
CATCH_REGISTER_LISTENER(FailureCounter)

}  // namespace

void check_all_ranks_passed() {
  if (!verdict_group) {
    ProcessGroupOptions options;
    options.checked = false;
    options.timeout = wait_timeout();
    options.name = "verdict";
    verdict_group = mpi_world(options);
  }
  const int failed_here = failed_assertions - agreed_failures;
  agreed_failures = failed_assertions;
  WorkPtr work = verdict_group->all_gather(ops::from_vector<int32_t>({failed_here}, Shape{1}));
  work->synchronize();
  std::vector<int32_t> failed = work->result().to_vector<int32_t>();
  if (verdict_group->rank() != 0) return;
  for (size_t r = 1; r < failed.size(); ++r) {
    INFO("rank " << r << " failed " << failed[r] << " assertion(s) here (see its own output)");
    CHECK(failed[r] == 0);
  }
}

}  // namespace tandem::test

namespace {

// Rank 0 keeps the arguments; other ranks drop `-r X`/`-o X` (and their
// long forms) and report compactly to stdout.
std::vector<std::string> arguments_for(int rank, int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);
  if (rank == 0) return args;
  std::vector<std::string> kept{args[0]};
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-r" || a == "--reporter" || a == "-o" || a == "--out") {
      ++i;  // and its value
      continue;
    }
    if (a.rfind("--reporter=", 0) == 0 || a.rfind("--out=", 0) == 0) continue;
    kept.push_back(a);
  }
  kept.push_back("-r");
  kept.push_back("compact");
  return kept;
}

// The number of ranks with failures, agreed by all ranks (through the backend
// under test itself; if even that fails, this rank counts as failed).
int ranks_failed(int failed_here) {
  try {
    tandem::ProcessGroupOptions options;
    options.checked = false;
    options.name = "verdict";
    tandem::ProcessGroupPtr world = tandem::mpi_world(options);
    tandem::Tensor flag =
        tandem::ops::from_vector<int32_t>({failed_here != 0 ? 1 : 0}, tandem::Shape{1});
    tandem::WorkPtr work = world->all_reduce(flag);
    work->synchronize();
    return work->result().to_vector<int32_t>()[0];
  } catch (const std::exception& e) {
    std::fprintf(stderr, "[tandem-tests-mpi] the final agreement failed: %s\n", e.what());
    return failed_here != 0 ? 1 : 0;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS) return 2;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  std::vector<std::string> args = arguments_for(rank, argc, argv);
  std::vector<char*> pointers;
  for (std::string& a : args)
    pointers.push_back(a.data());
  int failed = Catch::Session().run(static_cast<int>(pointers.size()), pointers.data());
  if (failed != 0)
    std::fprintf(stderr, "[tandem-tests-mpi] rank %d: %d failure(s)\n", rank, failed);

  int failing_ranks = ranks_failed(failed);
  if (rank == 0 && failing_ranks != 0) {
    std::fprintf(stderr, "[tandem-tests-mpi] %d rank(s) failed\n", failing_ranks);
  }
  tandem::test::verdict_group.reset();
  tandem::mpi_finalize();
  return failing_ranks != 0 || failed != 0 ? 1 : 0;
}
