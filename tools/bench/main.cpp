// tandem-bench: benchmark programs (DESIGN §9). Each subcommand measures one
// layer against baselines timed in the same run and prints a table, or one
// JSON object with --json. A row that misses its target is reported, not
// fatal: the exit status is non-zero only when something failed to run.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <string>

#include "tools/bench/bench.h"
#include "tools/bench/bench_cp.h"
#include "tools/bench/bench_overlap.h"

int main(int argc, char** argv) {
  tandem::bench::hold_blas_to_kernel_isa(argv);
  CLI::App app{"tandem-bench: tandem against baselines measured in the same run"};
  app.require_subcommand(1);

  tandem::bench::Options options;
  CLI::App* tensor = app.add_subcommand(
      "tensor", "matmul against OpenBLAS/cuBLAS, elementwise ops against plain loops");
  tensor->add_flag("--json", options.json, "print one JSON object instead of the table");
  tensor->add_flag("--quick", options.quick, "fewer, shorter trials (a smoke run)");
  tensor->add_option("--filter", options.filter,
                     "run only the rows whose \"group case\" contains this text, e.g. \"exp 16M\"");

  CLI::App* autograd = app.add_subcommand(
      "autograd", "per-op autograd overhead and a transformer block step, against LibTorch");
  autograd
      ->add_option("--device", options.device,
                   "cpu (default) or cuda: the block step on cuda:0 against PyTorch on its GPU "
                   "(the overhead rows stay CPU-only)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  CLI::App* comm = app.add_subcommand(
      "comm", "collective bandwidth against direct MPI calls and a shared-memory reference");
  CLI::App* dtensor = app.add_subcommand(
      "dtensor", "DTensor redistribution against the raw collectives it plans to (4 ranks)");
  CLI::App* cp = app.add_subcommand(
      "cp",
      "context-parallel attention modes on a simulated link: time, exposed communication, "
      "bytes and peak memory per rank (4 ranks)");
  cp->add_option("--seq", options.seq, "sequence length S (default: the largest that fits)");
  cp->add_option("--dim", options.dim, "model dimension d (default 1024, 256 with --quick)");
  cp->add_option("--heads", options.heads, "attention heads (default 16)");
  cp->add_option("--backend", options.backend,
                 "threads (default: rank threads, on the simulated link and on the plain "
                 "backend) or mpi (under mpirun -n 4: the plain MPI backend, exposed "
                 "communication and exact per-rank peak memory; S=1024 unless --seq)")
      ->check(CLI::IsMember({"threads", "mpi"}));
  cp->add_option("--device", options.device,
                 "cpu (default) or cuda: the 4 rank threads share cuda:0 (threads backend, no "
                 "simulated link; S=8192 d=1024 unless given)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  CLI::App* overlap = app.add_subcommand(
      "overlap",
      "dual-pipe overlap of MoE all-to-alls on a simulated link: overlapped step vs "
      "sequential and vs the ideal");
  overlap->add_option("--ranks", options.ranks, "expert-parallel rank threads (default 2)");
  overlap->add_option("--micro-batches", options.micro_batches,
                      "micro-batches per step (default 6, 4 with --quick)");
  overlap->add_option("--trace", options.trace,
                      "write the Chrome trace of one overlapped step to this file");
  overlap
      ->add_option("--device", options.device,
                   "cpu (default: the simulated link) or cuda: the rank threads share cuda:0, "
                   "sequential against overlapped step")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  CLI::App* fsdp = app.add_subcommand(
      "fsdp",
      "data parallelism's gradient reduction: bucketed DDP during the backward against no "
      "reduction and the flat one, plain and on a simulated link (4 ranks)");
  std::string all_json;
  CLI::App* all = app.add_subcommand(
      "all",
      "the --quick run of every sub-benchmark above, in this process, as one JSON document "
      "(progress on stderr)");
  all->add_option("--json", all_json, "write the JSON document to this file (default: stdout)");
  for (CLI::App* sub : {autograd, comm, dtensor, cp, overlap, fsdp}) {
    sub->add_flag("--json", options.json, "print one JSON object instead of the table");
    sub->add_flag("--quick", options.quick, "fewer, shorter trials (a smoke run)");
    sub->add_option("--filter", options.filter, "run only the rows whose name contains this text");
  }

  CLI11_PARSE(app, argc, argv);

  try {
    if (*tensor) return tandem::bench::run_tensor(options);
    if (*autograd) return tandem::bench::run_autograd(options);
    if (*comm) return tandem::bench::run_comm(options);
    if (*dtensor) return tandem::bench::run_dtensor(options);
    if (*cp) {
      if (options.device == "cuda") {
        if (options.backend != "threads") {
          fmt::print(stderr, "tandem-bench: error: cp --device cuda runs on the threads backend\n");
          return 2;
        }
        return tandem::bench::run_cp_cuda(options);
      }
      return options.backend == "mpi" ? tandem::bench::run_cp_mpi(options)
                                      : tandem::bench::run_cp(options);
    }
    if (*overlap) {
      return options.device == "cuda" ? tandem::bench::run_overlap_cuda(options)
                                      : tandem::bench::run_overlap(options);
    }
    if (*fsdp) return tandem::bench::run_fsdp(options);
    if (*all) return tandem::bench::run_all(all_json);
  } catch (const std::exception& e) {
    fmt::print(stderr, "tandem-bench: error: {}\n", e.what());
    return 1;
  }
  return 1;  // unreachable: CLI11 requires a subcommand
}
