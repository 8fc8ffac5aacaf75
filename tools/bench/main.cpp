// tandem-bench: benchmark programs (DESIGN §9). Each subcommand measures one
// layer against baselines timed in the same run and prints a table, or one
// JSON object with --json. A row that misses its target is reported, not
// fatal: the exit status is non-zero only when something failed to run.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "tools/bench/bench.h"

int main(int argc, char** argv) {
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
  CLI::App* comm = app.add_subcommand(
      "comm", "collective bandwidth against direct MPI calls and a shared-memory reference");
  for (CLI::App* sub : {autograd, comm}) {
    sub->add_flag("--json", options.json, "print one JSON object instead of the table");
    sub->add_flag("--quick", options.quick, "fewer, shorter trials (a smoke run)");
    sub->add_option("--filter", options.filter, "run only the rows whose name contains this text");
  }

  CLI11_PARSE(app, argc, argv);

  try {
    if (*tensor) return tandem::bench::run_tensor(options);
    if (*autograd) return tandem::bench::run_autograd(options);
    if (*comm) return tandem::bench::run_comm(options);
  } catch (const std::exception& e) {
    fmt::print(stderr, "tandem-bench: error: {}\n", e.what());
    return 1;
  }
  return 1;  // unreachable: CLI11 requires a subcommand
}
